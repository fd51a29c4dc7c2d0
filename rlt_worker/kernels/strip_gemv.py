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

Epilogues (`Epilogue`, fixed at construction). STORE stores y. The paired ones give each unit u of
a program a partner row GROUP below its own, loaded with it as one interleaved strip [2·BLOCK_N, K]
and reduced once, then split into the unit's two dots (rounded to the dtype, as the GEMV would
store them):
    SWIGLU      W = gate|up [2I, K], GROUP = I: y[m, u] = silu(gate)·up, fused_ops.swiglu's rounding
    ROTARY_KV   W = q|k|v [(Hq + 2·Hkv)·Dh, K], GROUP = Dh/2, unit u = dimension i = u mod Dh/2 of head
                u div (Dh/2): q and k heads rotated (fused_ops._rope_qk_kernel's rounding, the rope
                table at the row's position), q stored into y [M, Hq·Dh], k and v (as it is) into the
                paged caches at the row's slot: fused_ops.write_kv_rotary's stores
Under the interpreter both are bit for bit the STORE strip followed by the launch they replace.

Gating (`needed`, a call's bool [M] on the device). A caller that reads only some rows' results, and
knows which only on the device (device refill's CODA: the rows that exited this pass), passes them:
each program loads them first, and with none its weight loads are masked off, so the launch reads
no weight and stores zeros. Where a row is needed the results are the ungated strip's, bit for bit.

PDL (`launch=`, kernels/launch.py). The strip is the model's weight, which no kernel writes, so it
is loaded before gdc_wait: launched with PDL, a GEMV's whole read is in flight while its
predecessor drains. x's (and the positions', slots' and rope table's) loads and every store come
after the wait (the store rule of launch.py), then gdc_launch_dependents — except ROTARY_KV, whose
successor is the attention: it launches its dependents after its stores, since waiting attention
programs hold shared memory and would thin the strip's later waves. PDL on and off run the same
instructions on the same values: the same bits. A gated strip waits first: its needed rows are the
predecessor's, and they decide whether its weight is read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rlt_worker.attention.triton_backend import (
    _check_device,
    _interpreting,
    gdc_launch_dependents,
    gdc_wait,
    tl,
    triton,
)
from rlt_worker.kernels.fused_ops import check_rotary_targets, libdevice
from rlt_worker.kernels.launch import PLAIN, KernelLaunch
from rlt_worker.kernels.splitk_gemv import SUPPORTED_DTYPES, check_gemv_args, jitted_gemv
from rlt_worker.models.base import Rotary

__all__ = ["SUPPORTED_DTYPES", "Epilogue", "KVTarget", "StripConfig", "StripGemv"]


def _strip_kernel(
    x_ptr, w_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
    pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, stride_cos,
    stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd, needed_ptr,
    BLOCK_N: tl.constexpr, K_HI: tl.constexpr, K_LO: tl.constexpr, K_LO_PAD: tl.constexpr,
    PAIRED: tl.constexpr, SWIGLU: tl.constexpr, ROTARY: tl.constexpr, GROUP: tl.constexpr, Q_HEADS: tl.constexpr,
    ROT_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
    GATED: tl.constexpr, ROWS_PAD: tl.constexpr,
):
    """Units [j·BLOCK_N, (j+1)·BLOCK_N) of N: their rows of W loaded first (and, paired, each unit's
    partner row GROUP below it: SWIGLU, ROTARY), then every row of x: its dots, the epilogue.
    PAIRED = SWIGLU or ROTARY. GATED: needed_ptr [M] says which rows' results the caller reads; with
    none, the program loads no weight (its rows come out 0), so the launch reads almost nothing."""
    units = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = units < N
    if PAIRED:  # strip row r: unit r // 2's row (r even) or its partner (r odd), interleaved
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
        gdc_wait()  # x, positions, slots and every store: after the predecessor
        if not ROTARY:
            gdc_launch_dependents()
    dtype = x_ptr.dtype.element_ty
    for m in range(M):
        if ROTARY:  # the row's slot and rope table entries first: their loads overlap x's and the dots
            pos = tl.load(pos_ptr + m).to(tl.int64)
            slot = tl.load(slot_ptr + m).to(tl.int64)
            c = tl.load(cos_ptr + pos * stride_cos + units % GROUP, mask=ok, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + pos * stride_cos + units % GROUP, mask=ok, other=0.0).to(tl.float32)
        x_row = x_ptr + m * stride_xm
        x_hi = tl.load(x_row + hi).to(tl.float32)
        if K_LO > 0:
            x_lo = tl.load(x_row + lo, mask=lo_ok, other=0.0).to(tl.float32)
        acc = tl.sum(w_hi.to(tl.float32) * x_hi[None, :], axis=1)
        if K_LO > 0:
            acc += tl.sum(w_lo.to(tl.float32) * x_lo[None, :], axis=1)
        if PAIRED:  # one reduction for both rows of each unit, then the unit's two dots apart
            acc, acc_b = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
        if not PAIRED:
            tl.store(y_ptr + m * stride_ym + units, acc.to(dtype), mask=ok)
        elif SWIGLU:
            # fused_ops._swiglu_kernel's rounding on the GEMV's stored outputs: gate and up rounded
            # to the dtype, silu in fp32 (libdevice exp, IEEE division), rounded, times up.
            g = acc.to(dtype).to(tl.float32)
            if LIBDEVICE:
                silu = tl.div_rn(g, 1.0 + libdevice.exp(-g))
            else:
                silu = tl.div_rn(g, 1.0 + tl.exp(-g))
            act = silu.to(dtype).to(tl.float32) * acc_b.to(dtype).to(tl.float32)
            tl.store(y_ptr + m * stride_ym + units, act.to(dtype), mask=ok)
        else:
            rotary_kv_epilogue(acc.to(dtype).to(tl.float32), acc_b.to(dtype).to(tl.float32), c, s, slot, units, ok,
                               y_ptr + m * stride_ym, kc_ptr, vc_ptr, stride_kcb, stride_kcs, stride_kch,
                               stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd, GROUP, Q_HEADS, ROT_HEADS,
                               BLOCK_SIZE)
    if PDL and ROTARY:
        # The successor is the attention, whose waiting programs hold shared memory: launched as this
        # grid's last programs finish, they do not crowd out its later waves (measured: 1.109 ms a
        # 1-row pass with the launch after the wait, against 1.064 with the RoPE launch between).
        gdc_launch_dependents()


def _rotary_kv_epilogue(
    a, b, c, s, slot, units, ok, q_row_ptr, kc_ptr, vc_ptr, stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HALF: tl.constexpr, Q_HEADS: tl.constexpr, ROT_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One row's q|k|v pairs (a at dimension i of a head, b at i + HALF; c, s: the rope table at the
    row's position and i), as fused_ops._rope_qk_kernel stores them: q and k heads rotated
    (x·cos + rotate_half(x)·sin, each op rounded to the dtype), q into its row, k and v (as it is)
    into the paged caches at the row's slot."""
    dtype = q_row_ptr.dtype.element_ty
    head, i = units // HALF, units % HALF
    dim = head * (2 * HALF) + i  # the pair's first column in q|k|v (q's heads come first)
    rotated = head < ROT_HEADS
    o1 = tl.where(rotated, ((a * c).to(dtype).to(tl.float32) + (-b * s).to(dtype).to(tl.float32)), a).to(dtype)
    o2 = tl.where(rotated, ((b * c).to(dtype).to(tl.float32) + (a * s).to(dtype).to(tl.float32)), b).to(dtype)
    q_ok = ok & (head < Q_HEADS)
    tl.store(q_row_ptr + dim, o1, mask=q_ok)
    tl.store(q_row_ptr + dim + HALF, o2, mask=q_ok)
    blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k_ok = ok & rotated & (head >= Q_HEADS)
    kc = kc_ptr + blk * stride_kcb + off * stride_kcs + (head - Q_HEADS) * stride_kch + i * stride_kcd
    tl.store(kc, o1.to(kc_ptr.dtype.element_ty), mask=k_ok)
    tl.store(kc + HALF * stride_kcd, o2.to(kc_ptr.dtype.element_ty), mask=k_ok)
    v_ok = ok & (head >= ROT_HEADS)
    vc = vc_ptr + blk * stride_vcb + off * stride_vcs + (head - ROT_HEADS) * stride_vch + i * stride_vcd
    tl.store(vc, o1.to(vc_ptr.dtype.element_ty), mask=v_ok)
    tl.store(vc + HALF * stride_vcd, o2.to(vc_ptr.dtype.element_ty), mask=v_ok)


# The epilogue as a device function, jitted at import in the mode Triton is in then (tests/interp.py: an
# interpreter process sets TRITON_INTERPRET before it imports Triton).
rotary_kv_epilogue = triton.jit(_rotary_kv_epilogue) if triton is not None else None


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
    ROTARY_KV = 2  # W is q|k|v: q rotated into y [M, Hq·Dh], k rotated and v into the paged caches


class KVTarget(NamedTuple):
    """Where a ROTARY_KV strip stores k and v: paged caches [blocks, block_size, Hkv, Dh] (any strides)
    at flat slots [M] (fused_ops.write_kv_rotary's)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


class StripGemv:
    """x·Wᵀ for weights [out_features, in_features] and at most max_rows rows; no workspace.

    One instance may serve every weight of its shape (a model's layers). x [M, K] (unit column
    stride, any row stride; M ≤ max_rows), weight [N, K] (row-major) of x's dtype; results are new
    tensors of that dtype. `launch`: PDL or plain (module docstring). The epilogue is fixed at
    construction (ROTARY_KV also takes the q|k|v heads, `heads` = (Hq, Hkv, Dh), and runs through
    `rotary`, the others through `__call__`).
    """

    def __init__(self, out_features: int, in_features: int, config: StripConfig, max_rows: int,
                 launch: KernelLaunch = PLAIN, epilogue: Epilogue = Epilogue.STORE,
                 heads: tuple[int, int, int] | None = None) -> None:
        _check_device()  # Triton is importable
        if out_features < 1 or in_features < 1 or max_rows < 1:
            raise ValueError(f"StripGemv needs positive sizes, got {out_features}×{in_features}, max_rows {max_rows}")
        self.out_features, self.in_features = out_features, in_features
        self.config, self.max_rows, self.launch, self.epilogue = config, max_rows, launch, epilogue
        self._units, self._group, self.heads = out_features, 1, heads
        if epilogue == Epilogue.SWIGLU:
            if out_features % 2:
                raise ValueError(f"StripGemv with swiglu needs gate|up rows of an even count, got {out_features}")
            self._units = self._group = out_features // 2
        elif epilogue == Epilogue.ROTARY_KV:
            self._units, self._group = out_features // 2, _rotary_half(out_features, config, heads)
        self._width = heads[0] * heads[2] if epilogue == Epilogue.ROTARY_KV else self._units  # y's columns
        self._k = split_k(in_features)
        self._grid = (triton.cdiv(self._units, config.block_n),)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, needed: torch.Tensor | None = None) -> torch.Tensor:
        """x·weightᵀ [M, N] (SWIGLU: silu(gate)·up [M, N/2]), accumulated in fp32: one launch, no host
        synchronization. `needed` (bool [M], on the device): the rows the caller reads; when none is,
        the launch reads no weight and every row comes out 0 (the same values where one is)."""
        if needed is not None and (needed.shape != (x.shape[0],) or needed.dtype != torch.bool):
            raise ValueError(f"{self!r}: needed must be bool [{x.shape[0]}], got {needed.dtype} "
                             f"{tuple(needed.shape)}")
        return self._run(x, weight, None, needed)

    def rotary(self, x: torch.Tensor, weight: torch.Tensor, rope: Rotary, kv: KVTarget) -> torch.Tensor:
        """Rotated q [M, Hq, Dh] of a ROTARY_KV strip, k and v stored at kv: the q|k|v GEMV and
        fused_ops.write_kv_rotary in one launch, bit for bit the plain strip's q|k|v through it under
        the interpreter."""
        if self.epilogue != Epilogue.ROTARY_KV or (rope.num_heads, rope.num_kv_heads, rope.head_dim) != self.heads:
            raise ValueError(f"{self!r} does not take RoPE of {rope.num_heads}+2×{rope.num_kv_heads} heads of "
                             f"{rope.head_dim}")
        check_rotary_targets(kv.k_cache, kv.v_cache, x.shape[0], x.dtype, rope, kv.slot_mapping)
        return self._run(x, weight, (rope, kv), None).view(-1, rope.num_heads, rope.head_dim)

    def _run(self, x: torch.Tensor, weight: torch.Tensor, rotary: tuple[Rotary, KVTarget] | None,
             needed: torch.Tensor | None) -> torch.Tensor:
        check_gemv_args("StripGemv", (self.out_features, self.in_features), self.max_rows, x, weight)
        if (rotary is None) != (self.epilogue != Epilogue.ROTARY_KV):
            raise ValueError(f"{self!r}: a ROTARY_KV strip runs through `rotary`, the others do not")
        rope_args = _rotary_args(x, rotary)
        _check_device(x, weight, *rope_args[:6], *(() if needed is None else (needed,)))
        m = x.shape[0]
        y = torch.empty(m, self._width, dtype=x.dtype, device=x.device)
        if m == 0:
            return y
        k_hi, k_lo, k_lo_pad = self._k
        interpret = _interpreting()
        q_heads, kv_heads, _ = self.heads or (0, 0, 0)
        jitted_gemv(_strip_kernel, interpret)[self._grid](
            x, weight, y, m, self._units, x.stride(0), weight.stride(0), y.stride(0), *rope_args,
            x if needed is None else needed,
            BLOCK_N=self.config.block_n, K_HI=k_hi, K_LO=k_lo, K_LO_PAD=k_lo_pad,
            PAIRED=self.epilogue != Epilogue.STORE, SWIGLU=self.epilogue == Epilogue.SWIGLU,
            ROTARY=rotary is not None, GROUP=self._group, Q_HEADS=q_heads,
            ROT_HEADS=q_heads + kv_heads, BLOCK_SIZE=rotary[1].k_cache.shape[1] if rotary else 1,
            LIBDEVICE=not interpret, GATED=needed is not None, ROWS_PAD=triton.next_power_of_2(self.max_rows),
            **self.launch.kwargs(m, num_warps=self.config.num_warps, num_stages=1),
        )
        return y

    def __repr__(self) -> str:
        epilogue = "" if self.epilogue == Epilogue.STORE else f", {self.epilogue.name.lower()}"
        return f"StripGemv({self.out_features}×{self.in_features}, {self.config}{epilogue})"


def _rotary_half(out_features: int, config: StripConfig, heads: tuple[int, int, int] | None) -> int:
    """Dh/2 of a q|k|v weight's heads, checked: the rows are (Hq + 2·Hkv)·Dh, and a program's pairs
    (block_n of them) lie in one half head."""
    if heads is None:
        raise ValueError("StripGemv with the rotary K/V epilogue needs heads=(Hq, Hkv, Dh)")
    q_heads, kv_heads, head_dim = heads
    if head_dim % 2 or out_features != (q_heads + 2 * kv_heads) * head_dim or (head_dim // 2) % config.block_n:
        raise ValueError(f"StripGemv: {out_features} rows are not q|k|v of {q_heads}+2×{kv_heads} heads of "
                         f"{head_dim} in pairs of {config.block_n} a program")
    return head_dim // 2


def _rotary_args(x: torch.Tensor, rotary: tuple[Rotary, KVTarget] | None) -> tuple:
    """The kernel's RoPE and cache arguments (positions, cos, sin, slots, caches, strides); unused
    ones point at x."""
    if rotary is None:
        return (x,) * 6 + (0,) * 9
    rope, kv = rotary
    return (rope.positions, rope.cos, rope.sin, kv.slot_mapping, kv.k_cache, kv.v_cache, rope.cos.stride(0),
            *kv.k_cache.stride(), *kv.v_cache.stride())
