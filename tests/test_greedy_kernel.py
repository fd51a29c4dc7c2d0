"""triton_greedy (rlt_worker/kernels/greedy.py) against the sampler's torch rule, torch_greedy.

CPU: in Triton's interpreter (one child process, as test_fused_ops.py): the tokens equal torch's
argmax exactly, ties included (the lowest column wins, within a part and across parts), and the
logprobs equal log_softmax at the token to float64 rounding (the sum is taken in parts and
rescaled: 1e-12 relative); float32 and float64 logits, vocabularies that do and do not split
evenly into the parts, 1 and 5 rows, a row-strided view.

GPU (marked gpu): the compiled kernels on bf16 and float32 logits of the real vocabulary (49,152).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import interp
import pytest
import torch

from rlt_worker.attention import triton_backend as tb
from rlt_worker.sampler import torch_greedy

pytestmark = [pytest.mark.skipif(tb.triton is None, reason="Triton is not installed"), pytest.mark.timeout(300)]


def _logits(rows: int, vocab: int, dtype: torch.dtype, device: str, ties: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * vocab)
    wide = (4 * torch.randn(rows, vocab + 5, generator=gen, dtype=torch.float64)).to(dtype)
    logits = wide[:, 2 : 2 + vocab]  # a row-strided view: the kernels read the row stride
    if ties:
        from rlt_worker.kernels.greedy import PARTS

        chunk = -(-vocab // PARTS)
        top = logits.max() + 1
        logits[0, [chunk + 3, 2 * chunk + 1]] = top  # across parts: the earlier part's column wins
        if rows > 1:
            logits[-1, [vocab - 2, vocab - 1]] = top  # within the last part
    return logits.to(device)


def check_greedy(dtype: torch.dtype, rows: int, vocab: int, ties: bool = False, device: str = "cpu") -> None:
    from rlt_worker.kernels.greedy import triton_greedy

    logits = _logits(rows, vocab, dtype, device, ties)
    tokens, logprobs = triton_greedy(logits)
    want_tokens, want_logprobs = torch_greedy(logits)
    assert torch.equal(tokens, want_tokens), (tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-12, atol=1e-12)
    if ties:
        chunk = -(-vocab // 16)
        assert int(tokens[0]) == chunk + 3 and (rows == 1 or int(tokens[-1]) == vocab - 2)


INTERP_CASES: dict[str, Callable[[], None]] = {
    **{f"greedy-{str(d)[6:]}-{rows}x{vocab}": functools.partial(check_greedy, d, rows, vocab)
       for d in (torch.float32, torch.float64) for rows, vocab in ((1, 256), (5, 1000), (3, 4099))},
    "greedy-ties-float32": functools.partial(check_greedy, torch.float32, 3, 1000, True),
    "greedy-ties-float64": functools.partial(check_greedy, torch.float64, 2, 4099, True),
}


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter_matches_torch(interp_verdicts: dict[str, str], case: str) -> None:
    """Each interpreter case (see INTERP_CASES) passed in the child."""
    verdict = interp_verdicts[case]
    assert verdict == "ok", verdict


def test_the_runner_picks_triton_on_cuda_with_the_triton_backend_only() -> None:
    from rlt_worker.model_runner import sampling_kernels
    from rlt_worker.sampler import TORCH_KERNELS

    assert sampling_kernels(torch.device("cpu"), "triton") is TORCH_KERNELS
    assert sampling_kernels(torch.device("cuda"), "torch") is TORCH_KERNELS
    kernels = sampling_kernels(torch.device("cuda"), "triton")
    assert (kernels.greedy.__name__, kernels.noise.__name__) == ("triton_greedy", "triton_uniform")


@pytest.mark.gpu
@interp.needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 32])
def test_gpu_greedy_at_the_real_vocabulary(dtype: torch.dtype, rows: int) -> None:
    check_greedy(dtype, rows, 49152, device="cuda")
    check_greedy(dtype, rows, 49152, ties=True, device="cuda")


if __name__ == "__main__":
    interp.main(INTERP_CASES)
