"""The HTTP server's process: started, watched and stopped by `rlt-serve --http-port`.

    rlt-serve (engine process)                          HTTP process (no torch)
    binds the TCP socket ─── inherited fd ───────────►  uvicorn + FastAPI on that socket
    Frontend (ROUTER) ◄──────── ipc:// ───────────────  AsyncClient (one DEALER)

rlt-serve binds the listening socket itself, before the workers start, so a port in use fails
at once and `--http-port 0` reports the port it got; connections made while the HTTP process
starts (or is being restarted after a crash) wait in the socket's backlog. The HTTP process
exits when rlt-serve does (parent-death signal and a parent-pid check), ignores SIGINT (Ctrl-C
reaches the whole process group; rlt-serve drains, then stops it) and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

log = logging.getLogger("rlt.http")

RESTART_INTERVAL_S = 1.0  # at most one restart of a crashed HTTP process per interval
STOP_TIMEOUT_S = 5.0
GRACEFUL_SHUTDOWN_S = 3.0  # what the HTTP process gives open responses on SIGTERM
PARENT_CHECK_S = 0.5
_PR_SET_PDEATHSIG = 1


class HttpBindError(RuntimeError):
    """The HTTP address cannot be listened on (in use, not local, no permission)."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port); HttpBindError if that fails."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise HttpBindError(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise HttpBindError(f"cannot listen on http://{host}:{port}: {exc.strerror or exc}") from None
    return sock


class HttpProcess:
    """The HTTP server process of one rlt-serve: owns the listening socket; restarts the process if it dies."""

    def __init__(self, host: str, port: int, engine_address: str, model: str, log_level: str = "INFO") -> None:
        self.engine_address, self.model, self.log_level = engine_address, model, log_level
        self.sock = bind_listener(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.proc: subprocess.Popen | None = None
        self.num_restarts = 0
        self._started_at = 0.0
        self._stopped = False

    @property
    def url(self) -> str:
        """The base URL, e.g. http://127.0.0.1:8000."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> HttpProcess:
        """Start the HTTP process on the bound socket (call from the main thread: parent-death signal)."""
        fd = self.sock.fileno()
        cmd = [sys.executable, "-m", "rlt_engine.http_api", "--fd", str(fd), "--connect", self.engine_address,
               "--model", self.model, "--parent-pid", str(os.getpid()), "--log-level", self.log_level]
        self.proc = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     close_fds=True)
        self._started_at = time.monotonic()
        return self

    def check(self) -> None:
        """Restart the HTTP process if it exited (rate-limited); cheap enough to call every loop tick."""
        if self._stopped or self.proc is None or self.proc.poll() is None:
            return
        if time.monotonic() - self._started_at < RESTART_INTERVAL_S:
            return
        log.error("the HTTP server process (pid %d) exited with %s: restarting it", self.proc.pid, self.proc.returncode)
        self.num_restarts += 1
        self.start()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (open responses get GRACEFUL_SHUTDOWN_S), SIGKILL after `timeout`; close the socket. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the HTTP server process did not stop in %.0f s: killing it", timeout)
                proc.kill()
                proc.wait()
        self.sock.close()


# --------------------------------------------------------------------------- the HTTP process


def _arm_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the parent-pid check remains


def _uvicorn_server(config: object) -> object:
    """A uvicorn.Server that leaves signal handling to us (SIGTERM: stop; SIGINT: ignored)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(config)  # type: ignore[arg-type]


async def _serve(server: object, sock: socket.socket, parent_pid: int) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))

    async def watch_parent() -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(PARENT_CHECK_S)
        log.error("rlt-serve (pid %d) is gone: stopping the HTTP server", parent_pid)
        server.should_exit = True  # type: ignore[attr-defined]
        server.force_exit = True  # type: ignore[attr-defined]

    watcher = asyncio.create_task(watch_parent())
    try:
        await server.serve(sockets=[sock])  # type: ignore[attr-defined]
    finally:
        watcher.cancel()


def child_main(argv: list[str] | None = None) -> int:
    """`python -m rlt_engine.http_api --fd N --connect ipc://PATH --model M`: serve HTTP on an inherited socket."""
    parser = argparse.ArgumentParser(prog="rlt-http", description=child_main.__doc__)
    parser.add_argument("--fd", type=int, required=True, help="a listening TCP socket inherited from rlt-serve")
    parser.add_argument("--connect", required=True, help="rlt-serve's IPC address")
    parser.add_argument("--model", required=True, help="the served model (name or checkpoint directory)")
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _arm_parent_death_signal()
    parent_pid = args.parent_pid if args.parent_pid is not None else os.getppid()
    if os.getppid() != parent_pid:
        return 1  # rlt-serve died before the signal was armed
    logging.basicConfig(level=args.log_level, stream=sys.stderr, force=True,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    from rlt_engine.http_api.app import HttpSettings, build_app

    sock = socket.socket(fileno=args.fd)
    app = build_app(HttpSettings(engine_address=args.connect, model=args.model))
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S), log_level=args.log_level.lower())
    asyncio.run(_serve(_uvicorn_server(config), sock, parent_pid))
    return 0
