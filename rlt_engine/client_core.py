"""Shared state of rlt's Python clients: outbox, pending calls, id tombstones (no torch).

`Client` and `AsyncClient` (rlt_engine.client) differ only in who owns the socket and how they
wait; routing, liveness and the abort contract live here.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from protocol import ProtocolError, client_codec
from protocol.codec import CLIENT_MAX_FRAME_BYTES
from protocol.messages import (
    AbortRequest,
    EngineError,
    GenerateRequest,
    HealthReport,
    Keepalive,
    RequestOutput,
    SamplingParams,
)
from rlt_engine.errors import EngineDeadError

log = logging.getLogger("rlt.client")

class RequestError(RuntimeError):
    """The engine refused a request (code: invalid_request, overload, shutting_down, protocol, …)."""

    def __init__(self, request_id: str | None, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.request_id, self.code, self.message = request_id, code, message


@dataclass
class GenerateOutput:
    """A request's whole output, assembled from its deltas."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    seed: int | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V the engine's prefix cache held

    def add(self, delta: RequestOutput) -> None:
        """Append one delta (deltas arrive in order; first_index says where each starts)."""
        if delta.first_index != len(self.token_ids):
            raise ProtocolError(f"delta of {delta.request_id!r} starts at {delta.first_index}, "
                                f"expected {len(self.token_ids)}")
        self.token_ids += delta.token_ids
        self.exit_depths += delta.exit_depths
        self.logprobs += delta.logprobs
        self.text += delta.text
        self.seed = delta.seed if delta.seed is not None else self.seed
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            self.finish_reason, self.error = delta.finish_reason, delta.error


Sink = Callable[[object], None]
Prompt = str | list[int]


def make_request(request_id: str, prompt: Prompt, params: SamplingParams | None) -> GenerateRequest:
    """A GenerateRequest for a text or token-id prompt."""
    params = params or SamplingParams()
    if isinstance(prompt, str):
        return GenerateRequest(request_id=request_id, prompt=prompt, params=params)
    return GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt), params=params)


