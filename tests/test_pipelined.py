"""Pipelined plans (max_plans_in_flight = 2): plan N+1 is built and sent before plan N's result is
read, and every output equals the synchronous engine's (float64, CPU, both executors).

What may differ is only when a token is delivered, never which: a request found finished late
(stop token, max_tokens, stop string, abort) has the rest of the plans in flight dropped as stale.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal

import msgspec
import pytest

from protocol.messages import DecodeBatch, SamplingParams
from rlt_engine import LLM
from rlt_engine.executor import WorkerLost
from rlt_engine.exit_policy import OuroExit
from tests.factories import (
    DEPTH,
    Driver,
    Job,
    add_requests,
    assert_matches_reference,
    make_llm,
    make_prompt,
    make_scheduler,
    make_workload,
    result_for,
    run_workload,
)

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.timeout(600)]


def _finals(driver: Driver) -> dict[str, tuple]:
    return {life.job.request_id: (life.final.token_ids, life.final.exit_depths, life.final.finish_reason,
                                  life.final.text) for life in driver.lives}


def _watch_overlap(llm: LLM) -> list[int]:
    """For every plan submitted, how many plans of its worker were in flight already."""
    seen: list[int] = []
    llm.engine.add_plan_listener(lambda worker, plan: seen.append(llm.engine._in_flight[worker]))
    return seen


def _run(model: str, jobs: list[Job], in_flight: int, **options: object) -> tuple[Driver, list[int]]:
    llm = make_llm(model, max_plans_in_flight=in_flight, **options)
    try:
        overlap = _watch_overlap(llm)
        driver = run_workload(llm, jobs)
        driver.assert_resources_returned()
        return driver, overlap
    finally:
        llm.close()


def _continued_rows(driver: Driver) -> int:
    return sum(int(b.col("continues").sum()) for plan in driver.plans for b in plan.batches
               if isinstance(b, DecodeBatch))


CASES = {
    "ouro-fixed-last_exited": ("toy-ouro", dict(exit_mode="fixed")),
    "ouro-trace-shared": ("toy-ouro", dict(exit_mode="trace", kv_layout="shared")),
    "ouro-trace-16-passes": ("toy-ouro", dict(exit_mode="trace", loops_per_plan=16)),  # ExitTest.PLANNED
    "ouro-gate": ("toy-ouro", dict(exit_mode="ouro")),
    "ouro-gate-4-passes": ("toy-ouro", dict(exit_mode="ouro", loops_per_plan=4)),
    "ouro-delayed-no_refill": ("toy-ouro", dict(exit_mode="ouro_delayed", scheduling="no_refill", loops_per_plan=3)),
    "huginn-kl-shared": ("toy-huginn", dict(exit_mode="kl", kv_layout="shared", loops_per_plan=5)),
    "huginn-latent-reserve": ("toy-huginn", dict(exit_mode="latent_diff", kv_growth="reserve")),
    "huginn-fixed-no_refill": ("toy-huginn", dict(exit_mode="fixed", scheduling="no_refill", loops_per_plan=2)),
}
THRESHOLDS = {"ouro": 0.5, "ouro_delayed": 0.5, "kl": 0.3, "latent_diff": 0.3}


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_equals_synchronous(case: str) -> None:
    """Staggered arrivals, stop tokens (every 5th request; mid-plan under several passes), EOS where
    not ignored, mixed max_tokens: the same outputs as one plan at a time, and as the dense
    reference; plans were really built while another was in flight."""
    model, options = CASES[case]
    mode = options["exit_mode"]
    jobs = make_workload(random.Random(case), 10, depth=DEPTH[model], exit_mode=mode,
                         sampling=("greedy", "temperature", "top_k"), threshold=THRESHOLDS.get(mode), max_tokens=10)
    sync, _ = _run(model, jobs, 1, **options)
    piped, overlap = _run(model, jobs, 2, **options)
    assert _finals(piped) == _finals(sync)
    assert max(overlap) == 1, "no plan was built while another was in flight"
    assert_matches_reference(piped, model, kv_layout=options.get("kv_layout", "last_exited"), exit_mode=mode)
    decode_rows = mode in THRESHOLDS or options.get("loops_per_plan", 1) > 1  # planned exits too, then
    if decode_rows and options.get("scheduling") != "no_refill":
        assert _continued_rows(piped) > 0, "no DecodeBatch row continued a row in flight"


def _with_stops_and_aborts(jobs: list[Job], texts: dict[str, str]) -> list[Job]:
    """Every 3rd job aborted a few steps after it arrives; every 4th stopped by a character its
    text (`texts`, a run without stops) holds past its first few tokens."""
    out = []
    for i, job in enumerate(jobs):
        if i % 3 == 1:
            job = dataclasses.replace(job, abort_after=2 + i % 4)
        text = texts[job.request_id]
        stops = [c for c in text[len(text) // 2:] if c.isprintable() and c != "\ufffd"]
        if i % 4 == 2 and stops:
            job = dataclasses.replace(job, params=msgspec.structs.replace(job.params, stop=stops[:1]))
        out.append(job)
    return out


@pytest.mark.parametrize("exit_mode", ["fixed", "ouro"])
def test_aborts_and_stop_strings_deliver_nothing_past_the_end(exit_mode: str) -> None:
    """Aborted lives deliver a prefix of the un-aborted outputs and nothing after their abort; a stop
    string found when plan N's result arrives drops what plan N+1 sampled: the texts equal."""
    base = make_workload(random.Random("stops" + exit_mode), 12, depth=4, exit_mode=exit_mode,
                         sampling=("temperature",), threshold=0.5, max_tokens=12)
    options = dict(exit_mode=exit_mode, loops_per_plan=3)
    plain, _ = _run("toy-ouro", base, 1, **options)
    jobs = _with_stops_and_aborts(base, {rid: final[3] for rid, final in _finals(plain).items()})
    full, _ = _run("toy-ouro", [dataclasses.replace(j, abort_after=None) for j in jobs], 1, **options)
    expected = _finals(full)
    for in_flight in (1, 2):
        driver, _ = _run("toy-ouro", jobs, in_flight, **options)
        stopped = 0
        for life in driver.lives:
            rid, out = life.job.request_id, life.final
            want_tokens, _, want_reason, want_text = expected[rid]
            if life.aborted:
                assert out.token_ids == want_tokens[: len(out.token_ids)], rid
            else:
                assert (out.token_ids, out.finish_reason, out.text) == (want_tokens, want_reason, want_text), rid
                stopped += life.job.params.stop != [] and out.finish_reason == "stop"
        assert stopped > 0 and any(life.aborted for life in driver.lives)


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
@pytest.mark.parametrize("exit_mode", ["fixed", "ouro"])
def test_preemption_under_pipelining(preemption: str, exit_mode: str) -> None:
    """A pool of about two requests' blocks: growth preempts victims that may be in a plan in flight;
    their blocks come back after that plan, and every output is the synchronous one."""
    rng = random.Random("preempt")
    jobs = [Job(f"q{i}", make_prompt(rng, rng.randint(3, 8)),
                SamplingParams(max_tokens=rng.randint(14, 18), temperature=1.0, seed=i, ignore_eos=True,
                               exit_threshold=None if exit_mode == "fixed" else 0.5)) for i in range(10)]
    options = dict(exit_mode=exit_mode, preemption=preemption, block_size=4, num_blocks=8 * 4, loops_per_plan=2)
    sync, _ = _run("toy-ouro", jobs, 1, **options)
    llm = make_llm("toy-ouro", max_plans_in_flight=2, **options)
    try:
        piped = run_workload(llm, jobs)
        piped.assert_resources_returned()
        assert llm.engine.scheduler.stats.num_preemptions > 0
    finally:
        llm.close()
    assert _finals(piped) == _finals(sync)


