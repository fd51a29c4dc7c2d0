"""The GPU fast path's semantics on the CPU, in float64 against the dense reference (SPEC §7a):

- plans that run several loops per row (`loops_per_plan`) give the same tokens and exit depths
  as one loop per plan, with fewer engine steps;
- the graph-captured decode pass (rlt_worker.cuda_graphs), run eagerly in its emulation mode:
  the same padded, bucketed, static-buffer function a CUDA graph replays, equal to the reference.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from factories import (
    DEPTH,
    MODELS,
    Job,
    assert_matches_reference,
    in_plan_refills,
    loop_rows,
    make_llm,
    make_params,
    make_prompt,
    make_workload,
    run_workload,
)

from protocol.messages import DecodeBatch, ExitTest
from rlt_worker.cuda_graphs import LoopPassGraphs

pytestmark = pytest.mark.usefixtures("single_thread")


def _jobs(model: str, exit_mode: str) -> list:
    return make_workload(random.Random(f"fast-{model}-{exit_mode}"), 6, depth=DEPTH[model], exit_mode=exit_mode,
                         max_prompt_len=12, max_tokens=6, spread=1)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("exit_mode", ["fixed", "trace"])
def test_multi_pass_plans_match_single_loop(model: str, exit_mode: str) -> None:
    """One loop per plan: planned RecurrentBatch rows. Several: the worker's decode loop runs planned
    exits (ExitTest.PLANNED) and refills exited rows inside the plan. Same tokens and exit depths."""
    jobs = _jobs(model, exit_mode)
    runs = {}
    for loops_per_plan in (1, DEPTH[model]):
        with make_llm(model, exit_mode=exit_mode, loops_per_plan=loops_per_plan, max_num_seqs=4) as llm:
            assert llm.engine.scheduler.config.loops_per_plan == loops_per_plan
            run = run_workload(llm, jobs)
            assert_matches_reference(run, model, kv_layout="last_exited", exit_mode=exit_mode)
            run.assert_resources_returned()
            runs[loops_per_plan] = run
    single, multi = runs[1], runs[DEPTH[model]]
    for a, b in zip(single.lives, multi.lives, strict=True):
        assert (a.final.token_ids, a.final.exit_depths) == (b.final.token_ids, b.final.exit_depths)
    assert max(r.num_loops for p in single.plans for r in loop_rows(p)) == 1
    assert not any(isinstance(b, DecodeBatch) for p in single.plans for b in p.batches)
    decode = [b for p in multi.plans for b in p.batches if isinstance(b, DecodeBatch)]
    assert decode and {b.exit_test for b in decode} == {ExitTest.PLANNED} and not any(loop_rows(p) for p in multi.plans)
    assert max(Counter(p.step_id for p in multi.passes).values()) > 1  # plans of several passes
    if exit_mode == "trace":
        assert in_plan_refills(multi.passes), "no exited row took its next position inside a plan"
    assert len(multi.plans) < len(single.plans)


def _ideal_passes(jobs: list) -> int:
    """Loop passes of a workload whose requests all start together and never idle: the most loops any
    one request runs after its prompt (output 0's position loops in PREFILL)."""
    return max(sum(job.params.exit_depths[1:]) for job in jobs)


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("concurrency", [1, 8])
def test_planned_rows_refill_in_the_plan(concurrency: int, in_flight: int) -> None:
    """Issue 19: with 4·D passes per plan, a trace row that exits early takes its next position at the
    next pass instead of idling until the plan's deepest row ends, so c rows of mixed depths run about
    as many passes as the deepest request's loops (before: about c-row max depth per token, fixed's),
    pipelined or not, with the reference's tokens and exit depths."""
    depth, rng = DEPTH["toy-ouro"], random.Random(f"refill-{concurrency}")
    jobs = [Job(f"r{i}", make_prompt(rng, 4), make_params(rng, depth=depth, exit_mode="trace", max_tokens=12,
                                                           ignore_eos=True))
            for i in range(concurrency)]
    with make_llm("toy-ouro", exit_mode="trace", loops_per_plan=4 * depth, max_num_seqs=concurrency,
                  max_plans_in_flight=in_flight) as llm:
        run = run_workload(llm, jobs)
        assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="trace")
        run.assert_resources_returned()
    ideal = _ideal_passes(jobs)
    per_token_max = sum(max(job.params.exit_depths[i] for job in jobs) for i in range(1, 12))
    assert ideal <= len(run.passes) <= 1.05 * ideal, (len(run.passes), ideal, per_token_max)
    if concurrency > 1:
        assert 1.05 * ideal < per_token_max  # the workload tells the two apart
    assert len(run.plans) < 12  # several tokens per plan (one per token before)


