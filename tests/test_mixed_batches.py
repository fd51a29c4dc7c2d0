"""Mixed batches (`mixed_batches`): prompt chunks ride the loop passes of running decode rows.

CPU, float64, tiny models: every request equals the dense reference and the same workload run with
separate prefill passes (tokens, exit depths, finish reasons), for planned exits (fixed, trace) and
exits the worker decides (ouro, kl, latent_diff), both layouts, with prompts arriving while others
decode, prompts cut into many chunks, preemption of both kinds, a worker lost and replayed, and
prefix caching; and the passes really are shared. The interpreter case runs the Triton backend.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path

import interp
import pytest
from factories import (
    DEPTH,
    SAMPLING,
    Driver,
    Job,
    assert_matches_reference,
    coda_rows,
    make_llm,
    make_workload,
    run_workload,
)

from protocol.messages import DecodeBatch, ExecutionPlan, PrefillBatch, SamplingParams
from rlt_engine.executor import WorkerLost

pytestmark = pytest.mark.usefixtures("single_thread")

THRESHOLDS = {"fixed": None, "trace": None, "ouro": 0.6, "kl": 1e-3, "latent_diff": 0.05}


def jobs_for(model: str, mode: str, n: int = 7, max_prompt_len: int = 30, max_tokens: int = 8) -> list[Job]:
    """Staggered requests (most arrive while others decode), prompts of up to 30 tokens (up to four
    chunks of 8), 1 … 8 outputs, every sampling kind."""
    return make_workload(random.Random(f"mixed-{model}-{mode}"), n, depth=DEPTH[model], exit_mode=mode,
                         threshold=THRESHOLDS[mode], sampling=tuple(SAMPLING), max_prompt_len=max_prompt_len,
                         max_tokens=max_tokens, spread=2, vary_limits=True)


def run_jobs(model: str, mode: str, jobs: list[Job], *, mixed: bool, **options: object) -> Driver:
    settings = dict(exit_mode=mode, max_num_seqs=4, prefill_chunk_size=8) | options
    with make_llm(model, mixed_batches=mixed, **settings) as llm:
        run = run_workload(llm, jobs)
        run.assert_resources_returned()
    return run


def finals(run: Driver) -> list[tuple]:
    return [(life.job.request_id, life.final.token_ids, life.final.exit_depths, life.final.finish_reason)
            for life in run.lives]


def riding_plans(plans: list[ExecutionPlan]) -> list[ExecutionPlan]:
    return [p for p in plans if any(isinstance(b, PrefillBatch) and b.rides_loop_passes for b in p.batches)]


def shared_passes(run: Driver) -> int:
    """Loop passes holding prompt positions of one request and generated positions of another."""
    prompt_len = {life.key: len(life.job.prompt) for life in run.lives}
    count = 0
    for loop_pass in run.passes:
        prompting = {key for key, _, position, _ in loop_pass.rows if position < prompt_len[key]}
        decoding = {key for key, _, position, _ in loop_pass.rows if position >= prompt_len[key]}
        count += bool(prompting) and bool(decoding - prompting)
    return count


CASES = [
    ("toy-ouro", "fixed", "last_exited", 1),
    ("toy-ouro", "fixed", "shared", 4),
    ("toy-ouro", "ouro", "last_exited", 16),
    ("toy-ouro", "ouro", "shared", 1),
    ("toy-huginn", "trace", "last_exited", 6),
    ("toy-huginn", "kl", "last_exited", 24),
    ("toy-huginn", "latent_diff", "shared", 6),
]


@pytest.mark.parametrize(("model", "mode", "layout", "loops_per_plan"), CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_mixed_batches_equal_separate_passes_and_the_reference(model, mode, layout, loops_per_plan):
    """Chunks ride the passes of rows decoding at various depths (planned or worker-decided exits,
    refill inside plans)."""
    jobs = jobs_for(model, mode)
    options = dict(kv_layout=layout, loops_per_plan=loops_per_plan)
    separate = run_jobs(model, mode, jobs, mixed=False, **options)
    mixed = run_jobs(model, mode, jobs, mixed=True, **options)
    assert finals(mixed) == finals(separate)
    assert_matches_reference(mixed, model, kv_layout=layout, exit_mode=mode)
    assert not riding_plans(separate.plans) and shared_passes(separate) == 0
    riding = riding_plans(mixed.plans)
    assert len(riding) >= 2 and shared_passes(mixed) >= 3
    passes = {b.max_passes for p in riding for b in p.batches if isinstance(b, DecodeBatch)}
    # A mixed plan runs the passes it would run anyway: a prompt is pending, so at most D.
    assert passes <= {min(loops_per_plan, DEPTH[model])}
    # Not every chunk finds rows to ride: the plans before any request decodes run their chunks alone.
    assert any(isinstance(b, PrefillBatch) and not b.rides_loop_passes for p in mixed.plans for b in p.batches)


@pytest.mark.parametrize(("model", "mode"), [("toy-ouro", "ouro"), ("toy-huginn", "fixed")])
def test_no_refill_with_mixed_batches(model, mode):
    """no_refill: chunks ride the passes of a cohort that has not exited yet; boundaries wait for the
    cohort as before."""
    jobs = jobs_for(model, mode)
    options = dict(scheduling="no_refill", loops_per_plan=DEPTH[model])
    separate = run_jobs(model, mode, jobs, mixed=False, **options)
    mixed = run_jobs(model, mode, jobs, mixed=True, **options)
    assert finals(mixed) == finals(separate)
    assert_matches_reference(mixed, model, kv_layout="last_exited", exit_mode=mode)
    assert shared_passes(mixed)


def late_prompt_jobs(mode: str) -> list[Job]:
    """A long generation, and a 20-token prompt (chunks of 8, 8, 4) that arrives while it decodes."""
    extra = {"exit_depths": [4] + [1 + i % 4 for i in range(59)]} if mode == "trace" else {"exit_threshold": 0.6}
    first = Job("first", tuple(range(1, 6)), SamplingParams(max_tokens=60, seed=1, ignore_eos=True, **extra))
    extra = {"exit_depths": [4, 2, 3]} if mode == "trace" else {"exit_threshold": 0.6}
    late = Job("late", tuple(range(10, 30)), SamplingParams(max_tokens=3, seed=2, **extra), arrival=1)
    return [first, late]


@pytest.mark.parametrize("mode", ["ouro", "trace"])
def test_the_first_token_follows_the_last_riding_chunk_in_its_plan(mode):
    """DecodeBatch rows (ouro: the worker decides exits; trace with several passes per plan: planned
    exits): the last chunk's plan also samples the prompt's first token, once the chunk's D loops have
    run, and ends there (a prompt is pending: at most D passes), so the token comes with that plan's
    result; a chunk that runs alone (no loop rows to ride) is followed by its boundary in its plan as
    before."""
    run = run_jobs("toy-ouro", mode, late_prompt_jobs(mode), mixed=True, loops_per_plan=16)
    keys = {life.job.request_id: life.key for life in run.lives}
    chunks = [(p.step_id, b) for p in run.plans for b in p.batches if isinstance(b, PrefillBatch)]
    assert [b.rides_loop_passes for _, b in chunks] == [False, True, True, True]
    assert (keys["first"], 1) in decode_keys(run.plans[0])  # alone: its boundary in its plan
    last_step = chunks[-1][0]
    plan = next(p for p in run.plans if p.step_id == last_step)
    assert (keys["late"], 1) in decode_keys(plan)
    passes = [p.rows for p in run.passes if p.step_id == last_step]
    late = [{(position, depth) for key, _, position, depth in rows if key == keys["late"]} for rows in passes]
    assert late == [{(p, d) for p in range(16, 20)} for d in range(1, 5)]  # the chunk rides passes 1-4, the last
    assert run.life("late").outputs[0].token_ids  # delivered from that plan


def test_after_a_riding_chunk_planned_exits_sample_in_the_next_plan():
    """trace at one pass per plan (RecurrentBatch rows): the boundary of a riding last chunk would be
    CODA rows, which run before the plan's loop passes; it waits for the next plan."""
    run = run_jobs("toy-ouro", "trace", late_prompt_jobs("trace"), mixed=True, loops_per_plan=1)
    key = next(life.key for life in run.lives if life.job.request_id == "late")
    riding = [i for i, p in enumerate(run.plans) for b in p.batches
              if isinstance(b, PrefillBatch) and b.rides_loop_passes and key in b.col("keys").tolist()]
    assert len(riding) == 3
    last = riding[-1]
    assert key not in {k for k, *_ in coda_rows(run.plans[last])}
    assert (key, 19, 0) in coda_rows(run.plans[last + 1])


