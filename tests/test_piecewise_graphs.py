"""Loop passes in graph pieces around eager attention (rlt_worker/piecewise_graphs.py), on the CPU:

- the token buckets (a pure function);
- the pieces' function, emulated (static buffers, padding rows, attention cut out and run on the
  pass's context over the real rows), equals model.loop on the same rows in float64 (bit for bit
  without padding rows), for a stacked context (slot rows and a prompt chunk) with the torch and the
  fused Ouro loop;
- a failed capture leaves the other graphs on, and those passes run eagerly, still exact.

The end-to-end cases (mixed batches against separate passes and the reference, pipelined plans, the
Triton kernels in the interpreter) are in tests/test_mixed_batches.py.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import interp
import pytest
import torch
from factories import assert_matches_reference, make_llm, make_workload, run_workload

from rlt_engine.config import EngineConfig
from rlt_worker.piecewise_graphs import piece_buckets

pytestmark = pytest.mark.usefixtures("single_thread")


def test_piece_buckets() -> None:
    assert piece_buckets(2048)[:7] == (16, 32, 64, 128, 256, 512, 576)
    assert piece_buckets(2048)[-2:] == (1984, 2048) and len(piece_buckets(2048)) == 6 + 24
    assert piece_buckets(24) == (16, 24)  # ends at the budget itself
    assert piece_buckets(16) == (16,)


def test_mixed_graph_option() -> None:
    """Captured with the other graphs when mixed batches are on, on CUDA with the Triton backend."""
    on = EngineConfig(device="cuda", mixed_batches=True).resolved()
    assert on.worker_config("cuda").mixed_graphs
    assert not EngineConfig(device="cuda").resolved().worker_config("cuda").mixed_graphs
    assert not EngineConfig(device="cuda", mixed_batches=True, cuda_graphs=False).resolved().worker_config(
        "cuda").mixed_graphs
    assert not EngineConfig(device="cpu", mixed_batches=True).resolved().worker_config("cpu").mixed_graphs


def pieces_against_the_loop(fused: bool, chunk_rows: int) -> None:
    """One stacked pass (2 slot rows, a prompt chunk) through the emulated pieces of bucket 16 equals the
    loop over the same rows, and writes the same K/V: bit for bit when the rows fill the bucket; with
    padding rows the GEMMs have 16 rows instead of 7, which may change BLAS's kernel and its rounding
    (within 1e-13 here). The fused loop runs Triton kernels: in the interpreter, below."""
    from rlt_worker.models.ouro_fused import with_fused_layers
    from rlt_worker.paged_context import StackedContext

    jobs = make_workload(random.Random("pieces"), 2, depth=4, exit_mode="fixed", threshold=None, sampling=("greedy",),
                         max_prompt_len=12, max_tokens=2)
    backend = "triton" if fused else "torch"
    with make_llm("toy-ouro", exit_mode="fixed", max_num_seqs=4, prefill_chunk_size=8, max_num_batched_tokens=32,
                  attention_backend=backend) as llm:
        run_workload(llm, jobs)  # K/V to attend to in the slots' blocks
        runner = llm.engine.executor._worker.runner
        if fused:
            runner.model = with_fused_layers(runner.model)
        runner.use_pass_graphs(emulate=True, mixed=True)
        slots, positions, depths = torch.tensor([0, 1]), torch.tensor([5, 9]), torch.tensor([1, 3])
        chunk = torch.arange(chunk_rows)
        parts = [(runner.context(slots, positions, depths, 1), 2),
                 (runner.context(torch.full_like(chunk, 2), chunk, torch.full_like(chunk, 2), 1), chunk_rows)]
        gen = torch.Generator().manual_seed(0)
        state = torch.randn(2 + chunk_rows, runner.state.shape[1], generator=gen, dtype=runner.state.dtype)
        embedded = torch.randn(state.shape, generator=gen, dtype=state.dtype)
        rows_positions = torch.cat([positions, chunk])
        pool = runner.storage.pool
        before = pool.clone()
        eager = runner.model.loop(state, embedded, rows_positions, StackedContext(parts))
        written, pool[:] = pool.clone(), before
        pieces = runner.loop_rows(state, embedded, rows_positions, StackedContext(parts))
        stats = runner.graph_stats
    assert stats["piece_replays"] == 1 and stats["piece_padded_rows"] == 16 - len(state), stats
    if len(state) == 16:
        assert torch.equal(pieces, eager) and torch.equal(pool, written)
    else:
        assert torch.allclose(pieces, eager, rtol=0, atol=1e-13) and torch.allclose(pool, written, rtol=0, atol=1e-13)
    assert not torch.equal(written, before)  # the pass wrote K/V


@pytest.mark.parametrize("chunk_rows", [14, 5], ids=["whole-bucket", "padded"])
def test_pieces_equal_the_loop(chunk_rows: int) -> None:
    pieces_against_the_loop(fused=False, chunk_rows=chunk_rows)


def test_failed_piece_capture_keeps_the_other_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = make_workload(random.Random("pieces-fail"), 6, depth=4, exit_mode="trace", threshold=None,
                         sampling=("greedy",), max_prompt_len=30, max_tokens=8, spread=2)
    with make_llm("toy-ouro", exit_mode="trace", max_num_seqs=4, prefill_chunk_size=8, mixed_batches=True,
                  max_num_batched_tokens=24) as llm:
        runner = llm.engine.executor._worker.runner
        runner.use_pass_graphs(emulate=True, mixed=True)

        def capture_pieces(warm_up, fn):
            raise RuntimeError("CUDA out of memory (simulated)")

        monkeypatch.setattr(runner._graphs, "capture_pieces", capture_pieces)
        run = run_workload(llm, jobs)
        stats = runner.graph_stats
    assert_matches_reference(run, "toy-ouro", kv_layout="last_exited", exit_mode="trace")
    assert "simulated" in stats["piece_error"] and stats["error"] is None, stats
    assert stats["piece_replays"] == 0 and stats["piece_eager"] >= stats["mixed_passes"] > 0 and stats["replays"] > 0


# ---- the fused loop's Triton kernels (interpreter, in a child process) ---------------------------------

INTERP_CASES: dict[str, Callable[[], None]] = {
    f"fused-{name}": functools.partial(pieces_against_the_loop, True, rows) for name, rows in (("whole-bucket", 14),
                                                                                             ("padded", 5))}


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter_pieces(interp_verdicts: dict[str, str], case: str) -> None:
    verdict = interp_verdicts[case]
    assert verdict == "ok", verdict


if __name__ == "__main__":
    interp.main(INTERP_CASES)
