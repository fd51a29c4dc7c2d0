"""Mixed passes from CUDA graphs (rlt_worker/mixed_graphs.py), emulated on the CPU in float64: a failed
capture and the graph cap leave the passes eager and exact, the other graphs on; the option reaches
the worker only with mixed batches and CUDA graphs. The outputs of graphed mixed passes against the
reference and separate passes, pipelined plans and the Triton kernels in the interpreter are in
tests/test_mixed_batches.py; on the GPU, tests/test_gpu.py's mixed-batch gate."""

from __future__ import annotations

import dataclasses
import random

import pytest
from factories import assert_matches_reference, make_llm, make_workload, run_workload

from rlt_engine.config import EngineConfig
from rlt_worker import mixed_graphs

pytestmark = pytest.mark.usefixtures("single_thread")


def jobs():
    return make_workload(random.Random("mixed-graphs"), 6, depth=4, exit_mode="trace", sampling=("greedy",),
                         max_prompt_len=30, max_tokens=8, spread=2)


def run_mixed(monkeypatch: pytest.MonkeyPatch | None = None, fail: bool = False) -> dict:
    with make_llm("toy-ouro", exit_mode="trace", max_num_seqs=4, prefill_chunk_size=8, mixed_batches=True,
                  max_num_batched_tokens=24) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True, mixed=True)
        if fail:
            graphs, real = runner._graphs, runner._graphs._capture

            def capture(fn, warm_up):
                if getattr(fn, "func", None) == graphs.mixed.stacked_pass:
                    raise RuntimeError("CUDA out of memory (simulated)")
                return real(fn, warm_up)

            monkeypatch.setattr(graphs, "_capture", capture)
        run = run_workload(llm, jobs())
        assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="trace")
        return runner.graph_stats


def test_failed_mixed_capture_keeps_the_other_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = run_mixed(monkeypatch, fail=True)
    assert "simulated" in stats["mixed_error"] and stats["error"] is None, stats
    assert stats["mixed_replays"] == 0 and stats["mixed_eager"] == stats["mixed_passes"] > 0 and stats["replays"] > 0


def test_mixed_graph_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_GRAPHS keys, a pass of a new key runs eagerly; the keys captured keep replaying."""
    monkeypatch.setattr(mixed_graphs, "MAX_GRAPHS", 1)
    stats = run_mixed()
    assert stats["mixed_captures"] == 1 and stats["mixed_replays"] > 0 and stats["mixed_eager"] > 0, stats
    assert stats["mixed_replays"] + stats["mixed_eager"] == stats["mixed_passes"], stats


def test_mixed_graph_option() -> None:
    on = EngineConfig(device="cuda", mixed_batches=True).resolved()
    assert on.worker_config("cuda").mixed_graphs
    assert not EngineConfig(device="cuda", mixed_batches=False).resolved().worker_config("cuda").mixed_graphs
    assert not EngineConfig(device="cuda", exit_mode="kl").resolved().worker_config("cuda").mixed_graphs  # default off
    assert not EngineConfig(device="cuda", mixed_batches=True, cuda_graphs=False).resolved().worker_config(
        "cuda").mixed_graphs
    assert not EngineConfig(device="cpu", mixed_batches=True).resolved().worker_config("cpu").mixed_graphs


def test_slot_rows_are_padded_finer_than_powers_of_two() -> None:
    assert [mixed_graphs.slot_rows(n) for n in (1, 3, 9, 16, 17, 33, 48, 65, 100, 128)] == \
        [1, 4, 16, 16, 32, 48, 48, 80, 112, 128]


def test_mixed_graphs_of_slot_rows_between_powers_of_two() -> None:
    """40 requests decode while late prompts ride their passes: mixed keys of 48 slot rows (a count no
    decode graph has: its static rows are made at first use) replay, and the outputs are the reference's."""
    rng = random.Random("mixed-48")
    early = make_workload(rng, 40, depth=4, exit_mode="trace", max_prompt_len=3, max_tokens=40, spread=0)
    late = make_workload(rng, 4, depth=4, exit_mode="trace", max_prompt_len=30, max_tokens=2, spread=0, prefix="late")
    late = [dataclasses.replace(job, arrival=3 + i) for i, job in enumerate(late)]
    with make_llm("toy-ouro", exit_mode="trace", max_num_seqs=48, prefill_chunk_size=8, mixed_batches=True,
                  max_num_batched_tokens=64) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True, mixed=True)
        run = run_workload(llm, early + late)
        keys = set(runner._graphs.mixed._graphs)
        stats = runner.graph_stats
    assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="trace")
    assert any(rows == 48 for rows, *_ in keys), keys
    assert stats["mixed_eager"] == 0 and stats["mixed_replays"] == stats["mixed_passes"] > 0, stats