def decode_keys(plan: ExecutionPlan) -> set[tuple[int, int]]:
    """(key, exited) of the plan's DecodeBatch rows."""
    return {(k, e) for b in plan.batches if isinstance(b, DecodeBatch)
            for k, e in zip(b.col("keys").tolist(), b.col("exited").tolist(), strict=True)}


@pytest.mark.parametrize(("model", "layout", "preemption"), [("toy-ouro", "last_exited", "swap"),
                                                             ("toy-huginn", "shared", "recompute"),
                                                             ("toy-ouro", "shared", "recompute"),
                                                             ("toy-huginn", "last_exited", "swap")])
def test_preemption_with_mixed_batches(model, layout, preemption):
    """KV for about one long request: growth preempts requests while chunks ride; outputs unchanged."""
    mode = "ouro" if model == "toy-ouro" else "latent_diff"
    rng = random.Random(f"preempt-{model}")
    jobs = [Job(f"r{i}", tuple(rng.randrange(256) for _ in range(rng.randint(9, 20))),
                SamplingParams(max_tokens=rng.randint(12, 20), temperature=1.0, seed=7 + i, ignore_eos=True,
                               exit_threshold=THRESHOLDS[mode]), arrival=2 * i) for i in range(8)]
    planes = {"last_exited": DEPTH[model], "shared": 1}[layout] + (model == "toy-huginn")
    options = dict(kv_layout=layout, preemption=preemption, block_size=4, num_blocks=10 * planes,
                   loops_per_plan=2 * DEPTH[model])
    separate = run_jobs(model, mode, jobs, mixed=False, **options)
    with make_llm(model, exit_mode=mode, max_num_seqs=4, prefill_chunk_size=8, mixed_batches=True, **options) as llm:
        mixed = run_workload(llm, jobs)
        mixed.assert_resources_returned()
        assert llm.engine.scheduler.stats.num_preemptions >= 3
    assert finals(mixed) == finals(separate)
    assert_matches_reference(mixed, model, kv_layout=layout, exit_mode=mode)
    assert riding_plans(mixed.plans)


