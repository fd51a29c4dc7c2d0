"""y = x·Wᵀ for a few rows of x in Triton: the decode pass's projections at the HBM floor.

With one to a few rows, a projection is a read of W (102.7 MB per Ouro-1.4B layer set) and almost no
arithmetic, so the kernel is laid out for bandwidth alone:

    x [M, K] (few rows), W [N, K] row-major (the nn.Linear weight), y [M, N]
    grid = (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))
    program (j, i): output columns [j·BLOCK_N, (j+1)·BLOCK_N) of rows [i·BLOCK_M, (i+1)·BLOCK_M);
        streams its BLOCK_N rows of W along K in [BLOCK_N, BLOCK_K] tiles (contiguous along K)
        and multiplies each by the x tile [BLOCK_M, BLOCK_K], either
        multiply-add (1–3 rows, float64): into a [BLOCK_M, BLOCK_N, BLOCK_K] accumulator,
            reduced over K once at the end (no cross-thread reduction inside the loop), or
        tl.dot (4+ rows): x padded to 16 rows, into a [BLOCK_M, BLOCK_N] fp32 accumulator
            (input_precision "ieee" for float32: exact fp32 products, no tf32).

Every byte of W is read once when M ≤ BLOCK_M (x's rows are tiny and come from L2); there is no
split-K, so a result depends on the shapes and block sizes only, never on scheduling. Small
BLOCK_N gives enough programs to fill the GPU (N = 2048 at BLOCK_N 8: 256 programs over 132 SMs).
Columns past N (and rows past M) are clamped to the last one instead of masked, so loads are
unmasked unless K is not a multiple of BLOCK_K; their results are never stored.

Precision: products and sums in fp32 (fp64 for float64, the CPU oracle dtype, multiply-add
only), the result rounded once to x's dtype. The sum runs in another order than cuBLAS's, so
float32 agrees with F.linear to fp32 rounding, not bit for bit.

Jitted on first use through triton_backend._kernel: importing this module needs no CUDA.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlt_worker.attention.triton_backend import _check_device, _interpreting, _kernel, tl, triton

__all__ = ["GemvConfig", "RowBoundLinear", "default_config", "gemv"]


def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, F64: tl.constexpr,
):
    """Columns tile j, rows tile i: y[rows, cols] = Σ_k x[rows, k]·W[cols, k]."""
    cdt = tl.float64 if F64 else tl.float32
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    # Program ids and strides are int32: the row offsets are formed in int64 (W alone is > 2^31 bytes at scale).
    w_rows = tl.minimum(cols, N - 1).to(tl.int64)
    x_rows = tl.minimum(rows, M - 1).to(tl.int64)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + ks[None, :]
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + ks[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=cdt)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            x = tl.load(x_ptrs + k0)
        else:
            k_ok = (k0 + ks) < K
            w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs + k0, mask=k_ok[None, :], other=0.0)
        if USE_DOT:
            if UPCAST_DOT:  # the interpreter's tl.dot multiplies bf16's raw bits: fp32 holds them exactly
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:
            acc += x.to(cdt)[:, None, :] * w.to(cdt)[None, :, :]
    y = acc if USE_DOT else tl.sum(acc, axis=2)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    dst = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(dst, y.to(y_ptr.dtype.element_ty), mask=ok)


class GemvConfig(NamedTuple):
    """Launch parameters of one gemv call (block sizes are powers of two; tl.dot needs each ≥ 16)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    use_dot: bool = False


# Rows from which the default runs tl.dot (a [16+, BLOCK_K] x tile, padded): below it the
# multiply-add accumulator is small enough, and BLOCK_N 8 gives twice the programs.
DOT_MIN_ROWS = 4


def default_config(num_rows: int, k: int, dtype: torch.dtype) -> GemvConfig:
    """Block sizes for x [num_rows, k] of `dtype`. Multiply-add (few rows, and float64): all rows in
    one tile, BLOCK_N 8 (N = 2048: 256 programs), the accumulator BLOCK_M·BLOCK_N·BLOCK_K near 8K
    elements (~64 fp32 registers a thread at 4 warps). tl.dot: 16 × 16 output tiles (up to 64 rows
    in one tile), BLOCK_K 256."""
    if num_rows >= DOT_MIN_ROWS and dtype != torch.float64:
        return GemvConfig(max(16, min(triton.next_power_of_2(num_rows), 64)), 16, 256, use_dot=True)
    block_m = min(triton.next_power_of_2(max(num_rows, 1)), 16)
    block_k = max(32, min(512, 8192 // (block_m * 8), triton.next_power_of_2(k)))
    return GemvConfig(block_m, 8, block_k)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """x·weightᵀ [M, N] of x [M, K] (unit column stride, any row stride) and weight [N, K] (row-major),
    in x's dtype, accumulated in fp32 (fp64 for float64). One launch, no host synchronization."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv needs unit column strides, got x {x.stride()} and weight {weight.stride()}")
    if x.dtype != weight.dtype:
        raise ValueError(f"gemv needs one dtype, got x {x.dtype} and weight {weight.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    cfg = config or default_config(m, k, x.dtype)
    if cfg.use_dot and (min(cfg.block_m, cfg.block_n, cfg.block_k) < 16 or x.dtype == torch.float64):
        raise ValueError(f"gemv: tl.dot needs blocks ≥ 16 and a float32/16-bit dtype, got {cfg} for {x.dtype}")
    _check_device(x, weight)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    options = {} if _interpreting() else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _kernel(_gemv_kernel)[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))](
        x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        USE_DOT=cfg.use_dot, DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        UPCAST_DOT=_interpreting() and x.dtype == torch.bfloat16,
        F64=x.dtype == torch.float64, **options,
    )
    return y


class RowBoundLinear:
    """x·Wᵀ by row count: gemv for at most `max_rows` rows, F.linear (cuBLAS) above (0: always F.linear).

    A CUDA graph fixes its row count at capture, so within one graph the choice is static."""

    def __init__(self, max_rows: int) -> None:
        if max_rows < 0:
            raise ValueError(f"gemv max_rows must be ≥ 0 (0 turns the GEMV off), got {max_rows}")
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemv(x, weight) if x.shape[0] <= self.max_rows else F.linear(x, weight)

    def __repr__(self) -> str:
        return f"RowBoundLinear(max_rows={self.max_rows})"
