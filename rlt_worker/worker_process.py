"""The worker process: one Worker behind a ZeroMQ PAIR socket (SPEC §6, §7).

    python -m rlt_worker.worker_process --connect ipc://DIR/w0.0.sock --index 0 \
        --parent-pid PID --heartbeat ipc://DIR/heartbeat.sock        (spawned by MultiprocExecutor)
    rlt-worker --connect tcp://HOST:PORT --curve-server-key engine.key --curve-key worker.key_secret

Life: WorkerHello → build the Worker (on failure nothing is sent: the error goes to stderr and
the process exits nonzero) → WorkerReady → serve plans until Shutdown (exit 0), or until the
engine is gone: parent-death signal, parent-pid check, or no engine message (plan or
heartbeat, on either socket) for min(3 × heartbeat interval, 3 s). The worker's own heartbeats
go out between plans from the main thread and, while a plan runs, from a helper thread, so a
plan longer than the engine's worker_timeout is not taken for a hang.

Pipelined plans: a plan's work is queued (`Worker.submit`) and its result sent when its copy has
landed (its CUDA event fired; on the CPU at once), in plan order. While a result is on its way the
loop polls the socket without waiting, so the next plan's work is queued behind the running one.

Imports no torch until the hello arrives, so the parent-death signal is armed within
milliseconds of the fork rather than after seconds of importing.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import struct
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol import PROTOCOL_VERSION, ProtocolError, worker_side_codec
from protocol.codec import Codec
from protocol.messages import ExecutionPlan, Heartbeat, Shutdown, WorkerHello, WorkerReady

if TYPE_CHECKING:
    from rlt_worker.step_results import PendingResult
    from rlt_worker.worker import Worker

log = logging.getLogger("rlt.worker_process")

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1  # building the model or the KV pool raised
EXIT_USAGE = 2  # bad command line (argparse's code)
EXIT_HANDSHAKE = 3  # protocol version / config mismatch, no hello in time, CURVE refused
EXIT_ENGINE_GONE = 4  # parent changed, or the engine fell silent past the deadline

HELLO_TIMEOUT_S = 60.0
START_DELAY_ENV = "RLT_TEST_REPLACEMENT_START_DELAY_S"  # seconds a replacement worker waits before loading
MAX_DEADLINE_S = 3.0  # SPEC §7: workers notice a dead or hung engine within 3 s
POLL_S = 0.2  # upper bound on one poll, so the parent-pid check runs 5× a second
_PR_SET_PDEATHSIG = 1
_HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the engine refused this worker's CURVE key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CURVE handshake failed (wrong engine key?)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "CURVE handshake failed (wrong engine key?)",
}


class WorkerExit(Exception):
    """Leave the process with exit code `args[0]` (the reason has been logged)."""


def arm_parent_death_signal() -> None:
    """Ask the kernel to SIGKILL this process when the thread that spawned it exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError) as exc:  # no libc prctl: the pid check and deadline remain
        log.warning("cannot arm the parent-death signal: %s", exc)


def heartbeat_address(connect: str) -> str:
    """Where a remote worker hears engine heartbeats by default: the same host, port + 1."""
    if not connect.startswith("tcp://"):
        raise ValueError(f"no default heartbeat address for {connect!r}; pass one")
    host, _, port = connect[len("tcp://") :].rpartition(":")
    return f"tcp://{host}:{int(port) + 1}"


def _frame_version(frame: bytes) -> int | None:
    """The protocol version in a frame's header, if the frame has an rlt header at all."""
    if len(frame) >= 4 and frame[:2] == b"RL":
        return struct.unpack_from("<H", frame, 2)[0]
    return None