class LoseWorkerWhileRiding:
    """Before the step after the `nth` plan with riding chunks, with 3 or more requests on the worker,
    the worker is lost (once)."""

    def __init__(self, nth: int) -> None:
        self.nth = nth
        self.lost_at: int | None = None

    def __call__(self, steps: int, driver: Driver) -> None:
        running = sum(len(r) for r in driver.engine.scheduler.running)
        if self.lost_at is None and len(riding_plans(driver.plans)) >= self.nth and running >= 3:
            self.lost_at = len(driver.plans)
            driver.engine._on_worker_lost(0, WorkerLost(0, "injected by the test"))


@pytest.mark.parametrize(("model", "mode", "layout", "nth"), [("toy-ouro", "ouro", "last_exited", 1),
                                                              ("toy-huginn", "trace", "shared", 4),
                                                              ("toy-huginn", "kl", "last_exited", 2)])
def test_worker_lost_and_replayed_with_mixed_batches(model, mode, layout, nth):
    """The worker is lost while prompts are chunked through riding plans; its requests replay (chunks
    riding again, delivered positions at their recorded depths) and end with the fault-free outputs."""
    jobs = jobs_for(model, mode)
    options = dict(kv_layout=layout, loops_per_plan=2 * DEPTH[model], restart_workers=True)
    separate = run_jobs(model, mode, jobs, mixed=False, **options)
    lose = LoseWorkerWhileRiding(nth)
    with make_llm(model, exit_mode=mode, max_num_seqs=4, prefill_chunk_size=8, mixed_batches=True, **options) as llm:
        mixed = Driver(llm).run(jobs, before_step=lose)
        assert llm.engine.scheduler.stats.num_replays >= 3
    assert lose.lost_at is not None and riding_plans(mixed.plans[lose.lost_at:])
    assert finals(mixed) == finals(separate)