def test_prefix_caching_under_pipelining() -> None:
    """Prompts sharing a three-block prefix arrive together: the ones after the first wait for its
    plan to complete and share its blocks; outputs equal the synchronous run without caching."""
    rng = random.Random("prefix")
    prefix = make_prompt(rng, 48)
    jobs = [Job(f"p{i}", prefix + make_prompt(rng, 1 + i), SamplingParams(max_tokens=6, seed=i, temperature=1.0,
                                                                         exit_threshold=0.5, ignore_eos=True),
                arrival=i // 3) for i in range(8)]
    options = dict(exit_mode="ouro", block_size=16, prefill_chunk_size=16)
    plain, _ = _run("toy-ouro", jobs, 1, enable_prefix_caching=False, **options)
    llm = make_llm("toy-ouro", max_plans_in_flight=2, enable_prefix_caching=True, **options)
    try:
        piped = run_workload(llm, jobs)
        assert llm.engine.scheduler.stats.prefix_cache_hits > 0
    finally:
        llm.close()
    assert _finals(piped) == _finals(plain)


def _generate_with_loss(in_flight: int, lose_at: int | None) -> tuple[dict, int]:
    """Six seeded requests on an in-process engine that restarts its worker; optionally lose it
    before the first step from `lose_at` on that starts with plans in flight (their results never
    arrive; a step that brings a first token leaves none)."""
    llm = make_llm("toy-ouro", exit_mode="ouro", loops_per_plan=3, restart_workers=True, max_num_seqs=4,
                   prefill_chunk_size=4, max_plans_in_flight=in_flight)
    rng = random.Random(1)
    for i in range(6):
        params = SamplingParams(max_tokens=rng.randint(4, 12), temperature=1.0, seed=50 + i, ignore_eos=True,
                                exit_threshold=0.5)
        llm.engine.add_request(f"r{i}", make_prompt(rng, rng.randint(2, 10)), params)
    finals, step, lost = {}, 0, False
    try:
        while llm.engine.has_unfinished_requests():
            step += 1
            if lose_at is not None and step >= lose_at and not lost and llm.engine.has_work_in_flight:
                lost = True
                llm.engine._on_worker_lost(0, WorkerLost(0, "injected by the test"))
            for out in llm.engine.step():
                if out.finished:
                    finals[out.request_id] = (out.token_ids, out.exit_depths, out.finish_reason)
        assert lost == (lose_at is not None)
        return finals, llm.engine.scheduler.stats.num_replays
    finally:
        llm.close()


@pytest.mark.parametrize("lose_at", [3, 5])
def test_lost_worker_replays_exactly_under_pipelining(lose_at: int) -> None:
    expected, _ = _generate_with_loss(1, None)
    replayed, replays = _generate_with_loss(2, lose_at)
    assert replays >= 2
    assert replayed == expected


# ------------------------------------------------------------------------ the worker process


MP_OPTIONS = dict(device="cpu", dtype="float64", exit_mode="ouro", loops_per_plan=3, cpu_threads=1)


def _mp_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=10, seed=30 + i, temperature=1.0, exit_threshold=0.5,
                           stop_token_ids=[] if i % 3 else list(range(0, 256, 3)), ignore_eos=i % 2 == 0)
            for i in range(n)]


