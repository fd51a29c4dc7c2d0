"""y = x·Wᵀ for one to a few rows of x, each program holding whole rows of W: the 1-row pass's GEMV.

At one row a projection is a stream of its weight through the SMs, and what limits it is how many
bytes each SM has in flight. cuBLAS reaches about 53% of an H200's 4.8 TB/s on Ouro's decode shapes,
and a tiled Triton GEMV (a K loop that loads, reduces and loads again) less. Here a program owns
BLOCK_N whole rows of W, a strip of BLOCK_N·K elements, and loads all of it at once, before anything
else it does; the products are then reduced along K once, in fp32:

    x [M, K] (M ≤ max_rows), W [N, K] row-major (the nn.Linear weight), y [M, N]
    grid = (cdiv(N, BLOCK_N),)                 program j, columns [j·BLOCK_N, (j+1)·BLOCK_N):
        w = W[cols, 0:K]                         (K as K_HI + K_LO: the largest power of two ≤ K,
                                                   and the rest padded to one, masked)
        for each row m < M:   y[m, cols] = cast(Σ_k w[:, k] · x[m, k])       (fp32 products and sum)

The strip sits in registers (BLOCK_N·K·itemsize bytes over the program's threads), so a 16 KB strip
and a few programs per SM keep plenty of HBM requests in flight, and no program waits on a load in
a loop. Rows reuse the strip from registers; x comes from L2.

Determinism and batch invariance. The sum over K has one order for one setting and K (Triton's
reduction tree of the strip's layout, the high part then the low part), and a row's result reads
that row of x alone, so row r of gemv(x) is bit-equal, for every M ≤ max_rows, to gemv(x[r:r+1]),
and to itself across runs and graph replays. It is not bit-equal to cuBLAS: within fp32 rounding
of the exact product, then one rounding to the output dtype.

PDL (`launch=`, kernels/launch.py). The strip is the model's weight, which no kernel writes, so it
is loaded before gdc_wait: launched with PDL, a GEMV's whole read is in flight while its
predecessor drains. x's loads and y's stores come after the wait, then gdc_launch_dependents (the
store rule of launch.py). PDL on and off run the same instructions on the same values: the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlt_worker.attention.triton_backend import (
    _check_device,
    _interpreting,
    gdc_launch_dependents,
    gdc_wait,
    tl,
    triton,
)
from rlt_worker.kernels.fused_ops import libdevice
from rlt_worker.kernels.launch import PLAIN, KernelLaunch
from rlt_worker.kernels.splitk_gemv import SUPPORTED_DTYPES, check_gemv_args, jitted_gemv

__all__ = ["SUPPORTED_DTYPES", "StripConfig", "StripGemv"]


def _strip_kernel(
    x_ptr, w_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
    BLOCK_N: tl.constexpr, K_HI: tl.constexpr, K_LO: tl.constexpr, K_LO_PAD: tl.constexpr,
    SWIGLU: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
):
    """Columns [j·BLOCK_N, (j+1)·BLOCK_N): the strip W[cols, :] loaded first, then every row's dot.
    SWIGLU: W is gate|up [2N, K]; the program also holds the up rows N + cols, and stores silu(gate)·up."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    hi = tl.arange(0, K_HI)
    lo = K_HI + tl.arange(0, K_LO_PAD)  # the part of K past the largest power of two, padded, masked
    lo_ok = lo < K_HI + K_LO
    # Row offsets in int64: a packed weight's N·K elements can pass 2^31 bytes.
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    w_hi = tl.load(w_rows + hi[None, :], mask=col_ok[:, None], other=0.0)
    if K_LO > 0:
        w_lo = tl.load(w_rows + lo[None, :], mask=col_ok[:, None] & lo_ok[None, :], other=0.0)
    if SWIGLU:
        u_rows = w_rows + N * stride_wn
        u_hi = tl.load(u_rows + hi[None, :], mask=col_ok[:, None], other=0.0)
        if K_LO > 0:
            u_lo = tl.load(u_rows + lo[None, :], mask=col_ok[:, None] & lo_ok[None, :], other=0.0)
    if PDL:
        gdc_wait()  # x and y: after the predecessor
        gdc_launch_dependents()
    dtype = y_ptr.dtype.element_ty
    for m in range(M):
        x_row = x_ptr + m * stride_xm
        x_hi = tl.load(x_row + hi).to(tl.float32)
        if K_LO > 0:
            x_lo = tl.load(x_row + lo, mask=lo_ok, other=0.0).to(tl.float32)
        acc = tl.sum(w_hi.to(tl.float32) * x_hi[None, :], axis=1)
        if K_LO > 0:
            acc += tl.sum(w_lo.to(tl.float32) * x_lo[None, :], axis=1)
        if SWIGLU:
            up = tl.sum(u_hi.to(tl.float32) * x_hi[None, :], axis=1)
            if K_LO > 0:
                up += tl.sum(u_lo.to(tl.float32) * x_lo[None, :], axis=1)
            # fused_ops._swiglu_kernel's rounding on the GEMV's stored outputs: gate and up rounded
            # to the dtype, silu in fp32 (libdevice exp, IEEE division), rounded, times up.
            g = acc.to(dtype).to(tl.float32)
            if LIBDEVICE:
                silu = tl.div_rn(g, 1.0 + libdevice.exp(-g))
            else:
                silu = tl.div_rn(g, 1.0 + tl.exp(-g))
            acc = silu.to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + cols, acc.to(dtype), mask=col_ok)


