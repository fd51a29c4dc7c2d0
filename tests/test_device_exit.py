"""Exit decisions in the worker (DecodeBatch, SPEC §6): float64 on the CPU.

- The worker's exit tests decide exactly as the host policies' rules (a Python statement of SPEC §3).
- Engines whose plans run 1, 2, 3 or 4·D passes (in-plan refill) give the dense reference's tokens
  and exit depths for ouro, ouro_delayed, kl and latent_diff, in both layouts, with stop tokens,
  EOS (a forced one) and max_tokens reached inside plans, and each position runs exactly loops
  1 … its exit depth.
- A stop string inside a plan: later tokens are never delivered. An abort mid-plan drops the plan's
  rows; preemption (swap, recompute) and the graph-emulated passes still equal the reference.
- The scheduler reserves blocks ahead from free blocks only.
"""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest
import torch
from factories import (
    DEPTH,
    SAMPLING,
    Driver,
    Job,
    add_requests,
    assert_matches_reference,
    decode_rows,
    in_plan_refills,
    make_llm,
    make_params,
    make_prompt,
    make_scheduler,
    make_workload,
    record_sampling,
    reference,
    run_step,
    run_workload,
)

from protocol.messages import DecodeBatch, ExitTest, PrefillBatch, SamplingParams
from rlt_engine.exit_policy import OuroExit
from rlt_worker.exit_tests import PassRows, make_exit_test

pytestmark = pytest.mark.usefixtures("single_thread")

# Planned exits (fixed, trace) run in the decode loop too once a plan has several passes (ExitTest.PLANNED).
MODES = {"ouro": ("toy-ouro", 0.5), "ouro_delayed": ("toy-ouro", 0.5), "kl": ("toy-huginn", 0.3),
         "latent_diff": ("toy-huginn", 0.3), "trace": ("toy-ouro", None), "fixed": ("toy-huginn", None)}


# ------------------------------------------------------------------------------- the tests alone


def host_ouro_exit(gates: list[float], min_loops: int, max_loops: int, threshold: float, delayed: bool) -> int:
    """SPEC §3's Ouro rule as the host evaluated it: the exit depth of one position."""
    remaining, decided = 1.0, None
    for depth, gate in enumerate(gates, start=1):
        remaining *= 1.0 - gate
        if depth >= max_loops or depth == decided:
            return depth
        if decided is None and threshold < 1.0 and depth >= min_loops and 1.0 - remaining >= threshold:
            if not delayed:
                return depth
            decided = min(depth + 1, max_loops)
    raise AssertionError("a position exits by max_loops")


class GateRunner:
    """What OuroTest reads of a runner: the state rows (here the gate values themselves) and the gate."""

    def __init__(self, gates: torch.Tensor) -> None:
        self.state = gates[:, None]
        self.model = type("Model", (), {"exit_gate": staticmethod(lambda state: state[:, 0])})()


@pytest.mark.parametrize("delayed", [False, True])
def test_ouro_tests_decide_as_the_host_rule(delayed: bool) -> None:
    """300 positions of random gates and limits (and SPEC's example: λ = 0.4, threshold 0.6,
    min_loops 2 → loop 2, delayed 3), run pass by pass through the worker's test: every exit
    depth is the host rule's."""
    rng = random.Random(f"ouro-{delayed}")
    cases = [([0.4] * 6, 2, 4, 0.6)] + [
        ([rng.choice([0.0, 1.0, rng.random()]) for _ in range(6)], (m := rng.randint(1, 6)), rng.randint(m, 6),
         rng.choice([1.0, 0.0, rng.random()])) for _ in range(300)
    ]
    test = make_exit_test(ExitTest.OURO_DELAYED if delayed else ExitTest.OURO)
    n = len(cases)
    gates = torch.tensor([c[0] for c in cases], dtype=torch.float64)  # [n, 6]
    limits = [torch.tensor([c[i] for c in cases]) for i in (1, 2)]
    thresholds = torch.tensor([c[3] for c in cases], dtype=torch.float64)
    states, exits = torch.ones(n, dtype=torch.float64), torch.zeros(n, dtype=torch.long)
    for depth in range(1, 7):
        rows = PassRows(torch.arange(n), torch.zeros(n, dtype=torch.long), torch.full((n,), depth), *limits,
                        thresholds, width=1)
        decided, states = test.decide(GateRunner(gates[:, depth - 1]), rows, None, states)
        exits = torch.where((exits == 0) & decided, depth, exits)
    want = [host_ouro_exit(*case, delayed=delayed) for case in cases]
    assert exits.tolist() == want
    assert want[0] == (3 if delayed else 2)


