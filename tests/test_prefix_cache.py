"""Prefix caching: the hash chain, the KV manager's reference counts, deferred caching and LRU
eviction."""

from __future__ import annotations

from rlt_engine.kv_manager import KVManager
from rlt_engine.prefix_cache import BlockHasher, NoPrefixCaching, PrefixMatch

BLOCK = 4  # positions per block in these tests: prompts of a few dozen tokens span many blocks


def keys(prompt: list[int], seed: int = 0, salt: str = "test") -> tuple[bytes, ...]:
    return BlockHasher(salt, BLOCK, seeded=False).block_hashes(prompt, seed)


# ------------------------------------------------------------------------------ the hash chain


def test_only_full_blocks_before_the_last_prompt_position_get_a_key():
    """The block holding position P − 1 is written by its request (the last position always runs)."""
    assert [len(keys(list(range(p)))) for p in (1, 3, 4, 5, 8, 9, 13)] == [0, 0, 0, 1, 1, 2, 3]


def test_keys_chain_over_every_earlier_block():
    prompt = list(range(20))
    base = keys(prompt)
    assert keys(prompt[:13]) == base[:3]  # a prompt's keys are the prefix of any longer prompt's
    changed = list(prompt)
    changed[5] = 99  # a token of block 1
    other = keys(changed)
    assert other[0] == base[0] and all(a != b for a, b in zip(other[1:], base[1:], strict=True))


def test_the_salt_and_block_size_root_the_chain_and_a_seeded_chain_depends_on_the_seed():
    prompt = list(range(20))
    assert set(keys(prompt)).isdisjoint(keys(prompt, salt="another model"))
    assert set(keys(prompt)).isdisjoint(BlockHasher("test", 5, seeded=False).block_hashes(prompt, 0)[:3])
    assert keys(prompt, seed=1) == keys(prompt, seed=2)
    seeded = BlockHasher("test", BLOCK, seeded=True)  # Huginn's random state init
    assert seeded.block_hashes(prompt, 1) == seeded.block_hashes(prompt, 1)
    assert set(seeded.block_hashes(prompt, 1)).isdisjoint(seeded.block_hashes(prompt, 2))
    assert NoPrefixCaching().block_hashes(prompt, 1) == ()


# ------------------------------------------------------------------------------ the KV manager


def test_a_computed_prefix_is_cached_once_its_plan_completes_then_shared_and_kept():
    kv = KVManager(num_blocks=40, block_size=BLOCK, num_planes=2)
    prompt = list(range(13))  # 3 keyed blocks, the 4th holds position 12
    first = kv.allocate(16, keys(prompt))
    assert first.num_cached_positions == 0 and kv.prefix_match(keys(prompt)) == PrefixMatch(0, 3)
    kv.cache_computed(first, 8, step_id=1)  # a chunk of 8 positions: blocks 0 and 1
    kv.cache_computed(first, 13, step_id=2)
    assert kv.prefix_match(keys(prompt)) == PrefixMatch(0, 3), "cached before its plan completed"
    kv.retire(1)
    assert kv.prefix_match(keys(prompt)) == PrefixMatch(2, 1)
    kv.retire(2)
    assert kv.prefix_match(keys(prompt)) == PrefixMatch(3, 0) and kv.num_cached_blocks == 6

    second = kv.allocate(20, keys(prompt + [7, 7]))
    assert second.num_cached_positions == 12
    assert [p[:3] for p in second.planes] == [p[:3] for p in first.planes]  # shared, every plane
    assert {b for p in second.planes for b in p[3:]}.isdisjoint(b for p in first.planes for b in p)
    assert kv.num_used_blocks == 8 + 2 * 2  # first's 4 columns, second's 2 fresh ones
    kv.free(first, after_step=2)
    assert kv.num_used_blocks == 10  # the shared columns are still held by `second`
    kv.free(second, after_step=3)
    assert kv.num_used_blocks == 10, "let go before its last step completed"
    kv.retire(3)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 40 and kv.num_cached_blocks == 6
    kv.reset_prefix_cache()  # eviction returns them
    assert kv.num_cached_blocks == 0 and kv.num_free_blocks == 40
    assert kv.prefix_match(keys(prompt)) == PrefixMatch(0, 0)


def test_a_failed_plan_caches_nothing_and_a_freed_request_withdraws_its_promises():
    kv = KVManager(num_blocks=40, block_size=BLOCK, num_planes=2)
    prompt = list(range(13))
    a = kv.allocate(16, keys(prompt))
    kv.cache_computed(a, 8, step_id=1)
    kv.retire(1, failed=True)
    assert kv.prefix_match(keys(prompt)) == PrefixMatch(0, 0)
    assert kv.prefix_match(keys(prompt)[2:]) == PrefixMatch(0, 1)  # block 2 is still `a`'s to compute
    kv.free(a, after_step=1)
    assert kv.prefix_match(keys(prompt)[2:]) == PrefixMatch(0, 0) and kv.num_free_blocks == 40


def test_a_block_offered_and_freed_in_the_same_step_stays_cached():
    """An abort while the plan computing its prefix is in flight: the plan still ran."""
    kv = KVManager(num_blocks=40, block_size=BLOCK, num_planes=2)
    prompt = list(range(13))
    a = kv.allocate(16, keys(prompt))
    kv.cache_computed(a, 13, step_id=1)
    kv.free(a, after_step=1)
    kv.retire(1)
    assert kv.prefix_match(keys(prompt)) == PrefixMatch(3, 0) and kv.num_free_blocks == 40


def cache_chain(kv: KVManager, prompt: list[int], step_id: int) -> None:
    allocation = kv.allocate(len(prompt), keys(prompt))
    kv.cache_computed(allocation, len(prompt), step_id)
    kv.free(allocation, after_step=step_id)
    kv.retire(step_id)


def test_eviction_takes_the_least_recently_used_chain_tail_first():
    kv = KVManager(num_blocks=8, block_size=BLOCK, num_planes=1)
    a, b = [1] * 9, [2] * 9  # two keyed blocks each (the third holds the last position)
    cache_chain(kv, a, 1)
    cache_chain(kv, b, 2)
    cache_chain(kv, a, 3)  # `a` is used again: `b` is now the least recently used
    assert kv.num_cached_blocks == 4 and kv.num_free_blocks == 8
    kv.allocate(5 * BLOCK)  # 4 free blocks, then one eviction
    assert kv.prefix_match(keys(a)).num_cached == 2 and kv.prefix_match(keys(b)).num_cached == 1
    assert kv.can_allocate(2 * BLOCK, keys(b))  # its cached head is shared, one block from an eviction
    kv.allocate(3 * BLOCK)
    assert kv.prefix_match(keys(b)).num_cached == 0 and kv.prefix_match(keys(a)).num_cached == 0
    assert not kv.can_allocate(BLOCK)


def test_an_idle_cached_hit_cannot_also_be_evicted_for_the_same_allocation():
    kv = KVManager(num_blocks=4, block_size=BLOCK, num_planes=1)
    prompt = [3] * 13
    cache_chain(kv, prompt, 1)  # 3 idle cached blocks and one free block
    assert kv.num_free_blocks == 4
    assert kv.can_allocate(16, keys(prompt)) and not kv.can_allocate(20, keys(prompt))
    assert not kv.can_allocate(20)  # 5 blocks: more than the pool
