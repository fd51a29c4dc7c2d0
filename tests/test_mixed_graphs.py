"""Mixed passes from CUDA graphs (rlt_worker/mixed_graphs.py), emulated on the CPU in float64: a failed
capture and the graph cap leave the passes eager and exact, the other graphs on; the option reaches
the worker only with mixed batches and CUDA graphs. The outputs of graphed mixed passes against the
reference and separate passes, pipelined plans and the Triton kernels in the interpreter are in
tests/test_mixed_batches.py; on the GPU, tests/test_gpu.py's mixed-batch gate."""

from __future__ import annotations

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
                if getattr(fn, "func", None) == graphs.mixed._pass:
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
    assert not EngineConfig(device="cuda").resolved().worker_config("cuda").mixed_graphs
    assert not EngineConfig(device="cuda", mixed_batches=True, cuda_graphs=False).resolved().worker_config(
        "cuda").mixed_graphs
    assert not EngineConfig(device="cpu", mixed_batches=True).resolved().worker_config("cpu").mixed_graphs
