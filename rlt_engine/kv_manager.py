"""The logical KV manager of one worker: which block ids each request holds, per plane.

Only this class changes block ownership. Planes grow together (every plane covers the same
positions), so an allocation is `num_planes` equal-length lists of block ids. Blocks freed by
a request become reusable only once the worker has completed the last step that used them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class CapacityError(ValueError):
    """A request that could never fit in this worker's KV pool, even alone."""


@dataclass
class KVAllocation:
    """Opaque to the scheduler: the block ids a request holds, plane by plane."""

    planes: list[list[int]]
    num_positions: int  # positions the blocks cover (a multiple of block_size)

    @property
    def num_blocks(self) -> int:
        return sum(len(p) for p in self.planes)


@dataclass
class _PendingFree:
    after_step: int
    block_ids: list[int] = field(default_factory=list)


class KVManager:
    """Paged allocation for one worker: a free list plus frees waiting for their last step."""

    def __init__(self, num_blocks: int, block_size: int, num_planes: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_planes = num_planes
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pending: list[_PendingFree] = []
        self._completed_step = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now."""
        return len(self._free)

    @property
    def completed_step(self) -> int:
        """The last step this worker is known to have completed."""
        return self._completed_step

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests or waiting for their last step to complete."""
        return self.num_blocks - len(self._free)

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

    def can_allocate(self, num_positions: int) -> bool:
        """Whether a new allocation covering `num_positions` fits now."""
        return self.blocks_for(num_positions) <= len(self._free)

    def allocate(self, num_positions: int) -> KVAllocation:
        """A new allocation covering `num_positions` positions (check can_allocate first)."""
        per_plane = math.ceil(num_positions / self.block_size)
        planes = [[self._free.pop() for _ in range(per_plane)] for _ in range(self.num_planes)]
        return KVAllocation(planes=planes, num_positions=per_plane * self.block_size)

    def can_grow(self) -> bool:
        """Whether one more block per plane is free now."""
        return len(self._free) >= self.num_planes

    def grow(self, allocation: KVAllocation) -> list[list[int]]:
        """Append one block to every plane of `allocation`; returns the new ids per plane."""
        new = [[self._free.pop()] for _ in range(self.num_planes)]
        for plane, ids in zip(allocation.planes, new, strict=True):
            plane.extend(ids)
        allocation.num_positions += self.block_size
        return new

    def free(self, allocation: KVAllocation, after_step: int) -> None:
        """Give the blocks back once step `after_step` (the last that used them) completes."""
        ids = [b for plane in allocation.planes for b in plane]
        allocation.planes = []
        if after_step <= self._completed_step:
            self._free.extend(reversed(ids))
        else:
            self._pending.append(_PendingFree(after_step, ids))

    def retire(self, completed_step: int) -> None:
        """The worker completed every step up to `completed_step`: release what waited for it."""
        self._completed_step = max(self._completed_step, completed_step)
        still_pending = []
        for pending in self._pending:
            if pending.after_step <= completed_step:
                self._free.extend(reversed(pending.block_ids))
            else:
                still_pending.append(pending)
        self._pending = still_pending
