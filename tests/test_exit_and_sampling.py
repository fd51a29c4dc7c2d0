"""Adaptive exit, sampling and aborts (SPEC §3, §5, §6 identity, §8): gate-driven exits equal
the dense reference inside mixed batches, seeded sampling ignores its batch, an abort in any
stage ends the old life for good, and a long random workload with aborts and reused ids stays
exact and gives every resource back."""

from __future__ import annotations

import dataclasses
import random

import msgspec
import psutil
import pytest
import torch
from factories import (
    DEPTH,
    SAMPLING,
    Driver,
    Job,
    assert_matches_reference,
    coda_rows,
    decode_rows,
    early_exit_batches,
    finalize_rows,
    find_request,
    make_llm,
    make_params,
    make_prompt,
    make_workload,
    record_sampling,
    reference,
    reference_config,
    reference_model,
    run_workload,
)

import rlt_worker.models.reference as reference_module
from protocol.messages import SamplingParams
from rlt_engine import LLM
from rlt_engine.request import Phase, RequestStatus

pytestmark = pytest.mark.usefixtures("single_thread")

# (model, exit mode, threshold): thresholds where the toy models' signals exit early often
# (toy-huginn's KL after loops 1…6 has medians ≈ 3, 1.4, 0.65, 0.27, 0.14, 0.07 and its
# relative latent change ≈ 1.2, 0.77, 0.53, 0.37, 0.26, 0.19, so 0.3 exits at loops 3…6).
GATES = [
    ("toy-ouro", "ouro", 0.3),
    ("toy-ouro", "ouro", 0.7),
    ("toy-ouro", "ouro_delayed", 0.5),
    ("toy-huginn", "kl", 0.3),
    ("toy-huginn", "latent_diff", 0.3),
]


def case_ids(cases: list[tuple]) -> list[str]:
    return ["-".join(map(str, case)) for case in cases]


# ------------------------------------------------------------------------------- adaptive exit


@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize("kv_layout", ["last_exited", "shared"])
@pytest.mark.parametrize("model,exit_mode,threshold", GATES, ids=case_ids(GATES))
def test_adaptive_exit_matches_reference(model, exit_mode, threshold, kv_layout, scheduling):
    """Greedy, temperature, top-k and top-p requests (some with min_loops 2 or max_loops
    D − 1) arrive staggered; the gates' exits and every token equal the dense reference,
    positions run exactly their exit depth's loops, and the plans show early exits taken inside
    loop batches shared with other requests, at 3 or more different depths."""
    depth = DEPTH[model]
    jobs = make_workload(
        random.Random(f"exit-{model}-{exit_mode}-{threshold}"), 8, depth=depth, exit_mode=exit_mode,
        threshold=threshold, sampling=tuple(SAMPLING), max_prompt_len=16, max_tokens=10, vary_limits=True,
    )
    with make_llm(model, exit_mode=exit_mode, kv_layout=kv_layout, scheduling=scheduling, max_num_seqs=4,
                  prefill_chunk_size=8) as llm:
        run = run_workload(llm, jobs)
        assert_matches_reference(run, model, kv_layout=kv_layout, exit_mode=exit_mode)
        run.assert_resources_returned()

    generated_depths = {d for life in run.lives for d in life.final.exit_depths[1:]}
    assert len(generated_depths) >= 3, f"exit depths of generated positions: {generated_depths}"
    gate_decided = {  # requests with default limits: any depth below D is the gate's choice
        d for life in run.lives if life.job.params.min_loops == 1 and life.job.params.max_loops is None
        for d in life.final.exit_depths[1:]
    }
    assert min(gate_decided) < depth, f"the gate never exited early: {gate_decided}"
    assert early_exit_batches(run.passes, depth), "no early exit inside a loop pass shared with another request"