class EngineLink:
    """The worker's end: PAIR for commands and results, SUB for the engine's heartbeats."""

    def __init__(
        self,
        ctx: zmq.Context,
        connect: str,
        heartbeat: str | None,
        parent_pid: int | None,
        curve_server_public_key: bytes | None = None,
        curve_secret_key: bytes | None = None,
    ) -> None:
        self.parent_pid = parent_pid
        self.socket = self._socket(ctx, zmq.PAIR, curve_server_public_key, curve_secret_key)
        # CURVE: watch the handshake so a refused key ends the worker with a reason, not a silent wait.
        failures = 0
        for event in _HANDSHAKE_FAILURES:
            failures |= event
        self.monitor = self.socket.get_monitor_socket(failures) if curve_secret_key else None
        self.socket.connect(connect)
        self.heartbeats = self._socket(ctx, zmq.SUB, curve_server_public_key, curve_secret_key)
        self.heartbeats.setsockopt(zmq.SUBSCRIBE, b"")
        if heartbeat:
            self.heartbeats.connect(heartbeat)
        self.codec = worker_side_codec()  # one codec per socket
        self._heartbeat_codec = worker_side_codec()
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.heartbeats, zmq.POLLIN)
        if self.monitor is not None:
            self.poller.register(self.monitor, zmq.POLLIN)
        self.last_heard = self.last_sent = time.monotonic()
        self.num_rejected = 0
        # The PAIR socket moves between the main thread and BusyHeartbeats: whoever holds the
        # lock is the one thread touching it, which is how ZeroMQ lets a socket change threads.
        self._socket_lock = threading.Lock()
        self.executing = False  # a plan is running on the main thread (BusyHeartbeats reads it)

    @staticmethod
    def _socket(ctx: zmq.Context, kind: int, server_key: bytes | None, secret_key: bytes | None) -> zmq.Socket:
        sock = ctx.socket(kind)
        sock.linger = 0
        if secret_key is not None:
            if server_key is None:
                raise ValueError("a CURVE worker needs the engine's public key too")
            sock.curve_secretkey = secret_key
            sock.curve_publickey = zmq.curve_public(secret_key)
            sock.curve_serverkey = server_key
        return sock

    def check_engine(self, deadline_s: float | None) -> None:
        """Raise WorkerExit if our parent changed or the engine has been silent past the deadline."""
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.error("engine (pid %d) is gone: our parent is now %d", self.parent_pid, os.getppid())
            raise WorkerExit(EXIT_ENGINE_GONE)
        silent = time.monotonic() - self.last_heard
        if deadline_s is not None and silent > deadline_s:
            log.error("no word from the engine for %.2f s (deadline %.2f s): exiting", silent, deadline_s)
            raise WorkerExit(EXIT_ENGINE_GONE)

    def receive(self, timeout_s: float, handshake: bool = False) -> list[object]:
        """Every message that arrives within `timeout_s` (or is already queued); bad frames dropped."""
        with self._socket_lock:
            return self._receive(timeout_s, handshake)

    def _receive(self, timeout_s: float, handshake: bool) -> list[object]:
        events = dict(self.poller.poll(max(0.0, timeout_s) * 1000))
        messages: list[object] = []
        if self.monitor is not None and events.get(self.monitor):
            self._check_monitor()
        for sock, codec in ((self.heartbeats, self._heartbeat_codec), (self.socket, self.codec)):
            if not events.get(sock):
                continue
            # Read while EVENTS says a frame is queued: cheaper than ending on a zmq.Again.
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                frame = sock.recv(zmq.NOBLOCK)
                self.last_heard = time.monotonic()  # any frame at all means the engine lives
                message = self._decode(codec, frame, handshake)
                if message is not None:
                    messages.append(message)
        return messages

    def _decode(self, codec: Codec, frame: bytes, handshake: bool) -> object | None:
        try:
            return codec.decode(frame)
        except ProtocolError as exc:
            version = _frame_version(frame)
            if handshake and version is not None and version != PROTOCOL_VERSION:
                # The engine speaks another protocol: nothing it sends can be understood.
                log.error("engine speaks protocol version %d, this worker speaks %d", version, PROTOCOL_VERSION)
                raise WorkerExit(EXIT_HANDSHAKE) from None
            self.num_rejected += 1
            # No reply: a frame we cannot decode does not say what it was asking for.
            log.warning("dropped a malformed frame of %d bytes (%d so far): %s", len(frame), self.num_rejected, exc)
            return None

    def _check_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            reason = _HANDSHAKE_FAILURES.get(event["event"])
            if reason is not None:
                log.error("%s (%s): exiting", reason, event.get("endpoint", b"").decode(errors="replace"))
                raise WorkerExit(EXIT_HANDSHAKE)

    def send(self, message: object, block: bool = True) -> bool:
        """Send one message; False when a non-blocking send found the queue full."""
        with self._socket_lock:
            try:
                self.socket.send(self.codec.encode(message), 0 if block else zmq.NOBLOCK)
            except zmq.Again:
                return False
            self.last_sent = time.monotonic()
            return True

    def close(self) -> None:
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
        self.heartbeats.close(linger=0)
        self.socket.close(linger=0)