# ------------------------------------------------------------------------------- engine vs reference


def jobs_for(mode: str) -> list[Job]:
    """Eight staggered requests of every sampling kind, some with min/max loops, every 5th stopping on
    half of the bytes (stop tokens land inside plans), 1 … 9 outputs (max_tokens inside plans)."""
    model, threshold = MODES[mode]
    return make_workload(random.Random(f"device-{mode}"), 8, depth=DEPTH[model], exit_mode=mode,
                         threshold=threshold, sampling=tuple(SAMPLING), max_prompt_len=10, max_tokens=9,
                         vary_limits=True, spread=1)


def run_mode(mode: str, kv_layout: str, loops_per_plan: int, **options: object) -> Driver:
    model = MODES[mode][0]
    with make_llm(model, exit_mode=mode, kv_layout=kv_layout, max_num_seqs=4, loops_per_plan=loops_per_plan,
                  **options) as llm:
        run = run_workload(llm, jobs_for(mode))
        assert_matches_reference(run, model, kv_layout=kv_layout, exit_mode=mode)
        run.assert_resources_returned()
    return run


CASES = [(mode, layout, passes) for mode in MODES for layout in ("last_exited", "shared") for passes in (3, 0)]


@pytest.mark.parametrize("mode,kv_layout,passes", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_plans_of_several_passes_equal_the_reference(mode: str, kv_layout: str, passes: int) -> None:
    """3 or 4·D passes per plan (0 below): the reference's tokens and exit depths, each position
    running exactly loops 1 … its exit depth; tokens exit and refill inside plans, the passes
    are shared by rows at different positions, and requests end inside plans (stop tokens,
    max_tokens) with the rest going on."""
    depth = DEPTH[MODES[mode][0]]
    loops_per_plan = passes or 4 * depth
    run = run_mode(mode, kv_layout, loops_per_plan)
    assert len(in_plan_refills(run.passes)) >= 5
    assert any(len({key for key, *_ in p.rows}) > 1 for p in run.passes), "no pass shared by two requests"
    deltas = [len(o.new_token_ids) for life in run.lives for o in life.outputs]
    assert max(deltas) <= loops_per_plan + 1
    if not passes:  # 4·D passes: several tokens per delta, requests ending while the plan goes on
        assert max(deltas) > 1
        assert ended_mid_plan(run), "no request ended while its plan's passes went on"


def ended_mid_plan(run: Driver) -> list[str]:
    """Finish reasons of requests whose last loop ran in a pass their plan followed with more passes
    (the worker stopped them at a stop token or at max_tokens while other rows went on)."""
    reasons = []
    for life in run.lives:
        last = max((i for i, p in enumerate(run.passes) if any(row[0] == life.key for row in p.rows)), default=None)
        if last is not None and last + 1 < len(run.passes) and run.passes[last + 1].step_id == run.passes[last].step_id:
            reasons.append(life.final.finish_reason)
    return reasons


@pytest.mark.parametrize("mode", ["ouro", "kl", "trace"])
def test_no_refill_with_several_passes(mode: str) -> None:
    """no_refill: a row stops at its exit (EXITED) and the cohort's boundary work runs together in
    a later plan; the outputs are still the reference's."""
    run = run_mode(mode, "last_exited", 3, scheduling="no_refill")
    assert not in_plan_refills(run.passes)
    assert any(r[3] == 1 for plan in run.plans for r in decode_rows(plan) if r[4] >= 1)  # cohort boundaries


def test_a_forced_eos_ends_the_request_inside_a_plan() -> None:
    """Teacher forcing an EOS at output 3 of 9 (ignore_eos off): the worker stops the row there, as
    the reference does; the tokens before it are the forced ones."""
    forced = [65, 66, 67, 257, 68, 69, 70, 71, 72]
    job = Job("eos", (5, 6, 7), SamplingParams(max_tokens=9, seed=3, exit_threshold=0.3, forced_tokens=forced))
    with make_llm("toy-ouro", exit_mode="ouro", loops_per_plan=16) as llm:
        sampled = record_sampling(llm)
        run = run_workload(llm, [job])
        assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")
    out = run.life("eos").final
    assert out.token_ids == forced[:4] and out.finish_reason == "stop"
    assert len(sampled) == 4, "the worker sampled past the EOS"


# ------------------------------------------------------------------------------- stop strings, aborts


def test_tokens_past_a_stop_string_are_never_delivered() -> None:
    """A plan samples on past the token that completes a stop string (the worker does not see text):
    the engine drops those tokens; the request ends there with `stop`, as with one pass per plan."""
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, exit_threshold=0.3, ignore_eos=True)
    with make_llm("toy-ouro", exit_mode="ouro", loops_per_plan=1) as llm:
        free = run_workload(llm, [Job("r", (1, 2, 3), params)]).life("r").final
    stop = next(ch for ch in free.text[4:] if ch.isascii() and ch.isprintable())
    cut_at = free.text.index(stop)
    stopped = Job("r", (1, 2, 3), msgspec.structs.replace(params, stop=[stop]))
    finals = {}
    for passes in (1, 16):
        with make_llm("toy-ouro", exit_mode="ouro", loops_per_plan=passes) as llm:
            sampled = record_sampling(llm)
            run = run_workload(llm, [stopped])
            run.assert_resources_returned()
        finals[passes] = run.life("r").final
        delivered = [t for o in run.life("r").outputs for t in o.new_token_ids]
        assert delivered == finals[passes].token_ids  # the deltas never carried the dropped tokens
        if passes == 16:
            assert len(sampled) > len(finals[passes].token_ids), "the plan never sampled past the stop string"
    assert finals[1].token_ids == finals[16].token_ids == free.token_ids[: len(finals[1].token_ids)]
    assert finals[16].text == free.text[:cut_at] and finals[16].finish_reason == "stop"
    assert finals[16].exit_depths == free.exit_depths[: len(finals[16].token_ids)]