@pytest.mark.parametrize("kv_layout", ["last_exited", "shared"])
def test_forced_tokens_score_a_text_like_the_reference(kv_layout):
    """Teacher forcing (how `rlt-bench quality` scores text): every other request emits given
    tokens instead of samples, beside sampled requests in the same loop batches; the tokens are
    the given ones, and the gate's exits and the logprobs equal the dense reference's."""
    rng = random.Random(f"forced-{kv_layout}")
    jobs = make_workload(rng, 6, depth=DEPTH["toy-ouro"], exit_mode="ouro", threshold=0.5,
                         sampling=tuple(SAMPLING), max_prompt_len=8, max_tokens=10)
    forced = [
        dataclasses.replace(job, params=msgspec.structs.replace(
            job.params, logprobs=1, forced_tokens=[rng.randrange(256) for _ in range(job.params.max_tokens)]))
        if i % 2 == 0 else job
        for i, job in enumerate(jobs)
    ]
    with make_llm("toy-ouro", exit_mode="ouro", kv_layout=kv_layout, max_num_seqs=4) as llm:
        run = run_workload(llm, forced)
        assert_matches_reference(run, "toy-ouro", kv_layout=kv_layout, exit_mode="ouro")
    for life in run.lives:
        want = life.job.params.forced_tokens
        if want is not None:
            assert life.final.token_ids == want[: len(life.final.token_ids)]


def test_forced_tokens_outside_the_vocabulary_are_refused():
    with make_llm("toy-ouro") as llm, pytest.raises(ValueError, match="forced_tokens must be token ids in"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, forced_tokens=[3, 10**6]))


@pytest.mark.parametrize("exit_mode", ["ouro", "ouro_delayed"])
def test_ouro_modes_need_an_exit_gate(exit_mode):
    with pytest.raises(ValueError, match=rf"exit_mode '{exit_mode}' needs an exit gate.*huginn"):
        make_llm("toy-huginn", exit_mode=exit_mode)


@pytest.mark.parametrize("exit_mode", ["kl", "latent_diff"])
def test_signal_modes_need_a_coda_signal(exit_mode):
    with pytest.raises(ValueError, match=rf"exit_mode '{exit_mode}' needs a coda-based signal"):
        make_llm("toy-ouro", exit_mode=exit_mode)


def test_configuration_error_leaves_no_worker_running():
    """The ValueError of a bad exit_mode must not leave a worker process behind, even while the
    exception is still referenced (as pytest.raises, or sys.last_exc at a Python prompt, keep it)."""
    me = psutil.Process()
    before = {child.pid for child in me.children(recursive=True)}
    with pytest.raises(ValueError, match="needs an exit gate") as caught:
        LLM("toy-huginn", workers=1, device="cpu", exit_mode="ouro")
    leaked = [
        child.cmdline() for child in me.children(recursive=True)
        if child.pid not in before and child.status() != psutil.STATUS_ZOMBIE
    ]
    assert not leaked, f"worker processes still running while {caught.typename} is referenced: {leaked}"


# ------------------------------------------------------------------------------- sampling

INVARIANCE = [("toy-ouro", "ouro", 0.5), ("toy-huginn", "kl", 0.3)]


@pytest.mark.parametrize("model,exit_mode,threshold", INVARIANCE, ids=case_ids(INVARIANCE))
def test_seeded_sampling_ignores_batch_and_arrival_order(model, exit_mode, threshold):
    """One seeded top-p request gives the same tokens and exit depths alone, behind a crowd,
    ahead of it, in reverse arrival order, under no_refill and with other chunk sizes; another
    seed gives other tokens."""
    depth = DEPTH[model]
    rng = random.Random(f"invariance-{model}")
    target = Job(
        "target", make_prompt(rng, 9),
        SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=2**63 + 12345, exit_threshold=threshold,
                       ignore_eos=True),
    )
    crowd = make_workload(rng, 6, depth=depth, exit_mode=exit_mode, threshold=threshold,
                          sampling=tuple(SAMPLING), max_prompt_len=16, prefix="other")
    at = dataclasses.replace
    scenarios = {
        "alone": ([target], dict(max_num_seqs=1)),
        "behind_crowd": ([*crowd, at(target, arrival=4)], dict(max_num_seqs=4)),
        "ahead_of_crowd": ([target, *(at(j, arrival=j.arrival + 1) for j in crowd)], dict(max_num_seqs=8)),
        "reverse_order": ([at(j, arrival=0) for j in reversed(crowd[3:])] + [target]
                          + [at(j, arrival=0) for j in crowd[:3]], dict(max_num_seqs=3, prefill_chunk_size=2)),
        "no_refill": ([*crowd[:3], at(target, arrival=2), *crowd[3:]], dict(scheduling="no_refill", max_num_seqs=5)),
    }
    results = {}
    for name, (jobs, options) in scenarios.items():
        with make_llm(model, exit_mode=exit_mode, **options) as llm:
            sampling_calls = record_sampling(llm)
            run = run_workload(llm, jobs)
            run.assert_resources_returned()
        out = run.life("target").final
        results[name] = (tuple(out.token_ids), tuple(out.exit_depths))
        if name != "alone":  # the target really sampled in batches with other requests
            key = run.life("target").key
            shared = [keys for keys in sampling_calls if key in keys]
            assert any(len(keys) > 1 for keys in shared), f"{name}: the target's CODA never shared a batch"
    assert len(set(results.values())) == 1, results
    ref = reference(model, target, kv_layout="last_exited", exit_mode=exit_mode)
    assert results["alone"] == (tuple(ref.token_ids), tuple(ref.exit_depths))

    reseeded = at(target, params=msgspec.structs.replace(target.params, seed=target.params.seed + 1))
    with make_llm(model, exit_mode=exit_mode, max_num_seqs=1) as llm:
        other = run_workload(llm, [reseeded]).life("target").final
    assert tuple(other.token_ids) != results["alone"][0], "two seeds gave the same 10 sampled tokens"


