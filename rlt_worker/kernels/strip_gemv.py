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
from rlt_worker.kernels.fused_ops import check_rotary_targets, libdevice, rms_rsqrt, rms_weighted
from rlt_worker.kernels.launch import PLAIN, KernelLaunch
from rlt_worker.kernels.splitk_gemv import SUPPORTED_DTYPES, check_gemv_args, jitted_gemv
from rlt_worker.models.base import Rotary

__all__ = ["SUPPORTED_DTYPES", "Epilogue", "InputNorm", "KVTarget", "StripConfig", "StripGemv"]


def _strip_kernel(
    x_ptr, w_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
    h_ptr, x_out_ptr, wa_ptr, wb_ptr, stride_hm, stride_xom, inv_k, eps,
    pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, stride_cos,
    stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    BLOCK_N: tl.constexpr, K_HI: tl.constexpr, K_LO: tl.constexpr, K_LO_PAD: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, PAIRED: tl.constexpr, SWIGLU: tl.constexpr,
    ROTARY: tl.constexpr, GROUP: tl.constexpr, Q_HEADS: tl.constexpr, ROT_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
):
    """Units [j·BLOCK_N, (j+1)·BLOCK_N) of N: their rows of W loaded first (and, paired, each unit's
    partner row GROUP below it: SWIGLU, ROTARY), then every row of x: its norm (NORM; RESIDUAL: the
    add first), its dots, the epilogue. PAIRED = SWIGLU or ROTARY."""
    units = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = units < N
    if not PAIRED:
        rows_a = units
    else:  # paired: unit u is row (u // GROUP)·2·GROUP + u % GROUP, its partner GROUP below
        rows_a = (units // GROUP) * (2 * GROUP) + units % GROUP
    hi = tl.arange(0, K_HI)
    lo = K_HI + tl.arange(0, K_LO_PAD)  # the part of K past the largest power of two, padded, masked
    lo_ok = lo < K_HI + K_LO
    # Row offsets in int64: a packed weight's N·K elements can pass 2^31 bytes.
    a_rows = w_ptr + rows_a.to(tl.int64)[:, None] * stride_wn
    a_hi = tl.load(a_rows + hi[None, :], mask=ok[:, None], other=0.0)
    if K_LO > 0:
        a_lo = tl.load(a_rows + lo[None, :], mask=ok[:, None] & lo_ok[None, :], other=0.0)
    if PAIRED:
        b_rows = a_rows + GROUP * stride_wn
        b_hi = tl.load(b_rows + hi[None, :], mask=ok[:, None], other=0.0)
        if K_LO > 0:
            b_lo = tl.load(b_rows + lo[None, :], mask=ok[:, None] & lo_ok[None, :], other=0.0)
    if NORM:  # the norm weights are the model's too (K = K_HI: the norm is one block, as add_rmsnorm's)
        wb = tl.load(wb_ptr + hi)
        if RESIDUAL:
            wa = tl.load(wa_ptr + hi)
    if PDL:
        gdc_wait()  # x, h, positions, slots and every store: after the predecessor
        gdc_launch_dependents()
    dtype = x_ptr.dtype.element_ty
    for m in range(M):
        x_row = x_ptr + m * stride_xm
        x_hi = tl.load(x_row + hi)
        x_lo = tl.load(x_row + lo, mask=lo_ok, other=0.0)
        if NORM and RESIDUAL:  # x' = x + w_a·norm(h), stored once (program 0)
            h = tl.load(h_ptr + m * stride_hm + hi).to(tl.float32)
            r = rms_rsqrt(tl.sum(h * h, axis=0), 0, inv_k, eps, False, LIBDEVICE)
            x_hi = (x_hi.to(tl.float32) + rms_weighted(h, r, wa).to(tl.float32)).to(dtype)
            if tl.program_id(0) == 0:
                tl.store(x_out_ptr + m * stride_xom + hi, x_hi)
        if NORM:  # the GEMV's input: w_b·norm(x')
            v = x_hi.to(tl.float32)
            x_hi = rms_weighted(v, rms_rsqrt(tl.sum(v * v, axis=0), 0, inv_k, eps, False, LIBDEVICE), wb)
        x_hi, x_lo = x_hi.to(tl.float32), x_lo.to(tl.float32)
        acc = tl.sum(a_hi.to(tl.float32) * x_hi[None, :], axis=1)
        if K_LO > 0:
            acc += tl.sum(a_lo.to(tl.float32) * x_lo[None, :], axis=1)
        if PAIRED:
            acc_b = tl.sum(b_hi.to(tl.float32) * x_hi[None, :], axis=1)
            if K_LO > 0:
                acc_b += tl.sum(b_lo.to(tl.float32) * x_lo[None, :], axis=1)
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
            rotary_kv_epilogue(acc.to(dtype).to(tl.float32), acc_b.to(dtype).to(tl.float32), units, ok,
                                rows_a, m, y_ptr + m * stride_ym, pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr,
                                vc_ptr, stride_cos, stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb,
                                stride_vcs, stride_vch, stride_vcd, GROUP, Q_HEADS, ROT_HEADS, BLOCK_SIZE)


def _rotary_kv_epilogue(
    a, b, units, ok, rows_a, m, q_row_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, stride_cos,
    stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HALF: tl.constexpr, Q_HEADS: tl.constexpr, ROT_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Row m's q|k|v pairs (a at dimension i of a head, b at i + HALF), as fused_ops._rope_qk_kernel
    stores them: q and k heads rotated (x·cos + rotate_half(x)·sin, each op rounded to the dtype), q
    into its row, k and v (as it is) into the paged caches at the row's slot."""
    dtype = q_row_ptr.dtype.element_ty
    head, i = units // HALF, units % HALF
    pos = tl.load(pos_ptr + m).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + i, mask=ok, other=0.0).to(tl.float32)
    rotated = head < ROT_HEADS
    o1 = tl.where(rotated, ((a * c).to(dtype).to(tl.float32) + (-b * s).to(dtype).to(tl.float32)), a).to(dtype)
    o2 = tl.where(rotated, ((b * c).to(dtype).to(tl.float32) + (a * s).to(dtype).to(tl.float32)), b).to(dtype)
    q_ok = ok & (head < Q_HEADS)
    tl.store(q_row_ptr + rows_a, o1, mask=q_ok)
    tl.store(q_row_ptr + rows_a + HALF, o2, mask=q_ok)
    slot = tl.load(slot_ptr + m).to(tl.int64)
    blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k_ok = ok & rotated & (head >= Q_HEADS)
    kc = kc_ptr + blk * stride_kcb + off * stride_kcs + (head - Q_HEADS) * stride_kch + i * stride_kcd
    tl.store(kc, o1.to(kc_ptr.dtype.element_ty), mask=k_ok)
    tl.store(kc + HALF * stride_kcd, o2.to(kc_ptr.dtype.element_ty), mask=k_ok)
    v_ok = ok & (head >= ROT_HEADS)
    vc = vc_ptr + blk * stride_vcb + off * stride_vcs + (head - ROT_HEADS) * stride_vch + i * stride_vcd
    tl.store(vc, o1.to(vc_ptr.dtype.element_ty), mask=v_ok)
    tl.store(vc + HALF * stride_vcd, o2.to(vc_ptr.dtype.element_ty), mask=v_ok)


# The epilogue as a device function, jitted at import in the mode Triton is in then (fused_ops' norm).
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


class InputNorm(NamedTuple):
    """The add + RMSNorm before a GEMV (fused_ops.add_rmsnorm's): x' = x + weight_a·norm(h), and the
    GEMV's input weight_b·norm(x'); h None: x' = x."""

    h: torch.Tensor | None
    weight_a: torch.Tensor | None
    weight_b: torch.Tensor
    eps: float


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
    construction (ROTARY_KV also takes the q|k|v heads, `heads` = (Hq, Hkv, Dh)); the input norm is
    per call (`__call__` none, `normed` and `rotary` one).
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

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x·weightᵀ [M, N] (SWIGLU: silu(gate)·up [M, N/2]), accumulated in fp32: one launch, no host
        synchronization."""
        return self._run(x, weight, None, None)[1]

    def normed(self, x: torch.Tensor, weight: torch.Tensor, norm: InputNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(x', the GEMV of w_b·norm(x')) in one launch: fused_ops.add_rmsnorm, then this strip."""
        return self._run(x, weight, norm, None)

    def rotary(self, x: torch.Tensor, weight: torch.Tensor, norm: InputNorm | None, rope: Rotary,
               kv: KVTarget) -> tuple[torch.Tensor, torch.Tensor]:
        """(x', rotated q [M, Hq, Dh]) of a ROTARY_KV strip, k and v stored at kv: the norm (when
        given; else x' is x), the q|k|v GEMV and fused_ops.write_kv_rotary in one launch."""
        if self.epilogue != Epilogue.ROTARY_KV or (rope.num_heads, rope.num_kv_heads, rope.head_dim) != self.heads:
            raise ValueError(f"{self!r} does not take RoPE of {rope.num_heads}+2×{rope.num_kv_heads} heads of "
                             f"{rope.head_dim}")
        check_rotary_targets(kv.k_cache, kv.v_cache, x.shape[0], x.dtype, rope, kv.slot_mapping)
        x_out, q = self._run(x, weight, norm, (rope, kv))
        return x_out, q.view(-1, rope.num_heads, rope.head_dim)

    def _run(self, x: torch.Tensor, weight: torch.Tensor, norm: InputNorm | None,
             rotary: tuple[Rotary, KVTarget] | None) -> tuple[torch.Tensor, torch.Tensor]:
        check_gemv_args("StripGemv", (self.out_features, self.in_features), self.max_rows, x, weight)
        if (rotary is None) != (self.epilogue != Epilogue.ROTARY_KV):
            raise ValueError(f"{self!r}: a ROTARY_KV strip runs through `rotary`, the others do not")
        norm_args, x_out = _norm_args(x, norm)
        rope_args = _rotary_args(x, rotary)
        _check_device(x, weight, *norm_args[:4], *rope_args[:6])
        m = x.shape[0]
        y = torch.empty(m, self._width, dtype=x.dtype, device=x.device)
        if m == 0:
            return x_out, y
        k_hi, k_lo, k_lo_pad = self._k
        interpret = _interpreting()
        q_heads, kv_heads, _ = self.heads or (0, 0, 0)
        jitted_gemv(_strip_kernel, interpret)[self._grid](
            x, weight, y, m, self._units, x.stride(0), weight.stride(0), y.stride(0), *norm_args, *rope_args,
            BLOCK_N=self.config.block_n, K_HI=k_hi, K_LO=k_lo, K_LO_PAD=k_lo_pad,
            NORM=norm is not None, RESIDUAL=norm is not None and norm.h is not None,
            PAIRED=self.epilogue != Epilogue.STORE, SWIGLU=self.epilogue == Epilogue.SWIGLU,
            ROTARY=rotary is not None, GROUP=self._group, Q_HEADS=q_heads,
            ROT_HEADS=q_heads + kv_heads, BLOCK_SIZE=rotary[1].k_cache.shape[1] if rotary else 1,
            LIBDEVICE=not interpret, **self.launch.kwargs(m, num_warps=self.config.num_warps, num_stages=1),
        )
        return x_out, y

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


def _norm_args(x: torch.Tensor, norm: InputNorm | None) -> tuple[tuple, torch.Tensor]:
    """The kernel's norm arguments (h, x', w_a, w_b, strides, 1/K, eps) and x' (x itself without a
    residual); unused ones point at x."""
    if norm is None:
        return (x, x, x, x, 0, 0, 1.0, 0.0), x
    k = x.shape[1]
    if k & (k - 1):
        raise ValueError(f"a strip's input norm needs K a power of two (the norm in one block), got {k}")
    if norm.weight_b.shape != (k,) or norm.weight_b.dtype != x.dtype:
        raise ValueError(f"the norm weight must be [{k}] of {x.dtype}, got {tuple(norm.weight_b.shape)} "
                         f"{norm.weight_b.dtype}")
    if norm.h is None:
        return (x, x, norm.weight_b, norm.weight_b, 0, 0, 1.0 / k, norm.eps), x
    h, weight_a = norm.h, norm.weight_a
    if h.shape != x.shape or h.stride(1) != 1 or h.dtype != x.dtype or weight_a is None \
            or weight_a.shape != (k,) or weight_a.dtype != x.dtype:
        raise ValueError(f"the residual h {tuple(h.shape)} {h.dtype} (unit column stride) must match x "
                         f"{tuple(x.shape)} {x.dtype}, with weight_a [{k}]")
    x_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return (h, x_out, weight_a, norm.weight_b, h.stride(0), x_out.stride(0), 1.0 / k, norm.eps), x_out


def _rotary_args(x: torch.Tensor, rotary: tuple[Rotary, KVTarget] | None) -> tuple:
    """The kernel's RoPE and cache arguments (positions, cos, sin, slots, caches, strides); unused
    ones point at x."""
    if rotary is None:
        return (x,) * 6 + (0,) * 9
    rope, kv = rotary
    return (rope.positions, rope.cos, rope.sin, kv.slot_mapping, kv.k_cache, kv.v_cache, rope.cos.stride(0),
            *kv.k_cache.stride(), *kv.v_cache.stride())
