"""The engine's ledger of swap preemption: which slots go to host memory and come back.

A swapped-out request keeps its phase, position and outputs; only its slot and KV blocks
are given up. Its host copy lives on the worker that exported it (named by the request key),
so it resumes only there. Its blocks return to the free pool only after the plan carrying
the export completes (the export reads them after that plan's batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlt_engine.kv_manager import KVAllocation, KVManager
from rlt_engine.plan_builder import PlanBuilder
from rlt_engine.request import Request


@dataclass
class _WorkerLedger:
    exports: list[tuple[Request, int, KVAllocation]] = field(default_factory=list)  # (request, generation, blocks)
    imports: list[Request] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)  # request keys whose host copy is no longer wanted


class SwapBook:
    """Per-worker queues of exports, imports and drops, emitted into that worker's next plan."""

    def __init__(self, num_workers: int) -> None:
        self._ledgers = [_WorkerLedger() for _ in range(num_workers)]
        self.swapped_on: dict[int, int] = {}  # request key → worker holding its host copy
        self.positions: dict[int, int] = {}  # request key → positions its blocks covered
        self._exported_at: dict[int, int] = {}  # request key → step whose plan carried its export

    def swap_out(self, request: Request, allocation: KVAllocation) -> None:
        """Queue the export of the request's current slot."""
        self._ledgers[request.worker].exports.append((request, request.generation, allocation))
        self.swapped_on[request.key] = request.worker
        self.positions[request.key] = allocation.num_positions

    def swap_in(self, request: Request) -> None:
        """Queue the import into the request's new slot (its allocation is already set)."""
        self._ledgers[request.worker].imports.append(request)
        del self.swapped_on[request.key]
        del self.positions[request.key]
        del self._exported_at[request.key]

    def can_resume(self, request: Request, completed_step: int) -> bool:
        """Whether the request's export has run (its host copy exists), so an import may follow."""
        exported_at = self._exported_at.get(request.key)
        return exported_at is not None and exported_at <= completed_step

    def forget(self, request: Request, kv: KVManager) -> tuple[int, int] | None:
        """The request ended while swapped out; returns a slot to release if it was never exported."""
        worker = self.swapped_on.pop(request.key)
        self.positions.pop(request.key)
        self._exported_at.pop(request.key, None)
        ledger = self._ledgers[worker]
        for entry in ledger.exports:
            if entry[0] is request:
                ledger.exports.remove(entry)
                kv.free(entry[2], after_step=request.last_step_id)
                return request.key, entry[1]
        ledger.drops.append(request.key)
        return None

    def cancel(self, key: int) -> None:
        """The export of this key never ran (its plan failed): no host copy exists, forget the swap."""
        del self.swapped_on[key]
        del self.positions[key]
        self._exported_at.pop(key, None)

    def drop_later(self, worker: int, keys: list[int]) -> None:
        """Send swap drops for these keys with the worker's next plan (a missing copy is no error)."""
        self._ledgers[worker].drops.extend(keys)

    def emit(self, plan: PlanBuilder, worker: int, kv: KVManager) -> int:
        """Write the worker's queued swap ops into `plan`; returns the slots the exports free."""
        ledger = self._ledgers[worker]
        for request, generation, allocation in ledger.exports:
            plan.export(request.key, generation)
            self._exported_at[request.key] = plan.step_id
            kv.free(allocation, after_step=plan.step_id)
        for request in ledger.imports:
            plan.import_(request, request.allocation)
        for key in ledger.drops:
            plan.drop_swapped(key)
        num_exports = len(ledger.exports)
        self._ledgers[worker] = _WorkerLedger()
        return num_exports

    def num_pending_exports(self, worker: int) -> int:
        """Slots still held until their export is sent and completes."""
        return len(self._ledgers[worker].exports)

    def has_ops(self, worker: int) -> bool:
        ledger = self._ledgers[worker]
        return bool(ledger.exports or ledger.imports or ledger.drops)

    def worker_lost(self, worker: int) -> list[int]:
        """The worker died with its host copies; returns the keys that must be replayed instead."""
        self._ledgers[worker] = _WorkerLedger()
        lost = [key for key, w in self.swapped_on.items() if w == worker]
        for key in lost:
            del self.swapped_on[key]
            del self.positions[key]
            self._exported_at.pop(key, None)
        return lost
