"""Python clients of rlt-serve: `Client` (threads) and `AsyncClient` (asyncio). Imports no torch.

Both speak to the frontend's ROUTER through one DEALER socket that a single owner uses (the
sync client's I/O thread; the async client's event loop): user threads only append encoded
frames to an outbox under a lock and wake the owner through a pipe. Each incoming message is
routed by request id (or health nonce) to the queue of the call that waits for it.

Liveness (SPEC §7): a keepalive goes out every second and the engine answers each one. A call
fails with EngineDeadError once nothing was heard from the engine for 3 s since the call began,
and at once when the connection drops (the engine process exited or was killed).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import zmq
import zmq.asyncio

from protocol.messages import AbortRequest, HealthReport, HealthRequest, RequestOutput, SamplingParams
from rlt_engine.client_core import (
    Core,
    GenerateOutput,
    Prompt,
    RequestError,
    abort_quietly,
    drain,
    log,
    make_request,
    raise_if_error,
    read_some,
    send_quietly,
)
from rlt_engine.errors import EngineDeadError

KEEPALIVE_INTERVAL_S = 1.0
DEAD_AFTER_S = 3.0

__all__ = [
    "AsyncClient", "AsyncStream", "Client", "EngineDeadError", "GenerateOutput", "RequestError", "SamplingParams",
    "Stream",
]


class Stream:
    """Deltas of one request; closing it (or leaving its `with`) before the end aborts the request."""

    def __init__(self, core: Core, request_id: str, inbox: queue.SimpleQueue, wake: Callable[[], None]) -> None:
        self.request_id = request_id
        self.output = GenerateOutput(request_id)
        self._core, self._inbox, self._wake, self._done = core, inbox, wake, False

    def __iter__(self) -> Iterator[RequestOutput]:
        return self

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        item = self._inbox.get()
        if not isinstance(item, RequestOutput):
            self._done = True
            raise_if_error(item)
        assert isinstance(item, RequestOutput)
        self.output.add(item)
        self._done = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it has finished; idempotent."""
        if not self._done:
            self._done = True
            if self._core.abandon(self.request_id):
                abort_quietly(self._core, self.request_id)
                self._wake()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, closed client
            pass


class Client:
    """A blocking client; safe to share between threads. `close()` (or `with`) ends it."""

    def __init__(self, address: str, *, dead_after: float = DEAD_AFTER_S,
                 keepalive_interval: float = KEEPALIVE_INTERVAL_S) -> None:
        self._core = Core(address, dead_after)
        self.address = self._core.address
        self._interval = keepalive_interval
        self._ctx = zmq.Context()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._thread = threading.Thread(target=self._io_loop, name="rlt-client-io", daemon=True)
        self._thread.start()

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None) -> Stream:
        """Start a request and return its stream of deltas (RequestOutput)."""
        rid = request_id or uuid.uuid4().hex
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._core.submit(make_request(rid, prompt, params), rid, inbox.put)
        self._wake()
        return Stream(self._core, rid, inbox, self._wake)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                 request_id: str | None = None) -> GenerateOutput:
        """Run a request to the end and return its whole output."""
        with self.stream(prompt, params, request_id) as stream:
            for _ in stream:
                pass
        return stream.output

    def abort(self, request_id: str) -> None:
        """Abort a request of this client; its stream ends with finish reason `abort`."""
        self._core.submit(AbortRequest(request_id=request_id))
        self._wake()

    def health(self) -> HealthReport:
        """The engine's HealthReport (workers, KV usage, free slots, waiting and running)."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        nonce = next(self._core.nonces)
        self._core.submit(HealthRequest(nonce=nonce), sink=inbox.put, nonce=nonce)
        self._wake()
        item = inbox.get()
        raise_if_error(item)
        assert isinstance(item, HealthReport)
        return item

    def close(self) -> None:
        """Abort this client's live requests, fail its pending calls, close the socket; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        self._thread.join()
        self._core.closed = True
        self._core.fail_all("the client is closed")
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    def _io_loop(self) -> None:
        core = self._core
        sock, monitor = core.open_socket(self._ctx)
        poller = zmq.Poller()
        for item in (sock, monitor, self._wake_r):
            poller.register(item, zmq.POLLIN)
        next_keepalive = 0.0
        try:
            while not self._stopping:
                events = dict(poller.poll(core.poll_ms(100)))
                if self._wake_r in events:
                    while read_some(self._wake_r):
                        pass
                if sock in events:
                    drain(sock, core)
                if monitor in events and core.disconnected(monitor):
                    drain(sock, core)  # what arrived before the drop still counts
                    core.fail_all(f"the engine at {core.address} closed the connection")
                core.flush(sock)
                now = time.monotonic()
                if now >= next_keepalive:
                    send_quietly(sock, core.keepalive())
                    next_keepalive = now + self._interval
                core.expire(now)
            for frame in core.aborts():
                send_quietly(sock, frame)
        except Exception:
            log.exception("the client's I/O thread failed")
            core.closed = True
            core.fail_all("the client's I/O thread failed")
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close()


