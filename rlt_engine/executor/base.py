"""The executor interface the engine drives (SPEC §6)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from protocol.messages import ExecutionPlan, StepResult, WorkerReady


@dataclass(frozen=True)
class WorkerLost:
    """A worker died or went silent; its plan in flight will never return."""

    worker: int
    reason: str  # e.g. "exited with signal SIGKILL", "silent for 10.0 s (worker_timeout)"


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
    def collect(self, timeout: float | None = None) -> list[tuple[int, StepResult | WorkerLost | WorkerReady]]:
        """Results, losses and finished restarts, in arrival order; waits up to `timeout` for the first one.

        A `WorkerReady` is a replacement begun by `begin_restart` that is now serving; a
        `WorkerLost` for a worker being restarted means its replacement failed to start."""

    def begin_restart(self, worker: int) -> None:
        """Start a replacement for a lost worker (restart_workers=True) without waiting for it."""
        raise NotImplementedError(f"{type(self).__name__} cannot restart workers")

    @property
    def has_events(self) -> bool:
        """Whether `silence()` has read events (results, losses) that collect() will return at once."""
        return False

    def silence(self) -> dict[int, float]:
        """Seconds since each running worker was last heard from (reads what has arrived first)."""
        return {}

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and release every resource; idempotent."""
