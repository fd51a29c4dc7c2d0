"""Prefix caching: the hash chain, the KV manager's reference counts, deferred caching and LRU
eviction, placement by cached prefix, and engines whose outputs are identical with and without
caching (float64 on the CPU, both layouts, both models) under preemption of both kinds and after a
worker loss and replay. After every workload no block leaks: nothing is held, the pool is free
but for the idle cached blocks, and evicting them returns them."""

from __future__ import annotations

import random

import pytest
import torch
from factories import add_requests, make_scheduler, run_step

from protocol.messages import PrefillBatch, SamplingParams
from rlt_engine import LLM
from rlt_engine.executor import WorkerLost
from rlt_engine.kv_manager import KVManager
from rlt_engine.prefix_cache import BlockHasher, NoPrefixCaching, PrefixMatch
from rlt_engine.request import Phase, RequestStatus

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK = 4  # positions per block in these tests: prompts of a few dozen tokens span many blocks
EXIT = {"toy-ouro": ("ouro", 0.5), "toy-huginn": ("latent_diff", 0.3)}


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


# ------------------------------------------------------------------------------ the scheduler


def caching_scheduler(**overrides: object):
    return make_scheduler(enable_prefix_caching=True, prefix_cache_salt="test", block_size=BLOCK, **overrides)


def prefill_starts(plan, key: int) -> list[int]:
    return [start for batch in plan.batches if isinstance(batch, PrefillBatch)
            for k, start in zip(batch.col("keys").tolist(), batch.col("start_positions").tolist(), strict=True)
            if k == key]


def test_a_request_waits_for_a_prefix_being_computed_then_prefills_after_it():
    """b shares a's 13-token prompt: it waits while a's chunks run, then starts at position 12."""
    s = caching_scheduler(prefill_chunk_size=8)
    a, b = add_requests(s, 2, prompt_len=13)
    first = run_step(s)
    assert prefill_starts(first, a.key) == [0] and b.status == RequestStatus.WAITING
    second = run_step(s)
    assert prefill_starts(second, a.key) == [8] and b.status == RequestStatus.WAITING
    third = run_step(s)  # a's whole prefix is cached now
    assert b.status == RequestStatus.RUNNING and prefill_starts(third, b.key) == [12]
    assert b.num_cached_tokens == 12 and a.num_cached_tokens == 0
    assert (s.stats.prefix_cache_queries, s.stats.prefix_cache_hits) == (26, 12)


def test_aborting_the_request_computing_a_prefix_lets_the_waiting_one_go_and_its_id_be_reused():
    """a is aborted after its first chunk ran: b, waiting for a's prefix, takes the two blocks that
    chunk cached and computes the rest; a's id, added again, shares b's prefix."""
    s = caching_scheduler(prefill_chunk_size=8)
    a, b = add_requests(s, 2, prompt_len=13)
    run_step(s)
    s.abort(a.request_id)
    plan = run_step(s)
    assert prefill_starts(plan, b.key) == [8] and b.num_cached_tokens == 8
    run_step(s)  # b's last chunk ran: blocks 0 … 2 are cached
    (again,) = add_requests(s, 1, prompt_len=13)
    assert again.request_id == a.request_id
    plan = run_step(s)
    assert prefill_starts(plan, again.key) == [12]


def test_a_failed_prefill_plan_caches_nothing():
    s = caching_scheduler()
    (a,) = add_requests(s, 1, prompt_len=13)
    run_step(s, error="boom")
    assert a.finish_reason == "error"
    (b,) = add_requests(s, 1, prompt_len=13, prefix="again")
    plan = run_step(s)
    assert prefill_starts(plan, b.key) == [0] and b.num_cached_tokens == 0


def test_placement_prefers_the_worker_holding_the_longest_prefix_over_free_kv():
    """a's prompt is cached on worker 0, which also runs `busy`: b, with a's prompt, still goes
    there, though worker 1 has more free KV (which alone would have placed it on worker 1)."""
    s = caching_scheduler(num_workers=2)
    (a,) = add_requests(s, 1, prompt_len=13)
    while not a.is_finished:
        run_step(s, worker=0)
    run_step(s, worker=0)  # a's release
    (busy,) = add_requests(s, 1, prompt_len=3, prefix="busy", max_tokens=30)
    run_step(s, worker=0)
    free = [book.kv.num_free_blocks for book in s.books]
    assert a.worker == busy.worker == 0 and free[0] < free[1]
    (b,) = add_requests(s, 1, prompt_len=13, prefix="b")
    run_step(s, worker=0)
    assert b.worker == 0 and b.num_cached_tokens == 12


