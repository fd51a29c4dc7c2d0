"""Paged causal attention of prefill chunks in Triton: torch_ref.prefill_attention's contract on
tensor cores.

A chunk is one sequence's run of consecutive prompt positions; its own K/V are already in the
cache (write_kv runs first), so a row reads the paged prefix and the chunk alike, through one
block-table row per chunk:

    grid = (query tiles, chunks, kv heads)
    program (m, s, h): the tile of BLOCK_Q positions m·BLOCK_Q … of chunk s, times the GROUP query
        heads sharing kv head h, as one [BLOCK_M = BLOCK_Q · GROUP_PAD, Dh] tile (row i is
        position i // GROUP_PAD, head i % GROUP_PAD), so each K/V tile is loaded once per group;
        keys 0 … the tile's last position in tiles of BLOCK_N tokens, each gathered slot by slot
        through the block table (BLOCK_N is independent of the block size); QKᵀ and PV with
        tl.dot (bf16 in, fp32 accumulate; fp32 with ieee, SPEC §7a), causal mask, online softmax
        in fp32 (log2 domain).

        keys →             0 ………… p_s − 1 | p_s ………… p_s + n_s − 1
        row p_s            ███████████████ | █
        row p_s + 1        ███████████████ | ██
        …                  ███████████████ | ……
        row p_s + n_s − 1  ███████████████ | ██████████
                           the paged prefix  the chunk itself (causal)

    Tiles past a chunk's length (the grid is sized by the longest chunk) return at once.

The grid comes from shapes and the host-known longest chunk (max_query_len), never from the
metadata's values: no device→host sync, so the call can be captured in a CUDA graph. head_dim
that is not a power of two (Huginn: 96) is padded to the next one with masks. float64 (the CPU
oracle dtype, never a serving one) goes row by row through the decode kernel, which accumulates
in float64.

Addresses that an index times a stride can push past 2³¹ (rows × the q stride, block ids × the
block stride; KV pools reach 100+ GB) are computed in int64.
"""

from __future__ import annotations

import torch

from rlt_worker.attention import torch_ref
from rlt_worker.attention import triton_backend as tb
from rlt_worker.attention.triton_backend import tl, triton

__all__ = ["prefill_attention"]


