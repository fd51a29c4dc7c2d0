"""Preemption strategies (EngineConfig.preemption), chosen once when the scheduler is built.

    recompute  the victim's slot is released in the next plan and its blocks return after its
               last step; it resumes anywhere by depth-faithful replay
    swap       the next plan exports the victim's slot state and pages to the worker's host
               memory; its blocks return after that plan; it resumes on the same worker only,
               once the export has run, by an import into a new slot and new blocks

A strategy queues slot ops in a WorkerBook; the scheduler changes the Request.
"""

from __future__ import annotations

from rlt_engine.request import Request
from rlt_engine.worker_book import HostCopy, WorkerBook


class RecomputePreemption:
    """Give the slot and blocks up; resume by replay."""

    keeps_progress = False  # the victim replays from its prompt on resume
    frees_blocks_at_once = True  # its blocks can go to others in the step that preempted it

    def take_off(self, book: WorkerBook, request: Request) -> None:
        """Queue the victim's slot ops (it has reached its worker)."""
        book.to_release.append((request.key, request.generation))
        book.kv.free(request.allocation, after_step=request.last_step_id)

    def home(self, books: list[WorkerBook], request: Request) -> WorkerBook | None:
        """The worker a waiting request must resume on (None: any)."""
        return None

    def resume(self, book: WorkerBook, request: Request) -> bool:
        """Queue the resume of a placed request; False: it needs an admit (a new or replayed slot)."""
        return False

    def forget(self, books: list[WorkerBook], request: Request) -> None:
        """A waiting request ended: nothing of it is held anywhere."""


class SwapPreemption(RecomputePreemption):
    """Export the slot to host memory; import it back on the same worker."""

    keeps_progress = True
    frees_blocks_at_once = False  # its blocks return only after the plan carrying its export

    def take_off(self, book: WorkerBook, request: Request) -> None:
        assert request.allocation is not None
        book.swap.exports.append((request, request.generation, request.allocation))
        book.swap.copies[request.key] = HostCopy(request.allocation.num_positions)

    def home(self, books: list[WorkerBook], request: Request) -> WorkerBook | None:
        return next((b for b in books if request.key in b.swap.copies), None)

    def resume(self, book: WorkerBook, request: Request) -> bool:
        if request.key not in book.swap.copies:
            return False
        del book.swap.copies[request.key]  # the import consumes it
        book.swap.imports.append(request)
        return True

    def forget(self, books: list[WorkerBook], request: Request) -> None:
        book = self.home(books, request)
        if book is None:
            return
        del book.swap.copies[request.key]
        ledger = book.swap
        for entry in ledger.exports:
            if entry[0] is request:  # never sent: its slot is released instead
                ledger.exports.remove(entry)
                book.kv.free(entry[2], after_step=request.last_step_id)
                book.to_release.append((request.key, entry[1]))
                return
        ledger.drops.append(request.key)


def make_preemption(mode: str) -> RecomputePreemption:
    """The strategy for `EngineConfig.preemption` ("swap" or "recompute")."""
    return SwapPreemption() if mode == "swap" else RecomputePreemption()
