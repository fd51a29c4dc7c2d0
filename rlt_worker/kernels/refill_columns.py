"""A device-refill pass's bookkeeping in one launch per step (CUDA): device_refill.ColumnSteps' ops.

At one row a pass is about 1.6 ms of GPU time, and its bookkeeping in torch ops was some 35 launches
of a few rows each (wheres, index puts, compares, the any), each a kernel of ~1.5 µs plus its gap in
the graph (docs/benchmarks.md, session of 2026-12-04). Here each step is one program over the
bucket's rows (R ≤ the largest rows bucket, one tile):

    pass_rows      running rows one loop deeper; the loop's static rows (slots, positions, depths)
                   for the running rows, the dummy slot for the others
    after_sample   outputs recorded at each exited row's count (the others write the spare column),
                   ends (last output or stop token), the next position of the going rows at depth
                   0, FINISHED, RUNNING (stopped where the next position has no block), the
                   boundary's slot rows and `flags` (any row running, rows ended)

Integer and copy work only, so the results are ColumnSteps' exactly (tests/test_refill_columns.py
checks every column under TRITON_INTERPRET=1). bool tensors are read and written as uint8 views.
"""

from __future__ import annotations

import torch

from rlt_worker.attention.triton_backend import _kernel, tl, triton
from rlt_worker.device_refill import (
    COUNT,
    COVERED,
    DEPTHS,
    FINISHED,
    INDICES,
    LAST,
    MAX_PASSES,
    POSITIONS,
    RUNNING,
    SLOTS,
    ColumnSteps,
    RefillBuffers,
)

__all__ = ["TritonColumnSteps"]

# Column rows as compile-time constants of the kernels (Triton reads only constexpr globals).
_SLOTS, _POSITIONS, _DEPTHS, _INDICES = (tl.constexpr(v) for v in (SLOTS, POSITIONS, DEPTHS, INDICES))
_LAST, _COVERED, _RUNNING, _FINISHED, _COUNT = (tl.constexpr(v) for v in (LAST, COVERED, RUNNING, FINISHED, COUNT))


