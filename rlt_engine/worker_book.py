"""The engine's book of one worker: its requests, the slot ops it is owed, its KV and host copies.

One `WorkerBook` per worker holds everything that used to be parallel per-worker lists:

    running            requests with a slot (or one on its way) on this worker
    to_admit           placed here, admit op not sent yet
    to_release         slots to free in the next plan
    releases_in_flight step id → slots its plan frees (admits apply before releases, so a
                       released slot is held until that plan completes)
    in_flight          step id → the slot ops of each plan in flight (a failed plan is reconciled
                       from them; pipelined, two plans may be in flight)
    unopened           slots a failed plan's admits or imports never opened (a plan sent after it
                       may still name them: their releases are never sent again)
    num_free_slots     the worker's free slots as of its last result (for health)
    kv                 the KV manager of this worker's pool (and its prefix cache index)
    swap               the swap ledger: exports/imports/drops to send, host copies held

The book keeps counts and queues; it never changes a Request (the scheduler does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlt_engine.kv_manager import KVAllocation, KVManager
from rlt_engine.plan_builder import PlanBuilder, SlotOps
from rlt_engine.request import Request


@dataclass
class HostCopy:
    """A swapped-out request's slot held in this worker's host memory (named by the request key)."""

    num_positions: int  # positions its blocks covered: what its resume allocates
    exported_at: int | None = None  # the step whose plan carries the export (None: not sent yet)


@dataclass
class SwapLedger:
    """Swap ops owed to the worker and the host copies it holds."""

    exports: list[tuple[Request, int, KVAllocation]] = field(default_factory=list)  # (request, generation, blocks)
    imports: list[Request] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)  # keys whose host copy is no longer wanted
    copies: dict[int, HostCopy] = field(default_factory=dict)  # request key → its host copy

    def can_import(self, key: int, completed_step: int) -> bool:
        """Whether the key's export has run (its host copy exists), so an import may follow."""
        copy = self.copies.get(key)
        return copy is not None and copy.exported_at is not None and copy.exported_at <= completed_step


class WorkerBook:
    """What the engine knows about one worker."""

    def __init__(self, index: int, kv: KVManager, num_slots: int) -> None:
        self.index = index
        self.kv = kv
        self.num_slots = num_slots  # the worker's slot table (max_num_seqs)
        self.num_free_slots = num_slots  # as the worker reported with its last result
        self.alive = True
        self.responsive = True  # heard from within half of worker_timeout
        self.short_of_blocks = False  # its running requests could not grow last step: admit nothing
        self.running: list[Request] = []
        self.to_admit: list[Request] = []
        self.to_release: list[tuple[int, int]] = []
        self.releases_in_flight: dict[int, int] = {}
        self.in_flight: dict[int, SlotOps] = {}
        self.unopened: set[tuple[int, int]] = set()
        self.swap = SwapLedger()

    @property
    def num_slots_held(self) -> int:
        """Slots in use or not yet known to be free (releases and exports sent or owed)."""
        return (len(self.running) + len(self.to_release) + len(self.swap.exports)
                + sum(self.releases_in_flight.values()))

    @property
    def has_slot_ops(self) -> bool:
        ledger = self.swap
        return bool(self.to_release or ledger.exports or ledger.imports or ledger.drops)

    def emit_slot_ops(self, plan: PlanBuilder) -> None:
        """Write the releases, swap ops and admits owed into `plan` (the scheduler adds the rows)."""
        for key, generation in self.to_release:
            plan.release(key, generation)
        ledger = self.swap
        for request, generation, allocation in ledger.exports:
            plan.export(request.key, generation)
            ledger.copies[request.key].exported_at = plan.step_id
            self.kv.free(allocation, after_step=plan.step_id)  # the export reads them after the batches
        for request in ledger.imports:
            plan.import_(request, request.allocation)
        for key in ledger.drops:
            plan.drop_swapped(key)
        freed = len(self.to_release) + len(ledger.exports)
        if freed:
            self.releases_in_flight[plan.step_id] = freed
        self.to_release = []
        ledger.exports, ledger.imports, ledger.drops = [], [], []
        for request in self.to_admit:
            plan.admit(request, request.allocation)
        self.to_admit = []

    def sent(self, plan: PlanBuilder) -> None:
        """`plan` is on its way to the worker."""
        self.in_flight[plan.step_id] = plan.slot_ops

    def completed(self, step_id: int, num_free_slots: int, failed: bool = False) -> SlotOps | None:
        """The worker has finished the plan of `step_id` (it failed midway if `failed`); returns its slot ops."""
        self.num_free_slots = num_free_slots
        self.kv.retire(step_id, failed)
        self.releases_in_flight.pop(step_id, None)
        return self.in_flight.pop(step_id, None)

    def lost(self) -> list[int]:
        """The worker died: its queues and host copies with it; returns the keys of the copies lost."""
        self.alive, self.num_free_slots = False, 0
        lost = list(self.swap.copies)
        self.to_admit, self.to_release, self.releases_in_flight, self.in_flight = [], [], {}, {}
        self.unopened = set()
        self.swap = SwapLedger()
        return lost

    def restarted(self, kv: KVManager) -> None:
        """A replacement is serving with an empty pool and slot table (and so an empty prefix cache)."""
        self.kv, self.alive, self.responsive, self.short_of_blocks = kv, True, True, False
        self.num_free_slots = self.num_slots
