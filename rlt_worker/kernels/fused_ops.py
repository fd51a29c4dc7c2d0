"""Fused elementwise kernels of Ouro's decoder layer: residual add + RMSNorm, split-half RoPE, SwiGLU.

Each kernel computes its torch composition in rlt_worker.models.layers in the same rounding order
(SPEC §9), one launch per call, one program per row (SwiGLU: per row and column tile):

    add_rmsnorm(x, h, w_a, w_b)   x' = x + w_a·norm(h),  y = w_b·norm(x')   (h None: x' = x)
        norm(h) = (h32 · rsqrt(mean(h32²) + eps)) cast to the dtype, h32 = h in fp32 (fp64 on
        float64); w·norm rounded to the dtype; the residual add rounded to the dtype.
        Ouro's sandwich-norm boundaries are all this one shape: after attention
        (x + input_layernorm_2(attn), then post_attention_layernorm), after the MLP
        (x + post_attention_layernorm_2(mlp), then the next layer's input_layernorm, or
        model.norm after the last layer).
    rope_qk(qkv, positions, cos, sin)   the q and k heads of packed q|k|v rows, rotated:
        x·cos + rotate_half(x)·sin, each product and the sum rounded to the dtype; cos/sin come
        from a table that layers.split_half_cos_sin computed (fp32, cast), gathered by position.
    write_kv_rotary(k_cache, v_cache, qkv, rope, slots)   the same kernel storing rotated k and v
        straight into the paged caches (the Triton backend's fused K/V write); q comes back.
    swiglu(gate_up)   silu(gate)·up of packed gate|up rows: silu in fp32, rounded, the product
        rounded.

Exactness. Elementwise steps use what torch's CUDA kernels use: libdevice rsqrtf and expf, IEEE
division, and no FMA contraction (`enable_fp_fusion=False`), so they round as the unfused ops do.
The one difference is the mean of squares, a tree sum in another order than torch's, so fp32
results can differ in the last bit (and bf16 ones, rarely, by one bf16 ulp).

PDL (`launch=`, kernels/launch.py): each kernel waits for its predecessor before its first load of
activations, positions or slots and before its first store; before the wait add_rmsnorm loads its
norm weights, RoPE and SwiGLU only do index math.

Addresses: row index × row stride is formed in int64 (program ids are cast before multiplying).
Under TRITON_INTERPRET=1 (CPU tests) the libdevice calls, which the interpreter lacks, are replaced
by tl.math.rsqrt and tl.exp (numpy); the interpreter also truncates fp32→bf16 casts, so bf16 is
checked on the GPU only.
"""

from __future__ import annotations

import torch

from rlt_worker.attention.triton_backend import _check_device, _interpreting, _kernel, tl, triton
from rlt_worker.kernels.launch import PLAIN, KernelLaunch
from rlt_worker.models.base import Rotary
from rlt_worker.models.layers import split_half_cos_sin

try:
    from triton.language.extra import libdevice
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - exercised only without Triton
    libdevice = None

__all__ = ["add_rmsnorm", "check_rotary_targets", "rope_qk", "rope_table", "swiglu", "write_kv_rotary"]

SWIGLU_BLOCK = 1024  # columns per SwiGLU program