def _mp_prompts(n: int) -> list[list[int]]:
    rng = random.Random("mp")
    return [list(make_prompt(rng, rng.randint(1, 20))) for _ in range(n)]


def _outputs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    return [(o.token_ids, o.exit_depths, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def mp_expected() -> list[tuple]:
    with LLM("toy-ouro", workers=0, max_plans_in_flight=1, **MP_OPTIONS) as llm:
        return _outputs(llm, _mp_prompts(6), _mp_params(6))


def test_process_worker_pipelined_equals_in_process_synchronous(mp_expected: list[tuple]) -> None:
    with LLM("toy-ouro", workers=1, max_plans_in_flight=2, **MP_OPTIONS) as llm:
        overlap = _watch_overlap(llm)
        assert _outputs(llm, _mp_prompts(6), _mp_params(6)) == mp_expected
        assert max(overlap) == 1


def test_process_worker_killed_mid_pipeline_replays_exactly(mp_expected: list[tuple]) -> None:
    """SIGKILL the worker while two plans are in flight: the replacement replays every request."""
    with LLM("toy-ouro", workers=1, max_plans_in_flight=2, restart_workers=True, **MP_OPTIONS) as llm:
        engine, executor = llm.engine, llm.engine.executor
        for i, (prompt, params) in enumerate(zip(_mp_prompts(6), _mp_params(6), strict=True)):
            engine.add_request(f"r{i}", prompt, params)
        outputs, first_pid, killed = {}, executor.worker_pids()[0], False
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output
            delivered = any(r.output_token_ids for r in engine.scheduler.running[0])
            if not killed and engine._in_flight[0] == 2 and delivered:
                os.kill(first_pid, signal.SIGKILL)
                killed = True
        assert killed and engine.num_worker_restarts == 1
        got = [(outputs[f"r{i}"].token_ids, outputs[f"r{i}"].exit_depths, outputs[f"r{i}"].finish_reason)
               for i in range(6)]
        assert got == mp_expected


# ------------------------------------------------------------------------ the scheduler alone


def test_a_decode_row_in_flight_is_continued_with_blocks_for_both_plans() -> None:
    """Plan 2 is built before plan 1's result: its row continues on the worker, and the request's
    blocks cover what both plans can reach (2 × (loops_per_plan + 1) positions and the next one).
    Plan 1's token ends the request: plan 2's rows are stale and nothing of them is applied."""
    scheduler = make_scheduler(policy=OuroExit(), loops_per_plan=3, max_plans_in_flight=2, num_blocks=64)
    (request,) = add_requests(scheduler, 1, prompt_len=3, max_tokens=40, ignore_eos=False, stop_token_ids=[7])
    first = scheduler.schedule(0).build()
    reach_one = request.allocation.num_positions
    second = scheduler.schedule(0).build()
    (row1,) = [b for b in first.batches if isinstance(b, DecodeBatch)]
    (row2,) = [b for b in second.batches if isinstance(b, DecodeBatch)]
    assert row1.col("continues").tolist() == [0] and row2.col("continues").tolist() == [1]
    assert reach_one >= request.position + (3 + 1) + 1
    assert request.allocation.num_positions >= request.position + 2 * (3 + 1) + 1
    assert scheduler.update(0, result_for(first, token=7)) == [request]  # token 7: a stop token
    assert request.is_finished and request.output_token_ids == [7]
    stale = scheduler.stats.num_stale_rows
    assert scheduler.update(0, result_for(second, token=7)) == []
    assert scheduler.stats.num_stale_rows > stale and request.output_token_ids == [7]


def test_two_plans_in_flight_by_default_on_cuda_only() -> None:
    from rlt_engine.config import EngineConfig

    assert EngineConfig(device="cuda").resolved().max_plans_in_flight == 2
    assert EngineConfig(device="cpu").resolved().max_plans_in_flight == 1
    with pytest.raises(ValueError, match="max_plans_in_flight"):
        EngineConfig(max_plans_in_flight=3)


class _FailOnce:
    """A runner fault hook: raise the `nth` time a plan reaches `point`."""

    def __init__(self, point: str, nth: int) -> None:
        self.point, self.left = point, nth

    def __call__(self, point: str) -> None:
        if point == self.point:
            self.left -= 1
            if self.left == 0:
                raise RuntimeError(f"injected failure at {point}")


@pytest.mark.parametrize(("point", "nth"), [("admit", 4), ("batch", 9), ("release", 2)])
def test_a_failed_plan_with_another_in_flight_leaks_nothing(point: str, nth: int) -> None:
    """A plan fails midway while the next one is already on the worker: each is reconciled from its
    own slot ops, the requests they reached end with an error, the rest finish, nothing leaks."""
    jobs = make_workload(random.Random("fail" + point), 10, depth=4, exit_mode="ouro", sampling=("temperature",),
                         threshold=0.5, max_tokens=10)
    llm = make_llm("toy-ouro", exit_mode="ouro", loops_per_plan=2, max_plans_in_flight=2)
    try:
        llm.engine.executor._worker.runner.fault_hook = hook = _FailOnce(point, nth)
        driver = run_workload(llm, jobs)
        driver.assert_resources_returned()
    finally:
        llm.close()
    reasons = [life.final.finish_reason for life in driver.lives]
    assert hook.left <= 0 and "error" in reasons and {"length", "stop"} & set(reasons), reasons