def test_loops_per_plan_defaults() -> None:
    from rlt_engine.config import EngineConfig

    assert EngineConfig(device="cpu").resolved().loops_per_plan == 1
    assert EngineConfig(device="cpu").resolved().cuda_graphs is False
    assert EngineConfig(device="cuda", attention_backend="torch").resolved().cuda_graphs is False
    assert EngineConfig(device="cuda").resolved().cuda_graphs is True
    assert EngineConfig(device="cuda").resolved().loops_per_plan == 0  # 4·D, once the workers report D
    with pytest.raises(ValueError, match="loops_per_plan"):
        EngineConfig(loops_per_plan=-1)
    with make_llm("toy-ouro", exit_mode="ouro", loops_per_plan=4) as llm:  # the worker decides: DecodeBatch
        run = run_workload(llm, _jobs("toy-ouro", "ouro"))
    assert not any(loop_rows(p) for p in run.plans)
    decode = [b for p in run.plans for b in p.batches if isinstance(b, DecodeBatch)]
    assert decode and {b.max_passes for b in decode} == {4} and all(b.refill for b in decode)
    assert max(Counter(p.step_id for p in run.passes).values()) == 4  # a plan of four passes


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("loops_per_plan", [1, 0])
def test_emulated_pass_graphs_match_reference(model: str, loops_per_plan: int) -> None:
    exit_mode = "trace"
    with make_llm(model, exit_mode=exit_mode, loops_per_plan=loops_per_plan or DEPTH[model], max_num_seqs=6) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True)
        run = run_workload(llm, _jobs(model, exit_mode))
        assert_matches_reference(run, model, kv_layout="last_exited", exit_mode=exit_mode)
        run.assert_resources_returned()
        stats = runner.graph_stats
    assert stats["replays"] > 0 and stats["eager_passes"] == 0
    assert stats["padded_rows"] > 0  # row buckets were padded (3, 5, 6 rows → 4, 8, 8)
    widths = {int(name.split("x")[1]) for name in stats["buckets"]}
    assert widths <= {4, 8, 16, 32}


def test_pass_graph_buckets() -> None:
    class Runner:  # what LoopPassGraphs reads of a runner
        import torch

        device = torch.device("cpu")
        block_tables = torch.zeros(9, 4, 32, dtype=torch.int32)
        storage = type("S", (), {"block_size": 16})()
        config = type("C", (), {"max_slots": 8})()
        # Huginn-like: no CODA graphs, no exit gate
        model = type("M", (), {"info": type("I", (), {"num_outer_kv_layers": 1, "has_exit_gate": False})()})()

    graphs = LoopPassGraphs(Runner(), dummy_slot=8, scratch_block=99, emulate=True)
    assert graphs.row_buckets == (1, 2, 4, 8)
    assert graphs.bucket(3, 0) == (4, 4)
    assert graphs.bucket(8, 16 * 5) == (8, 8)  # 6 blocks → 8
    assert graphs.bucket(1, 16 * 31 + 3) == (1, 32)  # capped at the table width
    assert graphs.bucket(9, 0) is None
    assert int(Runner.block_tables[8].unique()) == 99
    assert graphs.widths() == (4, 8, 16, 32) and graphs.coda is None


