"""DecodeBatch exit tests replayed from (emulated) graphs (rlt_worker/exit_graphs.py), float64 on the CPU.

- The worker's config names the exit tests its engine's DecodeBatches may carry; the start-up capture
  covers them (one graph per rows bucket), so serving ouro captures nothing and equals the reference.
- A model without an exit gate (Huginn under its default, fixed) captures no exit-test graph.
- A failed exit-test capture leaves the pass graphs on and runs the test eagerly: still the reference's.
- The test alone, random slot states, limits, thresholds and exit states, 1 … 8 rows (padded
  buckets): the graph's exit flags and exit states equal the eager `apply`'s, and no other slot's
  exit state moves (padding rows write only the dummy slot's). tests/test_gpu_exit_graphs.py runs
  the same check on CUDA, where it compares a captured graph with the eager kernels bit for bit.
(The decode loop's exactness with graphed tests: tests/test_device_exit.py; that a graphed pass
launches no eager exit-test op: tests/test_decode_host_work.py.)
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from factories import DEPTH, assert_matches_reference, make_llm, make_workload, run_workload

from protocol.messages import ExitTest
from rlt_engine.config import EngineConfig
from rlt_worker.exit_tests import EXIT_STATE, MAX_LOOPS, MIN_LOOPS, THRESHOLD, make_exit_test
from rlt_worker.model_runner import ModelRunner

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
        captures = 4 * 4 + 4 * 3 + 4  # passes rows × widths, CODA rows × SamplingKind, exit test rows
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


def check_graphed_test_equals_eager(runner: ModelRunner, exit_test: ExitTest) -> None:
    """Random states and exit columns in the first 8 slots, then passes of 1 … 8 of them: the exit-test
    graph's flags and exit states (after the rows' stage, without running the pass) equal the eager
    `apply`'s on the same inputs, and the other slots' exit states stay as they were."""
    graphs, cursors, test = runner._graphs, runner.decode_cursors, make_exit_test(exit_test)
    assert graphs is not None and graphs.exits.ready(exit_test)
    gen = torch.Generator(device="cpu").manual_seed(7)
    depth, num_slots = runner.config.max_depth, runner.config.max_slots
    for n in (1, 2, 3, 5, 8):
        rng = random.Random(n)
        runner.state[:8] = torch.randn(8, runner.state.shape[1], generator=gen, dtype=torch.float64).to(runner.state)
        minimum = [rng.randint(1, depth) for _ in range(8)]
        cursors.loop_limits[:8, MIN_LOOPS] = torch.tensor(minimum)
        cursors.loop_limits[:8, MAX_LOOPS] = torch.tensor([rng.randint(m, depth) for m in minimum])
        cursors.exit_values[:8, THRESHOLD] = torch.tensor([rng.choice([0.3, 0.6, 0.9, 1.0]) for _ in range(8)],
                                                          dtype=torch.float64)
        cursors.exit_values[:8, EXIT_STATE] = torch.rand(8, generator=gen, dtype=torch.float64)
        slots = np.array(rng.sample(range(8), n), dtype=np.int64)
        positions = np.array([rng.randint(0, 40) for _ in range(n)], dtype=np.int64)
        depths = np.array([rng.randint(1, depth) for _ in range(n)], dtype=np.int64)
        before = cursors.exit_values.clone()
        staged = graphs.stage(slots, positions, depths)
        assert staged is not None and staged.key[0] >= n
        graphed_exits = graphs.exits.replay(exit_test, staged).cpu()
        graphed_values = cursors.exit_values[:num_slots].clone()  # the dummy slot's row after them: not compared
        cursors.exit_values.copy_(before)
        device_slots, device_positions, device_depths = runner.upload(slots, positions, depths)
        eager_exits = test.apply(runner, device_slots, device_positions, device_depths, graphs.max_width, None).cpu()
        assert torch.equal(graphed_exits, eager_exits), (n, graphed_exits, eager_exits)
        # The graph's gate product runs at the bucket's row count, and the BLAS may sum a row in
        # another order there (1.1e-16 in float64 on an AMD EPYC VM); the slots the pass did not run
        # stay as they were bit for bit (below).
        eps = torch.finfo(graphed_values.dtype).eps
        torch.testing.assert_close(graphed_values, cursors.exit_values[:num_slots], rtol=0, atol=4 * eps,
                                   msg=lambda e, n=n: f"{n} rows: {e}")
        untouched = np.setdiff1d(np.arange(num_slots), slots)
        assert torch.equal(graphed_values[untouched].cpu(), before[untouched].cpu()), n
        assert graphed_exits.any() and not graphed_exits.all() or n < 5, (n, graphed_exits)  # both decisions occur


@pytest.mark.parametrize("mode", ["ouro", "ouro_delayed"])
def test_graphed_test_equals_eager_with_padding(mode: str) -> None:
    """check_graphed_test_equals_eager on emulated graphs (float64): padding rows disturb no slot."""
    with make_llm("toy-ouro", exit_mode=mode, max_num_seqs=8) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True)
        check_graphed_test_equals_eager(runner, ExitTest[mode.upper()])
