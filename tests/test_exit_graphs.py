"""DecodeBatch exit tests replayed from (emulated) graphs (rlt_worker/exit_graphs.py), float64 on the CPU.

- The worker's config names the exit tests its engine's DecodeBatches may carry; the start-up capture
  covers them (one graph per rows bucket), so serving ouro captures nothing and equals the reference.
- A model without an exit gate (Huginn under its default, fixed) captures no exit-test graph.
- A failed exit-test capture leaves the pass graphs on and runs the test eagerly: still the reference's.
(The decode loop's exactness with graphed tests: tests/test_device_exit.py; that a graphed pass
launches no eager exit-test op: tests/test_decode_host_work.py.)
"""

from __future__ import annotations

import random

import pytest
from factories import DEPTH, assert_matches_reference, make_llm, make_workload, run_workload

from protocol.messages import ExitTest
from rlt_engine.config import EngineConfig

pytestmark = pytest.mark.usefixtures("single_thread")


def _jobs(mode: str) -> list:
    return make_workload(random.Random(f"exit-graphs-{mode}"), 7, depth=DEPTH["toy-ouro"], exit_mode=mode,
                         threshold=0.5, sampling=("greedy", "top_k"), max_prompt_len=10, max_tokens=8,
                         vary_limits=True, spread=1)


def test_worker_config_names_the_engines_exit_tests() -> None:
    """exit_mode → WorkerConfig.exit_tests: the mode's test, none for planned exits, OURO for the
    model's default (only a gated model, whose default it is, captures it)."""
    tests = {mode: EngineConfig(device="cpu", exit_mode=mode).resolved().worker_config("cpu").exit_tests
             for mode in ("ouro", "ouro_delayed", "kl", "latent_diff", "fixed", "trace", None)}
    assert tests == {"ouro": (ExitTest.OURO,), "ouro_delayed": (ExitTest.OURO_DELAYED,), "kl": (ExitTest.KL,),
                     "latent_diff": (ExitTest.LATENT,), "fixed": (), "trace": (), None: (ExitTest.OURO,)}


@pytest.mark.parametrize("mode", ["ouro", "ouro_delayed"])
def test_startup_capture_covers_the_exit_test(mode: str) -> None:
    """capture_all() also captures the configured test per rows bucket (4 here): serving then captures
    nothing, every pass's test replays (padded buckets included), and the outputs are the reference's."""
    with make_llm("toy-ouro", exit_mode=mode, loops_per_plan=4 * DEPTH["toy-ouro"], max_num_seqs=6) as llm:
        runner = llm.engine.executor._worker.runner
        assert runner.config.exit_tests == (ExitTest[mode.upper()],)
        runner.use_pass_graphs(emulate=True)
        runner.capture_pass_graphs()
        captures = 4 * 4 + 4 * 2 + 4  # passes rows × widths, CODA rows × (greedy, sampling), exit test rows
        assert runner.graph_stats["startup_captures"] == captures
        run = run_workload(llm, _jobs(mode))
        assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode=mode)
        run.assert_resources_returned()
        stats = runner.graph_stats
    assert stats["captures"] == captures and stats["lazy_captures"] == 0
    assert stats["exit_replays"] == stats["replays"] > 0 and stats["exit_eager"] == 0 and stats["padded_rows"] > 0


def test_a_model_without_an_exit_gate_captures_no_exit_test() -> None:
    """Huginn under the default exit mode (fixed): its config still names OURO (the engine could not
    know the model's default), and the worker captures none of it."""
    with make_llm("toy-huginn", exit_mode=None, loops_per_plan=DEPTH["toy-huginn"], max_num_seqs=4) as llm:
        runner = llm.engine.executor._worker.runner
        assert runner.config.exit_tests == (ExitTest.OURO,)
        runner.use_pass_graphs(emulate=True)
        runner.capture_pass_graphs()
        assert runner._graphs.exits.startup_tests == ()
        graphs = runner._graphs  # passes only (Huginn's CODA stays eager)
        assert runner.graph_stats["startup_captures"] == len(graphs.row_buckets) * len(graphs.widths())


def test_failed_exit_test_capture_keeps_pass_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exit-test capture that fails turns off exit-test graphs only: the test runs eagerly after
    each replayed pass, and the outputs are the reference's."""
    with make_llm("toy-ouro", exit_mode="ouro", loops_per_plan=4 * DEPTH["toy-ouro"], max_num_seqs=4) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True)
        graphs = runner._graphs
        real = graphs._capture

        def capture(fn, warm_up):
            if fn.func == graphs.exits._test:
                raise RuntimeError("CUDA out of memory (simulated)")
            return real(fn, warm_up)

        monkeypatch.setattr(graphs, "_capture", capture)
        run = run_workload(llm, _jobs("ouro"))
        assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="ouro")
        stats = runner.graph_stats
    assert "simulated" in stats["exit_error"] and stats["error"] is None and stats["coda_error"] is None
    assert stats["replays"] > 0 and stats["exit_replays"] == 0 and stats["coda_replays"] > 0
