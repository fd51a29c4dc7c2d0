"""The IPC frontend: a ZeroMQ ROUTER in the engine process serving many clients (SPEC §6, §7).

One thread does everything, in a loop that never blocks for long:

    poll the ROUTER (0 ms when the engine has work, else 50 ms) → handle up to a batch of frames
    → abort the requests of clients silent for 3 s → engine.step(timeout=10 ms) → send deltas

Client request ids are scoped per client identity: the engine sees "<identity hex>:<n>:<id>",
where n counts admissions, so two clients may use the same id and an id reused right after an
abort never mixes with the aborted incarnation. Every incarnation ends with exactly one final
message on the wire (a finished RequestOutput or an EngineError), and nothing of it follows
that message; clients rely on this to reuse ids safely.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from protocol import PROTOCOL_VERSION, ProtocolError, frontend_codec
from protocol.codec import CLIENT_MAX_FRAME_BYTES
from protocol.messages import (
    AbortRequest,
    EngineError,
    GenerateRequest,
    HealthRequest,
    Keepalive,
    KeepaliveAck,
    RequestOutput,
)
from rlt_engine.engine import LLMEngine
from rlt_engine.errors import CapacityError, EngineDeadError, InvalidRequestError
from rlt_engine.output_processor import GenerationOutput

log = logging.getLogger("rlt.frontend")

CLIENT_TIMEOUT_S = 3.0  # a client silent this long has its requests aborted (SPEC §7)
IDLE_POLL_MS = 50
STEP_TIMEOUT_S = 0.01  # how long one step may wait for a worker's result before clients are served again
MAX_FRAMES_PER_POLL = 256
_IPC_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) − 1


_warned_dirs: set[str] = set()


class AddressInUseError(RuntimeError):
    """Another rlt-serve is listening on the requested ipc path."""


@dataclass
class _Live:
    """One admitted request incarnation as the frontend tracks it."""

    client: bytes
    request_id: str
    engine_id: str
    want_logprobs: bool
    sent: int = 0  # output tokens delivered so far


@dataclass
class _Peer:
    """A client identity: when it was last heard and its live requests (user id → engine id)."""

    last_seen: float
    requests: dict[str, str] = field(default_factory=dict)


def prepare_ipc_path(path: str) -> None:
    """Make `path` bindable: a private parent directory, and a stale socket file removed.

    Raises AddressInUseError when a process still accepts connections on it.
    """
    if len(path) > _IPC_PATH_MAX:
        raise ValueError(f"ipc path too long for a unix socket ({len(path)} > {_IPC_PATH_MAX} bytes): {path}")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    if os.stat(parent).st_mode & 0o077 and parent not in _warned_dirs:
        _warned_dirs.add(parent)
        log.warning("%s is accessible to other users; prefer a private (0700) directory for the socket", parent)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        log.warning("replacing the stale socket file %s (no one is listening on it)", path)
        os.unlink(path)
        return
    except OSError as exc:
        raise AddressInUseError(f"cannot probe {path}: {exc}") from None
    finally:
        probe.close()
    raise AddressInUseError(f"another rlt-serve is listening on ipc://{path}")


class Frontend:
    """Serves GenerateRequest / AbortRequest / HealthRequest / Keepalive for one engine."""

    def __init__(
        self, engine: LLMEngine, address: str, *, max_pending: int = 1024, client_timeout: float = CLIENT_TIMEOUT_S
    ) -> None:
        self.engine = engine
        self.address = address
        self.max_pending = max_pending
        self.client_timeout = client_timeout
        self._codec = frontend_codec()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises, instead of a silent drop
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        # Frames a little over the codec limit still get an error reply; far larger ones cost the
        # sender its connection instead of our memory.
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4 * CLIENT_MAX_FRAME_BYTES)
        self._sock.linger = 1000  # final outputs leave before close
        self._ipc_path = address[len("ipc://") :] if address.startswith("ipc://") else None
        try:
            if self._ipc_path is not None:
                prepare_ipc_path(self._ipc_path)
            self._sock.bind(address)
            if self._ipc_path is not None:
                os.chmod(self._ipc_path, 0o600)
        except BaseException:
            self._sock.close(linger=0)
            self._ctx.term()
            raise
        self._peers: dict[bytes, _Peer] = {}
        self._live: dict[str, _Live] = {}  # engine id → incarnation
        self._admitted = 0
        self._need_step = False
        self._gone: set[bytes] = set()
        self._stops = 0  # signals received
        self._drain_deadline: float | None = None
        self._closed = False
        self.exit_code = 0

    # ------------------------------------------------------------------ control

    def request_stop(self, shutdown_timeout: float) -> None:
        """Stop accepting and drain (first call); shorten the drain to now (later calls). Signal-safe."""
        self._stops += 1
        now = time.monotonic()
        self._drain_deadline = now + shutdown_timeout if self._stops == 1 else now

    @property
    def draining(self) -> bool:
        """Whether a stop was requested (new requests are refused)."""
        return self._stops > 0

    @property
    def num_pending(self) -> int:
        """Live request incarnations across all clients."""
        return len(self._live)

    def serve(self, on_tick: Callable[[], None] | None = None) -> int:
        """Run until a requested stop has drained or the engine dies; returns the exit code."""
        engine = self.engine
        while True:
            busy = self._need_step or engine.has_unfinished_requests() or engine.has_work_in_flight
            self._poll_clients(0 if busy else IDLE_POLL_MS)
            now = time.monotonic()
            self._expire_silent(now)
            if self.draining:
                if not self._live:
                    return self.exit_code
                if now >= (self._drain_deadline or now):
                    log.warning("shutdown timeout: aborting %d request(s) still running", len(self._live))
                    for live in list(self._live.values()):
                        self._abort(live, notify=True)
            if self._need_step or engine.has_unfinished_requests() or engine.has_work_in_flight:
                self._need_step = False
                try:
                    outputs = engine.step(timeout=STEP_TIMEOUT_S)
                except Exception:
                    log.exception("engine step failed; failing every request")
                    self._fail_all("internal", "the engine failed; see the rlt-serve log")
                    return 1
                self._publish(outputs)
            self._drop_gone()
            if engine.is_dead:
                log.error("the engine has no worker left: exiting")
                self._fail_all("engine_dead", "the engine has no worker left")
                return 1
            if on_tick is not None:
                on_tick()

    def close(self) -> None:
        """Close the socket and remove its file; idempotent (the engine is the caller's to close)."""
        if self._closed:
            return
        self._closed = True
        self._sock.close()
        self._ctx.term()
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ inbound

    def _poll_clients(self, timeout_ms: int) -> None:
        if not self._sock.poll(timeout_ms, zmq.POLLIN):
            return
        for _ in range(MAX_FRAMES_PER_POLL):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._on_frames(frames)

    def _on_frames(self, frames: list[bytes]) -> None:
        identity = frames[0]
        peer = self._peers.get(identity)
        if peer is None:
            peer = self._peers[identity] = _Peer(last_seen=time.monotonic())
        peer.last_seen = time.monotonic()
        if len(frames) != 2:
            self._bad_frame(identity, f"expected one frame per message, got {len(frames) - 1}", None)
            return
        try:
            message = self._codec.decode(frames[1])
        except ProtocolError as exc:
            self._bad_frame(identity, str(exc), _salvage_request_id(frames[1]))
            return
        if isinstance(message, Keepalive):
            self._send(identity, KeepaliveAck(sent_at=message.sent_at))
        elif isinstance(message, GenerateRequest):
            self._on_generate(identity, peer, message)
        elif isinstance(message, AbortRequest):
            engine_id = peer.requests.get(message.request_id)
            if engine_id is not None:
                self._abort(self._live[engine_id], notify=True)
        elif isinstance(message, HealthRequest):
            report = self.engine.health()
            report.nonce = message.nonce
            report.draining = self.draining
            self._send(identity, report)

    def _bad_frame(self, identity: bytes, reason: str, request_id: str | None) -> None:
        log.warning("client %s sent a bad frame: %s", identity.hex()[:12], reason)
        code = "protocol" if request_id is None else "invalid_request"
        self._send(identity, EngineError(request_id=request_id, code=code, message=reason))

    def _on_generate(self, identity: bytes, peer: _Peer, message: GenerateRequest) -> None:
        rid = message.request_id

        def refuse(code: str, text: str) -> None:
            self._send(identity, EngineError(request_id=rid, code=code, message=text))

        if self.draining:
            return refuse("shutting_down", "the server is draining and accepts no new requests")
        if rid in peer.requests:
            return refuse("invalid_request", f"request id {rid!r} is already live; wait for it to finish or abort it")
        if (message.prompt is None) == (message.prompt_token_ids is None):
            return refuse("invalid_request", "give exactly one of prompt (text) and prompt_token_ids")
        if len(self._live) >= self.max_pending:
            return refuse("overload", f"{len(self._live)} requests pending (--max-pending {self.max_pending})")
        self._admitted += 1
        engine_id = f"{identity.hex()}:{self._admitted}:{rid}"
        prompt = message.prompt if message.prompt is not None else message.prompt_token_ids
        assert prompt is not None
        try:
            self.engine.add_request(engine_id, prompt, message.params)
        except (InvalidRequestError, CapacityError, ValueError) as exc:
            return refuse("invalid_request", str(exc))
        except EngineDeadError as exc:
            return refuse("engine_dead", str(exc))
        except Exception as exc:  # a bug must cost one request, not the server
            log.exception("add_request(%r) failed", engine_id)
            return refuse("internal", f"{type(exc).__name__}: {exc}")
        peer.requests[rid] = engine_id
        self._live[engine_id] = _Live(identity, rid, engine_id, message.params.logprobs > 0)

    def _expire_silent(self, now: float) -> None:
        for identity, peer in list(self._peers.items()):
            if now - peer.last_seen <= self.client_timeout:
                continue
            if peer.requests:
                log.warning("client %s silent for %.1f s: aborting its %d request(s)",
                            identity.hex()[:12], now - peer.last_seen, len(peer.requests))
            for engine_id in list(peer.requests.values()):
                self._abort(self._live[engine_id], notify=True)  # it may only be slow: tell it
            del self._peers[identity]

    # ------------------------------------------------------------------ outbound

    def _abort(self, live: _Live, notify: bool) -> None:
        """End an incarnation now: abort it in the engine and send its final message at once.

        The engine hands back the life's final output and never reports that life again."""
        final = self.engine.abort_request(live.engine_id)
        self._need_step = True  # the release plan goes out with the next step
        self._forget(live)
        if notify:
            if final is None:  # not live in the engine (it failed with the engine): a bare final message
                final = GenerationOutput(request_id=live.engine_id, prompt_token_ids=[], first_index=live.sent,
                                         finished=True, finish_reason="abort")
            self._send(live.client, self._delta(live, final))

    def _forget(self, live: _Live) -> None:
        self._live.pop(live.engine_id, None)
        peer = self._peers.get(live.client)
        if peer is not None and peer.requests.get(live.request_id) == live.engine_id:
            del peer.requests[live.request_id]

    def _publish(self, outputs: list[GenerationOutput]) -> None:
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue  # aborted here already (its final message is out) or its client is gone
            if not output.new_token_ids and not output.new_text and not output.finished:
                continue
            if output.finished:
                self._forget(live)
            self._send(live.client, self._delta(live, output))

    def _delta(self, live: _Live, output: GenerationOutput) -> RequestOutput:
        """The wire message of one engine delta (built once, by the engine's output processor)."""
        live.sent = output.num_tokens
        return RequestOutput(
            request_id=live.request_id, first_index=output.first_index, token_ids=output.new_token_ids,
            exit_depths=output.new_exit_depths, logprobs=output.new_logprobs if live.want_logprobs else [],
            text=output.new_text, finished=output.finished, finish_reason=output.finish_reason, seed=output.seed,
            num_cached_tokens=output.num_cached_tokens,
            error="the engine failed this request (see the rlt-serve log)" if output.finish_reason == "error" else None,
        )

    def _fail_all(self, code: str, message: str) -> None:
        for live in list(self._live.values()):
            self._forget(live)
            self._send(live.client, EngineError(request_id=live.request_id, code=code, message=message))

    def _send(self, identity: bytes, message: msgspec.Struct) -> None:
        if identity in self._gone:
            return
        try:
            self._sock.send_multipart([identity, self._codec.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the client disconnected; EAGAIN: it stopped reading (100k messages queued).
            why = "disconnected" if exc.errno == errno.EHOSTUNREACH else f"cannot be sent to ({exc})"
            log.warning("client %s %s: aborting its requests", identity.hex()[:12], why)
            self._gone.add(identity)

    def _drop_gone(self) -> None:
        for identity in self._gone:
            for live in [v for v in self._live.values() if v.client == identity]:
                self._abort(live, notify=False)
            self._peers.pop(identity, None)
        self._gone.clear()


def _salvage_request_id(frame: bytes) -> str | None:
    """The request_id of an invalid GenerateRequest, so that its caller gets the error."""
    if frame[:4] != struct.pack("<2sH", b"RL", PROTOCOL_VERSION):
        return None  # not a frame of this protocol version: nothing in it can be trusted
    try:
        body = msgspec.msgpack.decode(frame[4:])
    except Exception:
        return None
    if isinstance(body, dict) and body.get("type") == "GenerateRequest":
        rid = body.get("request_id")
        return rid if isinstance(rid, str) else None
    return None
