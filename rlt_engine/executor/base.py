"""The executor interface the engine drives (SPEC §6)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from protocol.messages import ExecutionPlan, StepResult, WorkerReady


class Executor(ABC):
    """Runs plans on workers: submit(plan) per worker, collect() finished results, shutdown()."""

    num_workers: int

    @abstractmethod
    def start(self) -> list[WorkerReady]:
        """Start every worker; returns their WorkerReady in worker order."""

    @abstractmethod
    def submit(self, worker: int, plan: ExecutionPlan) -> None:
        """Send a plan to one worker (returns before it runs when the executor is asynchronous)."""

    @abstractmethod
    def collect(self, timeout: float | None = None) -> list[tuple[int, StepResult]]:
        """Results that arrived, as (worker, result); waits up to `timeout` for the first one."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and release every resource; idempotent."""