def _add_rmsnorm_kernel(
    x_ptr, h_ptr, wa_ptr, wb_ptr, x_out_ptr, y_ptr, eps_ptr,
    stride_x, stride_h, stride_xo, stride_y,
    n_cols, inv_n, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, F64: tl.constexpr, LIBDEVICE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row: x' = x + w_a·norm(h) (stored), y = w_b·norm(x') (stored)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    dtype = y_ptr.dtype.element_ty
    cdt = tl.float64 if F64 else tl.float32
    # The weights are the model's, which no kernel writes: loaded before the PDL wait.
    wb = tl.load(wb_ptr + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        wa = tl.load(wa_ptr + cols, mask=ok, other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if F64:
        eps = tl.load(eps_ptr)  # a Python float argument is fp32: the exact fp64 eps comes from memory
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        h = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(cdt)
        if F64:
            r = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
        elif LIBDEVICE:
            r = libdevice.rsqrt(tl.sum(h * h, axis=0) * inv_n + eps)
        else:
            r = tl.math.rsqrt(tl.sum(h * h, axis=0) * inv_n + eps)
        a = (wa.to(cdt) * (h * r).to(dtype).to(cdt)).to(dtype)
        x = (x.to(cdt) + a.to(cdt)).to(dtype)
        tl.store(x_out_ptr + row * stride_xo + cols, x, mask=ok)
    xc = x.to(cdt)
    if F64:
        r = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    elif LIBDEVICE:
        r = libdevice.rsqrt(tl.sum(xc * xc, axis=0) * inv_n + eps)
    else:
        r = tl.math.rsqrt(tl.sum(xc * xc, axis=0) * inv_n + eps)
    y = (wb.to(cdt) * (xc * r).to(dtype).to(cdt)).to(dtype)
    tl.store(y_ptr + row * stride_y + cols, y, mask=ok)


def _rope_qk_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, slot_ptr, kc_ptr, vc_ptr,
    stride_qkv, stride_cos, stride_out,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_HEADS: tl.constexpr, NUM_OUT: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TO_CACHE: tl.constexpr, F64: tl.constexpr, PDL: tl.constexpr,
):
    """One row: its first NUM_HEADS heads (q then k) rotated; heads < NUM_OUT into out [.., 2·HALF].

    TO_CACHE: NUM_OUT is the q heads; the rotated k heads and the row's unrotated v heads go to
    the paged caches at slot slot_mapping[row] (block = slot // BLOCK_SIZE, offset = slot % it).
    """
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    i_ok = i < HALF
    ok = (heads < NUM_HEADS)[:, None] & i_ok[None, :]
    dtype = out_ptr.dtype.element_ty
    cdt = tl.float64 if F64 else tl.float32
    if PDL:
        gdc_wait()  # qkv is the predecessor's; positions and slots are read after the wait too
        gdc_launch_dependents()
    pos = tl.load(pos_ptr + row).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=i_ok, other=0.0).to(cdt)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + i, mask=i_ok, other=0.0).to(cdt)[None, :]
    src = qkv_ptr + row * stride_qkv + heads[:, None] * (2 * HALF) + i[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(cdt)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(cdt)
    # x·cos + rotate_half(x)·sin with rotate_half([x1, x2]) = [−x2, x1]; every op rounded to the dtype.
    o1 = ((x1 * c).to(dtype).to(cdt) + (-x2 * s).to(dtype).to(cdt)).to(dtype)
    o2 = ((x2 * c).to(dtype).to(cdt) + (x1 * s).to(dtype).to(cdt)).to(dtype)
    out_ok = ok & (heads < NUM_OUT)[:, None]
    dst = out_ptr + row * stride_out + heads[:, None] * (2 * HALF) + i[None, :]
    tl.store(dst, o1, mask=out_ok)
    tl.store(dst + HALF, o2, mask=out_ok)
    if TO_CACHE:
        slot = tl.load(slot_ptr + row).to(tl.int64)
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        k_ok = ok & (heads >= NUM_OUT)[:, None]
        kc = (kc_ptr + blk * stride_kcb + off * stride_kcs + (heads - NUM_OUT)[:, None] * stride_kch
              + i[None, :] * stride_kcd)
        tl.store(kc, o1.to(kc_ptr.dtype.element_ty), mask=k_ok)
        tl.store(kc + HALF * stride_kcd, o2.to(kc_ptr.dtype.element_ty), mask=k_ok)
        # v: the row's last KV_HEADS heads, copied as they are (write_kv's store).
        h = tl.arange(0, KV_PAD)
        d = tl.arange(0, 2 * HALF_PAD)
        v_ok = (h < KV_HEADS)[:, None] & (d < 2 * HALF)[None, :]
        v = tl.load(qkv_ptr + row * stride_qkv + (NUM_HEADS + h)[:, None] * (2 * HALF) + d[None, :], mask=v_ok)
        vc = vc_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :] * stride_vcd
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=v_ok)


