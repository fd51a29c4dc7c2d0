"""Placement decisions: which waiting request goes next, onto which worker, with how many
positions of KV (and which cached prompt blocks), whether it should wait for a prefix being
computed, and which running request a higher-priority arrival may displace.

Pure decisions over the scheduler's books (it reads, never writes); the scheduler acts on them.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlt_engine.preemption import RecomputePreemption
from rlt_engine.request import Phase, Request
from rlt_engine.worker_book import WorkerBook


class Placement:
    """FCFS or priority order; the worker holding the longest cached prefix of the prompt, then the
    one with the most free KV (then fewest running)."""

    def __init__(self, books: list[WorkerBook], preemption: RecomputePreemption, *, priority: bool,
                 max_bypasses: int, max_num_seqs: int, on_demand_kv: bool) -> None:
        self.books, self.preemption = books, preemption
        self.priority, self.max_bypasses = priority, max_bypasses
        self.max_num_seqs, self.on_demand_kv = max_num_seqs, on_demand_kv

    def next_waiting(self, waiting: Iterable[Request]) -> Request:
        """FCFS: the head. Priority: a request bypassed max_bypasses times, else the lowest number."""
        waiting = list(waiting)
        if not self.priority:
            return waiting[0]
        starved = [r for r in waiting if r.num_bypasses >= self.max_bypasses]
        if starved:
            return min(starved, key=lambda r: r.arrival)
        return min(waiting, key=lambda r: (r.params.priority, r.arrival))

    def initial_positions(self, request: Request) -> int:
        """Positions its first allocation covers: a swap copy's, the whole request's (reserve), or
        the prompt plus one block (on_demand)."""
        home = self.preemption.home(self.books, request)
        if home is not None:
            return home.swap.copies[request.key].num_positions
        if not self.on_demand_kv:
            return request.max_positions
        return min(request.max_positions, request.prompt_len + self.books[0].kv.block_size)

    def cache_keys(self, request: Request) -> tuple[bytes, ...]:
        """The prefix-cache keys its first allocation may share: none for a swap resume, whose
        pages come back into blocks of its own."""
        return () if self.preemption.home(self.books, request) is not None else request.block_hashes

    def awaits_prefix(self, request: Request) -> bool:
        """Whether some worker is computing, for another request, more of this prompt's blocks than
        any worker caches now: the request then waits for that plan to complete and shares them,
        rather than computing the same blocks again."""
        keys = self.cache_keys(request)
        if not keys:
            return False
        matches = [b.kv.prefix_match(keys) for b in self._usable()]
        cached = max((m.num_cached for m in matches), default=0)
        return any(m.num_cached + m.num_promised > cached for m in matches)

    def worker_for(self, request: Request) -> WorkerBook | None:
        """The book to place `request` on now, or None: responsive workers only (a late one only
        when every worker is late); a swapped request only on its copy's worker, after the export."""
        home = self.preemption.home(self.books, request)
        if home is not None and not home.swap.can_import(request.key, home.kv.completed_step):
            return None
        positions, keys = self.initial_positions(request), self.cache_keys(request)
        candidates = [
            b for b in self._usable()
            if not b.short_of_blocks and home in (None, b) and b.num_slots_held < self.max_num_seqs
            and b.kv.can_allocate(positions, keys)
        ]
        if not candidates:
            return None
        return max(candidates, key=lambda b: (b.kv.prefix_match(keys).num_cached, b.kv.num_free_blocks,
                                              -len(b.running)))

    def _usable(self) -> list[WorkerBook]:
        """Live workers new work may go to: the responsive ones (every live one when all are late)."""
        alive = [b for b in self.books if b.alive]
        return [b for b in alive if b.responsive] or alive

    def priority_victim(self, request: Request) -> Request | None:
        """The running request of strictly lower priority to preempt for `request` (most blocks first)."""
        victims = [
            r for b in self.books if b.alive
            for r in b.running if r.params.priority > request.params.priority and r.phase != Phase.LAST_CODA
        ]
        if not victims:
            return None
        return max(victims, key=lambda r: (r.params.priority, r.allocation.num_blocks if r.allocation else 0))