def _await_hello(link: EngineLink, index: int | None, timeout_s: float) -> WorkerHello:
    deadline = time.monotonic() + timeout_s
    while True:
        for message in link.receive(min(POLL_S, max(0.0, deadline - time.monotonic())), handshake=True):
            if isinstance(message, WorkerHello):
                if index is not None and message.worker_index != index:
                    log.error("hello for worker %d sent to worker %d", message.worker_index, index)
                    raise WorkerExit(EXIT_HANDSHAKE)
                return message
            log.warning("ignoring %s before the hello", type(message).__name__)
        link.check_engine(deadline_s=None)
        if time.monotonic() > deadline:
            log.error("no WorkerHello within %.1f s: exiting", timeout_s)
            raise WorkerExit(EXIT_HANDSHAKE)


class BusyHeartbeats(threading.Thread):
    """Sends the worker's heartbeats while the main thread executes a plan.

    A plan may outlast the engine's worker_timeout (a first Triton compile, a CUDA graph
    capture, a long prefill on the CPU); without these beats the engine would kill a busy
    worker as a hung one. A hung worker still falls silent: the beats stop with the process.
    """

    def __init__(self, link: EngineLink, interval_s: float) -> None:
        super().__init__(name="busy-heartbeats", daemon=True)
        self._link, self._interval_s = link, interval_s
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self._interval_s / 4):
            link = self._link
            if link.executing and time.monotonic() - link.last_sent >= self._interval_s:
                link.send(Heartbeat(sent_at=time.monotonic()), block=False)  # a full queue drops it

    def stop(self) -> None:
        self._stopped.set()
        self.join()


def _serve(link: EngineLink, worker: Worker, interval_s: float) -> int:
    """Execute plans until Shutdown; heartbeat while busy and when idle; leave when the engine is gone."""
    beats = BusyHeartbeats(link, interval_s)
    beats.start()
    try:
        return _serve_plans(link, worker, interval_s)
    finally:
        beats.stop()


def _serve_plans(link: EngineLink, worker: Worker, interval_s: float) -> int:
    deadline_s = min(3 * interval_s, MAX_DEADLINE_S)
    pending: list[PendingResult] = []  # results of the plans queued (early ones first), in order, not sent yet
    while True:
        next_beat = link.last_sent + interval_s - time.monotonic()
        # A result on its way: poll without waiting, so it leaves as soon as it lands.
        messages = link.receive(0.0 if pending else min(POLL_S, max(0.0, next_beat)))
        for message in messages:
            if isinstance(message, ExecutionPlan):
                link.executing = True
                try:
                    pending.extend(worker.submit(message))
                finally:
                    link.executing = False
                _send_landed(link, pending)
            elif isinstance(message, Shutdown):
                log.info("worker %d shutting down (%s)", worker.index, message.reason or "engine request")
                return EXIT_OK
            elif not isinstance(message, Heartbeat):
                log.warning("ignoring an unexpected %s", type(message).__name__)
        _send_landed(link, pending)
        # Only judge silence after a poll that found nothing: frames queued while a long plan
        # ran are read (and refresh last_heard) before the deadline is checked.
        link.check_engine(deadline_s if not messages and not pending else None)
        if time.monotonic() - link.last_sent >= interval_s:
            link.send(Heartbeat(sent_at=time.monotonic()), block=False)  # a full queue drops it


def _send_landed(link: EngineLink, pending: list[PendingResult]) -> None:
    """Send, in plan order, every result whose copy has landed."""
    while pending and pending[0].is_ready():
        result = pending.pop(0).result()
        if result is not None:  # None: an early result with nothing left to carry
            link.send(result)