def _pass_rows_kernel(c_ptr, stride_c, index_ptr, stride_i, n, dummy, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    ok = r < n
    running = tl.load(c_ptr + _RUNNING * stride_c + r, mask=ok, other=0) > 0
    slots = tl.load(c_ptr + _SLOTS * stride_c + r, mask=ok, other=0)
    positions = tl.load(c_ptr + _POSITIONS * stride_c + r, mask=ok, other=0)
    depths = tl.load(c_ptr + _DEPTHS * stride_c + r, mask=ok, other=0) + running.to(tl.int64)
    tl.store(c_ptr + _DEPTHS * stride_c + r, depths, mask=ok)
    tl.store(index_ptr + r, tl.where(running, slots, dummy), mask=ok)
    tl.store(index_ptr + stride_i + r, tl.where(running, positions, 0), mask=ok)
    tl.store(index_ptr + 2 * stride_i + r, tl.where(running, depths, 1), mask=ok)


def _after_sample_kernel(c_ptr, stride_c, exits_ptr, tokens_ptr, logprobs_ptr, stops_ptr,
                         out_ptr, stride_ok, stride_or, lp_ptr, stride_lr, bslots_ptr, stride_b, flags_ptr,
                         n, dummy, SPARE: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    ok = r < n
    running = tl.load(c_ptr + _RUNNING * stride_c + r, mask=ok, other=0) > 0
    slots = tl.load(c_ptr + _SLOTS * stride_c + r, mask=ok, other=0)
    positions = tl.load(c_ptr + _POSITIONS * stride_c + r, mask=ok, other=0)
    depths = tl.load(c_ptr + _DEPTHS * stride_c + r, mask=ok, other=0)
    indices = tl.load(c_ptr + _INDICES * stride_c + r, mask=ok, other=0)
    last = tl.load(c_ptr + _LAST * stride_c + r, mask=ok, other=0)
    covered = tl.load(c_ptr + _COVERED * stride_c + r, mask=ok, other=0)
    finished = tl.load(c_ptr + _FINISHED * stride_c + r, mask=ok, other=0)
    count = tl.load(c_ptr + _COUNT * stride_c + r, mask=ok, other=0)
    exits = tl.load(exits_ptr + r, mask=ok, other=0) != 0
    stops = tl.load(stops_ptr + r, mask=ok, other=0) != 0
    tokens = tl.load(tokens_ptr + r, mask=ok, other=0)
    logprobs = tl.load(logprobs_ptr + r, mask=ok, other=0.0)

    at = tl.where(exits, count, SPARE)
    tl.store(out_ptr + r * stride_or + at, tokens, mask=ok)
    tl.store(out_ptr + stride_ok + r * stride_or + at, depths, mask=ok)
    tl.store(lp_ptr + r * stride_lr + at, logprobs, mask=ok)
    tl.store(c_ptr + _COUNT * stride_c + r, count + exits.to(tl.int64), mask=ok)
    ends = exits & ((indices == last) | stops)
    going = exits & (ends == 0)
    tl.store(bslots_ptr + r, tl.where(exits, slots, dummy), mask=ok)
    tl.store(bslots_ptr + stride_b + r, tl.where(going, slots, dummy), mask=ok)
    positions += going.to(tl.int64)
    indices += going.to(tl.int64)
    tl.store(c_ptr + _POSITIONS * stride_c + r, positions, mask=ok)
    tl.store(c_ptr + _INDICES * stride_c + r, indices, mask=ok)
    tl.store(c_ptr + _DEPTHS * stride_c + r, tl.where(going, 0, depths), mask=ok)
    completable = (positions + 1 < covered) | (indices == last)
    tl.store(c_ptr + _FINISHED * stride_c + r, tl.where(ends, 1, finished), mask=ok)
    still = running & (ends == 0) & ((going & (completable == 0)) == 0)
    tl.store(c_ptr + _RUNNING * stride_c + r, still.to(tl.int64), mask=ok)
    tl.store(flags_ptr, tl.max(tl.where(ok & still, 1, 0), axis=0).to(tl.int64))
    tl.store(flags_ptr + 1, tl.sum(tl.where(ok & ends, 1, 0), axis=0).to(tl.int64))


def _one_tile(columns: torch.Tensor) -> tuple[int, int]:
    """(rows, the tile that holds them): the kernels run one program over a bucket's rows."""
    if columns.dtype != torch.long or columns.stride(1) != 1:
        raise ValueError(f"columns must be int64 with unit row stride, got {columns.dtype} {columns.stride()}")
    n = columns.shape[1]
    return n, triton.next_power_of_2(max(n, 16))


class TritonColumnSteps(ColumnSteps):
    """ColumnSteps' two steps, one launch each (module docstring)."""

    @staticmethod
    def pass_rows(c: torch.Tensor, index: torch.Tensor, dummy: int) -> None:
        n, block = _one_tile(c)
        if index.shape != (3, n) or index.stride(1) != 1:
            raise ValueError(f"index must be [3, {n}] with unit row stride, got {tuple(index.shape)}")
        _kernel(_pass_rows_kernel)[(1,)](c, c.stride(0), index, index.stride(0), n, dummy, BLOCK=block,
                                         num_warps=1)

    @staticmethod
    def after_sample(b: RefillBuffers, exits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
                     stops: torch.Tensor, dummy: int) -> None:
        c, out, lp, slots = b.columns, b.outputs, b.logprobs, b.boundary_slots
        n, block = _one_tile(c)
        for name, t in (("exits", exits), ("tokens", tokens), ("logprobs", logprobs), ("stops", stops)):
            if t.shape != (n,) or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous [{n}], got {tuple(t.shape)}")
        _kernel(_after_sample_kernel)[(1,)](
            c, c.stride(0), exits.view(torch.uint8), tokens, logprobs, stops.view(torch.uint8),
            out, out.stride(0), out.stride(1), lp, lp.stride(0), slots, slots.stride(0), b.flags,
            n, dummy, SPARE=MAX_PASSES, BLOCK=block, num_warps=4)