def _swiglu_kernel(
    gu_ptr, out_ptr, stride_gu, stride_out, n_cols,
    BLOCK: tl.constexpr, F64: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
):
    """Row, column tile: silu(gate)·up of columns [tile·BLOCK, (tile+1)·BLOCK)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    cdt = tl.float64 if F64 else tl.float32
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(cdt)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=ok, other=0.0).to(cdt)
    if F64:
        silu = g / (1.0 + tl.exp(-g))
    elif LIBDEVICE:
        silu = tl.div_rn(g, 1.0 + libdevice.exp(-g))  # torch: x / (1 + expf(-x)), IEEE division
    else:
        silu = tl.div_rn(g, 1.0 + tl.exp(-g))
    out = (silu.to(dtype).to(cdt) * u).to(dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=ok)


def _options(num_warps: int, launch: KernelLaunch, rows: int) -> dict[str, object]:
    """Launch keywords: no FMA contraction (torch's unfused ops round each step), and launch's (PDL)."""
    return launch.kwargs(rows, num_warps=num_warps, enable_fp_fusion=False)


def _rows(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be [rows, columns] with unit column stride, got {tuple(t.shape)} "
                         f"strides {t.stride()}")


def add_rmsnorm(
    x: torch.Tensor, h: torch.Tensor | None, weight_a: torch.Tensor | None, weight_b: torch.Tensor, eps: float,
    *, launch: KernelLaunch = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', y) with x' = x + weight_a·norm(h) and y = weight_b·norm(x'), in one launch.

    h None: x' is x itself and y = weight_b·norm(x) (a plain RMSNorm). x, h: [N, H] rows (any row
    stride), weights [H]; x' and y are new contiguous [N, H] tensors of x's dtype.
    """
    _rows(x, "x")
    num_rows, hidden = x.shape
    has_residual = h is not None
    if has_residual:
        _rows(h, "h")
        if h.shape != x.shape or weight_a is None:
            raise ValueError(f"h {tuple(h.shape)} must match x {tuple(x.shape)}, with weight_a")
    _check_device(x, weight_b, *((h, weight_a) if has_residual else ()))
    y = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    x_out = torch.empty_like(y) if has_residual else x
    if num_rows == 0:
        return x_out, y
    f64 = x.dtype == torch.float64
    eps_t = torch.full((1,), eps, dtype=torch.float64, device=x.device) if f64 else y
    block = triton.next_power_of_2(hidden)
    _kernel(_add_rmsnorm_kernel)[(num_rows,)](
        x, h if has_residual else x, weight_a if has_residual else weight_b, weight_b, x_out, y, eps_t,
        x.stride(0), h.stride(0) if has_residual else 0, x_out.stride(0), y.stride(0),
        hidden, 1.0 / hidden, eps,
        HAS_RESIDUAL=has_residual, BLOCK=block, F64=f64, LIBDEVICE=not _interpreting(),
        **_options(4 if block <= 1024 else 8, launch, num_rows),
    )
    return x_out, y


def rope_table(
    max_positions: int, head_dim: int, base: float, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim/2] of positions 0 … max_positions−1, as layers.split_half_cos_sin
    computes them (its two halves are equal, so one half is kept)."""
    positions = torch.arange(max_positions, device=device)
    cos, sin = split_half_cos_sin(positions, head_dim, base, dtype)
    half = head_dim // 2
    return cos[:, 0, :half].contiguous(), sin[:, 0, :half].contiguous()


def rope_qk(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, Dh] and k [N, Hkv, Dh], rotated, from packed q|k|v rows [N, (Hq + 2·Hkv)·Dh], one launch.

    positions [N] index the rope_table rows cos/sin [max_positions, Dh/2]. The results are views of
    one new [N, Hq + Hkv, Dh] tensor; v stays where it is (qkv[:, (Hq + Hkv)·Dh:]).
    """
    rope = Rotary(positions, cos, sin, num_heads, num_kv_heads, head_dim)
    out = torch.empty(qkv.shape[0], num_heads + num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope(qkv, rope, out, None, PLAIN)
    return out[:, :num_heads], out[:, num_heads:]


def write_kv_rotary(
    k_cache: torch.Tensor, v_cache: torch.Tensor, qkv: torch.Tensor, rope: Rotary, slot_mapping: torch.Tensor,
    *, launch: KernelLaunch = PLAIN,
) -> torch.Tensor:
    """rope_qk then triton_backend.write_kv in one launch: rotated q [N, Hq, Dh] returned, rotated k
    and v (as it is in qkv) stored at flat cache slots [N] of k_cache/v_cache [blocks, block_size, Hkv, Dh]
    (any strides), bit for bit what the two launches store."""
    check_rotary_targets(k_cache, v_cache, qkv.shape[0], qkv.dtype, rope, slot_mapping)
    q = torch.empty(qkv.shape[0], rope.num_heads, rope.head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope(qkv, rope, q, (k_cache, v_cache, slot_mapping), launch)
    return q


def check_rotary_targets(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: int, dtype: torch.dtype, rope: Rotary,
                         slot_mapping: torch.Tensor) -> None:
    """A rotating K/V write's caches [blocks, block_size, Hkv, Dh] of the rows' dtype, slots [rows], and
    one rope_table pair; a ValueError otherwise."""
    cache_shape = (rope.num_kv_heads, rope.head_dim)
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != cache_shape or k_cache.dtype != dtype \
            or v_cache.dtype != dtype or slot_mapping.shape != (rows,) or rope.positions.shape != (rows,):
        raise ValueError(f"caches {tuple(k_cache.shape)} {k_cache.dtype}, {tuple(v_cache.shape)} {v_cache.dtype}, "
                         f"slots {tuple(slot_mapping.shape)} and positions {tuple(rope.positions.shape)} do not fit "
                         f"{rows} rows of {dtype} with {rope.num_kv_heads} kv heads of {rope.head_dim}")
    rope.check_table()


def _rope(
    qkv: torch.Tensor, rope: Rotary, out: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, launch: KernelLaunch,
) -> None:
    """The one RoPE launch: q|k rotated into out, or (cache given) q into out and k, v into the caches."""
    _rows(qkv, "qkv")
    num_rows = qkv.shape[0]
    positions, cos, sin, num_heads, num_kv_heads, head_dim = rope
    heads = num_heads + num_kv_heads
    rope.check_qkv(qkv)
    _check_device(qkv, positions, cos, sin, *(cache or ()))
    if num_rows == 0:
        return
    # Without a cache the kernel never reads the cache arguments (TO_CACHE is a constexpr).
    k_cache, v_cache, slots = cache or (out, out, positions)
    cache_strides = (*k_cache.stride(), *v_cache.stride()) if cache else (0,) * 8
    half = head_dim // 2
    _kernel(_rope_qk_kernel)[(num_rows,)](
        qkv, positions, cos, sin, out, slots, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), out.stride(0), *cache_strides,
        NUM_HEADS=heads, NUM_OUT=out.shape[1], HEADS_PAD=triton.next_power_of_2(heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        KV_HEADS=num_kv_heads, KV_PAD=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=k_cache.shape[1] if cache else 1, TO_CACHE=cache is not None, F64=qkv.dtype == torch.float64,
        **_options(4, launch, num_rows),
    )


def swiglu(gate_up: torch.Tensor, *, launch: KernelLaunch = PLAIN) -> torch.Tensor:
    """silu(gate)·up [N, I] of packed gate|up rows [N, 2·I], in one launch."""
    _rows(gate_up, "gate_up")
    num_rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate|up rows must have an even width, got {width}")
    _check_device(gate_up)
    inner = width // 2
    out = torch.empty(num_rows, inner, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        block = min(SWIGLU_BLOCK, triton.next_power_of_2(inner))
        _kernel(_swiglu_kernel)[(num_rows, triton.cdiv(inner, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inner,
            BLOCK=block, F64=gate_up.dtype == torch.float64, LIBDEVICE=not _interpreting(),
            **_options(4, launch, num_rows),
        )
    return out