def test_abort_mid_plan_drops_its_rows_and_the_id_is_reused() -> None:
    """Aborted while its plan of 4·D passes is in flight: the plan's rows of the old life are dropped,
    the id's new life and the bystander equal the reference, resources come back."""
    rng = random.Random("abort-mid-plan")
    depth = DEPTH["toy-huginn"]
    bystander = Job("bystander", make_prompt(rng, 8), make_params(rng, depth=depth, exit_mode="kl",
                                                                  sampling="top_p", max_tokens=12, threshold=0.3,
                                                                  ignore_eos=True))
    target = Job("target", make_prompt(rng, 5), make_params(rng, depth=depth, exit_mode="kl",
                                                            sampling="temperature", max_tokens=30, threshold=0.3,
                                                            ignore_eos=True))
    with make_llm("toy-huginn", exit_mode="kl", loops_per_plan=4 * depth) as llm:
        driver = Driver(llm)
        driver.add(bystander)
        old = driver.add(target)
        # (the step that brings the first token submits no plan: wait for one in flight that names it)
        driver.step_until(lambda: bool(old.outputs) and llm.engine.has_work_in_flight
                          and any(r[0] == old.key for r in decode_rows(driver.plans[-1])))
        stale_before = llm.engine.scheduler.stats.num_stale_rows
        delivered = list(old.outputs[-1].token_ids)
        driver.abort("target")
        new_job = Job("target", make_prompt(rng, 6), make_params(rng, depth=depth, exit_mode="kl",
                                                                 sampling="greedy", max_tokens=7, threshold=0.3))
        driver.add(new_job)
        driver.finish()
        driver.assert_resources_returned()
        assert llm.engine.scheduler.stats.num_stale_rows > stale_before, "the in-flight plan's rows were not dropped"
    assert delivered == reference("toy-huginn", target, kv_layout="last_exited", exit_mode="kl").token_ids[
        : len(delivered)]
    assert_matches_reference(driver, "toy-huginn", kv_layout="last_exited", exit_mode="kl")


