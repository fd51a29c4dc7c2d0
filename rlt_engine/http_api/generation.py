"""The engine side of one HTTP request: one IPC stream per prompt, started and ended together.

Every stream is closed in `close()` (called from a `finally`), which aborts the requests that
have not finished: a client that disconnects, a cancelled handler and a failed sibling prompt
all give their KV blocks and slots back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from protocol.messages import RequestOutput, SamplingParams
from rlt_engine.client import AsyncClient, AsyncStream, GenerateOutput, RequestError
from rlt_engine.errors import EngineDeadError
from rlt_engine.http_api.metrics import Metrics, RequestTracker
from rlt_engine.http_api.schemas import APIError, engine_error


def as_api_error(exc: BaseException) -> APIError:
    """The APIError for what an IPC call raised."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return engine_error(exc.code, exc.message)
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not available: {exc}", kind="service_unavailable", code="engine_dead")
    if isinstance(exc, ValueError):
        return APIError(413 if "exceeds" in str(exc) else 400, str(exc))
    return APIError(500, f"{type(exc).__name__}: {exc}", kind="internal_error", code="internal")


class Generation:
    """The streams of one HTTP request; iterate `deltas()` or await `collect()`, then `close()`."""

    def __init__(self, client: AsyncClient, metrics: Metrics, request_id: str) -> None:
        self.client, self.metrics, self.request_id = client, metrics, request_id
        self.streams: list[AsyncStream] = []
        self.trackers: list[RequestTracker] = []
        self.firsts: list[RequestOutput] = []
        self.finished: list[bool] = []

    async def start(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Submit every prompt and wait for each one's first delta (APIError if any is refused)."""
        many = len(prompts) > 1
        try:
            for i, ids in enumerate(prompts):
                rid = f"{self.request_id}-{i}" if many else self.request_id
                self.trackers.append(self.metrics.track(len(ids)))
                self.streams.append(await self.client.stream(ids, params, request_id=rid))
            self.finished = [False] * len(prompts)
            self.firsts = list(await asyncio.gather(*(self._next(i) for i in range(len(prompts)))))
        except Exception as exc:
            self.close()
            raise as_api_error(exc) from None
        except BaseException:
            self.close()
            raise

    async def _next(self, index: int) -> RequestOutput:
        delta = await self.streams[index].__anext__()
        self.trackers[index].on_delta(delta)
        self.finished[index] = delta.finished
        return delta

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) in arrival order, the first deltas first; raises APIError on failure."""
        for i, first in enumerate(self.firsts):
            yield i, first
        live = [i for i, done in enumerate(self.finished) if not done]
        if len(live) == 1:  # the usual case: no tasks needed
            try:
                while not self.finished[live[0]]:
                    yield live[0], await self._next(live[0])
            except (RequestError, EngineDeadError) as exc:
                raise as_api_error(exc) from None
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                while not self.finished[i]:
                    queue.put_nowait((i, await self._next(i)))
                queue.put_nowait((i, None))
            except Exception as exc:
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i)) for i in live]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise as_api_error(item)
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self) -> list[GenerateOutput]:
        """Every prompt's whole output."""
        async for _ in self.deltas():
            pass
        return [s.output for s in self.streams]

    def close(self) -> None:
        """Abort what has not finished and record every admitted request once; idempotent."""
        for stream, tracker in zip(self.streams, self.trackers, strict=False):
            stream.close()
            tracker.end(stream.output.finish_reason)
