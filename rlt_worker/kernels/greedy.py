"""Greedy sampling on CUDA in two launches: the argmax of each row's logits and its float64 logprob.

The sampler's torch path for an all-greedy batch casts the [N, V] logits to float64, takes the
argmax, and gathers log_softmax at it. On the H200 at 1 row and V = 49,152, log_softmax takes 28 µs
and the argmax 14 (one block per row each; docs/benchmarks/h200-ouro-gap-4aa2626.json), paid at
every pass of device refill. Here:

    partials   program (row, part) over columns [part·chunk, (part + 1)·chunk): in float64 the
               part's max m, the lowest column holding it, and s = Σ exp(x − m)
    combine    program row: M = max m; the token is the lowest column among the parts whose m = M;
               logprob = x[token] − M − log(Σ s·exp(m − M))

The token is exactly torch's argmax (lowest index on ties). The logprob is torch's formula,
x − max − log(Σ exp(x − max)), with the sum taken in parts and rescaled, so it can differ from
torch's in the last bits of float64. Exact equality is asserted only in the CPU float64 suites
(SPEC §7a), which keep the torch path (`rlt_worker.sampler.torch_greedy`); the runner picks this
one on CUDA.
"""

from __future__ import annotations

import torch

from rlt_worker.attention.triton_backend import _kernel, tl, triton

__all__ = ["PARTS", "triton_greedy"]

PARTS = 16  # programs per row in the first launch: V = 49,152 gives parts of 3,072 columns


def _partials_kernel(x_ptr, stride_x, n_cols, chunk, m_ptr, i_ptr, s_ptr, BLOCK: tl.constexpr):
    """Row, part: the part's max, its lowest column, and Σ exp(x − max), all float64."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * chunk + tl.arange(0, BLOCK)
    ok = (cols < n_cols) & (tl.arange(0, BLOCK) < chunk)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float64)
    m = tl.max(x, axis=0)
    first = tl.min(tl.where(ok & (x == m), cols, n_cols), axis=0)
    s = tl.sum(tl.where(ok, tl.exp(x - m), 0.0), axis=0)
    out = row * tl.num_programs(1) + part
    tl.store(m_ptr + out, m)
    tl.store(i_ptr + out, first)
    tl.store(s_ptr + out, s)


def _combine_kernel(x_ptr, stride_x, m_ptr, i_ptr, s_ptr, token_ptr, logprob_ptr, n_cols,
                    PARTS: tl.constexpr):
    """Row: the parts merged in order into the token and its logprob."""
    row = tl.program_id(0).to(tl.int64)
    parts = row * PARTS + tl.arange(0, PARTS)
    m = tl.load(m_ptr + parts)
    top = tl.max(m, axis=0)
    token = tl.min(tl.where(m == top, tl.load(i_ptr + parts), n_cols), axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, tl.load(s_ptr + parts) * tl.exp(m - top)), axis=0)
    x = tl.load(x_ptr + row * stride_x + token).to(tl.float64)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, x - top - tl.log(total))


def triton_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [N], logprobs float64 [N]) of logits [N, V] (any float dtype, unit column stride)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with unit column stride, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float64, device=logits.device)
    if rows == 0:
        return tokens, logprobs
    chunk = triton.cdiv(vocab, PARTS)
    m = torch.empty(rows, PARTS, dtype=torch.float64, device=logits.device)
    first = torch.empty(rows, PARTS, dtype=torch.int64, device=logits.device)
    s = torch.empty_like(m)
    _kernel(_partials_kernel)[(rows, PARTS)](logits, logits.stride(0), vocab, chunk, m, first, s,
                                             BLOCK=triton.next_power_of_2(chunk), num_warps=8)
    _kernel(_combine_kernel)[(rows,)](logits, logits.stride(0), m, first, s, tokens, logprobs, vocab,
                                      PARTS=PARTS, num_warps=1)
    return tokens, logprobs