@pytest.mark.parametrize("model,exit_mode,threshold", INVARIANCE, ids=case_ids(INVARIANCE))
def test_temperature_zero_is_argmax(model, exit_mode, threshold, monkeypatch):
    """Greedy requests (batched with sampled ones) pick the argmax of the dense reference's
    logits at every output, and report its log-probability, the largest one."""
    depth = DEPTH[model]
    rng = random.Random(f"greedy-{model}")
    jobs = make_workload(rng, 6, depth=depth, exit_mode=exit_mode, threshold=threshold,
                         sampling=("greedy", "temperature", "greedy"), max_prompt_len=12, max_tokens=6)
    with make_llm(model, exit_mode=exit_mode, max_num_seqs=6) as llm:
        run = run_workload(llm, jobs)

    logits_seen: list[torch.Tensor] = []
    original = reference_module._sample

    def recording_sample(logits, params, seed, index):
        logits_seen.append(logits[0].double())
        return original(logits, params, seed, index)

    monkeypatch.setattr(reference_module, "_sample", recording_sample)
    greedy = [life for life in run.lives if life.job.params.temperature == 0]
    assert len(greedy) >= 3
    for life in greedy:
        out = life.final
        logits_seen.clear()
        reference_module.generate_reference(
            reference_model(model), list(life.job.prompt), life.job.params, life.job.params.seed,
            reference_config(model, "last_exited", exit_mode),
        )
        assert len(logits_seen) == len(out.token_ids), life.job.describe()
        for i, (logits, token, logprob) in enumerate(zip(logits_seen, out.token_ids, out.logprobs, strict=True)):
            logp = torch.log_softmax(logits, dim=-1)
            assert token == int(logits.argmax()), f"{life.job.request_id} output {i}"
            assert logprob == pytest.approx(float(logp.max()), rel=1e-9, abs=1e-9)


# ------------------------------------------------------------------------------- aborts

STAGES = ["waiting", "prefill", "recurrent", "boundary", "coda_in_flight"]
ABORT_MODELS = [("toy-ouro", "trace"), ("toy-huginn", "kl")]


def deep_and_shallow(rng: random.Random, depth: int, exit_mode: str, max_tokens: int) -> tuple[SamplingParams, ...]:
    """Params whose generated positions run D loops (deep) or exit after loop 1 (shallow):
    under `trace` by their depths, under `kl` by a threshold of 0 (never early) or one above
    every KL value of the toy (always at loop 1)."""
    def params(loops: int) -> SamplingParams:
        if exit_mode == "trace":
            return make_params(rng, depth=depth, exit_mode="trace", sampling="temperature", max_tokens=max_tokens,
                               exit_depths=[depth] + [loops] * (max_tokens - 1), ignore_eos=True)
        return make_params(rng, depth=depth, exit_mode=exit_mode, sampling="temperature", max_tokens=max_tokens,
                           threshold=None if loops == depth else 100.0, ignore_eos=True)

    return params(depth), params(1)


