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

Epilogues (`Epilogue`, fixed at construction). STORE stores y. SWIGLU (W = gate|up [2I, K]) gives
each unit u of a program its partner row I below its own, loaded with it as one interleaved strip
[2·BLOCK_N, K] and reduced once, then split into the unit's two dots, rounded to the dtype as the
GEMV would store them: y[m, u] = silu(gate)·up, fused_ops.swiglu's rounding. Under the interpreter it
is bit for bit the STORE strip followed by swiglu's launch. (A q|k|v epilogue that also rotated q
and k and wrote k and v into the paged caches measured slower in the 1-row pass three times: 1.109,
1.072 and 1.070 ms against 1.064-1.066 on the H200, docs/benchmarks.md; removed.)

Gating (`needed`, a call's bool [M] on the device). A caller that reads only some rows' results, and
knows which only on the device (device refill's CODA: the rows that exited this pass), passes them:
each program loads them first, and with none its weight loads are masked off, so the launch reads
no weight and stores zeros. Where a row is needed the results are the ungated strip's, bit for bit.

PDL (`launch=`, kernels/launch.py). The strip is the model's weight, which no kernel writes, so it
is loaded before gdc_wait: launched with PDL, a GEMV's whole read is in flight while its
predecessor drains. x's (and the positions', slots' and rope table's) loads and every store come
after the wait (the store rule of launch.py), then gdc_launch_dependents. PDL on and off run the same
instructions on the same values: the same bits. A gated strip waits first: its needed rows are the
predecessor's, and they decide whether its weight is read.
"""

from __future__ import annotations

import enum
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

__all__ = ["SUPPORTED_DTYPES", "Epilogue", "StripConfig", "StripGemv"]


def _strip_kernel(
    x_ptr, w_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym, needed_ptr,
    BLOCK_N: tl.constexpr, K_HI: tl.constexpr, K_LO: tl.constexpr, K_LO_PAD: tl.constexpr,
    SWIGLU: tl.constexpr, GROUP: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
    GATED: tl.constexpr, ROWS_PAD: tl.constexpr,
):
    """Units [j·BLOCK_N, (j+1)·BLOCK_N) of N: their rows of W loaded first (SWIGLU: and each unit's
    partner row GROUP below it), then every row of x: its dots, the epilogue. GATED: needed_ptr [M]
    says which rows' results the caller reads; with none, the program loads no weight (its rows come
    out 0), so the launch reads almost nothing."""
    units = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = units < N
    if SWIGLU:  # strip row r: unit r // 2's row (r even) or its partner (r odd), interleaved
        r = tl.arange(0, 2 * BLOCK_N)
        r_units = tl.program_id(0) * BLOCK_N + r // 2
        rows = (r_units // GROUP) * (2 * GROUP) + r_units % GROUP + (r % 2) * GROUP
        rows_ok = r_units < N
    else:
        rows, rows_ok = units, ok
    hi = tl.arange(0, K_HI)
    lo = K_HI + tl.arange(0, K_LO_PAD)  # the part of K past the largest power of two, padded, masked
    lo_ok = lo < K_HI + K_LO
    if GATED:  # the needed rows are the predecessor's output: they and then the strip, after the wait
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        r = tl.arange(0, ROWS_PAD)
        wanted = tl.max(tl.load(needed_ptr + r, mask=r < M, other=0).to(tl.int32), axis=0)
        rows_ok = rows_ok & (rows * 0 + wanted > 0)
    # Row offsets in int64: a packed weight's N·K elements can pass 2^31 bytes.
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    w_hi = tl.load(w_rows + hi[None, :], mask=rows_ok[:, None], other=0.0)
    if K_LO > 0:
        w_lo = tl.load(w_rows + lo[None, :], mask=rows_ok[:, None] & lo_ok[None, :], other=0.0)
    if PDL and not GATED:
        gdc_wait()  # x and every store: after the predecessor
        gdc_launch_dependents()
    dtype = x_ptr.dtype.element_ty
    for m in range(M):
        x_row = x_ptr + m * stride_xm
        x_hi = tl.load(x_row + hi).to(tl.float32)
        if K_LO > 0:
            x_lo = tl.load(x_row + lo, mask=lo_ok, other=0.0).to(tl.float32)
        acc = tl.sum(w_hi.to(tl.float32) * x_hi[None, :], axis=1)
        if K_LO > 0:
            acc += tl.sum(w_lo.to(tl.float32) * x_lo[None, :], axis=1)
        if SWIGLU:
            # One reduction for both rows of each unit, then the unit's two dots apart, and
            # fused_ops._swiglu_kernel's rounding on the GEMV's stored outputs: gate and up rounded
            # to the dtype, silu in fp32 (libdevice exp, IEEE division), rounded, times up.
            gate, up = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
            g = gate.to(dtype).to(tl.float32)
            if LIBDEVICE:
                silu = tl.div_rn(g, 1.0 + libdevice.exp(-g))
            else:
                silu = tl.div_rn(g, 1.0 + tl.exp(-g))
            act = silu.to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
            tl.store(y_ptr + m * stride_ym + units, act.to(dtype), mask=ok)
        else:
            tl.store(y_ptr + m * stride_ym + units, acc.to(dtype), mask=ok)


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


class Epilogue(enum.IntEnum):
    """What a strip does with its dot products (module docstring)."""

    STORE = 0  # y = x·Wᵀ
    SWIGLU = 1  # W is gate|up [2I, K]: y = silu(gate)·up [M, I]


class StripGemv:
    """x·Wᵀ for weights [out_features, in_features] and at most max_rows rows; no workspace.

    One instance may serve every weight of its shape (a model's layers). x [M, K] (unit column
    stride, any row stride; M ≤ max_rows), weight [N, K] (row-major) of x's dtype; results are new
    tensors of that dtype. `launch`: PDL or plain (module docstring). The epilogue is fixed at
    construction.
    """

    def __init__(self, out_features: int, in_features: int, config: StripConfig, max_rows: int,
                 launch: KernelLaunch = PLAIN, epilogue: Epilogue = Epilogue.STORE) -> None:
        _check_device()  # Triton is importable
        if out_features < 1 or in_features < 1 or max_rows < 1:
            raise ValueError(f"StripGemv needs positive sizes, got {out_features}×{in_features}, max_rows {max_rows}")
        self.out_features, self.in_features = out_features, in_features
        self.config, self.max_rows, self.launch, self.epilogue = config, max_rows, launch, epilogue
        self._units, self._group = out_features, 1  # group: SWIGLU's partner rows lie that far below
        if epilogue == Epilogue.SWIGLU:
            if out_features % 2:
                raise ValueError(f"StripGemv with swiglu needs gate|up rows of an even count, got {out_features}")
            self._units = self._group = out_features // 2
        self._k = split_k(in_features)
        self._grid = (triton.cdiv(self._units, config.block_n),)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, needed: torch.Tensor | None = None) -> torch.Tensor:
        """x·weightᵀ [M, N] (SWIGLU: silu(gate)·up [M, N/2]), accumulated in fp32: one launch, no host
        synchronization. `needed` (bool [M], on the device): the rows the caller reads; when none is,
        the launch reads no weight and every row comes out 0 (the same values where one is)."""
        if needed is not None and (needed.shape != (x.shape[0],) or needed.dtype != torch.bool):
            raise ValueError(f"{self!r}: needed must be bool [{x.shape[0]}], got {needed.dtype} "
                             f"{tuple(needed.shape)}")
        check_gemv_args("StripGemv", (self.out_features, self.in_features), self.max_rows, x, weight)
        _check_device(x, weight, *(() if needed is None else (needed,)))
        m = x.shape[0]
        y = torch.empty(m, self._units, dtype=x.dtype, device=x.device)
        if m == 0:
            return y
        k_hi, k_lo, k_lo_pad = self._k
        interpret = _interpreting()
        jitted_gemv(_strip_kernel, interpret)[self._grid](
            x, weight, y, m, self._units, x.stride(0), weight.stride(0), y.stride(0), x if needed is None else needed,
            BLOCK_N=self.config.block_n, K_HI=k_hi, K_LO=k_lo, K_LO_PAD=k_lo_pad,
            SWIGLU=self.epilogue == Epilogue.SWIGLU, GROUP=self._group, LIBDEVICE=not interpret,
            GATED=needed is not None, ROWS_PAD=triton.next_power_of_2(self.max_rows),
            **self.launch.kwargs(m, num_warps=self.config.num_warps, num_stages=1),
        )
        return y

    def __repr__(self) -> str:
        epilogue = "" if self.epilogue == Epilogue.STORE else f", {self.epilogue.name.lower()}"
        return f"StripGemv({self.out_features}×{self.in_features}, {self.config}{epilogue})"