# ------------------------------------------------------------------------------- preemption, graphs


PREEMPT = [("ouro", "swap"), ("latent_diff", "recompute"), ("kl", "swap"), ("ouro_delayed", "recompute"),
           ("trace", "swap"), ("fixed", "recompute")]


@pytest.mark.parametrize("mode,preemption", PREEMPT, ids=["-".join(c) for c in PREEMPT])
def test_preemption_with_plans_of_several_passes(mode: str, preemption: str) -> None:
    """A pool of about two requests' worth of blocks (block size 4): reservations ahead stop where
    free blocks end, growth preempts, and every request still equals the reference."""
    model, threshold = MODES[mode]
    depth = DEPTH[model]
    planes = depth + (1 if model == "toy-huginn" else 0)
    rng = random.Random(f"preempt-{mode}")
    jobs = [Job(f"p{i}", make_prompt(rng, rng.randint(3, 8)),
                make_params(rng, depth=depth, exit_mode=mode, sampling=rng.choice(list(SAMPLING)),
                            max_tokens=rng.randint(10, 16), threshold=threshold, ignore_eos=True))
            for i in range(8)]
    with make_llm(model, exit_mode=mode, loops_per_plan=2 * depth, preemption=preemption, block_size=4,
                  num_blocks=10 * planes, max_num_seqs=6, prefill_chunk_size=8) as llm:
        run = run_workload(llm, jobs)
        assert llm.engine.scheduler.stats.num_preemptions >= 1
        assert_matches_reference(run, model, kv_layout="last_exited", exit_mode=mode)
        run.assert_resources_returned()
    assert in_plan_refills(run.passes)


@pytest.mark.parametrize("mode", ["ouro", "ouro_delayed", "latent_diff"])
def test_emulated_pass_graphs_with_exits_in_the_worker(mode: str) -> None:
    """The decode loop's passes replay the (emulated) pass graphs, Ouro's exits sample through the
    CODA graphs; Ouro's tests replay their own graph after each pass (rlt_worker/exit_graphs.py),
    latent_diff's runs eagerly on the state the graph left: the reference's outputs."""
    model = MODES[mode][0]
    with make_llm(model, exit_mode=mode, loops_per_plan=8, max_num_seqs=6) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True)
        run = run_workload(llm, jobs_for(mode))
        assert_matches_reference(run, model, kv_layout="last_exited", exit_mode=mode)
        stats = runner.graph_stats
    assert stats["replays"] > 0 and stats["eager_passes"] == 0
    gated = mode.startswith("ouro")
    assert (stats["coda_replays"] > 0) == gated
    assert stats["exit_replays"] == (stats["replays"] if gated else 0) and stats["exit_eager"] == 0


# ------------------------------------------------------------------------------- plan length


@pytest.mark.parametrize("in_flight", [1, 2])
def test_plans_run_at_most_d_passes_while_a_prompt_is_pending(in_flight: int) -> None:
    """loops_per_plan 4·D, two slots for seven staggered requests (some wait to be placed), one or two
    plans in flight: every plan built while a request waits, carries a prompt chunk, or has not had its
    first token back runs at most D passes (that token, or the waiting one's placement, comes with
    that plan's result or the one in flight), the others 4·D; the outputs are the reference's."""
    depth = DEPTH["toy-ouro"]
    jobs = make_workload(random.Random("pending-prompts"), 7, depth=depth, exit_mode="ouro", threshold=0.5,
                         sampling=tuple(SAMPLING), max_prompt_len=10, max_tokens=12, spread=1)
    with make_llm("toy-ouro", exit_mode="ouro", loops_per_plan=4 * depth, max_num_seqs=2,
                  max_plans_in_flight=in_flight) as llm:
        scheduler = llm.engine.scheduler
        waiting: list[bool] = []  # per plan: whether a request was left waiting when it was built
        first_pending: list[bool] = []  # … whether a request on the worker had no output yet
        llm.engine.add_plan_listener(lambda worker, plan: (
            waiting.append(bool(scheduler.waiting)),
            first_pending.append(any(not r.num_outputs for r in scheduler.running[worker]))))
        run = run_workload(llm, jobs)
        assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")
    pending, passes = [], []
    for plan, left_waiting, first in zip(run.plans, waiting, first_pending, strict=True):
        decode = [b.max_passes for b in plan.batches if isinstance(b, DecodeBatch)]
        if decode:
            pending.append(left_waiting or first or any(isinstance(b, PrefillBatch) for b in plan.batches))
            passes.append(decode[0])
    assert passes == [depth if p else 4 * depth for p in pending]
    assert any(waiting) and any(pending) and not all(pending)
    assert max(Counter(p.step_id for p in run.passes).values()) > depth  # the others do run more than D