def run_worker(
    connect: str,
    curve_server_public_key: bytes | None = None,
    curve_secret_key: bytes | None = None,
    *,
    index: int | None = None,
    parent_pid: int | None = None,
    heartbeat: str | None = None,
    hello_timeout_s: float = HELLO_TIMEOUT_S,
    start_delay_s: float = 0.0,
) -> int:
    """Serve one engine until it says Shutdown or goes away; returns the process exit code."""
    if parent_pid is not None:
        # Ctrl-C in a terminal signals the whole process group: a local worker must leave it to
        # its engine, which drains and then sends Shutdown (SPEC §7).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        arm_parent_death_signal()
        if os.getppid() != parent_pid:  # the engine died before the signal was armed
            log.error("engine (pid %d) died before this worker started", parent_pid)
            return EXIT_ENGINE_GONE
    if heartbeat is None and connect.startswith("tcp://"):
        heartbeat = heartbeat_address(connect)
    ctx = zmq.Context()
    link = None
    try:
        link = EngineLink(ctx, connect, heartbeat, parent_pid, curve_server_public_key, curve_secret_key)
        hello = _await_hello(link, index, hello_timeout_s)
        if start_delay_s > 0:  # a test hook: a slow start (say, a large checkpoint) on a small model
            log.info("start delayed by %.1f s (%s)", start_delay_s, START_DELAY_ENV)
            time.sleep(start_delay_s)
        worker, ready = _build_worker(hello)
        link.send(ready)
        link.last_heard = time.monotonic()  # loading may have taken a while: start the deadline now
        return _serve(link, worker, hello.heartbeat_interval_s)
    except WorkerExit as gone:
        return int(gone.args[0])
    finally:
        if link is not None:
            link.close()
        ctx.term()


def _build_worker(hello: WorkerHello) -> tuple[Worker, WorkerReady]:
    """Worker(hello).start(); on failure, log why and exit nonzero without sending anything."""
    from rlt_worker.worker import HandshakeError, Worker  # torch is imported here, after the hello

    try:
        worker = Worker(hello)
    except HandshakeError as exc:
        log.error("handshake refused: %s", exc)
        raise WorkerExit(EXIT_HANDSHAKE) from None
    try:
        return worker, worker.start()
    except Exception:
        log.exception("worker %d failed to start", hello.worker_index)
        raise WorkerExit(EXIT_STARTUP_FAILED) from None


def _load_key(path: str, want_secret: bool) -> bytes:
    import zmq.auth

    public, secret = zmq.auth.load_certificate(path)
    if want_secret:
        if secret is None:
            raise ValueError(f"{path} holds no secret key (pass the .key_secret file)")
        return secret
    return public


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The worker's command line."""
    parser = argparse.ArgumentParser(prog="rlt-worker", description="An rlt worker process.")
    parser.add_argument("--connect", required=True, help="the engine's address: ipc://PATH or tcp://HOST:PORT")
    parser.add_argument("--index", type=int, default=None, help="worker index (checked against the hello)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer our parent")
    parser.add_argument("--heartbeat", default=None, help="engine heartbeat address (tcp default: PORT + 1)")
    parser.add_argument("--curve-server-key", default=None, help="the engine's public certificate (zmq.auth format)")
    parser.add_argument("--curve-key", default=None, help="this worker's secret certificate (*.key_secret)")
    parser.add_argument("--hello-timeout", type=float, default=HELLO_TIMEOUT_S, help="seconds to wait for the engine")
    parser.add_argument("--replacement", action="store_true", help="started in place of a lost worker")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m rlt_worker.worker_process` and of `rlt-worker`."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format=f"%(asctime)s worker[{args.index if args.index is not None else '-'}] %(levelname)s %(message)s",
    )
    try:
        server_key = _load_key(args.curve_server_key, False) if args.curve_server_key else None
        secret_key = _load_key(args.curve_key, True) if args.curve_key else None
    except (OSError, ValueError) as exc:
        log.error("cannot load CURVE keys: %s", exc)
        return EXIT_USAGE
    # Test hook: slow the start of replacement workers only (the first ones start as usual).
    delay = float(os.environ.get(START_DELAY_ENV, "0") or 0) if args.replacement else 0.0
    return run_worker(
        args.connect, server_key, secret_key, index=args.index, parent_pid=args.parent_pid,
        heartbeat=args.heartbeat, hello_timeout_s=args.hello_timeout, start_delay_s=delay,
    )


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Sockets and context are closed by now; skip the interpreter teardown, which takes
    # 0.7 s on the 2-core CPU once torch is loaded and would make every close() that slow.
    os._exit(code)
