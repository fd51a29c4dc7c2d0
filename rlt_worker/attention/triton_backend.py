"""Paged attention, KV writes and the LAST_EXITED finalize copy in Triton: the GPU path, with
torch_ref's exact contracts.

One launch serves every row (decode rows at mixed loop depths and prefill-chunk rows alike):
a row is a query token with its own block-table row and context length.

Kernel design (flash-decoding):

    grid = (rows, kv heads, splits)
    program (n, h, s): the GROUP query heads sharing kv head h, as one [GROUP_PAD, Dh] tile
        (padded to 16 rows for tl.dot, so each K/V tile is loaded once per group);
        tokens [s·span, min((s+1)·span, ctx_n)) in tiles of TILE = 64 tokens; each tile gathers
        its K/V rows [TILE, Dh] slot by slot through the block table (so TILE is independent of
        the block size), scores with tl.dot (ieee for fp32, SPEC §7a) and folds them into an
        online softmax accumulated in fp32.
    float64 (the CPU oracle dtype, not a serving one) takes a tl.sum path accumulated in fp64.
    splits = 1: the program normalizes and writes the output directly.
    splits > 1 (flash-decoding, when rows · kv heads < 2 · SMs): each program writes
        (max, sum, unnormalized acc) to scratch and a second kernel, grid (rows, q heads),
        merges the splits.

The split count is chosen on the host from shapes alone (rows, kv heads, block-table width,
SM count), never from context_lens' values: no device→host sync, so the call can be captured
in a CUDA graph. Splits are sized from the block-table width, so pass tables trimmed to the
batch's longest row. Measured on an H200 (Ouro-1.4B: 16 heads, Dh 128, block 16, contexts
~1,100, bf16, graph replay): 32 rows 75 µs, 64 rows 142 µs, 256 rows 552 µs, i.e. 3.9–4.2 TB/s
of K/V read against a ~4.3 TB/s copy ceiling; 1 row 9 µs with splits.

Triton is imported defensively and kernels are jitted on first use: importing this module works
on a machine without CUDA (or without Triton). Triton's interpreter (CPU tensors) needs
TRITON_INTERPRET=1 set before triton is first imported: Triton jits its own tl.* helpers then.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from rlt_worker.attention import torch_ref
from rlt_worker.kernels.launch import PLAIN, KernelLaunch
from rlt_worker.kernels.launch import interpreting as _interpreting
from rlt_worker.models.base import Rotary

try:  # Triton is a dependency, but keep the import from failing where no wheel exists.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - exercised only without Triton
    triton = None
    tl = None

__all__ = ["finalize_kv", "paged_attention", "paged_attention_rotary", "write_kv"]

_LOG2E = 1.4426950408889634
# One line to the L2 per pointer (PTX prefetch), and a dummy result: inline asm must return a value.
_PREFETCH_L2: tl.constexpr = tl.constexpr("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;") if tl else None
# Fewest tokens worth giving a split, and the most splits: one row of Ouro-1.4B at context 1,024 (a
# 1,024-token table) attends fastest in 16 splits of one 64-token tile each: 8.47 µs a layer against
# 9.19 in 8 of two tiles, PDL launches, on an H100 (scripts/bench_decode_attention.py,
# docs/benchmarks.md). A graphed pass's table is a power-of-two bucket (2,048 tokens for contexts of
# 1,025 to 2,048), hence 32 at most: one tile a split there too.
_MIN_SPLIT_TOKENS = 64
_MAX_SPLITS = 32
# How paged_attention_rotary's writer program hands this pass's k and v to its own loop (_attn_kernel,
# STORE_FIRST): from registers (False) or stored first behind a barrier (True); the same bits either
# way. From registers, the rotary attention was slower than the RoPE launch then the attention on an
# H100 (docs/benchmarks.md); store-first is untimed (scripts/gpu_time_off_paths.sh 1).
ROTARY_STORE_FIRST = False
# Warps per attention program. At Ouro-1.4B's heads (Dh 128, MHA, 64-token tiles, bf16, sm_90), Triton
# 3.6 gives 4 warps 255 registers a thread and a stack (spills) of 40 B, 408 B with ROTARY and its
# register hand-off, 16 B with STORE_FIRST; 8 warps 160-255 registers and no stack. Yet 4 stays: on an
# H100 (PDL launches, context 1,024) 8 warps took 9.18 µs a layer at 1 row against 9.26, and 111.6
# against 93.3 at 32 rows, where an SM holds half the programs (docs/benchmarks.md).
ATTENTION_WARPS = 4


def _attn_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
    qk_scale, scale_ptr, pos_ptr, cos_ptr, sin_ptr, stride_cos,
    stride_qn, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btn, stride_btb,
    stride_on, stride_oh, stride_od,
    split_tokens,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_F64: tl.constexpr, PDL: tl.constexpr,
    LINES: tl.constexpr, LINE_ELEMS: tl.constexpr, ROTARY: tl.constexpr, Q_HEADS: tl.constexpr,
    STORE_FIRST: tl.constexpr,
):
    """One (row, kv head, split): online-softmax attention of the head group over its token span.

    ROTARY: q_ptr is the rows' packed q|k|v (Q_HEADS q heads, then the k heads, then the v heads).
    Every program rotates its q heads at the row's position pos (pos_ptr, the cos/sin table rows;
    fused_ops._rope_qk_kernel's arithmetic), and the one whose span holds pos (the writer) also its
    kv head's k, and stores it and v at pos's slot: what a separate write then this attention would
    read and store, provided no other row of the batch reads pos (each row its own sequence). The
    writer hands them to its own loop one of two ways (STORE_FIRST, module constant
    ROTARY_STORE_FIRST): stored before its loop behind a CTA barrier, so its loop reads them from the
    cache (its loop starts an L2 round trip later); or (False) taken at pos's tile from registers
    and stored after its loop (that tile goes through shared memory to the dot: 36.9 KB a program
    against 22.5, sm_90 at Ouro-1.4B's heads).

    PDL (kernels/launch.py): q is the predecessor's (the rotating K/V write's) output, and so is the
    K/V at the rows' own positions, so every load the attention uses comes after the wait. Before it
    the program asks the L2 for its first tile's K and V lines (prefetch.global.L2): the L2 is
    where writes land, so a line the predecessor then writes is read fresh after the wait, and a
    stale block table or context length read for the addresses only prefetches the wrong lines.
    """
    # Program ids are int32 and Triton passes a stride below 2^31 as int32, so a product of the
    # two wraps silently: every index that scales a stride is widened first (here and below).
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    acc_dtype = tl.float64 if ACC_F64 else tl.float32

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g

    q_row = q_ptr + row * stride_qn
    q_ptrs = q_row + heads[:, None] * stride_qh + d[None, :] * stride_qd
    if PDL:
        # The first tile's K and V lines to the L2 (LINES lines of LINE_ELEMS elements a token's head);
        # tokens past the span point at the pool's first line (valid memory, never used).
        t = split * split_tokens + tl.arange(0, TILE)
        t_ok = t < tl.minimum(split * split_tokens + split_tokens, tl.load(ctx_ptr + row))
        blk = tl.load(bt_ptr + row * stride_btn + (t // BLOCK_SIZE) * stride_btb, mask=t_ok, other=0).to(tl.int64)
        line = tl.arange(0, LINES) * LINE_ELEMS
        t_in = (t % BLOCK_SIZE)[:, None]
        k_lines = k_ptr + blk[:, None] * stride_kb + t_in * stride_ks + kv_head * stride_kh + line[None, :] * stride_kd
        v_lines = v_ptr + blk[:, None] * stride_vb + t_in * stride_vs + kv_head * stride_vh + line[None, :] * stride_vd
        tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [tl.where(t_ok[:, None], k_lines, k_ptr)], dtype=tl.int32,
                                  is_pure=False, pack=1)
        tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [tl.where(t_ok[:, None], v_lines, v_ptr)], dtype=tl.int32,
                                  is_pure=False, pack=1)
        gdc_wait()
        gdc_launch_dependents()
    # Padded heads/dims load as 0: their scores are finite and never stored.
    q_ok = g_ok[:, None] & d_ok[None, :]
    if ROTARY:
        pos = tl.load(pos_ptr + row).to(tl.int64)
        half = HEAD_DIM // 2
        partner = tl.where(d < half, d + half, d - half)  # rotate_half's source of each dimension
        sign = tl.where(d < half, -1.0, 1.0)
        cos = tl.load(cos_ptr + pos * stride_cos + d % half, mask=d_ok, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_cos + d % half, mask=d_ok, other=0.0)
        q = rotate_half(q_ptrs, q_row + heads[:, None] * stride_qh + partner[None, :] * stride_qd, q_ok,
                        cos[None, :], sin[None, :], sign[None, :], ACC_F64)
        writes = pos // split_tokens == split  # one program of each (row, kv head): uniform, a branch
        pos_blk = tl.load(bt_ptr + row * stride_btn + (pos // BLOCK_SIZE) * stride_btb).to(tl.int64)
        k_dst = k_ptr + pos_blk * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh + d * stride_kd
        v_dst = v_ptr + pos_blk * stride_vb + (pos % BLOCK_SIZE) * stride_vs + kv_head * stride_vh + d * stride_vd
        k_new = tl.zeros([D_PAD], dtype=k_ptr.dtype.element_ty)
        v_new = tl.zeros([D_PAD], dtype=v_ptr.dtype.element_ty)
        if writes:
            kv = (Q_HEADS + kv_head) * stride_qh
            k_new = rotate_half(q_row + kv + d * stride_qd, q_row + kv + partner * stride_qd, d_ok, cos, sin,
                                sign, ACC_F64).to(k_ptr.dtype.element_ty)
            v_new = tl.load(q_row + (Q_HEADS + tl.num_programs(1) + kv_head) * stride_qh + d * stride_qd,
                            mask=d_ok).to(v_ptr.dtype.element_ty)
            if STORE_FIRST:
                tl.store(k_dst, k_new, mask=d_ok)
                tl.store(v_dst, v_new, mask=d_ok)
                tl.debug_barrier()  # the stores before any thread's loads of the loop
    else:
        q = tl.load(q_ptrs, mask=q_ok, other=0.0)
    if not USE_DOT:
        q = q.to(acc_dtype)
    if ACC_F64:
        # Scalar kernel args are fp32: read the exact fp64 scale from memory instead.
        qk_scale = tl.load(scale_ptr)

    ctx = tl.load(ctx_ptr + row)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, ctx)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=acc_dtype)
    l_i = tl.zeros([GROUP_PAD], dtype=acc_dtype)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=acc_dtype)

    t_local = tl.arange(0, TILE)
    for t0 in range(start, end, TILE):
        t = t0 + t_local
        t_ok = t < end
        # Per-token block lookup; masked so a table narrower than the padded tile is never overread.
        blk = tl.load(bt_ptr + row * stride_btn + (t // BLOCK_SIZE) * stride_btb, mask=t_ok, other=0)
        # int64: block × block stride overflows int32 on large pools.
        blk = blk.to(tl.int64)
        off_in = t % BLOCK_SIZE
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k_ptrs = (k_ptr + blk[:, None] * stride_kb + off_in[:, None] * stride_ks + kv_head * stride_kh
                  + d[None, :] * stride_kd)
        v_ptrs = (v_ptr + blk[:, None] * stride_vb + off_in[:, None] * stride_vs + kv_head * stride_vh
                  + d[None, :] * stride_vd)
        # other=0: stale slots past the context may hold NaN/inf, and 0·NaN would poison the dot.
        k = tl.load(k_ptrs, mask=kv_ok, other=0.0)
        v = tl.load(v_ptrs, mask=kv_ok, other=0.0)
        if ROTARY and not STORE_FIRST:  # at pos this pass's k and v (the cache still holds the old ones)
            here = (t == pos)[:, None]
            k = tl.where(here, k_new[None, :], k)
            v = tl.where(here, v_new[None, :], v)

        if USE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [GROUP_PAD, TILE] fp32
        else:
            s = tl.sum(q[:, None, :] * k.to(acc_dtype)[None, :, :], axis=2)
        s = s * qk_scale  # fp32/bf16: pre-multiplied by log2(e), so exp2 below
        s = tl.where(t_ok[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds ≥ 1 valid token
        if ACC_F64:
            # exp2 lowers to the fp32 approximation; exp on fp64 keeps double precision.
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
        else:
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(acc_dtype)[None, :, :], axis=1)
        m_i = m_new

    if ROTARY and not STORE_FIRST:
        if writes:  # pos's k and v into the cache, after the loop's reads
            tl.store(k_dst, k_new, mask=d_ok)
            tl.store(v_dst, v_new, mask=d_ok)
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + row * stride_on + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        # Scratch layout: m/l [rows, Hq, NUM_SPLITS], acc [rows, Hq, NUM_SPLITS, D_PAD], contiguous.
        # A split past the context stores m = -inf, l = 0, acc = 0, which the merge weighs as 0.
        ml_off = (row * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(m_ptr + ml_off, m_i, mask=g_ok)
        tl.store(l_ptr + ml_off, l_i, mask=g_ok)
        tl.store(acc_ptr + ml_off[:, None] * D_PAD + d[None, :], acc, mask=g_ok[:, None])


def _rotate_half(x_ptrs, partner_ptrs, mask, c, s, sign, F64: tl.constexpr):
    """x·cos + rotate_half(x)·sin at x_ptrs (partner_ptrs: each element's rotate_half source, sign its
    sign), every op rounded to x's dtype: fused_ops._rope_qk_kernel's arithmetic, element for element."""
    dtype = x_ptrs.dtype.element_ty
    cdt = tl.float64 if F64 else tl.float32
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(cdt)
    x_partner = tl.load(partner_ptrs, mask=mask, other=0.0).to(cdt)
    return ((x * c.to(cdt)).to(dtype).to(cdt) + (sign * x_partner * s.to(cdt)).to(dtype).to(cdt)).to(dtype)


# A device function, jitted at import in the mode Triton is in then (tests/interp.py: an interpreter
# process sets TRITON_INTERPRET before it imports Triton).
rotate_half = triton.jit(_rotate_half) if triton is not None else None


def _merge_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr,
    stride_on, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
    ACC_F64: tl.constexpr, PDL: tl.constexpr,
):
    """One (row, q head): merge the splits' partial softmax states into the output (PDL: every
    input is the attention kernel's, so only the index math runs before the wait)."""
    row = tl.program_id(0).to(tl.int64)  # int64: see _attn_kernel
    head = tl.program_id(1).to(tl.int64)
    sp = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    sp_ok = sp < NUM_SPLITS
    base = (row * tl.num_programs(1) + head) * NUM_SPLITS
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    m = tl.load(m_ptr + base + sp, mask=sp_ok, other=float("-inf"))
    l = tl.load(l_ptr + base + sp, mask=sp_ok, other=0.0)
    acc = tl.load(acc_ptr + (base + sp)[:, None] * D_PAD + d[None, :], mask=sp_ok[:, None], other=0.0)
    m_max = tl.max(m, axis=0)  # finite: split 0 always holds token 0
    # Empty splits weigh exp(-inf) = 0. m is in the log2 domain except for fp64 (see _attn_kernel).
    if ACC_F64:
        w = tl.exp(m - m_max)
    else:
        w = tl.exp2(m - m_max)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * stride_on + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One token: its K and V [Hkv, Dh] into cache slot slot_mapping[n]."""
    n = tl.program_id(0).to(tl.int64)  # int64: see _attn_kernel
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    ok = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    slot = tl.load(slot_ptr + n).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    k = tl.load(k_ptr + n * stride_kn + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=ok)
    v = tl.load(v_ptr + n * stride_vn + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=ok)
    kc = kc_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :] * stride_kcd
    vc = vc_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :] * stride_vcd
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=ok)


def _finalize_kv_kernel(
    pool_ptr, bt_ptr, slot_ptr, pos_ptr, depth_ptr,
    stride_pl, stride_pk, stride_pb, stride_ps, stride_ph, stride_pd,
    stride_bts, stride_btp, stride_btb,
    NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program (row, plane, layer·2 + K/V): if plane ≥ the row's exit depth e, copy the row's
    [Hkv, Dh] tile at its position from plane e − 1 into this plane."""
    row = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)
    # int64 before `layer × stride_pl`: the per-layer stride of a pool of 1,425–32,767 blocks of
    # Ouro-1.4B is below 2^31 (so Triton passes it as int32) while layer × stride is above it.
    layer_kv = tl.program_id(2).to(tl.int64)
    depth = tl.load(depth_ptr + row).to(tl.int64)
    if plane >= depth:
        slot = tl.load(slot_ptr + row).to(tl.int64)
        pos = tl.load(pos_ptr + row).to(tl.int64)
        table = bt_ptr + slot * stride_bts + (pos // BLOCK_SIZE) * stride_btb
        src_block = tl.load(table + (depth - 1) * stride_btp).to(tl.int64)
        dst_block = tl.load(table + plane * stride_btp).to(tl.int64)
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, D_PAD)
        ok = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        base = pool_ptr + (layer_kv // 2) * stride_pl + (layer_kv % 2) * stride_pk + (pos % BLOCK_SIZE) * stride_ps
        tile = h[:, None] * stride_ph + d[None, :] * stride_pd
        x = tl.load(base + src_block * stride_pb + tile, mask=ok)
        tl.store(base + dst_block * stride_pb + tile, x, mask=ok)


@functools.cache
def _jit(fn: Callable[..., Any], interpret: bool) -> Any:
    """fn decorated by triton.jit, once per mode: Triton fixes interpreter vs compiled at decoration."""
    del interpret  # only part of the cache key; triton.jit reads the environment itself
    return triton.jit(fn)


def _kernel(fn: Callable[..., Any]) -> Any:
    """The jitted kernel for fn in the current TRITON_INTERPRET mode."""
    if triton is None:
        raise RuntimeError("rlt_worker.attention.triton_backend needs Triton; use torch_ref instead")
    return _jit(fn, _interpreting())


@functools.cache
def _sm_count(device_index: int) -> int:
    """Multiprocessor count of a CUDA device."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_device(*tensors: torch.Tensor) -> None:
    """Triton must be importable; compiled kernels need CUDA tensors, CPU ones work only under TRITON_INTERPRET=1."""
    if triton is None:
        raise RuntimeError("rlt_worker.attention.triton_backend needs Triton; use torch_ref instead")
    if not _interpreting() and any(t.device.type != "cuda" for t in tensors):
        raise ValueError("Triton backend: tensors must be on CUDA (or set TRITON_INTERPRET=1 for CPU tests)")


def _auto_splits(num_rows: int, num_kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Splits per (row, kv head) so that small batches still fill the GPU; 1 when they already do.

    max_tokens is the block table's width, which a row's context fills from half to whole when the
    table is a graph's power-of-two bucket: the splits past the context return at once, so the
    occupancy bound counts twice the splits that would fill the GPU if every table were full."""
    if device.type != "cuda":
        return 1
    programs = num_rows * num_kv_heads
    target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= target:
        return 1
    by_occupancy = 2 * math.ceil(target / programs)
    by_length = max(1, max_tokens // _MIN_SPLIT_TOKENS)
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


_L2_LINE_BYTES = 128


def _prefetch_lines(head_dim: int, element_size: int) -> dict[str, int]:
    """The L2 lines a token's head spans (a power of two, for tl.arange) and the elements in a line."""
    line_elems = max(1, _L2_LINE_BYTES // element_size)
    return {"LINES": triton.next_power_of_2(math.ceil(head_dim / line_elems)), "LINE_ELEMS": line_elems}


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    tile: int | None = None,
    launch: KernelLaunch = PLAIN,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [N, Hq, Dh] over each row's first context_lens[i] cached positions (torch_ref's contract).

    k_cache, v_cache: [num_blocks, block_size, Hkv, Dh], any strides (views of a bigger pool are read
    in place); block_tables: int32 [N, max_blocks], any strides; context_lens: int32 [N] ≥ 1 and
    ≤ max_blocks·block_size. num_splits / tile override the heuristics (tests, tuning). launch: how
    the attention kernel and the split merge are launched (PDL or not). out: where to write the
    result (q's shape and dtype, any row stride; returned), else a new tensor.
    """
    _check_attention(q.shape, q.dtype, k_cache, v_cache, block_tables, context_lens)
    _check_device(q, k_cache, v_cache, block_tables, context_lens)
    return _attend(q, q.stride(), None, k_cache, v_cache, block_tables, context_lens, scale,
                   _output(out, q.shape, q.dtype, q.device), num_splits, tile, launch)


def paged_attention_rotary(
    qkv: torch.Tensor,
    rope: Rotary,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    tile: int | None = None,
    launch: KernelLaunch = PLAIN,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch_ref.paged_attention_rotary in one launch: packed q|k|v rows [N, (Hq + 2·Hkv)·Dh] rotated
    by `rope`, k and v stored at each row's slot at rope.positions[i] (its block table's), and the
    rotated q's attention (q [N, Hq, Dh], into `out` when given); bit for bit
    fused_ops.write_kv_rotary then paged_attention.

    The rows must be independent: no row's context holds a position another row of the batch writes
    (a decode batch, one row a sequence), since each row's write is seen only by its own programs.
    Arguments as write_kv_rotary's and paged_attention's.
    """
    rope.check_qkv(qkv)
    if qkv.stride(1) != 1 or k_cache.shape[2] != rope.num_kv_heads:
        raise ValueError(f"qkv strides {qkv.stride()} (a unit column stride needed) or caches of {k_cache.shape[2]} "
                         f"kv heads do not fit {rope.num_kv_heads} kv heads")
    q_shape = (qkv.shape[0], rope.num_heads, rope.head_dim)
    _check_attention(q_shape, qkv.dtype, k_cache, v_cache, block_tables, context_lens)
    _check_device(qkv, rope.positions, rope.cos, rope.sin, k_cache, v_cache, block_tables, context_lens)
    out = _output(out, q_shape, qkv.dtype, qkv.device)
    return _attend(qkv, (qkv.stride(0), rope.head_dim, 1), rope, k_cache, v_cache, block_tables, context_lens, scale,
                   out, num_splits, tile, launch)


def _check_attention(q_shape: tuple[int, ...], dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    num_rows, num_heads, head_dim = q_shape
    num_kv_heads, kv_dim = k_cache.shape[2:]
    if v_cache.shape != k_cache.shape or kv_dim != head_dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit q {tuple(q_shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_rows or context_lens.shape != (num_rows,):
        raise ValueError("block_tables must be [N, max_blocks] and context_lens [N]")
    if k_cache.dtype != dtype or v_cache.dtype != dtype:
        raise ValueError(f"dtype mismatch: q {dtype}, k {k_cache.dtype}, v {v_cache.dtype}")


def _attend(
    q: torch.Tensor, q_strides: tuple[int, int, int], rope: Rotary | None, k_cache: torch.Tensor,
    v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, out: torch.Tensor,
    num_splits: int | None, tile: int | None, launch: KernelLaunch,
) -> torch.Tensor:
    """The attention launch (and the split merge) of checked arguments; q is q|k|v rows when rope is given."""
    num_rows, num_heads, head_dim = out.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_rows == 0:
        return out
    context_lens = context_lens.to(torch.int32)  # no-op (no copy) when already int32
    block_tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)

    group = num_heads // num_kv_heads
    f64 = q.dtype == torch.float64
    # tl.dot needs every dim ≥ 16; fp64 (an oracle dtype, not a serving one) takes the tl.sum path,
    # which also avoids relying on fp64 MMA support.
    use_dot = not f64 and head_dim >= 16
    group_pad = max(triton.next_power_of_2(group), 16 if use_dot else 1)
    d_pad = triton.next_power_of_2(head_dim)
    if tile is None:
        tile = 64 if use_dot else 16
    max_tokens = block_tables.shape[1] * block_size
    splits = num_splits if num_splits is not None else _auto_splits(num_rows, num_kv_heads, max_tokens, q.device)
    splits = max(1, min(splits, max(1, math.ceil(max_tokens / tile))))
    # Each split spans whole tiles so that only the last tile of a row is partial.
    split_tokens = math.ceil(math.ceil(max_tokens / splits) / tile) * tile
    splits = max(1, math.ceil(max_tokens / split_tokens))

    acc_dtype = torch.float64 if f64 else torch.float32
    if splits > 1:
        m = torch.empty(num_rows, num_heads, splits, device=q.device, dtype=acc_dtype)
        l = torch.empty_like(m)
        acc = torch.empty(num_rows, num_heads, splits, d_pad, device=q.device, dtype=acc_dtype)
    else:
        m = l = acc = out  # unused by the single-split kernel
    # fp64 reads its scale (natural-log domain) from a tensor; a fill kernel, so graph capture still works.
    scale_t = torch.full((1,), float(scale), dtype=torch.float64, device=q.device) if f64 else out
    # Without rope the kernel never reads the rotary arguments (ROTARY is a constexpr).
    positions, cos, sin = (rope.positions, rope.cos, rope.sin) if rope is not None else (context_lens, out, out)

    _kernel(_attn_kernel)[(num_rows, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, m, l, acc,
        float(scale) * _LOG2E, scale_t, positions, cos, sin, cos.stride(0) if rope is not None else 0,
        *q_strides, *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        split_tokens,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, TILE=tile, NUM_SPLITS=splits,
        USE_DOT=use_dot, DOT_PRECISION="ieee" if q.dtype == torch.float32 else None, ACC_F64=f64,
        ROTARY=rope is not None, Q_HEADS=num_heads, STORE_FIRST=ROTARY_STORE_FIRST,
        **_prefetch_lines(head_dim, k_cache.element_size()),
        # No FMA contraction: the rotation rounds each op as fused_ops' RoPE kernel does.
        **launch.kwargs(num_rows, num_warps=ATTENTION_WARPS, num_stages=3, enable_fp_fusion=False),
    )
    if splits > 1:
        _kernel(_merge_kernel)[(num_rows, num_heads)](
            m, l, acc, out, *out.stride(),
            HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=splits, S_PAD=triton.next_power_of_2(splits), ACC_F64=f64,
            **launch.kwargs(num_rows),
        )
    return out


def _output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
            ) -> torch.Tensor:
    """The attention's output tensor: `out` (checked against q's shape, dtype and device) or a new one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    torch_ref.check_out(out, shape, dtype, device)
    return out


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k/v [N, Hkv, Dh] at flat cache slots (block * block_size + offset) [N], in one launch.

    Unlike torch_ref.write_kv the caches may be any strided view; slots must lie in [0, num_slots).
    """
    num_rows, num_kv_heads, head_dim = k.shape
    if num_rows == 0:
        return
    _check_device(k_cache, v_cache, k, v, slot_mapping)
    _kernel(_write_kv_kernel)[(num_rows,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, H_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )


def finalize_kv(
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    exit_depths: torch.Tensor,
) -> None:
    """torch_ref.finalize_kv in one launch: grid (rows, planes, layers × K/V), one [Hkv, Dh] tile each.

    Programs for planes at or below a row's exit return at once, so the grid is fixed by shapes
    alone (no device→host sync; capturable in a CUDA graph).
    """
    num_rows = slots.shape[0]
    layers, two, _, block_size, num_kv_heads, head_dim = kv_pool.shape
    if num_rows == 0:
        return
    _check_device(kv_pool, block_tables, slots, positions, exit_depths)
    _kernel(_finalize_kv_kernel)[(num_rows, block_tables.shape[1], layers * two)](
        kv_pool, block_tables, slots, positions, exit_depths,
        *kv_pool.stride(), *block_tables.stride(),
        NUM_KV_HEADS=num_kv_heads, H_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
    )


def __getattr__(name: str) -> Any:
    """The backend's prefill_attention (triton_prefill) and write_kv_rotary (kernels.fused_ops) live in
    modules that import this one: resolved lazily."""
    if name == "prefill_attention":
        from rlt_worker.attention.triton_prefill import prefill_attention

        return prefill_attention
    if name == "write_kv_rotary":
        from rlt_worker.kernels.fused_ops import write_kv_rotary

        return write_kv_rotary
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