@pytest.mark.parametrize(("model", "layout"), [("toy-ouro", "last_exited"), ("toy-huginn", "shared")])
def test_prefix_caching_with_mixed_batches(model, layout):
    """Requests sharing a 17-token system prompt arrive while others decode: they hit the cache, run
    only their own tokens riding the passes, and give the outputs of separate passes without caching
    (Huginn's state init is zero here, so its prompts' K/V does not depend on their seeds)."""
    mode = "ouro" if model == "toy-ouro" else "kl"
    rng = random.Random(f"prefix-{model}")
    system = tuple(rng.randrange(256) for _ in range(17))
    jobs = [Job(f"p{i}", system + tuple(rng.randrange(256) for _ in range(rng.randint(1, 9))),
                SamplingParams(max_tokens=6, temperature=1.0, seed=40 + i, ignore_eos=True,
                               exit_threshold=THRESHOLDS[mode]), arrival=3 * i) for i in range(6)]
    options = dict(kv_layout=layout, block_size=4, loops_per_plan=DEPTH[model], state_init="zero")
    uncached = run_jobs(model, mode, jobs, mixed=False, enable_prefix_caching=False, **options)
    with make_llm(model, exit_mode=mode, max_num_seqs=4, prefill_chunk_size=8, mixed_batches=True, **options) as llm:
        cached = run_workload(llm, jobs)
        assert llm.engine.scheduler.stats.prefix_cache_hits >= 5 * 16
    assert finals(cached) == finals(uncached)
    assert riding_plans(cached.plans) and shared_passes(cached)


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "mixed-graphs"])
def test_emulated_pass_graphs_with_mixed_batches(graphed: bool):
    """Passes without chunks replay their graphs; a pass with riding chunks replays a mixed graph
    (rlt_worker/mixed_graphs.py: slot rows and chunk rows padded to their buckets), or runs eagerly
    without them, and is counted; the outputs are the reference's."""
    jobs = jobs_for("toy-ouro", "trace")
    with make_llm("toy-ouro", exit_mode="trace", max_num_seqs=4, prefill_chunk_size=8, mixed_batches=True,
                  loops_per_plan=4, max_num_batched_tokens=24) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True, mixed=graphed)
        run = run_workload(llm, jobs)
        stats = runner.graph_stats
    assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="trace")
    assert stats["replays"] > 0 and stats["mixed_passes"] == shared_passes(run) > 0 and stats["eager_passes"] == 0
    if graphed:
        assert stats["mixed_replays"] == stats["mixed_passes"] and stats["mixed_eager"] == 0, stats
        assert stats["mixed_padded_rows"] > 0 and stats["mixed_captures"] > 0, stats
    else:
        assert stats["mixed_replays"] == 0, stats


def last_chunk_plans(run: Driver) -> dict[int, int]:
    """key → the index in run.plans of the plan whose riding PREFILL batch carries its prompt's last chunk."""
    prompt_len = {life.key: len(life.job.prompt) for life in run.lives}
    out = {}
    for i, plan in enumerate(run.plans):
        for batch in plan.batches:
            if isinstance(batch, PrefillBatch) and batch.rides_loop_passes:
                ends = batch.col("start_positions") + batch.col("query_lens")
                out |= {k: i for k, end in zip(batch.col("keys").tolist(), ends.tolist(), strict=True)
                        if end == prompt_len[k]}
    return out


@pytest.mark.parametrize(("mode", "loops_per_plan"), [("ouro", 16), ("trace", 1)])
def test_pipelined_mixed_batches_with_prefill_graphs_equal_synchronous_separate_passes(mode, loops_per_plan):
    """Two plans in flight, chunks riding the passes, decode and prefill graphs emulated (chunks that
    find no rows to ride replay prefill graphs): the outputs of one plan at a time with separate,
    eager passes. The plan after a riding last chunk, built while that one was in flight, assumes only
    what it scheduled: under ouro it continues the output-0 row the riding plan held (`continues`);
    under trace at one pass per plan (RecurrentBatch rows) it carries the boundary's CODA rows."""
    jobs = jobs_for("toy-ouro", mode)
    options = dict(loops_per_plan=loops_per_plan)
    separate = run_jobs("toy-ouro", mode, jobs, mixed=False, max_plans_in_flight=1, **options)
    with make_llm("toy-ouro", exit_mode=mode, max_num_seqs=4, prefill_chunk_size=8, mixed_batches=True,
                  max_plans_in_flight=2, **options) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True, prefill=True, mixed=True)
        in_flight: dict[int, int] = {}  # step id → plans in flight when it was submitted
        llm.engine.add_plan_listener(lambda worker, plan: in_flight.setdefault(plan.step_id,
                                                                               llm.engine._in_flight[worker]))
        piped = run_workload(llm, jobs)
        piped.assert_resources_returned()
        stats = runner.graph_stats
    assert finals(piped) == finals(separate)
    assert max(in_flight.values()) == 1, "no plan was built while another was in flight"
    assert stats["prefill_replays"] > 0 and stats["mixed_passes"] == shared_passes(piped) > 0 and stats["replays"] > 0
    assert stats["mixed_replays"] == stats["mixed_passes"] and stats["mixed_eager"] == 0, stats
    followed = 0
    for key, i in last_chunk_plans(piped).items():
        after = piped.plans[i + 1]
        if in_flight[after.step_id] != 1:
            continue  # built after the riding plan's result
        if mode == "ouro":
            assert (key, 1) in decode_keys(piped.plans[i])  # output 0 held behind the chunk in its plan
            continued = {k for b in after.batches if isinstance(b, DecodeBatch)
                         for k, c in zip(b.col("keys").tolist(), b.col("continues").tolist(), strict=True) if c}
            followed += key in continued
        else:
            followed += key in {k for k, *_ in coda_rows(after)}
    assert followed, "no plan built while a riding last chunk was in flight followed it"


