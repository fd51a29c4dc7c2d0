"""The scheduler's fault paths (SPEC §7): a lost worker, a failed plan, a late worker, a restart.

A mixin of `Scheduler` (same object, same single writer of request state), kept apart so that
the planning code reads on its own.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from protocol.messages import AppliedOps, StepResult
from rlt_engine.kv_manager import KVManager
from rlt_engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from rlt_engine.scheduler import Scheduler

log = logging.getLogger("rlt.scheduler")


class SchedulerFaults:
    """worker_lost, step_failed, set_responsive, worker_started, fail_all."""

    def worker_lost(self: Scheduler, worker: int) -> list[Request]:
        """A worker died: replay its requests elsewhere; returns those that end with an error.

        A request that has now lost two workers ends with an error, so a request that kills
        workers cannot take the whole fleet down. Swapped requests whose host copy died with the
        worker replay instead of importing it.
        """
        book = self.books[worker]
        lost_copies = set(book.lost())
        failed: list[Request] = []
        for request in reversed(list(book.running)):
            request.num_workers_lost += 1
            request.allocation = None  # the blocks died with the worker's pool
            if request.num_workers_lost >= 2:
                failed.append(request)
                self.finish(request, "error", slot_open=False)
                continue
            book.running.remove(request)
            request.status = RequestStatus.WAITING
            self._reset_for_replay(request)
            self.waiting.appendleft(request)
            self.stats.num_replays += 1
        for request in self.waiting:
            if request.key in lost_copies:
                self._reset_for_replay(request)
                self.stats.num_replays += 1
        return failed

    def step_failed(self: Scheduler, worker: int, result: StepResult) -> list[Request]:
        """The worker's plan failed midway: reconcile the book with the slot ops it says it
        applied, then end every request the plan reached on that worker with an error.

        Slot ops that never ran are sent again (releases, drops) or undone in the book: a slot an
        admit or import never opened is not released; a swap victim whose export never ran still
        holds its slot (released now) and has no host copy, so it replays instead. Requests placed
        after the plan was sent (still to admit) are untouched."""
        book = self.books[worker]
        # It has stopped using the plan's blocks; the blocks the plan was to compute are not cached.
        sent = book.completed(result.step_id, result.num_free_slots, failed=True)
        assert sent is not None, f"worker {worker} failed a step the scheduler never sent"
        applied = result.applied or AppliedOps()
        never_opened = set(sent.admits[applied.admits:]) | set(sent.imports[applied.imports:])
        book.unopened |= never_opened  # a plan sent after this one (pipelined) may release them too
        # Releases not sent yet (aborted while in flight) and those of this plan that did not run.
        releases = [s for s in book.to_release + sent.releases[applied.releases:] if s not in book.unopened]
        book.swap.drops += sent.swap_drops[applied.swap_drops:] + [key for key, _ in sent.imports]
        for key, generation in sent.exports[applied.exports:]:
            releases.append((key, generation))  # still in its slot, with no host copy
            request = self._by_key.get(key)
            if book.swap.copies.pop(key, None) is not None and request is not None:
                self._reset_for_replay(request)
                self.stats.num_replays += 1
        book.to_release = releases
        failed = [r for r in book.running if r not in book.to_admit]
        for request in failed:
            self.finish(request, "error", slot_open=(request.key, request.generation) not in never_opened)
        return failed

    def set_responsive(self: Scheduler, worker: int, responsive: bool) -> None:
        """A late worker gets no new requests; those placed on it but never sent wait for another."""
        book = self.books[worker]
        if book.responsive == responsive:
            return
        book.responsive = responsive
        if responsive:
            log.warning("worker %d is heard from again", worker)
            return
        log.warning("worker %d is late (no word for half of worker_timeout): new requests go elsewhere", worker)
        for request in reversed(book.to_admit):
            book.running.remove(request)
            book.kv.free(request.allocation, after_step=book.kv.completed_step)  # never named in a plan
            request.allocation = None
            request.status = RequestStatus.WAITING
            self._reset_for_replay(request)
            self.waiting.appendleft(request)
        book.to_admit = []

    def worker_started(self: Scheduler, worker: int, kv_manager: KVManager) -> None:
        """A (replacement) worker is ready with an empty pool."""
        self.books[worker].restarted(kv_manager)

    def fail_all(self: Scheduler, reason: str) -> list[Request]:
        """End every live request (no worker is left to run them)."""
        requests = list(self._live.values())
        for request in requests:
            self.finish(request, reason, slot_open=False)
        return requests