@dataclass(frozen=True)
class StripConfig:
    """One setting: BLOCK_N whole rows of W per program, over num_warps warps."""

    block_n: int = 4
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"StripConfig.{name} must be a power of two, got {value}")


def split_k(in_features: int) -> tuple[int, int, int]:
    """K as (K_HI, K_LO, K_LO_PAD): the largest power of two ≤ K, the rest, and the rest's padded width."""
    k_hi = 1 << (in_features.bit_length() - 1)
    k_lo = in_features - k_hi
    return k_hi, k_lo, triton.next_power_of_2(k_lo) if k_lo else 1


class StripGemv:
    """x·Wᵀ for weights [out_features, in_features] and at most max_rows rows; no workspace.

    One instance may serve every weight of its shape (a model's layers). Call it with x [M, K] (unit
    column stride, any row stride; M ≤ max_rows) and a weight [N, K] (row-major) of x's dtype; the
    result is a new [M, N] tensor of that dtype. `launch`: PDL or plain (module docstring).

    swiglu: the weight is a packed gate|up [2I, K] (out_features = 2I) and the result is
    swiglu(x·Wᵀ) [M, I], bit for bit the GEMV's output through fused_ops.swiglu, in one launch: each
    program holds the gate rows of its columns and the up rows I below them.
    """

    def __init__(self, out_features: int, in_features: int, config: StripConfig, max_rows: int,
                 launch: KernelLaunch = PLAIN, swiglu: bool = False) -> None:
        _check_device()  # Triton is importable
        if out_features < 1 or in_features < 1 or max_rows < 1:
            raise ValueError(f"StripGemv needs positive sizes, got {out_features}×{in_features}, max_rows {max_rows}")
        if swiglu and out_features % 2:
            raise ValueError(f"StripGemv with swiglu needs gate|up rows of an even count, got {out_features}")
        self.out_features, self.in_features = out_features, in_features
        self.config, self.max_rows, self.launch, self.swiglu = config, max_rows, launch, swiglu
        self._width = out_features // 2 if swiglu else out_features  # the result's columns
        self._k = split_k(in_features)
        self._grid = (triton.cdiv(self._width, config.block_n),)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x·weightᵀ [M, N] in x's dtype (swiglu: silu(gate)·up [M, N/2]), accumulated in fp32: one
        launch, no host synchronization."""
        check_gemv_args("StripGemv", (self.out_features, self.in_features), self.max_rows, x, weight)
        _check_device(x, weight)
        m, n = x.shape[0], self._width
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0:
            return y
        k_hi, k_lo, k_lo_pad = self._k
        interpret = _interpreting()
        jitted_gemv(_strip_kernel, interpret)[self._grid](
            x, weight, y, m, n, x.stride(0), weight.stride(0), y.stride(0),
            BLOCK_N=self.config.block_n, K_HI=k_hi, K_LO=k_lo, K_LO_PAD=k_lo_pad,
            SWIGLU=self.swiglu, LIBDEVICE=not interpret,
            **self.launch.kwargs(m, num_warps=self.config.num_warps, num_stages=1),
        )
        return y

    def __repr__(self) -> str:
        return f"StripGemv({self.out_features}×{self.in_features}, {self.config}{', swiglu' if self.swiglu else ''})"