class AsyncStream:
    """Async iterator of one request's deltas; `aclose()` (or `async with`) before the end aborts it."""

    def __init__(self, client: AsyncClient, request_id: str, inbox: asyncio.Queue) -> None:
        self.request_id = request_id
        self.output = GenerateOutput(request_id)
        self._client, self._inbox, self._done = client, inbox, False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._inbox.get()
        if not isinstance(item, RequestOutput):
            self._done = True
            raise_if_error(item)
        assert isinstance(item, RequestOutput)
        self.output.add(item)
        self._done = item.finished
        return item

    def close(self, _flush: bool = True) -> None:
        """Abort the request unless it has finished (no await needed); idempotent."""
        if not self._done:
            self._done = True
            core = self._client._core
            if core.abandon(self.request_id):
                abort_quietly(core, self.request_id)
                if _flush:
                    self._client._flush()

    async def aclose(self) -> None:
        """Same as close()."""
        self.close()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(_flush=False)  # the collector may run in any thread: leave the send to the I/O task
        except Exception:
            pass


class AsyncClient:
    """An asyncio client (zmq.asyncio); use it from one event loop. `await close()` ends it."""

    def __init__(self, address: str, *, dead_after: float = DEAD_AFTER_S,
                 keepalive_interval: float = KEEPALIVE_INTERVAL_S) -> None:
        self._core = Core(address, dead_after)
        self.address = self._core.address
        self._interval = keepalive_interval
        # Plain sockets, used only from the event loop's thread and waited on through zmq.asyncio's
        # Poller: non-blocking sends and receives stay plain calls, shared with Client.
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._task: asyncio.Task | None = None

    def _start(self) -> None:
        if self._core.closed:
            raise EngineDeadError("the client is closed")
        if self._task is None:
            self._sock, monitor = self._core.open_socket(self._ctx)
            self._task = asyncio.get_running_loop().create_task(self._io_loop(self._sock, monitor))

    def _flush(self) -> None:
        """Send what was queued now (same thread as the I/O task, so no wake-up is needed)."""
        if self._sock is not None and not self._core.closed:
            self._core.flush(self._sock)

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncStream:
        """Start a request and return its async stream of deltas (RequestOutput)."""
        self._start()
        rid = request_id or uuid.uuid4().hex
        inbox: asyncio.Queue = asyncio.Queue()
        self._core.submit(make_request(rid, prompt, params), rid, inbox.put_nowait)
        self._flush()
        return AsyncStream(self, rid, inbox)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> GenerateOutput:
        """Run a request to the end and return its whole output."""
        async with await self.stream(prompt, params, request_id) as stream:
            async for _ in stream:
                pass
        return stream.output

    async def abort(self, request_id: str) -> None:
        """Abort a request of this client; its stream ends with finish reason `abort`."""
        self._start()
        self._core.submit(AbortRequest(request_id=request_id))
        self._flush()

    async def health(self) -> HealthReport:
        """The engine's HealthReport."""
        self._start()
        inbox: asyncio.Queue = asyncio.Queue()
        nonce = next(self._core.nonces)
        self._core.submit(HealthRequest(nonce=nonce), sink=inbox.put_nowait, nonce=nonce)
        self._flush()
        item = await inbox.get()
        raise_if_error(item)
        assert isinstance(item, HealthReport)
        return item

    async def close(self) -> None:
        """Abort live requests, fail pending calls, close the socket; idempotent."""
        if self._core.closed:
            return
        self._core.closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._core.fail_all("the client is closed")
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _io_loop(self, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        core = self._core
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        next_keepalive = 0.0
        try:
            while True:
                events = dict(await poller.poll(core.poll_ms(100)))
                if sock in events:
                    drain(sock, core)
                if monitor in events and core.disconnected(monitor):
                    drain(sock, core)
                    core.fail_all(f"the engine at {core.address} closed the connection")
                core.flush(sock)
                now = time.monotonic()
                if now >= next_keepalive:
                    send_quietly(sock, core.keepalive())
                    next_keepalive = now + self._interval
                core.expire(now)
        finally:
            for frame in core.aborts():
                send_quietly(sock, frame)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close()