# ---- the Triton backend (interpreter, in a child process) ---------------------------------------------


def _interp_engine_mixed() -> None:
    """toy-ouro (fused loop, emulated pass and mixed graphs) and toy-huginn with the Triton backend, float64:
    mixed batches give the dense reference's tokens and exit depths, chunks through the prefill kernel
    and decode rows through the decode kernel in one pass."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    from rlt_worker.models.ouro_fused import with_fused_layers

    torch.set_num_threads(1)
    for model, mode in (("toy-ouro", "ouro"), ("toy-huginn", "kl")):
        jobs = jobs_for(model, mode, n=3, max_prompt_len=10, max_tokens=3)
        with make_llm(model, exit_mode=mode, max_num_seqs=4, prefill_chunk_size=4, attention_backend="triton",
                      mixed_batches=True, loops_per_plan=DEPTH[model]) as llm:
            runner = llm.engine.executor._worker.runner
            if model == "toy-ouro":
                runner.model = with_fused_layers(runner.model)
                runner.use_pass_graphs(emulate=True, mixed=True)
            run = run_workload(llm, jobs)
        assert_matches_reference(run, model, kv_layout="last_exited", exit_mode=mode)
        assert shared_passes(run), model
        if model == "toy-ouro":  # the mixed passes from mixed graphs: decode and prefill kernels in one
            assert runner.graph_stats["mixed_replays"] == shared_passes(run), runner.graph_stats


INTERP_CASES: dict[str, Callable[[], None]] = {"engine-float64-mixed": _interp_engine_mixed}


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter_mixed_batches(interp_verdicts: dict[str, str], case: str) -> None:
    verdict = interp_verdicts[case]
    assert verdict == "ok", verdict


if __name__ == "__main__":
    interp.main(INTERP_CASES)


@pytest.mark.parametrize(("device", "exit_mode", "asked", "resolved"), [
    ("cuda", "trace", None, True), ("cuda", "fixed", None, True),  # planned exits: on by default
    ("cuda", "ouro", None, True), ("cuda", "ouro_delayed", None, True),  # chunks ride device refill's passes
    ("cuda", "kl", None, False),  # not measured with mixing
    ("cuda", None, None, True),  # the model's default mode, ouro or fixed: either mixes
    ("cpu", "trace", None, False),  # no CUDA graphs: off (mixing was measured only with mixed graphs)
    ("cuda", "trace", False, False), ("cuda", "ouro", True, True), ("cpu", "fixed", True, True),  # as asked
])
def test_mixed_batches_default(device: str, exit_mode: str | None, asked: bool | None, resolved: bool) -> None:
    """mixed_batches = None resolves once, at construction: on with CUDA graphs for fixed and trace, and
    for ouro, ouro_delayed and the model's default (ouro or fixed) while device refill runs a gate's
    greedy rows (off without it)."""
    from rlt_engine.config import EngineConfig

    config = EngineConfig(model="toy-ouro", device=device, exit_mode=exit_mode, mixed_batches=asked).resolved()
    assert config.mixed_batches is resolved
    assert config.worker_config(device).mixed_graphs is (resolved and device == "cuda")
    if exit_mode in ("ouro", None) and asked is None:
        assert EngineConfig(model="toy-ouro", device=device, exit_mode=exit_mode,
                            device_refill=False).resolved().mixed_batches is False
