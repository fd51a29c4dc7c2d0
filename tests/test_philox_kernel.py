"""triton_uniform (rlt_worker/kernels/philox_uniform.py) against the torch Philox, philox.uniform.

CPU: in Triton's interpreter (one child process, as test_greedy_kernel.py): the uniforms equal
the torch path's bit for bit: seeds at 0, 2^63 - 1, at and above 2^63 and 2^64 - 1; Philox indices
past 2^32 and -1; both purposes; draw lengths that are and are not a multiple of 4 and that span
one or several programs; a strided index. And `sample` with the Triton noise gives the torch rules'
tokens and logprobs exactly (temperature, top-k and top-p rows, a greedy row among them).

GPU (marked gpu): the compiled kernel at the real vocabulary (49,152), 1 and 32 rows, against the
torch path on the same device and on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import interp
import pytest
import torch

from rlt_worker.attention import triton_backend as tb
from rlt_worker.philox import PURPOSE_SAMPLE, PURPOSE_STATE_INIT, seed_to_int64, uniform
from rlt_worker.sampler import SamplingKernels, SamplingKind, SamplingTensors, sample

pytestmark = [pytest.mark.skipif(tb.triton is None, reason="Triton is not installed"), pytest.mark.timeout(300)]

SEEDS = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]
INDICES = [0, 5, 2**32 + 7, -1, 99, 2**31]


def check_uniform(rows: int, purpose: int, num_elements: int, device: str = "cpu") -> None:
    from rlt_worker.kernels.philox_uniform import triton_uniform

    seeds = torch.tensor([seed_to_int64(SEEDS[r % len(SEEDS)]) for r in range(rows)], device=device)
    wide = torch.tensor([INDICES[r % len(INDICES)] for r in range(2 * rows)], device=device)
    index = wide[::2]  # strided: the kernel reads a contiguous copy
    got = triton_uniform(seeds, purpose, index, num_elements)
    want = uniform(seeds, purpose, index, num_elements)
    assert got.dtype == torch.float64 and got.shape == (rows, num_elements)
    assert torch.equal(got, want), (got - want).abs().max()
    if device != "cpu":
        assert torch.equal(got.cpu(), uniform(seeds.cpu(), purpose, index.cpu(), num_elements))


def check_sample(device: str = "cpu") -> None:
    from rlt_worker.kernels.philox_uniform import triton_uniform

    gen = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(6, 1000, generator=gen, dtype=torch.float64)).to(device)
    params = SamplingTensors.build([0.7, 1.0, 0.0, 1.3, 1.0, 0.5], [-1, 20, -1, 5, -1, 100],
                                   [1.0, 1.0, 1.0, 0.9, 0.8, 0.95], SEEDS, [0, 1, 2, 3, 4, 2**33], device=device)
    want = sample(logits, params, SamplingKind.FILTERED)
    got = sample(logits, params, SamplingKind.FILTERED, kernels=SamplingKernels(noise=triton_uniform))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def check_mismatched_lengths() -> None:
    from rlt_worker.kernels.philox_uniform import triton_uniform

    with pytest.raises(ValueError, match="one Philox index a seed"):
        triton_uniform(torch.zeros(3, dtype=torch.int64), PURPOSE_SAMPLE, torch.zeros(2, dtype=torch.int64), 8)


INTERP_CASES: dict[str, Callable[[], None]] = {
    **{f"uniform-{rows}x{e}-purpose{p}": functools.partial(check_uniform, rows, p, e)
       for rows, e in ((1, 1), (6, 5), (6, 2048), (3, 4099), (2, 49152)) for p in (PURPOSE_SAMPLE, PURPOSE_STATE_INIT)},
    "uniform-no-rows": functools.partial(check_uniform, 0, PURPOSE_SAMPLE, 7),
    "sample-with-triton-noise": check_sample,
    "mismatched-lengths": check_mismatched_lengths,
}


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter_matches_torch(interp_verdicts: dict[str, str], case: str) -> None:
    """Each interpreter case (see INTERP_CASES) passed in the child."""
    verdict = interp_verdicts[case]
    assert verdict == "ok", verdict


@pytest.mark.gpu
@interp.needs_cuda
@pytest.mark.parametrize("rows", [1, 32])
def test_gpu_uniform_at_the_real_vocabulary(rows: int) -> None:
    check_uniform(rows, PURPOSE_SAMPLE, 49152, device="cuda")
    check_sample(device="cuda")


if __name__ == "__main__":
    interp.main(INTERP_CASES)
