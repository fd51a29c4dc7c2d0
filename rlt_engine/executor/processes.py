"""Process and socket plumbing of MultiprocExecutor: worker handles, the heartbeat thread,
the CURVE allow-list, and killing a worker's process tree by pid."""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import zmq

from protocol import engine_worker_codec
from protocol.codec import Codec
from protocol.messages import Heartbeat
from rlt_engine.errors import WorkerStartupError

log = logging.getLogger("rlt.executor")

ENGINE_PID_FILE = "engine.pid"  # in each private directory, so a later engine can tell it is stale
_IPC_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) − 1


def bind_socket(ctx: zmq.Context, kind: int, address: str, curve_secret: bytes | None = None) -> zmq.Socket:
    """A bound socket (a CURVE server when given its secret key); ipc socket files get mode 0600."""
    if address.startswith("ipc://") and len(address) - len("ipc://") > _IPC_PATH_MAX:
        raise ValueError(f"ipc path too long for a unix socket ({address}); use a shorter TMPDIR")
    sock = ctx.socket(kind)
    sock.linger = 0
    if curve_secret is not None:
        sock.curve_server = True
        sock.curve_secretkey = curve_secret
    for attempt in range(20):
        try:
            sock.bind(address)
            break
        except zmq.ZMQError as exc:
            # A restarted remote worker rebinds its port, which the closed socket may hold briefly.
            if exc.errno != zmq.EADDRINUSE or attempt == 19 or not address.startswith("tcp://"):
                sock.close(linger=0)
                raise
            time.sleep(0.1)
    if address.startswith("ipc://"):
        os.chmod(address[len("ipc://") :], 0o600)  # the directory is 0700 already; belt and braces
    return sock


@dataclass(eq=False)
class WorkerHandle:
    """The engine's side of one worker incarnation."""

    index: int
    socket: zmq.Socket
    codec: Codec = field(default_factory=engine_worker_codec)  # one codec per socket
    process: subprocess.Popen | None = None  # None: a remote worker
    pidfd: int | None = None
    log_path: str | None = None
    last_heard: float = field(default_factory=time.monotonic)
    hello_sent: bool = False
    alive: bool = True
    starting: bool = False  # a replacement whose handshake runs inside collect()
    ready_by: float = 0.0  # starting: the deadline of its WorkerReady

    def log_tail(self, lines: int = 15) -> str:
        """The end of the worker's stderr, for error messages."""
        if self.log_path is None or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - 8192))
            tail = f.read().decode(errors="replace").splitlines()[-lines:]
        return "\n  " + "\n  ".join(tail) if tail else ""

    def close(self, linger_ms: int = 0) -> None:
        if not self.socket.closed:
            self.socket.close(linger=linger_ms)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class HeartbeatThread(threading.Thread):
    """Publishes a Heartbeat every `period` s; owns its PUB sockets from start() on."""

    def __init__(self, sockets: list[zmq.Socket], period: float) -> None:
        super().__init__(name="rlt-heartbeat", daemon=True)
        self._sockets = sockets
        self._period = period
        self._stopped = threading.Event()

    def run(self) -> None:
        codec = engine_worker_codec()
        try:
            while True:
                frame = codec.encode(Heartbeat(sent_at=time.monotonic()))
                for sock in self._sockets:
                    try:
                        sock.send(frame, zmq.NOBLOCK)  # PUB drops for a slow subscriber, never blocks
                    except zmq.Again:
                        pass
                if self._stopped.wait(self._period):
                    return
        finally:
            for sock in self._sockets:
                sock.close(linger=0)

    def stop(self) -> None:
        self._stopped.set()
        if self.ident is None:  # never started: the sockets are still ours to close
            for sock in self._sockets:
                sock.close(linger=0)
        else:
            self.join()


class AllowList:
    """ZAP credentials provider: a CURVE client is let in only with an authorized public key."""

    def __init__(self, keys: set[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        if key not in self._keys:
            log.warning("refused a worker with an unknown CURVE key %s", key.decode(errors="replace"))
        return key in self._keys


def visible_device(index: int) -> str:
    """The GPU a local worker gets: the index-th of the engine's visible devices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return str(index)
    ids = [d.strip() for d in visible.split(",") if d.strip()]
    if index >= len(ids):
        raise WorkerStartupError(f"worker {index} has no GPU: CUDA_VISIBLE_DEVICES={visible!r}")
    return ids[index]


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_tree(proc: subprocess.Popen, children: list[psutil.Process] | None = None) -> None:
    """SIGKILL a worker and its descendants; the worker itself is left for Popen to reap."""
    if children is None:
        children = descendants(proc) if proc.poll() is None else []
    if proc.poll() is None:
        proc.kill()  # our unreaped child: its pid cannot have been recycled
    for child in children:
        try:
            child.kill()  # psutil checks the create time, so a recycled pid is never hit
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=2)


def remove_stale_dirs(parent: str) -> None:
    """Remove private directories left by killed engines: ours, and naming an engine pid that is gone."""
    for pid_file in glob.glob(os.path.join(parent, "rlt-*", ENGINE_PID_FILE)):
        try:
            pid = int(Path(pid_file).read_text())
            if os.stat(pid_file).st_uid != os.getuid() or psutil.pid_exists(pid):
                continue
        except (OSError, ValueError):
            continue
        log.info("removing %s, left behind by engine pid %d", os.path.dirname(pid_file), pid)
        shutil.rmtree(os.path.dirname(pid_file), ignore_errors=True)


def emergency_cleanup(directory: str, processes: list[subprocess.Popen]) -> None:
    """An executor collected or left at exit without shutdown(): kill its workers, remove its files."""
    for proc in processes:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.rmtree(directory, ignore_errors=True)
