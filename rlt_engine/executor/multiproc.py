"""MultiprocExecutor: one worker process per device behind ZeroMQ (SPEC §6, §7).

Topology, in a private directory (mode 0700; socket files 0600) per executor:

    engine main thread                                  worker process i
    PAIR bind ipc://DIR/w{i}.{n}.sock  ◄────────────►  PAIR connect   hello/ready, plans/results, its heartbeats
    pidfd(worker i) ─┐  one zmq.Poller in collect(): a result and a death are seen by the same poll
    PAIR sockets  ───┘
    heartbeat thread (owns only its PUB sockets)
    PUB  bind ipc://DIR/heartbeat.sock ─────────────►  SUB connect    the engine's heartbeats, every interval / 2

One PAIR per worker keeps each worker's ordering trivial and admits exactly one peer. The
heartbeats come from a thread so that an idle engine (nobody calling collect) keeps its
workers, while a dead or SIGSTOPped one loses them within 3 s. A remote worker gets the same
pair over tcp://HOST:PORT with CURVE, its heartbeats on PORT + 1, its key checked by ZAP.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass

import msgspec
import zmq

from protocol import PROTOCOL_VERSION, ProtocolError, config_hash
from protocol.messages import ExecutionPlan, Heartbeat, Shutdown, StepResult, WorkerConfig, WorkerHello, WorkerReady
from rlt_engine.config import EngineConfig
from rlt_engine.errors import WorkerStartupError
from rlt_engine.executor.base import Executor, WorkerLost
from rlt_engine.executor.processes import (
    ENGINE_PID_FILE,
    AllowList,
    HeartbeatThread,
    WorkerHandle,
    bind_socket,
    descendants,
    describe_exit,
    emergency_cleanup,
    kill_tree,
    remove_stale_dirs,
    visible_device,
)
from rlt_worker.worker_process import heartbeat_address

log = logging.getLogger("rlt.executor")

HEARTBEAT_INTERVAL_S = 1.0
STARTUP_TIMEOUT_S = 600.0  # loading a large checkpoint onto a GPU takes minutes
SHUTDOWN_GRACE_S = 3.0


@dataclass(frozen=True)
class RemoteWorker:
    """A worker on another host: the engine binds `address` with CURVE and waits for it to connect."""

    address: str  # tcp://HOST:PORT; the engine's heartbeats are published on PORT + 1
    server_secret_key_file: str  # the engine's certificate, zmq.auth format (the *.key_secret file)
    authorized_key_files: tuple[str, ...]  # public certificates of the workers allowed to connect


class MultiprocExecutor(Executor):
    """Local worker processes (one per device), plus optionally one remote worker over CURVE tcp."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        remote: RemoteWorker | None = None,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
        num_threads: int | None = None,  # torch threads of each local CPU worker; None: cores // local workers
    ) -> None:
        self.config = config = config.resolved()
        if config.workers < 1:
            raise ValueError(f"MultiprocExecutor needs workers ≥ 1, got {config.workers}")
        self.num_workers = config.workers
        self._remote = remote  # when given, it is the last worker index
        self._num_local = config.workers - (remote is not None)
        self._startup_timeout = startup_timeout
        self._heartbeat_interval = heartbeat_interval
        self._num_threads = num_threads
        self._configs = [self._worker_config(i) for i in range(config.workers)]
        self._handles: list[WorkerHandle | None] = [None] * config.workers
        self._all_handles: list[WorkerHandle] = []
        self._processes: list[subprocess.Popen] = []  # everything spawned, for shutdown and the finalizer
        self._owners: dict[object, WorkerHandle] = {}  # poller item (socket or pidfd) → its worker
        self._poller = zmq.Poller()
        self._polled_at = time.monotonic()
        self._stash: list[tuple[int, StepResult | WorkerLost | WorkerReady]] = []  # read by silence()
        self._incarnation = 0
        self._dir: str | None = None
        self._ctx: zmq.Context | None = None
        self._heartbeats: HeartbeatThread | None = None
        self._auth = None
        self._server_secret: bytes | None = None
        self._finalizer: weakref.finalize | None = None
        self._closed = False

    def _worker_config(self, index: int) -> WorkerConfig:
        device = self.config.device
        assert device is not None
        is_local = index < self._num_local
        if device.startswith("cuda"):
            device = "cuda"  # a local worker sees one GPU, through CUDA_VISIBLE_DEVICES
        threads = 0  # torch's default
        if device == "cpu" and is_local:
            # CPU workers split the cores so that N workers do not oversubscribe them N-fold.
            threads = (self._num_threads or self.config.cpu_threads
                       or max(1, len(os.sched_getaffinity(0)) // max(1, self._num_local)))
        return msgspec.structs.replace(self.config.worker_config(device), num_threads=threads)

    def _hello(self, index: int) -> WorkerHello:
        config = self._configs[index]
        return WorkerHello(
            protocol_version=PROTOCOL_VERSION, worker_index=index, config=config,
            config_hash=config_hash(config), heartbeat_interval_s=self._heartbeat_interval,
        )

    # ------------------------------------------------------------------ start

    def start(self) -> list[WorkerReady]:
        """Spawn (or await) every worker and handshake with all of them at once."""
        if self._closed or self._ctx is not None:
            raise RuntimeError("a MultiprocExecutor starts once")
        try:
            self._open()
            handles = [self._launch(i) for i in range(self.num_workers)]
            readies = self._handshake(handles)
        except BaseException:
            self.shutdown()  # no process, socket or directory left behind
            raise
        for handle in handles:
            self._watch(handle)
        return readies

    def _open(self) -> None:
        remove_stale_dirs(tempfile.gettempdir())
        self._dir = tempfile.mkdtemp(prefix="rlt-")  # mode 0700
        with open(os.path.join(self._dir, ENGINE_PID_FILE), "w") as f:
            f.write(str(os.getpid()))
        self._finalizer = weakref.finalize(self, emergency_cleanup, self._dir, self._processes)
        self._ctx = zmq.Context()
        sockets = [self._bind(zmq.PUB, f"ipc://{self._dir}/heartbeat.sock")]
        if self._remote is not None:
            self._start_authenticator(self._remote)
            sockets.append(self._bind(zmq.PUB, heartbeat_address(self._remote.address), curve=True))
        self._heartbeats = HeartbeatThread(sockets, self._heartbeat_interval / 2)
        self._heartbeats.start()

    def _start_authenticator(self, remote: RemoteWorker) -> None:
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        _, self._server_secret = zmq.auth.load_certificate(remote.server_secret_key_file)
        if self._server_secret is None:
            raise ValueError(f"{remote.server_secret_key_file} holds no secret key")
        allowed = {zmq.auth.load_certificate(path)[0] for path in remote.authorized_key_files}
        self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("rlt.executor.auth"))
        self._auth.start()  # owns its own ZAP socket and thread
        self._auth.configure_curve_callback(domain="*", credentials_provider=AllowList(allowed))

    def _bind(self, kind: int, address: str, curve: bool = False) -> zmq.Socket:
        assert self._ctx is not None
        return bind_socket(self._ctx, kind, address, self._server_secret if curve else None)

    def _launch(self, index: int, replacement: bool = False) -> WorkerHandle:
        self._incarnation += 1
        if index >= self._num_local:
            assert self._remote is not None
            handle = WorkerHandle(index, self._bind(zmq.PAIR, self._remote.address, curve=True))
        else:
            address = f"ipc://{self._dir}/w{index}.{self._incarnation}.sock"
            handle = WorkerHandle(index, self._bind(zmq.PAIR, address))
        self._handles[index] = handle
        self._all_handles.append(handle)
        if index < self._num_local:
            self._spawn(handle, handle.socket.getsockopt_string(zmq.LAST_ENDPOINT), replacement)
        return handle

    def _spawn(self, handle: WorkerHandle, address: str, replacement: bool) -> None:
        if threading.current_thread() is not threading.main_thread():
            # PR_SET_PDEATHSIG fires when the spawning *thread* exits, not the process.
            log.warning("spawning worker %d from a non-main thread: its parent-death signal follows that thread",
                        handle.index)
        cmd = [
            sys.executable, "-m", "rlt_worker.worker_process", "--connect", address, "--index", str(handle.index),
            "--parent-pid", str(os.getpid()), "--heartbeat", f"ipc://{self._dir}/heartbeat.sock",
        ] + (["--replacement"] if replacement else [])
        env = dict(os.environ)
        if self._configs[handle.index].device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = visible_device(handle.index)
        handle.log_path = os.path.join(self._dir or "", f"w{handle.index}.{self._incarnation}.log")
        with open(handle.log_path, "wb") as log_file:  # the worker's stderr; tails go into errors
            handle.process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                start_new_session=False, close_fds=True,
            )
        self._processes.append(handle.process)
        handle.pidfd = os.pidfd_open(handle.process.pid)

    def _handshake(self, handles: list[WorkerHandle]) -> list[WorkerReady]:
        """Hello to each worker once it is connected; WorkerReady back; a death fails at once."""
        poller = zmq.Poller()
        for handle in handles:
            poller.register(handle.socket, zmq.POLLOUT)  # writable = the worker has connected
            if handle.pidfd is not None:
                poller.register(handle.pidfd, zmq.POLLIN)
        readies: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + self._startup_timeout
        while len(readies) < len(handles):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerStartupError(self._late_message([h for h in handles if h.index not in readies]))
            events = dict(poller.poll(min(remaining, 1.0) * 1000))
            for handle in handles:
                flags = events.get(handle.socket, 0)
                if flags & zmq.POLLOUT and not handle.hello_sent:
                    handle.socket.send(handle.codec.encode(self._hello(handle.index)))
                    handle.hello_sent = True
                    poller.modify(handle.socket, zmq.POLLIN)
                elif flags & zmq.POLLIN:
                    readies[handle.index] = self._read_ready(handle)
                    poller.unregister(handle.socket)
                    if handle.pidfd is not None:
                        poller.unregister(handle.pidfd)
                elif handle.pidfd in events:
                    raise WorkerStartupError(
                        f"worker {handle.index} {describe_exit(handle.process.wait())} during startup; "
                        f"its log ends:{handle.log_tail()}"
                    )
        return [readies[h.index] for h in handles]

    def _late_message(self, late: list[WorkerHandle]) -> str:
        parts = []
        for handle in late:
            where = "remote worker" if handle.process is None else "worker"
            what = "sent no WorkerReady" if handle.hello_sent else "never connected (wrong address or key?)"
            parts.append(f"{where} {handle.index} {what} within {self._startup_timeout:.1f} s{handle.log_tail()}")
        return "; ".join(parts)

    def _read_ready(self, handle: WorkerHandle) -> WorkerReady:
        i = handle.index
        try:
            ready = handle.codec.decode(handle.socket.recv())
        except ProtocolError as exc:  # e.g. a worker of another protocol version
            raise WorkerStartupError(f"worker {i} answered the hello with a bad frame: {exc}") from None
        if not isinstance(ready, WorkerReady):
            raise WorkerStartupError(f"worker {i} answered the hello with {type(ready).__name__}")
        if ready.protocol_version != PROTOCOL_VERSION:
            raise WorkerStartupError(
                f"worker {i} speaks protocol version {ready.protocol_version}, the engine {PROTOCOL_VERSION}"
            )
        expected = config_hash(self._configs[i])
        if ready.config_hash != expected or ready.worker_index != i:
            raise WorkerStartupError(
                f"worker {i} config hash mismatch: engine {expected}, worker {ready.config_hash} "
                f"(worker index {ready.worker_index})"
            )
        handle.last_heard = time.monotonic()
        log.info("worker %d ready (pid %d, %s, %d KV blocks)", i, ready.pid, ready.device, ready.num_blocks)
        return ready

    def _watch(self, handle: WorkerHandle) -> None:
        self._poller.register(handle.socket, zmq.POLLIN)
        self._owners[handle.socket] = handle
        if handle.pidfd is not None:
            self._poller.register(handle.pidfd, zmq.POLLIN)
            self._owners[handle.pidfd] = handle

    def _unwatch(self, handle: WorkerHandle) -> None:
        for item in (handle.socket, handle.pidfd):
            if item is not None and self._owners.pop(item, None) is not None:
                self._poller.unregister(item)

    # ------------------------------------------------------------------ run

    def submit(self, worker: int, plan: ExecutionPlan) -> None:
        """Encode and queue the plan for one worker; never blocks."""
        handle = self._handles[worker]
        if handle is None or not handle.alive:
            raise RuntimeError(f"worker {worker} is not running")
        try:
            handle.socket.send(handle.codec.encode(plan), zmq.NOBLOCK)
        except zmq.Again:  # no peer: the worker is going away, and collect() will say so
            log.warning("worker %d is disconnected; plan %d dropped", worker, plan.step_id)

    def collect(self, timeout: float | None = None) -> list[tuple[int, StepResult | WorkerLost | WorkerReady]]:
        """Results, losses and finished restarts in arrival order; waits up to `timeout` (None:
        forever) for the first. A replacement's handshake advances here, never blocking the caller."""
        out, self._stash = self._stash, []
        end = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            live = [h for h in self._handles if h is not None and h.alive]
            if not live:
                return out
            now = time.monotonic()
            wait = min(self._verdict_at(h) for h in live) - now  # next silence (or startup) verdict
            if end is not None:
                wait = min(wait, end - now)
            self._poll(0.0 if out else max(0.0, wait), out)
            self._reap_silent(out)
            if out or (end is not None and time.monotonic() >= end):
                return out

    @property
    def has_events(self) -> bool:
        return bool(self._stash)

    def silence(self) -> dict[int, float]:
        """Seconds since each serving worker was last heard from, after reading what has arrived
        (kept for the next collect())."""
        self._poll(0.0, self._stash)
        self._reap_silent(self._stash)
        now = time.monotonic()
        return {h.index: now - h.last_heard for h in self._handles if h is not None and h.alive and not h.starting}

    def _verdict_at(self, handle: WorkerHandle) -> float:
        return handle.ready_by if handle.starting else handle.last_heard + self.config.worker_timeout

    def _poll(self, wait_s: float, out: list) -> None:
        watched_since = self._polled_at
        events = self._poller.poll(wait_s * 1000)
        self._polled_at = time.monotonic()
        deaths = []
        for item, flags in events:
            handle = self._owners.get(item)
            if handle is None:
                continue
            if isinstance(item, int):
                deaths.append(handle)
            elif handle.starting:
                self._advance_startup(handle, flags, out)
            else:
                self._drain(handle, out)
        for handle in deaths:
            # It died after the previous poll returned (or that poll would have seen it).
            if handle.alive:
                self._lose(handle, "", out, window=self._polled_at - watched_since)

    def _advance_startup(self, handle: WorkerHandle, flags: int, out: list) -> None:
        """A replacement's handshake, one event at a time: hello once it connects, then its WorkerReady."""
        if flags & zmq.POLLOUT and not handle.hello_sent:
            handle.socket.send(handle.codec.encode(self._hello(handle.index)))
            handle.hello_sent = True
            self._poller.modify(handle.socket, zmq.POLLIN)
        elif flags & zmq.POLLIN:
            try:
                ready = self._read_ready(handle)
            except WorkerStartupError as exc:
                self._lose(handle, f"replacement refused: {exc}", out, kill=True)
                return
            handle.starting = False
            out.append((handle.index, ready))

    def _drain(self, handle: WorkerHandle, out: list) -> None:
        # Read while EVENTS says a frame is queued: cheaper than ending on a zmq.Again.
        while not handle.socket.closed and handle.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frame = handle.socket.recv(zmq.NOBLOCK)
            handle.last_heard = time.monotonic()
            try:
                message = handle.codec.decode(frame)
            except ProtocolError as exc:
                log.warning("worker %d sent a malformed frame of %d bytes, dropped: %s", handle.index, len(frame), exc)
                continue
            if isinstance(message, StepResult):
                out.append((handle.index, message))
            elif not isinstance(message, Heartbeat):
                log.warning("worker %d sent an unexpected %s, dropped", handle.index, type(message).__name__)

    def _reap_silent(self, out: list) -> None:
        now = time.monotonic()
        for handle in self._handles:
            if handle is None or not handle.alive:
                continue
            if handle.starting:
                if now > handle.ready_by:
                    why = f"the replacement sent no WorkerReady within {self._startup_timeout:.1f} s"
                    self._lose(handle, why, out, kill=True)
            elif now - handle.last_heard > self.config.worker_timeout:
                silent = now - handle.last_heard
                self._lose(handle, f"silent for {silent:.1f} s (worker_timeout)", out, kill=True)

    def _lose(
        self, handle: WorkerHandle, reason: str, out: list, kill: bool = False, window: float | None = None
    ) -> None:
        """Mark a worker dead: its queued results first, then one WorkerLost; reap its process."""
        self._drain(handle, out)
        handle.alive = False
        self._unwatch(handle)
        if handle.process is not None:
            if kill:
                kill_tree(handle.process)
            exit_text = describe_exit(handle.process.wait())
            reason = f"{reason}; {exit_text}" if reason else exit_text
        handle.close()
        silent = time.monotonic() - handle.last_heard
        detected = f"death seen within {window:.3f} s" if window is not None else "declared dead"
        log.error("worker %d lost: %s (%s; last message %.3f s before)%s",
                  handle.index, reason, detected, silent, handle.log_tail(5))
        out.append((handle.index, WorkerLost(handle.index, reason)))

    def begin_restart(self, worker: int) -> None:
        """Spawn (or, remote, await) a replacement with the same index; its handshake runs inside
        collect(), which returns its WorkerReady (or a WorkerLost if it fails to start)."""
        old = self._handles[worker]
        if old is not None and old.alive:
            self._lose(old, "replaced by restart", [], kill=True)
        handle = self._launch(worker, replacement=True)
        handle.starting, handle.ready_by = True, time.monotonic() + self._startup_timeout
        self._poller.register(handle.socket, zmq.POLLOUT)  # writable = the replacement has connected
        self._owners[handle.socket] = handle
        if handle.pidfd is not None:
            self._poller.register(handle.pidfd, zmq.POLLIN)
            self._owners[handle.pidfd] = handle

    def alive_workers(self) -> list[int]:
        """Indices of the workers that are running (for health reports)."""
        return [h.index for h in self._handles if h is not None and h.alive]

    def worker_pids(self) -> dict[int, int]:
        """Process ids of the running local workers."""
        return {h.index: h.process.pid for h in self._handles if h is not None and h.alive and h.process}

    # ------------------------------------------------------------------ stop

    def shutdown(self) -> None:
        """Shutdown to every live worker, wait up to 3 s, kill what is left, release everything."""
        if self._closed:
            return
        self._closed = True
        live = [h for h in self._handles if h is not None and h.alive]
        # Descendants are listed before any worker exits: an orphan can no longer be found by parent.
        trees = {proc.pid: descendants(proc) for proc in self._processes if proc.poll() is None}
        for handle in live:
            try:
                handle.socket.send(handle.codec.encode(Shutdown(reason="engine shutdown")), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for proc in self._processes:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d ignored Shutdown for %.0f s: killing it", proc.pid, SHUTDOWN_GRACE_S)
        for proc in self._processes:
            kill_tree(proc, trees.get(proc.pid, []))
            proc.wait()
        for handle in self._all_handles:
            self._unwatch(handle)
            # A remote worker cannot be waited for: give its Shutdown a second to leave (term waits).
            handle.close(linger_ms=1000 if handle.alive and handle.process is None else 0)
            handle.alive = False
        if self._heartbeats is not None:
            self._heartbeats.stop()
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        if self._finalizer is not None:
            self._finalizer.detach()
