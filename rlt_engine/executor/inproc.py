"""InprocExecutor (`workers=0`): the Worker runs in the engine process.

Plans and results still pass through the protocol codecs, so this path exercises the same
bytes as the multi-process one and measures what the process boundary itself costs. `submit`
queues the plan's work (on the CPU: runs it); `collect` hands back the results in plan order,
waiting for the oldest one's copy if none has landed, so pipelined plans overlap here too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import config_hash, engine_worker_codec, worker_side_codec
from protocol.messages import PROTOCOL_VERSION, ExecutionPlan, StepResult, WorkerConfig, WorkerHello, WorkerReady
from rlt_engine.executor.base import Executor, WorkerLost

if TYPE_CHECKING:
    from rlt_worker.step_results import PendingResult


class InprocExecutor(Executor):
    """One in-process worker; submit runs the plan at once, collect hands its result back."""

    num_workers = 1

    def __init__(self, config: WorkerConfig) -> None:
        from rlt_worker.worker import Worker  # the executor is where the engine meets the worker

        self._hello = WorkerHello(
            protocol_version=PROTOCOL_VERSION, worker_index=0, config=config, config_hash=config_hash(config)
        )
        self._worker: Worker | None = Worker(self._hello)
        self._worker_codec = worker_side_codec()  # the worker's end: decodes plans
        self._engine_codec = engine_worker_codec()  # the engine's end: decodes results
        self._done: list[tuple[int, StepResult | WorkerReady]] = []
        self._pending: list[PendingResult] = []  # results of the plans submitted (early ones first), not collected

    def _cross(self, message: WorkerReady | StepResult) -> WorkerReady | StepResult:
        return self._engine_codec.decode(self._worker_codec.encode(message))

    def start(self) -> list[WorkerReady]:
        assert self._worker is not None
        return [self._cross(self._worker.start())]

    def begin_restart(self, worker: int) -> None:
        """A fresh Worker (empty slot table and pool) in place of the old one; ready at the next collect."""
        from rlt_worker.worker import Worker

        assert worker == 0
        self._close_worker()
        self._worker = Worker(self._hello)
        self._done.append((0, self.start()[0]))

    def submit(self, worker: int, plan: ExecutionPlan) -> None:
        assert self._worker is not None and worker == 0
        received = self._worker_codec.decode(self._engine_codec.encode(plan))
        self._pending.extend(self._worker.submit(received))

    def collect(self, timeout: float | None = None) -> list[tuple[int, StepResult | WorkerLost | WorkerReady]]:
        """Every result that has landed, in plan order (the oldest waited for if none has)."""
        landed = 0
        while landed < len(self._pending) and (landed == 0 or self._pending[landed].is_ready()):
            landed += 1
        results, self._pending = self._pending[:landed], self._pending[landed:]
        built = [r.result() for r in results]  # None: an early result with nothing left to carry
        done, self._done = self._done + [(0, self._cross(r)) for r in built if r is not None], []
        return done

    def shutdown(self) -> None:
        self._close_worker()
        self._done = []

    def _close_worker(self) -> None:
        """Drop the uncollected results first: they hold the worker's device tensors (on CUDA, some
        from its graphs' private pools), so the worker's close could free them only after this
        executor died, and the allocator would keep that memory reserved from the next engine."""
        self._pending = []
        if self._worker is not None:
            self._worker.close()
            self._worker = None
