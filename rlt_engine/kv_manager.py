"""The logical KV manager of one worker: which block ids each request holds, per plane.

Only this class changes block ownership. Planes grow together (every plane covers the same
positions), so an allocation is `num_planes` equal-length lists of block ids; its i-th *column*
(the i-th id of every plane) covers positions i·block_size … (i+1)·block_size − 1.

Each block has a reference count: the requests holding it (more than one only for a column shared
through the prefix cache, see prefix_cache.py). A request's blocks are let go only once the worker
has completed the last step that used them; a block whose count then drops to zero goes back to
the free list, or, if the prefix cache indexes its column, stays cached and *idle*:

    free list  ◄── never cached, or evicted          idle cached columns (LRU) ◄── last holder left
       │                                                 │ least recently used first
       └──────────── allocate / grow: the free list first, then evict the LRU idle column

Both count as free (`num_free_blocks`): an idle column is evicted as soon as blocks run short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlt_engine.prefix_cache import Column, PrefixCache, PrefixMatch


class CapacityError(ValueError):
    """A request that could never fit in this worker's KV pool, even alone."""


@dataclass
class KVAllocation:
    """Opaque to the scheduler: the block ids a request holds, plane by plane."""

    planes: list[list[int]]
    num_positions: int  # positions the blocks cover (a multiple of block_size)
    block_hashes: tuple[bytes, ...] = ()  # prefix-cache keys of its shareable prompt blocks
    num_cached_positions: int = 0  # leading positions whose blocks came from the prefix cache
    num_offered: int = 0  # leading blocks (per plane) cached or offered to the cache so far

    @property
    def num_blocks(self) -> int:
        return sum(len(p) for p in self.planes)

    def columns(self) -> list[Column]:
        return list(zip(*self.planes, strict=True))


@dataclass
class _PendingFree:
    after_step: int
    columns: list[Column] = field(default_factory=list)