# ------------------------------------------------------------------------------ engines


def engine(model: str, layout: str, caching: bool, **overrides: object) -> LLM:
    options = dict(workers=0, device="cpu", dtype="float64", exit_mode=EXIT[model][0], kv_layout=layout,
                   block_size=BLOCK, num_blocks=1024, max_num_seqs=6, prefill_chunk_size=8,
                   enable_prefix_caching=caching)
    return LLM(model, **{**options, **overrides})


def shared_prefix_workload(model: str, seed_groups: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing prefixes of 0, 1 block, many blocks and a partial last block, a prompt equal
    to another (its last position must still run) and one that is only the shared prefix.
    `seed_groups`: requests of one prefix share a seed (Huginn's random state init keys on it)."""
    rng = random.Random(f"prefix-{model}")
    trunk = [rng.randrange(256) for _ in range(24)]
    prompts, params = [], []
    for group, shared in enumerate((0, BLOCK, 6 * BLOCK, 3 * BLOCK + 2)):
        for i in range(3):
            prompts.append(trunk[:shared] + [rng.randrange(256) for _ in range(rng.randint(1, 6))])
            seed = 100 + group if seed_groups else 100 + 3 * group + i
            params.append(SamplingParams(max_tokens=rng.randint(6, 12), temperature=1.0, seed=seed, ignore_eos=True,
                                         exit_threshold=EXIT[model][1], logprobs=1))
    prompts += [list(prompts[7]), trunk[: 6 * BLOCK]]
    params += [params[7], params[6]]
    return prompts, params


def outputs(llm: LLM, prompts, params) -> list[tuple]:
    return [(o.token_ids, o.exit_depths, o.logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_same(got: list[tuple], expected: list[tuple]) -> None:
    """Tokens and exit depths exactly, logprobs to float64 rounding (batches sum in other orders)."""
    assert [(t, d) for t, d, _ in got] == [(t, d) for t, d, _ in expected]
    for (_, _, a), (_, _, b) in zip(got, expected, strict=True):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-9)


def assert_no_leak(llm: LLM) -> None:
    """Every request has ended: nothing is held, the blocks off the free list are the cached ones,
    and evicting those returns them."""
    eng = llm.engine
    runner = eng.executor._worker.runner
    assert runner.num_free_slots == eng.config.max_num_seqs and runner.num_swapped == 0 and len(eng.rng) == 0
    kv = eng.kv_managers[0]
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_blocks and kv.num_cached_blocks > 0
    eng.reset_prefix_cache()
    assert kv.num_cached_blocks == 0 and kv.num_free_blocks == kv.num_blocks


# (model, layout, state_init): both layouts for both models, Huginn with either state init.
CASES = [("toy-ouro", "last_exited", "random"), ("toy-ouro", "shared", "random"),
         ("toy-huginn", "last_exited", "random"), ("toy-huginn", "shared", "zero")]


@pytest.mark.parametrize(("model", "layout", "state_init"), CASES)
def test_outputs_are_identical_with_and_without_caching(model, layout, state_init):
    prompts, params = shared_prefix_workload(model, seed_groups=state_init == "random")
    with engine(model, layout, False, state_init=state_init) as llm:
        expected = outputs(llm, prompts, params)
    with engine(model, layout, True, state_init=state_init) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert_same([(o.token_ids, o.exit_depths, o.logprobs) for o in got], expected)
        cached = [o.num_cached_tokens for o in got]
        health = llm.engine.health()
        assert cached[0] == cached[1] == cached[2] == 0  # no shared prefix
        assert cached[4] == BLOCK and cached[7] == 6 * BLOCK and cached[10] == 3 * BLOCK  # the partial block runs
        assert cached[12] == (len(prompts[12]) - 1) // BLOCK * BLOCK  # prompts[7] again
        assert cached[13] == 5 * BLOCK  # only the 6 shared blocks: the one holding the last position runs
        assert health.prefix_cache_hits == sum(cached) and health.prefix_cache_queries == sum(map(len, prompts))
        assert health.workers[0].kv_blocks_cached == llm.engine.kv_managers[0].num_cached_blocks > 0
        assert_no_leak(llm)


def test_huginn_random_state_init_shares_a_prefix_only_under_the_same_seed():
    prompts, params = shared_prefix_workload("toy-huginn", seed_groups=False)
    with engine("toy-huginn", "last_exited", True) as llm:
        got = llm.generate(prompts[:12], params[:12], use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in got)


PLANES = {("toy-ouro", "last_exited"): 4, ("toy-ouro", "shared"): 1,
          ("toy-huginn", "last_exited"): 7, ("toy-huginn", "shared"): 2}


PREEMPTION_CASES = [("toy-ouro", "last_exited", "swap"), ("toy-ouro", "shared", "recompute"),
                    ("toy-huginn", "last_exited", "recompute"), ("toy-huginn", "shared", "swap")]


@pytest.mark.parametrize(("model", "layout", "preemption"), PREEMPTION_CASES)
def test_preemption_with_shared_blocks_gives_the_uncached_outputs(model, layout, preemption):
    prompts, params = shared_prefix_workload(model, seed_groups=True)
    # About one long request's worth of blocks (the longest needs all 10 per plane): growth must preempt.
    options = dict(preemption=preemption, num_blocks=10 * PLANES[(model, layout)])
    with engine(model, layout, False, **options) as llm:
        expected = outputs(llm, prompts, params)
    with engine(model, layout, True, **options) as llm:
        assert_same(outputs(llm, prompts, params), expected)
        stats = llm.engine.scheduler.stats
        assert stats.num_preemptions >= 3 and stats.prefix_cache_hits > 0
        assert_no_leak(llm)


def test_swapping_out_a_request_that_shares_blocks_leaves_them_intact():
    """b shares a's cached prefix; b is swapped out and back in (into blocks of its own) while a
    keeps running: the shared blocks' K/V is unchanged and both give the uncached outputs."""
    prompt = [random.Random(5).randrange(256) for _ in range(21)]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=9, ignore_eos=True, exit_threshold=0.5)
    with engine("toy-ouro", "last_exited", False) as llm:
        expected = outputs(llm, [prompt, prompt + [1]], [params, params])
    with engine("toy-ouro", "last_exited", True, preemption="swap") as llm:
        eng = llm.engine
        eng.add_request("a", prompt, params)
        eng.add_request("b", prompt + [1], params)
        a, b = eng.scheduler._live["a"], eng.scheduler._live["b"]
        while not (b.status == RequestStatus.RUNNING and b.num_outputs >= 2 and b.phase == Phase.LOOP):
            eng.step()
        shared = [plane[:5] for plane in b.allocation.planes]
        assert [plane[:5] for plane in a.allocation.planes] == shared
        pool = eng.executor._worker.runner.storage.pool
        before = pool[:, :, torch.tensor(shared).flatten()].clone()
        eng.scheduler.preempt(b)
        finals = {}
        while eng.has_unfinished_requests():
            finals.update({o.request_id: o for o in eng.step() if o.finished})
        assert eng.scheduler.stats.num_preemptions == 1
        assert torch.equal(pool[:, :, torch.tensor(shared).flatten()], before)
        assert_same([(finals[r].token_ids, finals[r].exit_depths, finals[r].logprobs) for r in "ab"], expected)
        assert_no_leak(llm)


@pytest.mark.parametrize(("model", "layout", "lose_at"),
                         [("toy-ouro", "last_exited", 6), ("toy-huginn", "shared", 12)])
def test_a_lost_worker_replays_into_an_empty_cache_and_gives_the_uncached_outputs(model, layout, lose_at):
    """The replacement's pool is empty: the engine drops the dead worker's index, so the replays
    recompute their prefixes instead of reading blocks the new pool never held."""
    prompts, params = shared_prefix_workload(model, seed_groups=True)
    with engine(model, layout, False) as llm:
        expected = outputs(llm, prompts, params)
    with engine(model, layout, True, restart_workers=True) as llm:
        eng = llm.engine
        plans = []
        eng.add_plan_listener(lambda worker, plan: plans.append(plan))
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            eng.add_request(f"r{i}", prompt, p)
        finals, step, plans_then = {}, 0, 0
        while eng.has_unfinished_requests():
            step += 1
            if step == lose_at:
                assert eng.kv_managers[0].num_cached_blocks > 0
                eng._on_worker_lost(0, WorkerLost(0, "injected by the test"))
                plans_then = len(plans)
            finals.update({o.request_id: o for o in eng.step() if o.finished})
        first_after = plans[plans_then]
        starts = [s for b in first_after.batches if isinstance(b, PrefillBatch) for s in b.col("start_positions")]
        assert starts and all(start == 0 for start in starts)  # nothing was cached in the new pool yet
        assert eng.scheduler.stats.num_replays >= 2
        assert_same([(finals[f"r{i}"].token_ids, finals[f"r{i}"].exit_depths, finals[f"r{i}"].logprobs)
                     for i in range(len(prompts))], expected)
        assert_no_leak(llm)