@pytest.mark.parametrize("model,exit_mode", ABORT_MODELS, ids=case_ids(ABORT_MODELS))
@pytest.mark.parametrize("stage", STAGES)
def test_abort_in_each_stage_then_reuse_id(stage, model, exit_mode):
    """Abort "target" in one stage of its life and at once add a different request under the
    same id. The stream then holds exactly one abort output for the old life (repeating only
    the tokens delivered before the abort, a prefix of its reference), and after it only the
    new life's outputs, growing from one token to the new request's exact result, which equals
    a fresh engine's and the reference's. The bystander is untouched; resources come back."""
    depth = DEPTH[model]
    rng = random.Random(f"abort-{stage}-{model}")
    deep, shallow = deep_and_shallow(rng, depth, exit_mode, max_tokens=8)
    bystander = Job("bystander", make_prompt(rng, 12), deep)
    target_params = {"recurrent": deep, "boundary": shallow, "coda_in_flight": shallow}.get(stage, deep)
    target = Job("target", make_prompt(rng, 30 if stage == "prefill" else 6), target_params)
    options = dict(
        exit_mode=exit_mode,
        max_num_seqs=1 if stage == "waiting" else 4,
        prefill_chunk_size=4,
        scheduling="no_refill" if stage == "boundary" else "refill",
    )
    with make_llm(model, **options) as llm:
        driver = Driver(llm)
        driver.add(bystander)
        driver.step()
        old = driver.add(target)
        request = find_request(llm.engine, "target")

        def sampling_in_flight() -> bool:
            """The submitted plan finalizes and samples a generated output of the target: planned (trace)
            as FINALIZE and CODA rows, decided in the worker (kl, always exiting at loop 1) as a DECODE row."""
            plan = driver.plans[-1]
            planned = ([r for r in coda_rows(plan) if r[0] == old.key and r[2] >= 1]
                       and [r for r in finalize_rows(plan) if r[0] == old.key])
            return bool(planned) or any(r[0] == old.key and r[4] >= 1 for r in decode_rows(plan))

        if stage == "waiting":
            driver.step()
            assert request.status == RequestStatus.WAITING
        elif stage == "prefill":
            driver.step()
            assert request.phase == Phase.PREFILL and 0 < request.num_prefilled < len(target.prompt)
        elif stage == "recurrent":  # mid-loop of a generated position, its loop in flight
            driver.step_until(lambda: request.phase == Phase.LOOP and request.num_outputs >= 1
                              and 2 <= request.depth < depth)
        elif stage == "boundary":  # exited after loop 1, finalize + CODA wait for the cohort
            driver.step_until(lambda: request.phase == Phase.BOUNDARY and request.num_outputs >= 1)
            assert any(r.phase == Phase.LOOP for r in llm.engine.scheduler.running[0])
        elif stage == "coda_in_flight":  # the submitted plan finalizes and samples a generated output
            driver.step_until(sampling_in_flight)
        delivered = list(old.outputs[-1].token_ids) if old.outputs else []
        stale_before = llm.engine.scheduler.stats.num_stale_rows

        assert driver.abort("target")
        new_job = Job("target", make_prompt(rng, 7), make_params(rng, depth=depth, exit_mode=exit_mode,
                                                                  sampling="top_p", max_tokens=6, threshold=0.3))
        new = driver.add(new_job)
        driver.finish()
        driver.assert_resources_returned()
        # Rows in flight that report: a sampled output, or a loop the worker decided (planned loops report nothing).
        if stage == "coda_in_flight" or (stage == "recurrent" and exit_mode != "trace"):
            assert llm.engine.scheduler.stats.num_stale_rows > stale_before, "the in-flight rows were not dropped"

    # abort_request answered with the old life's final output; the stream of step() outputs for
    # the id "target" holds the old life's outputs up to the abort, then only the new life's.
    abort_output = old.outputs[-1]
    assert abort_output.finish_reason == "abort" and abort_output.token_ids == delivered
    stream = [o for o in driver.stream if o.request_id == "target"]
    assert not any(o.finish_reason == "abort" for o in stream), [o.finish_reason for o in stream]
    after = stream[len(old.outputs) - 1:]
    old_ref = reference(model, target, kv_layout="last_exited", exit_mode=exit_mode)
    assert delivered == old_ref.token_ids[: len(delivered)]
    new_ref = reference(model, new_job, kv_layout="last_exited", exit_mode=exit_mode)
    assert [o.token_ids for o in after] == [new_ref.token_ids[:n] for n in range(1, len(new_ref.token_ids) + 1)]
    assert after[-1].finished and not any(o.finished for o in after[:-1])
    assert old.aborted and new.final is after[-1]

    assert_matches_reference(driver, model, kv_layout="last_exited", exit_mode=exit_mode)  # bystander, new life
    with make_llm(model, **options) as llm:
        fresh = run_workload(llm, [new_job]).life("target").final
    assert (fresh.token_ids, fresh.exit_depths) == (new.final.token_ids, new.final.exit_depths)