class KVManager:
    """Paged allocation for one worker: reference counts, a free list, the prefix cache's index,
    and frees waiting for their last step."""

    def __init__(self, num_blocks: int, block_size: int, num_planes: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_planes = num_planes
        self._free = list(range(num_blocks - 1, -1, -1))  # blocks no cached column names
        self._refs = [0] * num_blocks
        self._cache = PrefixCache()
        self._pending: list[_PendingFree] = []
        self._completed_step = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (idle cached ones are evicted for it)."""
        return len(self._free) + self.num_planes * self._cache.num_idle

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests or waiting for their last step to complete."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks of the columns the prefix cache indexes, held or idle."""
        return self.num_planes * self._cache.num_columns

    @property
    def completed_step(self) -> int:
        """The last step this worker is known to have completed."""
        return self._completed_step

    def blocks_for(self, num_positions: int) -> int:
        """Blocks (all planes) that cover `num_positions` positions."""
        return math.ceil(num_positions / self.block_size) * self.num_planes

    def check_fits(self, num_positions: int) -> None:
        """Raise CapacityError if `num_positions` could never fit, even in an empty pool."""
        needed = self.blocks_for(num_positions)
        if needed > self.num_blocks:
            raise CapacityError(
                f"request needs {needed} KV blocks ({num_positions} positions × {self.num_planes} planes, "
                f"block size {self.block_size}) but the worker's pool holds {self.num_blocks}; "
                "shorten the prompt or max_tokens, or start the engine with more num_blocks"
            )

    def prefix_match(self, block_hashes: tuple[bytes, ...]) -> PrefixMatch:
        """How many leading blocks of these keys are cached here, and how many more are being computed."""
        return self._cache.match(block_hashes)

    def can_allocate(self, num_positions: int, block_hashes: tuple[bytes, ...] = ()) -> bool:
        """Whether a new allocation covering `num_positions` fits now (its cached prefix shared)."""
        hits = block_hashes[: self._cache.match(block_hashes).num_cached]
        needed = self.blocks_for(num_positions) - len(hits) * self.num_planes
        # A hit on an idle column takes that column: it cannot also be evicted for the new blocks.
        return needed <= self.num_free_blocks - self.num_planes * self._cache.num_idle_among(hits)

    def allocate(self, num_positions: int, block_hashes: tuple[bytes, ...] = ()) -> KVAllocation:
        """A new allocation covering `num_positions` positions (check can_allocate first): the
        cached prefix of `block_hashes` shared, fresh blocks for the rest; the keys it has to
        compute are promised until its plans offer them."""
        per_plane = math.ceil(num_positions / self.block_size)
        num_hits = min(self._cache.match(block_hashes).num_cached, per_plane)
        hits = [self._cache.hold(key) for key in block_hashes[:num_hits]]  # before any eviction
        for column in hits:
            self._hold(column)
        fresh = [[self._take() for _ in range(per_plane - num_hits)] for _ in range(self.num_planes)]
        planes = [[column[p] for column in hits] + fresh[p] for p in range(self.num_planes)]
        self._cache.promise(block_hashes[num_hits:])
        return KVAllocation(planes=planes, num_positions=per_plane * self.block_size, block_hashes=block_hashes,
                            num_cached_positions=num_hits * self.block_size, num_offered=num_hits)

    def can_grow(self) -> bool:
        """Whether one more block per plane is free now."""
        return self.num_free_blocks >= self.num_planes

    def grow(self, allocation: KVAllocation) -> list[list[int]]:
        """Append one block to every plane of `allocation`; returns the new ids per plane."""
        new = [[self._take()] for _ in range(self.num_planes)]
        for plane, ids in zip(allocation.planes, new, strict=True):
            plane.extend(ids)
        allocation.num_positions += self.block_size
        return new

    def cache_computed(self, allocation: KVAllocation, num_computed: int, step_id: int) -> None:
        """The plan of `step_id` computes the allocation's positions up to `num_computed`: its
        shareable blocks among them enter the prefix cache once that plan has completed."""
        end = min(len(allocation.block_hashes), num_computed // self.block_size)
        if end <= allocation.num_offered:
            return
        columns = allocation.columns()
        self._cache.offer(step_id, [(allocation.block_hashes[i], columns[i])
                                    for i in range(allocation.num_offered, end)])
        allocation.num_offered = end

    def free(self, allocation: KVAllocation, after_step: int) -> None:
        """Let the blocks go once step `after_step` (the last that used them) completes."""
        self._cache.withdraw(allocation.block_hashes[allocation.num_offered :])
        columns = allocation.columns()
        allocation.planes = []
        if after_step <= self._completed_step:
            self._release(columns)
        else:
            self._pending.append(_PendingFree(after_step, columns))

    def retire(self, completed_step: int, failed: bool = False) -> None:
        """The worker completed every step up to `completed_step` (the last one failed if
        `failed`): offered blocks enter the prefix cache, then what waited for it is let go."""
        self._completed_step = max(self._completed_step, completed_step)
        self._cache.settle(completed_step, failed)  # first: a block offered and freed in one step stays cached
        still_pending = []
        for pending in self._pending:
            if pending.after_step <= completed_step:
                self._release(pending.columns)
            else:
                still_pending.append(pending)
        self._pending = still_pending

    def reset_prefix_cache(self) -> None:
        """Evict every idle cached column (columns requests hold stay cached)."""
        while self._cache.num_idle:
            self._free.extend(reversed(self._cache.evict()))

    def _hold(self, column: Column) -> None:
        for block in column:
            self._refs[block] += 1

    def _take(self) -> int:
        """A block for a new holder: from the free list, or by evicting the LRU idle column."""
        if not self._free:
            self._free.extend(reversed(self._cache.evict()))
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _release(self, columns: list[Column]) -> None:
        # The last column first: it reaches the idle queue first and is evicted before the
        # earlier ones, which later prompts can still match without it (a chain is read from its head).
        for column in reversed(columns):
            for block in column:
                self._refs[block] -= 1
            if self._refs[column[0]]:
                continue  # another request still holds this shared column
            if self._cache.is_cached(column):
                self._cache.park(column)
            else:
                self._free.extend(reversed(column))