def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, start_ptr, out_ptr,
    qk_scale,
    stride_qn, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_on, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (query tile, chunk, kv head): causal online-softmax attention of the tile's rows."""
    # Last tiles first: they read the most keys, so the long programs start early.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    chunk = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2).to(tl.int64)
    q_begin = tl.load(cu_ptr + chunk).to(tl.int64)
    q_len = (tl.load(cu_ptr + chunk + 1) - q_begin).to(tl.int32)
    if tile * BLOCK_Q >= q_len:
        return
    start = tl.load(start_ptr + chunk).to(tl.int32)  # the chunk's first position

    i = tl.arange(0, BLOCK_M)  # BLOCK_M = BLOCK_Q · GROUP_PAD
    local = tile * BLOCK_Q + i // GROUP_PAD  # row within the chunk
    g = i % GROUP_PAD
    row_ok = (local < q_len) & (g < GROUP)
    pos = start + local  # the row's position: it reads keys 0 … pos
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM

    # int64: row × the q stride passes 2³¹ in big batches.
    rows = q_begin + local.to(tl.int64)
    heads = kv_head * GROUP + g
    q_ptrs = q_ptr + rows[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :] * stride_qd
    # Rows past the chunk and padded heads/dims load as 0: their scores are finite and never stored.
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    first = start + tile * BLOCK_Q  # the tile's first and last positions
    last = start + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    table = bt_ptr + chunk * stride_bts
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    n = tl.arange(0, BLOCK_N)
    for t0 in range(0, last + 1, BLOCK_N):
        t = t0 + n
        t_ok = t <= last
        # Per-token block lookup, masked so a table narrower than the padded tile is never overread;
        # int64: block id × the block stride passes 2³¹ on large pools.
        blk = tl.load(table + (t // BLOCK_SIZE) * stride_btb, mask=t_ok, other=0).to(tl.int64)
        off_in = t % BLOCK_SIZE
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k_ptrs = k_base + blk[:, None] * stride_kb + off_in[:, None] * stride_ks + d[None, :] * stride_kd
        v_ptrs = v_base + blk[:, None] * stride_vb + off_in[:, None] * stride_vs + d[None, :] * stride_vd
        # other=0: stale slots past the context may hold NaN/inf, and 0·NaN would poison the dot.
        k = tl.load(k_ptrs, mask=kv_ok, other=0.0)
        v = tl.load(v_ptrs, mask=kv_ok, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
        if t0 + BLOCK_N > first:  # keys wholly before the tile's first position need no mask
            # Causal: key t ≤ the row's position (which also keeps t ≤ last for every stored row).
            s = tl.where(t[None, :] <= pos[:, None], s, float("-inf"))

        # Finite: key t0 ≤ the tile's first position, so every row sees ≥ 1 key in the first tile,
        # and a later tile that masks a whole row leaves its m_i as it was (alpha = 1, p = 0).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    start_positions: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of prefill chunks over their paged prefix and themselves (torch_ref's contract).

    q [N, Hq, Dh]: chunk s's rows are q[cu_query_lens[s] : cu_query_lens[s + 1]] at positions
    start_positions[s] …; k_cache, v_cache [num_blocks, block_size, Hkv, Dh], any strides (views of
    a bigger pool are read in place), already holding the chunks' own K/V; block_tables int
    [S, max_blocks], one row per chunk, any strides; cu_query_lens int [S + 1], start_positions
    int [S]. max_query_len: the longest chunk, known on the host (N when not given: correct, but
    the grid then has N / BLOCK_Q tiles per chunk). block_m … num_stages override the tuning. out:
    where to write the result (q's shape and dtype, any row stride; returned), else a new tensor.
    """
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    num_chunks = start_positions.shape[0]
    if v_cache.shape != k_cache.shape or kv_dim != head_dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_chunks or cu_query_lens.shape != (num_chunks + 1,):
        raise ValueError("block_tables must be [S, max_blocks], cu_query_lens [S + 1] and start_positions [S]")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    tb._check_device(q, k_cache, v_cache, block_tables, cu_query_lens, start_positions)
    if q.dtype == torch.float64 or head_dim < 16:
        # The oracle dtype (and dims too small for tl.dot) go row by row through the decode kernel.
        chunks, positions = torch_ref.chunk_rows(cu_query_lens, start_positions, num_rows)
        context_lens = (positions + 1).to(torch.int32)
        return tb.paged_attention(q, k_cache, v_cache, block_tables[chunks], context_lens, scale, out=out)
    out = tb._output(out, q.shape, q.dtype, q.device)
    if num_rows == 0 or num_chunks == 0:
        return out

    group = num_heads // num_kv_heads
    max_query_len = num_rows if max_query_len is None else max(1, min(max_query_len, num_rows))
    group_pad = triton.next_power_of_2(group)
    compiled = not tb._interpreting()
    # 64 × 32 tiles, 4 warps, 2 stages: the fastest of 20 tile settings at every Ouro-1.4B chunk
    # shape on an H200 (bf16, 32 chunks; docs/benchmarks.md), and float32 fits them too.
    if block_m is None:
        block_m = 64 if compiled else 16
    if block_n is None:
        block_n = 32 if compiled else 16
    # tl.dot needs every dim ≥ 16 and tl.arange powers of two; a tile holds one position at least.
    block_m = triton.next_power_of_2(max(block_m, 16, group_pad))
    block_n = triton.next_power_of_2(max(block_n, 16))
    block_q = block_m // group_pad
    launch_opts: dict[str, int] = {}
    if compiled:
        launch_opts = {"num_warps": num_warps or 4, "num_stages": num_stages or 2}

    grid = (triton.cdiv(max_query_len, block_q), num_chunks, num_kv_heads)
    tb._kernel(_prefill_kernel)[grid](
        q, k_cache, v_cache, block_tables, cu_query_lens, start_positions, out,
        float(scale) * tb._LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_q * group_pad, BLOCK_N=block_n,
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        **launch_opts,
    )
    return out