def test_every_engine_flag_has_help() -> None:
    """`rlt-serve --help` explains every engine option, not just its default."""
    import argparse
    import dataclasses

    from rlt_engine.cli import add_engine_options
    from rlt_engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    helps = {a.dest: a.help for a in parser._actions if a.dest != "help"}
    assert set(helps) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert all(h and not h.startswith("(default") for h in helps.values()), helps


def test_startup_capture_leaves_no_capture_to_serving() -> None:
    """capture_all() (the worker's start-up capture, emulated here) covers every rows × width bucket
    and every CODA bucket (each SamplingKind) a workload can need: serving then replays only,
    captures nothing, runs no pass or CODA eagerly; every sampling kind equals the reference."""
    jobs = make_workload(random.Random("fast-startup"), 7, depth=DEPTH["toy-ouro"], exit_mode="trace",
                         sampling=("greedy", "temperature", "top_k", "top_p"), max_prompt_len=12, max_tokens=6,
                         spread=1)
    with make_llm("toy-ouro", exit_mode="trace", loops_per_plan=DEPTH["toy-ouro"], max_num_seqs=6) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True)
        runner.capture_pass_graphs()
        graphs = runner._graphs
        assert graphs.row_buckets == (1, 2, 4, 8) and graphs.widths() == (4, 8, 16, 32)  # 512 positions / 16
        started = runner.graph_stats
        captures = 4 * 4 + 4 * 3  # loop passes rows × widths, CODA rows × SamplingKind (greedy, gumbel, filtered)
        assert started["startup_captures"] == started["captures"] == captures and started["lazy_captures"] == 0
        run = run_workload(llm, jobs)
        assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="trace")
        run.assert_resources_returned()
        stats = runner.graph_stats
    assert stats["replays"] > 0 and stats["eager_passes"] == 0
    assert stats["coda_replays"] > 0 and stats["coda_eager"] == 0
    assert stats["captures"] == captures and stats["lazy_captures"] == 0


def test_huginn_coda_stays_eager() -> None:
    """Huginn's coda attends (its coda K/V): no CODA graphs; its loop passes still are graphed."""
    with make_llm("toy-huginn", exit_mode="trace", loops_per_plan=DEPTH["toy-huginn"], max_num_seqs=4) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True)
        assert runner._graphs.coda is None
        run = run_workload(llm, _jobs("toy-huginn", "trace"))
        assert_matches_reference(run, "toy-huginn", kv_layout="last_exited", exit_mode="trace")
        assert runner.graph_stats["coda_replays"] == 0 and runner.graph_stats["replays"] > 0


def test_graph_capture_option() -> None:
    from rlt_engine.config import EngineConfig

    assert EngineConfig(device="cuda").resolved().worker_config("cuda").cuda_graph_capture == "startup"
    lazy = EngineConfig(device="cuda", cuda_graph_capture="lazy").resolved()
    assert lazy.worker_config("cuda").cuda_graph_capture == "lazy"
    with pytest.raises(ValueError, match="cuda_graph_capture"):
        EngineConfig(cuda_graph_capture="never")


def test_failed_coda_capture_keeps_pass_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CODA capture that fails (say, out of memory beside a full KV pool) turns off CODA graphs only."""
    with make_llm("toy-ouro", exit_mode="trace", loops_per_plan=DEPTH["toy-ouro"], max_num_seqs=4) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True)
        graphs = runner._graphs
        real = graphs._capture

        def capture(fn, warm_up):
            if fn.func == graphs.coda._coda:
                raise RuntimeError("CUDA out of memory (simulated)")
            return real(fn, warm_up)

        monkeypatch.setattr(graphs, "_capture", capture)
        run = run_workload(llm, _jobs("toy-ouro", "trace"))
        assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="trace")
        stats = runner.graph_stats
    assert "simulated" in stats["coda_error"] and stats["error"] is None
    assert stats["replays"] > 0 and stats["coda_replays"] == 0 and stats["coda_eager"] > 0