class Core:
    """State shared by both clients: outbox, pending calls, id tombstones. Guarded by `lock`."""

    def __init__(self, address: str, dead_after: float) -> None:
        self.address = address if "://" in address else f"ipc://{address}"
        self.dead_after = dead_after
        self.identity = uuid.uuid4().bytes  # fixed, so a reconnect does not look like a new client
        self.lock = threading.RLock()
        self.codec = client_codec()
        self.outbox: collections.deque[tuple[str | None, bytes]] = collections.deque()
        self.streams: dict[str, tuple[Sink, float]] = {}
        self.health: dict[int, tuple[Sink, float]] = {}
        # An abandoned incarnation still has exactly one final message on its way (frontend
        # contract); until it arrives, messages for that id belong to the old incarnation.
        self.tombs: collections.Counter[str] = collections.Counter()
        self.last_heard = time.monotonic()
        self.nonces = itertools.count(1)
        self.closed = False
        self.stray = 0  # answers no call waited for (late ones after a failure; else a bug)

    def submit(self, message: msgspec.Struct, request_id: str | None = None, sink: Sink | None = None,
               nonce: int | None = None) -> None:
        """Queue a message; with a sink, register the call its answers go to."""
        frame = self.encode(message)
        if len(frame) > CLIENT_MAX_FRAME_BYTES:
            raise ValueError(f"message of {len(frame)} bytes exceeds the {CLIENT_MAX_FRAME_BYTES}-byte limit")
        with self.lock:
            if self.closed:
                raise EngineDeadError("the client is closed")
            if sink is not None and request_id is not None:
                if request_id in self.streams:
                    raise ValueError(f"request id {request_id!r} is already live in this client")
                self.streams[request_id] = (sink, time.monotonic())
            elif sink is not None and nonce is not None:
                self.health[nonce] = (sink, time.monotonic())
            self.outbox.append((request_id if sink is not None else None, frame))

    def abandon(self, request_id: str) -> bool:
        """Stop listening to a live stream; True when its request must be aborted."""
        with self.lock:
            if self.streams.pop(request_id, None) is None:
                return False
            self.tombs[request_id] += 1
            return True

    def flush(self, sock: zmq.Socket) -> None:
        """Send what the outbox holds until the socket has no connected peer (IMMEDIATE)."""
        with self.lock:
            while self.outbox:
                try:
                    sock.send(self.outbox[0][1], zmq.NOBLOCK)
                except zmq.Again:
                    return
                self.outbox.popleft()

    def on_frame(self, frame: bytes) -> None:
        """Route one frame from the engine to the call waiting for it."""
        self.last_heard = time.monotonic()
        try:
            message = self.codec.decode(frame)
        except ProtocolError as exc:
            log.warning("dropping a bad frame from the engine: %s", exc)
            return
        with self.lock:
            if isinstance(message, HealthReport):
                entry = self.health.pop(message.nonce, None)
            elif isinstance(message, RequestOutput | EngineError) and message.request_id is not None:
                rid = message.request_id
                final = isinstance(message, EngineError) or message.finished
                if self.tombs[rid]:
                    self.tombs[rid] -= final
                    if not self.tombs[rid]:
                        del self.tombs[rid]
                    return
                entry = self.streams.pop(rid, None) if final else self.streams.get(rid)
            elif isinstance(message, EngineError):
                log.warning("the engine refused a message: %s: %s", message.code, message.message)
                return
            else:
                return  # KeepaliveAck: last_heard is all it is for
        if entry is None:
            self.stray += 1
            log.debug("no call waits for %r", message)
        else:
            entry[0](message)

    def expire(self, now: float) -> None:
        """Fail the calls that heard nothing from the engine for dead_after seconds."""
        with self.lock:
            heard = self.last_heard
            late = [(rid, s) for rid, (s, t0) in self.streams.items() if now - max(t0, heard) > self.dead_after]
            late_h = [(n, s) for n, (s, t0) in self.health.items() if now - max(t0, heard) > self.dead_after]
            if not late and not late_h:
                return
            for rid, _ in late:
                del self.streams[rid]
            for n, _ in late_h:
                del self.health[n]
            self._purge({rid for rid, _ in late})
        error = EngineDeadError(f"no answer from the engine at {self.address} for {now - heard:.1f} s")
        for _, sink in late + late_h:
            sink(error)

    def poll_ms(self, idle_ms: int) -> int:
        """How long the owner may wait: until the nearest call deadline, at most idle_ms (10 with sends queued)."""
        with self.lock:
            if self.outbox:
                return 10
            starts = [t0 for _, t0 in self.streams.values()] + [t0 for _, t0 in self.health.values()]
        if not starts:
            return idle_ms
        deadline = max(min(starts), self.last_heard) + self.dead_after
        return max(1, min(idle_ms, int((deadline - time.monotonic()) * 1000) + 1))

    def fail_all(self, reason: str) -> None:
        """Fail every pending call with EngineDeadError(reason)."""
        with self.lock:
            sinks = [s for s, _ in self.streams.values()] + [s for s, _ in self.health.values()]
            self._purge(set(self.streams))
            self.streams.clear()
            self.health.clear()
            self.tombs.clear()  # their final messages will never come
        error = EngineDeadError(reason)
        for sink in sinks:
            sink(error)

    def _purge(self, request_ids: set[str]) -> None:
        # A failed call's request must not reach a restarted engine later.
        self.outbox = collections.deque(e for e in self.outbox if e[0] not in request_ids)

    def open_socket(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
        """The DEALER (connected) and a monitor socket that reports its disconnections."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.identity)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not there
        sock.linger = 200
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        return sock, monitor

    def disconnected(self, monitor: zmq.Socket) -> bool:
        """Read the monitor's pending events: whether one says the engine's connection dropped."""
        dropped = False
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return dropped
            dropped |= parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED

    def encode(self, message: msgspec.Struct) -> bytes:
        """Encode under the lock (user threads and the socket's owner share one encoder)."""
        with self.lock:
            return self.codec.encode(message)

    def keepalive(self) -> bytes:
        """A Keepalive frame."""
        return self.encode(Keepalive(sent_at=time.monotonic()))

    def aborts(self) -> list[bytes]:
        """AbortRequest frames for every live stream (sent when the client closes)."""
        with self.lock:
            return [self.codec.encode(AbortRequest(request_id=rid)) for rid in self.streams]


def abort_quietly(core: Core, request_id: str) -> None:
    """Send an abort unless the client closed meanwhile."""
    try:
        core.submit(AbortRequest(request_id=request_id))
    except EngineDeadError:
        pass  # the client closed meanwhile: its close() aborts what is live


def raise_if_error(item: object) -> None:
    """Raise what a call received instead of its answer."""
    if isinstance(item, EngineError):
        raise RequestError(item.request_id, item.code, item.message)
    if isinstance(item, BaseException):
        raise item


def read_some(fd: int) -> bool:
    """Empty a non-blocking wake-up pipe; False once it is empty."""
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def drain(sock: zmq.Socket, core: Core) -> None:
    """Route every frame the socket holds."""
    while True:
        try:
            core.on_frame(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return


def send_quietly(sock: zmq.Socket, frame: bytes) -> None:
    """Send if a peer is connected, else drop (keepalives, final aborts)."""
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass  # not connected: nothing to keep alive
