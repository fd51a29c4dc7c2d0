"""Prefix caching (`enable_prefix_caching`): the keys of a prompt's blocks, and one worker's index of
cached blocks.

A prompt position runs all D loops in PREFILL and nothing writes it again, so the K/V a full prompt
block holds in every plane (each loop depth's under LAST_EXITED, the last loop's under SHARED,
Huginn's prelude and coda layers in its outer plane) is a function of the tokens up to the block's
end, and, under Huginn's random state init, of the request's seed. Such a block is keyed by a hash
chain over the token ids, rooted in what else the K/V depends on:

    key(−1) = sha256(salt ‖ block size [‖ seed])     salt: model, dtype, layout, D, state init
    key(i)  = sha256(key(i−1) ‖ token ids of block i, int32 little-endian)

Only the blocks that end before the last prompt position P−1 get a key. That position always
runs: its state feeds output 0's CODA (and Huginn's CODA rewrites its coda K/V there), so the block
holding it and every later one is written by its request and never shared:

    prompt   | b0 | b1 | … | b(k−1) | block holding P−1 | …      k = (P − 1) // block_size
              keyed: shared read-only   private: written by the request

A *column* is one logical block: its block id in every plane. The index (`PrefixCache`) belongs to
a worker's KVManager, which alone calls it and keeps the reference counts.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

Column = tuple[int, ...]  # one logical block: its block id in each plane


class BlockHasher:
    """The keys of a prompt's shareable blocks (prefix caching on)."""

    def __init__(self, salt: str, block_size: int, seeded: bool) -> None:
        self.block_size = block_size
        self.seeded = seeded  # the prompt's K/V depends on the request's seed (Huginn's random state init)
        self._root = hashlib.sha256(f"rlt-prefix-cache/1|{salt}|block_size={block_size}".encode()).digest()

    def block_hashes(self, prompt_token_ids: Sequence[int], seed: int) -> tuple[bytes, ...]:
        """key(0) … key(k−1) of the prompt's blocks that end before its last position."""
        parent = self._root
        if self.seeded:
            parent = hashlib.sha256(parent + seed.to_bytes(8, "little")).digest()
        size, keys = self.block_size, []
        for start in range(0, (len(prompt_token_ids) - 1) // size * size, size):
            block = prompt_token_ids[start : start + size]
            parent = hashlib.sha256(parent + struct.pack(f"<{size}i", *block)).digest()
            keys.append(parent)
        return tuple(keys)


class NoPrefixCaching:
    """Prefix caching off: no prompt block has a key, so nothing is ever looked up or cached."""

    def block_hashes(self, prompt_token_ids: Sequence[int], seed: int) -> tuple[bytes, ...]:
        return ()


@dataclass(frozen=True)
class PrefixMatch:
    """How much of a key chain one worker's index covers."""

    num_cached: int  # leading blocks cached now
    num_promised: int  # blocks right after those that a live request is computing


class PrefixCache:
    """One worker's index: key → cached column, the idle ones (no request holds them) least
    recently used first, and the keys live requests are computing.

    A computed block is *offered* with the step of the plan that computes it and enters the index
    only once that plan has completed (`settle`), so a hit never reads K/V that is not written yet
    or that a failed plan left half written. Until then its key is *promised*: placement lets a
    request whose prefix is promised wait for it rather than compute the same blocks again.
    """

    def __init__(self) -> None:
        self._columns: dict[bytes, Column] = {}
        self._keys: dict[int, bytes] = {}  # a cached column's plane-0 block id → its key
        self._idle: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._promised: Counter[bytes] = Counter()
        self._offers: dict[int, list[tuple[bytes, Column]]] = {}  # step id → columns its plan computes

    @property
    def num_columns(self) -> int:
        return len(self._columns)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def match(self, keys: Sequence[bytes]) -> PrefixMatch:
        """The cached prefix of `keys`, and the promised run right after it."""
        cached = 0
        while cached < len(keys) and keys[cached] in self._columns:
            cached += 1
        promised = cached
        while promised < len(keys) and keys[promised] in self._promised:
            promised += 1
        return PrefixMatch(cached, promised - cached)

    def num_idle_among(self, keys: Sequence[bytes]) -> int:
        """How many of these cached keys no request holds (a hit takes them off the idle queue)."""
        return sum(key in self._idle for key in keys)

    def is_cached(self, column: Column) -> bool:
        return column[0] in self._keys

    def hold(self, key: bytes) -> Column:
        """A hit: the cached column of `key`, no longer idle."""
        self._idle.pop(key, None)
        return self._columns[key]

    def park(self, column: Column) -> None:
        """The last holder of a cached column let go: it is idle, the most recently used."""
        self._idle[self._keys[column[0]]] = None

    def evict(self) -> Column:
        """The least recently used idle column leaves the index; its blocks are free."""
        key, _ = self._idle.popitem(last=False)
        column = self._columns.pop(key)
        del self._keys[column[0]]
        return column

    def promise(self, keys: Sequence[bytes]) -> None:
        self._promised.update(keys)

    def withdraw(self, keys: Sequence[bytes]) -> None:
        """These promised keys will not be computed after all (their request let its blocks go)."""
        self._promised.subtract(keys)
        for key in keys:
            if self._promised[key] <= 0:
                del self._promised[key]

    def offer(self, step_id: int, offers: list[tuple[bytes, Column]]) -> None:
        """Columns the plan of `step_id` computes: cached once it has completed."""
        self._offers.setdefault(step_id, []).extend(offers)

    def settle(self, completed_step: int, failed: bool) -> None:
        """The worker completed every plan up to `completed_step` (the last one failed if `failed`):
        their offers enter the index, except a failed plan's. A key already cached (two requests
        computed the same block) keeps its first column; the other stays its request's own."""
        for step_id in [s for s in self._offers if s <= completed_step]:
            offers = self._offers.pop(step_id)
            self.withdraw([key for key, _ in offers])
            if failed and step_id == completed_step:
                continue
            for key, column in offers:
                if key not in self._columns:
                    self._columns[key] = column
                    self._keys[column[0]] = key