def test_a_first_token_reaches_the_engine_after_d_passes_per_plan() -> None:
    """One request, a 3-chunk prompt, two plans in flight, loops_per_plan 4·D: the plan with the
    prompt's last chunk samples output 0 and the plan built before its result is read (in-process,
    submitted, so run, before it) run D passes each, and the step that reads the token returns it
    before submitting more plans: the worker has run at most 2·D passes when the first token is
    delivered (without these, 4·D + 2 · 4·D more); later plans run 4·D; the outputs are the reference's."""
    depth = DEPTH["toy-ouro"]
    job = Job("first", tuple(range(40, 60)), SamplingParams(max_tokens=30, seed=5, exit_threshold=0.5,
                                                            ignore_eos=True))
    with make_llm("toy-ouro", exit_mode="ouro", loops_per_plan=4 * depth, max_plans_in_flight=2,
                  prefill_chunk_size=8) as llm:
        driver = Driver(llm)
        life = driver.add(job)
        driver.step_until(lambda: bool(life.outputs))
        passes_to_first_token = len(driver.passes)
        driver.finish()
        driver.assert_resources_returned()
        assert_matches_reference(driver, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")
    assert life.outputs[0].token_ids[:1] == life.final.token_ids[:1]
    assert 0 < passes_to_first_token <= 2 * depth
    decode = [b.max_passes for p in driver.plans for b in p.batches if isinstance(b, DecodeBatch)]
    assert decode[:2] == [depth, depth] and 4 * depth in decode[2:]


# ------------------------------------------------------------------------------- blocks ahead


def test_blocks_are_reserved_ahead_from_free_blocks_only() -> None:
    """A DecodeBatch row of a plan of 6 passes gets blocks for position + 7 when they are free; on a
    pool with too few, the reservation takes what is free and never preempts (growth for the next
    position still may); a request that ends gives every block back after its step."""
    scheduler = make_scheduler(num_blocks=40, block_size=4, num_planes=4, policy=OuroExit(), loops_per_plan=6)
    (r,) = add_requests(scheduler, 1, prompt_len=3, max_tokens=30)
    plan = run_step(scheduler)  # prefill + the boundary of output 0, as a DecodeBatch row (exited)
    (row,) = decode_rows(plan)
    assert row[1:4] == (2, DEPTH["toy-ouro"], 1)
    assert r.allocation.num_positions >= 2 + 6 + 2  # position 2 + loops_per_plan + 2
    assert (r.position, r.depth, r.num_outputs) == (3, 0, 1)  # result_for: one token, then depth 0
    tight = make_scheduler(num_blocks=20, block_size=4, num_planes=4, policy=OuroExit(), loops_per_plan=40)
    a, b = add_requests(tight, 2, prompt_len=3, max_tokens=10)  # admitted with 2 blocks per plane each
    run_step(tight)
    assert tight.books[0].kv.num_free_blocks == 0 and tight.stats.num_preemptions == 0
    assert a.allocation.num_positions == 12 and b.allocation.num_positions == 8  # a took the 4 free blocks
    for _ in range(200):
        if a.is_finished and b.is_finished:
            break
        run_step(tight)
    assert a.is_finished and b.is_finished and tight.books[0].kv.num_free_blocks == 20