def test_random_workload_with_aborts_and_reused_ids():
    """200 requests (mixed sampling, Ouro gate thresholds, ≤ 16-token prompts, ≤ 12 outputs)
    over ~300 steps; 20% are aborted 0 … 12 steps after they arrive; some ids are reused,
    some in the very step their old life was aborted. Every request that was not aborted equals
    the reference, no life's stream mixes with another's, and blocks, slots and seeds come back."""
    depth, rng = DEPTH["toy-ouro"], random.Random("soak")
    jobs: list[Job] = []
    for i in range(200):
        request_id, arrival = f"soak{i}", rng.randint(0, 300)
        if i >= 20 and rng.random() < 0.15:  # reuse an earlier id, arriving while it may still be live
            base = rng.choice(jobs)
            request_id, arrival = base.request_id, base.arrival + rng.randint(0, 10)
        params = make_params(rng, depth=depth, exit_mode="ouro", sampling=rng.choice(list(SAMPLING)),
                             max_tokens=rng.randint(1, 12), threshold=rng.choice([None, 0.3, 0.6, 0.9]))
        abort_after = rng.randint(0, 12) if rng.random() < 0.2 else None
        jobs.append(Job(request_id, make_prompt(rng, rng.randint(1, 16)), params, arrival, abort_after))
    jobs.sort(key=lambda job: job.arrival)

    with make_llm("toy-ouro", exit_mode="ouro", max_num_seqs=8, prefill_chunk_size=8) as llm:
        run = run_workload(llm, jobs)
        run.assert_resources_returned()
        assert llm.engine.scheduler.stats.num_stale_rows > 0  # some aborts hit rows in flight
    assert len(run.lives) == 200
    aborted = [life for life in run.lives if life.aborted]
    assert 20 <= len(aborted) <= 50, len(aborted)
    reuses = 200 - len({life.job.request_id for life in run.lives})
    assert reuses >= 15, "too few ids were reused"
    previous_life = {}
    reused_at_once = 0
    for life in run.lives:
        old = previous_life.get(life.job.request_id)
        reused_at_once += old is not None and old.aborted_at == life.added_at
        previous_life[life.job.request_id] = life
    assert reused_at_once >= 1, "no id was reused in the step its old life was aborted"
    assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")


# ------------------------------------------------------------------------------- progress bar


def test_generate_progress_bar(capsys):
    jobs = [Job(f"p{i}", make_prompt(random.Random(i), 5 + i), SamplingParams(max_tokens=4, exit_threshold=0.5,
                                                                              seed=i, ignore_eos=True))
            for i in range(3)]
    with make_llm("toy-ouro", exit_mode="ouro") as llm:
        capsys.readouterr()
        outs = llm.generate([list(j.prompt) for j in jobs], [j.params for j in jobs], use_tqdm=True)
        shown = capsys.readouterr()
        assert "3/3" in shown.err and "tok/s=" in shown.err and "loops/tok=" in shown.err, shown.err
        again = llm.generate([list(j.prompt) for j in jobs], [j.params for j in jobs], use_tqdm=False)
        hidden = capsys.readouterr()
        assert hidden.err == "" and hidden.out == ""
    for job, out, out2 in zip(jobs, outs, again, strict=True):
        ref = reference("toy-ouro", job, kv_layout="last_exited", exit_mode="ouro")
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths)
        assert (out2.token_ids, out2.exit_depths) == (ref.token_ids, ref.exit_depths)
