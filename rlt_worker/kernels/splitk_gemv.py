"""y = x·Wᵀ for a few rows of x, split over K so that a small weight fills the GPU: the decode pass's GEMV.

With M ≤ 8 rows a projection is a read of W and almost no arithmetic. A square 2048×2048 weight in
tiles of BLOCK_N output columns gives too few programs for 132 SMs (the unsplit Triton GEMV this
replaces lost to cuBLAS at every Ouro shape), so the K axis is cut into S slices as well:

    x [M, K] (M ≤ max_rows), W [N, K] row-major (the nn.Linear weight), y [M, N]
    grid = (cdiv(N, BLOCK_N), S)               program (j, s):
        columns [j·BLOCK_N, (j+1)·BLOCK_N) over K blocks [s·B, (s+1)·B) (B = cdiv(K/BLOCK_K, S) blocks)
        acc [BLOCK_M, BLOCK_N] fp32 += x tile [BLOCK_M, BLOCK_K] · W tile [BLOCK_N, BLOCK_K]ᵀ
        S = 1: y tile = acc, cast.   S > 1: acc → partials[s] (a [S, BLOCK_M, N] fp32 workspace);
        counts[j] += 1 (acq_rel); the program that sees S − 1 there is the tile's last one:
            y tile = cast(((p₀ + p₁) + p₂) + … + p_{S−1})   and counts[j] = 0 again (graph replay)

The program that sums is whichever finishes last, but the sum reads the partials in slice order,
so its result never depends on scheduling. Each W tile is BLOCK_K contiguous elements per column
(16-byte vector loads), the next one in flight while the current one is used (PDL below); x rows
are tiny and come from L2, through a ring of num_stages cp.async copies. The inner product
is either tl.dot (x padded to BLOCK_M = 16 rows: tensor cores, input_precision "ieee" for float32,
so no tf32) or a multiply-add reduced over the tile's K (BLOCK_M = next power of two ≥ max_rows).

Determinism and batch invariance. For one setting (SplitKConfig) and one weight, a row's result is
a function of that row of x alone: BLOCK_M, the slices and their summation order are fixed by the
setting and K, never by M; rows past M are zeros whose products land in rows never stored. So
row r of gemv(x) is bit-equal, for every M ≤ max_rows, to gemv(x[r:r+1]) with the same SplitKGemv,
and to itself across runs and graph replays. It is not bit-equal to cuBLAS, nor to another
setting (another S sums in another order): within fp32 rounding of the exact product, then one
rounding to the output dtype.

PDL (`launch=`, kernels/launch.py). A decode layer runs four GEMVs back to back (q|k|v → o →
gate|up → down), each a stream of its weight; cuBLAS GEMMs are not launched with PDL, so no Triton
kernel of the pass has a PDL predecessor to overlap. Launched with PDL, a program loads its
slice's first W tile before gdc_wait (weights are the model's, which no kernel writes), so that
load is in flight while the predecessor drains; the K loop then loads each next W tile at the end
of the current iteration (loop-carried), one code path with PDL on or off:

    w = W[cols, k_lo : k_lo + BLOCK_K]                                   before the wait
    wait
    for k0 in k_lo, k_lo + BLOCK_K, … < k_hi:
        acc += x[:, k0 : k0 + BLOCK_K] · wᵀ;   w = W[cols, k0 + BLOCK_K : …]  (masked: none past k_hi)
    launch_dependents;   partials, counter, the sum, y

The store rule as in launch.py: every load of x, every store and every atomic (partials, counters,
y) comes after the wait, since the caching allocator may hand y the memory of a tensor the
predecessor still reads, and the partials and counters are the previous launch's. Unlike the
elementwise kernels, a GEMV calls gdc_launch_dependents after its K loop, not right after the wait:
its successor's prologue (its own first W tiles) starts when this grid's last programs finish
streaming their weight, and overlaps their stores and sums instead of competing for HBM with them.
The products and their summation order are those of a loop that loads both tiles at k0 (the
kernel before PDL; their sm_90 PTX has the same floating-point instructions in the same order), and
PDL on and off give the same bits. The cost: Triton's pipeliner does not ring a loop-carried load,
so W is one tile ahead in registers instead of num_stages − 1 ahead in shared memory, and tl.dot
takes it through shared memory (at num_stages = 1 a program's shared memory grows by one W tile).
Measured on the H200 (`scripts/bench_gemv_chain.py`, docs/benchmarks.md): PDL gains 0.5% in a
24-layer chain, and the chain is 0.89× cuBLAS's with or without it.

Workspace: one SplitKGemv per (weight shape, setting) holds its partials and counters, allocated
once at construction (outside any CUDA graph); launches that share one must be stream-ordered
(one pass at a time on one stream, as the worker runs them; PDL keeps that order, since a launch
touches its workspace only after its wait, when every earlier launch has finished). No host
synchronization.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from rlt_worker.attention.triton_backend import _check_device, _interpreting, tl, triton
from rlt_worker.kernels.launch import PLAIN, KernelLaunch

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - exercised only without Triton
    gdc_wait = gdc_launch_dependents = None

__all__ = ["SUPPORTED_DTYPES", "SplitKConfig", "SplitKGemv"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_gemv_args(kernel: str, shape: tuple[int, int], max_rows: int, x: torch.Tensor,
                    weight: torch.Tensor) -> None:
    """A GEMV call's x [M ≤ max_rows, K] and weight `shape` [N, K], unit column strides, one supported
    dtype; a ValueError naming `kernel` otherwise."""
    if x.dim() != 2 or tuple(weight.shape) != shape or x.shape[1] != shape[1] or x.shape[0] > max_rows:
        raise ValueError(f"{kernel} for {shape[0]}×{shape[1]} weights and ≤ {max_rows} rows got "
                         f"x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{kernel} needs unit column strides, got x {x.stride()} and weight {weight.stride()}")
    if x.dtype != weight.dtype or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{kernel} needs x and weight of one of {SUPPORTED_DTYPES}, got {x.dtype} "
                         f"and {weight.dtype} (float64 keeps F.linear)")


def _splitk_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym, k_per_split, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """Column tile j, K slice s: the partial x·W[cols]ᵀ over the slice; the tile's last slice sums them."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    # Row offsets in int64: a packed weight's N·K elements can pass 2^31 bytes.
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # The slice's first W tile, before the PDL wait (no kernel writes weights). A slice is never
    # empty (k_lo < k_hi), and within it (k0 + ks) < k_hi is (k0 + ks) < K: only the last slice ends
    # at K, the others at a whole K block.
    if EVEN_K:  # no mask along K: the loads stay 16-byte vectors
        w = tl.load(w_ptrs + k_lo, mask=col_ok[:, None], other=0.0)
    else:
        w = tl.load(w_ptrs + k_lo, mask=col_ok[:, None] & ((k_lo + ks) < k_hi)[None, :], other=0.0)
    if PDL:
        gdc_wait()  # x, the partials, the counters and y: after the predecessor
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
        if DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        # The next iteration's W tile (loop-carried); past the slice's end the mask loads nothing.
        # (A column bound, not `col_ok & (k1 < k_hi)`: the interpreter rejects a scalar in a mask.)
        k1 = k0 + BLOCK_K
        if EVEN_K:
            w = tl.load(w_ptrs + k1, mask=(cols < tl.where(k1 < k_hi, N, 0))[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs + k1, mask=col_ok[:, None] & ((k1 + ks) < k_hi)[None, :], other=0.0)
    if PDL:
        gdc_launch_dependents()  # the successor's prologue overlaps this grid's last programs' stores
    out_ok = row_ok[:, None] & col_ok[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    if SPLIT:
        # partials [S, BLOCK_M, N]; .cg: through L2 only, where the summing program (any SM) reads them.
        tile_ptrs = part_ptr + rows[:, None] * N + cols[None, :]
        tl.store(tile_ptrs + split * BLOCK_M * N, acc, mask=out_ok, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's partial is stored before the counter says so (release)
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            total = tl.load(tile_ptrs, mask=out_ok, other=0.0, cache_modifier=".cg")
            for s in range(1, num_splits):  # slice order, whichever program came last
                total += tl.load(tile_ptrs + s * BLOCK_M * N, mask=out_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(count_ptr + tile, 0)  # the next launch (a graph replay) counts from zero
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_ok)


@functools.cache
def jitted_gemv(kernel: Any, interpret: bool) -> Any:
    """A GEMV kernel, jitted once per TRITON_INTERPRET mode. M is not specialized: Triton would build
    another binary for M = 1, and every M must run the same code (batch invariance)."""
    del interpret  # only part of the cache key; triton.jit reads the environment itself
    return triton.jit(kernel, do_not_specialize=["M"])


@dataclass(frozen=True)
class SplitKConfig:
    """One tile setting: BLOCK_N columns × BLOCK_K per program, K in `splits` slices, launch options."""

    block_n: int = 32
    block_k: int = 256
    splits: int = 4
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SplitKConfig.{name} must be a power of two, got {value}")
        if self.splits < 1 or self.num_stages < 1:
            raise ValueError(f"SplitKConfig.splits and num_stages must be ≥ 1, got {self.splits}, {self.num_stages}")
        if self.dot and min(self.block_n, self.block_k) < 16:
            raise ValueError(f"SplitKConfig: tl.dot needs block_n and block_k ≥ 16, got {self}")


class SplitKGemv:
    """x·Wᵀ for weights [out_features, in_features] and at most max_rows rows, with its own workspace.

    One instance may serve many weights of its shape (a model's layers), one launch at a time on a
    stream. Call it with x [M, K] (unit column stride, any row stride; M ≤ max_rows) and a weight
    [N, K] (row-major) of x's dtype; the result is a new [M, N] tensor of that dtype. `launch`:
    PDL or plain launches (module docstring), the same bits either way.
    """

    def __init__(self, out_features: int, in_features: int, config: SplitKConfig, max_rows: int,
                 device: torch.device | str, launch: KernelLaunch = PLAIN) -> None:
        _check_device()  # Triton is importable
        if out_features < 1 or in_features < 1 or max_rows < 1:
            raise ValueError(f"SplitKGemv needs positive sizes, got {out_features}×{in_features}, "
                             f"max_rows {max_rows}")
        self.out_features, self.in_features = out_features, in_features
        self.config, self.max_rows, self.launch = config, max_rows, launch
        self.block_m = 16 if config.dot else triton.next_power_of_2(max_rows)
        if self.block_m < max_rows:
            raise ValueError(f"SplitKGemv: tl.dot pads rows to 16; max_rows {max_rows} does not fit")
        # Slices of whole K blocks; asking for more slices than blocks (or a count that leaves the
        # last one empty) gives fewer: `splits` is what runs.
        num_blocks = triton.cdiv(in_features, config.block_k)
        blocks_per_split = triton.cdiv(num_blocks, config.splits)
        self.splits = triton.cdiv(num_blocks, blocks_per_split)
        self._k_per_split = blocks_per_split * config.block_k
        num_tiles = triton.cdiv(out_features, config.block_n)
        self._grid = (num_tiles, self.splits)
        f32 = dict(dtype=torch.float32, device=device)
        self._partials = torch.empty(self.splits, self.block_m, out_features, **f32) if self.splits > 1 else None
        self._counts = torch.zeros(num_tiles, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x·weightᵀ [M, N] in x's dtype, accumulated in fp32: one launch, no host synchronization."""
        check_gemv_args("SplitKGemv", (self.out_features, self.in_features), self.max_rows, x, weight)
        _check_device(x, weight, self._counts)
        m, n, k = x.shape[0], self.out_features, self.in_features
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0:
            return y
        cfg = self.config
        jitted_gemv(_splitk_kernel, _interpreting())[self._grid](
            x, weight, y, self._partials if self._partials is not None else y, self._counts,
            m, n, k, x.stride(0), weight.stride(0), y.stride(0), self._k_per_split, self.splits,
            BLOCK_M=self.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
            SPLIT=self.splits > 1, DOT=cfg.dot, PRECISION="ieee" if x.dtype == torch.float32 else None,
            **self.launch.kwargs(m, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        )
        return y

    def __repr__(self) -> str:
        return f"SplitKGemv({self.out_features}×{self.in_features}, {self.config}, splits={self.splits})"
