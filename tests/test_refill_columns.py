"""TritonColumnSteps (rlt_worker/kernels/refill_columns.py) against device_refill.ColumnSteps' torch ops.

CPU: in Triton's interpreter (one child process, as test_fused_ops.py): from random bucket states
(running and stopped rows, padding rows on the dummy slot, rows exiting or not, stop tokens, last
outputs, next positions with and without a block, counts up to the spare column), both steps leave
every column, output, logprob, boundary slot and the flags (any row running, rows ended) exactly as
the torch ops do; also a bucket where no row runs after the step. GPU (marked gpu): the compiled
kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import interp
import pytest
import torch

from rlt_worker import device_refill as dr
from rlt_worker.attention import triton_backend as tb
from rlt_worker.device_refill import ColumnSteps, RefillBuffers, column_steps

pytestmark = [pytest.mark.skipif(tb.triton is None, reason="Triton is not installed"), pytest.mark.timeout(300)]

DUMMY = 40


def _state(rows: int, seed: int, device: str, all_end: bool = False) -> tuple[RefillBuffers, dict[str, torch.Tensor]]:
    """A bucket mid-plan: rows ≥ rows·3/4 are padding (dummy slot, not running)."""
    gen = torch.Generator().manual_seed(seed)

    def ints(low: int, high: int) -> torch.Tensor:
        return torch.randint(low, high, (rows,), generator=gen)

    b = RefillBuffers(rows, torch.device(device))
    c = torch.zeros_like(b.columns, device="cpu")
    padding = torch.arange(rows) >= max(1, rows * 3 // 4)
    c[dr.SLOTS] = torch.where(padding, DUMMY, ints(0, DUMMY))
    c[dr.POSITIONS] = ints(0, 60)
    c[dr.DEPTHS] = ints(0, 4)
    c[dr.INDICES] = ints(0, 9)
    c[dr.LAST] = torch.where(ints(0, 3) == 0, c[dr.INDICES], c[dr.INDICES] + ints(1, 5))  # some at their last
    c[dr.COVERED] = c[dr.POSITIONS] + ints(0, 3)  # 0 / 1: the next position has no block
    c[dr.RUNNING] = (ints(0, 4) > 0) & ~padding
    c[dr.FINISHED] = (c[dr.RUNNING] == 0) & (ints(0, 2) > 0) & ~padding
    c[dr.SEEDS] = ints(0, 1 << 30)
    c[dr.COUNT] = torch.where(ints(0, 4) == 0, dr.MAX_PASSES - 1, ints(0, dr.MAX_PASSES - 1))
    if all_end:
        c[dr.LAST] = c[dr.INDICES]
    b.columns.copy_(c.to(device))
    b.outputs.copy_(torch.randint(0, 100, b.outputs.shape, generator=gen).to(device))
    b.logprobs.copy_(torch.randn(b.logprobs.shape, generator=gen, dtype=torch.float64).to(device))
    exits = ((ints(0, 3) > 0) | torch.tensor(all_end)) & (c[dr.RUNNING] > 0)
    inputs = {"exits": exits, "tokens": ints(0, 1000), "stops": ints(0, 5) == 0,
              "logprobs": torch.randn(rows, generator=gen, dtype=torch.float64),
              "index": torch.randint(0, 9, (3, rows), generator=gen)}
    return b, {k: v.to(device) for k, v in inputs.items()}


def _run(steps: ColumnSteps, b: RefillBuffers, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    index = inputs["index"].clone()
    steps.pass_rows(b.columns, index, DUMMY)
    after_pass = b.columns.clone()
    steps.after_sample(b, inputs["exits"], inputs["tokens"], inputs["logprobs"], inputs["stops"], DUMMY)
    return {"index": index, "after_pass": after_pass, "columns": b.columns, "outputs": b.outputs,
            "logprobs": b.logprobs, "boundary_slots": b.boundary_slots, "flags": b.flags}


def check_steps(rows: int, seed: int, device: str = "cpu", all_end: bool = False) -> None:
    from rlt_worker.kernels.refill_columns import TritonColumnSteps

    want = _run(ColumnSteps(), *_state(rows, seed, device, all_end))
    got = _run(TritonColumnSteps(), *_state(rows, seed, device, all_end))
    for name, value in want.items():
        assert torch.equal(got[name], value), (name, got[name], value)
    if all_end:
        assert not bool(want["flags"][dr.ALIVE])
    elif rows >= 8:  # the random state reaches every branch
        c = want["columns"]
        assert (c[dr.FINISHED] > 0).any() and (c[dr.RUNNING] > 0).any() and (c[dr.DEPTHS] == 0).any()


INTERP_CASES: dict[str, Callable[[], None]] = {
    **{f"steps-{rows}-{seed}": functools.partial(check_steps, rows, seed) for rows in (8, 20, 64) for seed in (1, 2)},
    "steps-none-left-running": functools.partial(check_steps, 16, 3, all_end=True),
}


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter_matches_torch(interp_verdicts: dict[str, str], case: str) -> None:
    """Each interpreter case (see INTERP_CASES) passed in the child."""
    verdict = interp_verdicts[case]
    assert verdict == "ok", verdict


def test_the_triton_steps_run_on_cuda_with_the_triton_backend_only() -> None:
    assert type(column_steps(torch.device("cpu"), "triton")) is ColumnSteps
    assert type(column_steps(torch.device("cuda"), "torch")) is ColumnSteps
    assert type(column_steps(torch.device("cuda"), "triton")).__name__ == "TritonColumnSteps"


@pytest.mark.gpu
@interp.needs_cuda
@pytest.mark.parametrize("rows", [1, 32, 160])
def test_gpu_steps_equal_torch(rows: int) -> None:
    check_steps(rows, 5, device="cuda")
    check_steps(rows, 6, device="cuda", all_end=True)


if __name__ == "__main__":
    interp.main(INTERP_CASES)
