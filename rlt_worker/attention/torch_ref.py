"""Paged attention in plain torch: the CPU path and the oracle of the Triton kernels.

paged_attention: every query row is one token with its own block table and context length
(its position + 1), so decode rows at mixed loop depths and prefill-chunk rows share one call:

    row i:  block_tables[i] = [b0, b1, …]   context_lens[i] = position_i + 1
            reads cache slots b0*bs … b0*bs+bs−1, b1*bs …, up to context_lens[i] − 1

prefill_attention: the rows come as whole chunks, one per sequence, with one block-table row
per sequence (the Triton prefill kernel's contract; see chunk_rows for the row layout). Here it
is the per-row definition above, applied row by row, so the CPU path's numbers do not change.
"""

from __future__ import annotations

import torch

from rlt_worker.models.base import Rotary
from rlt_worker.models.layers import apply_split_half


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k/v [N, Hkv, Dh] at flat cache slots (block * block_size + offset) [N]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v


def write_kv_rotary(
    k_cache: torch.Tensor, v_cache: torch.Tensor, qkv: torch.Tensor, rope: Rotary, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """Rotate q|k of packed q|k|v rows [N, (Hq + 2·Hkv)·Dh] by `rope`, store k and v as write_kv does,
    return q [N, Hq, Dh]: the torch modules' rotation (layers.apply_split_half) at the table's rows."""
    positions, cos, sin, num_heads, num_kv_heads, head_dim = rope
    n, heads = qkv.shape[0], num_heads + num_kv_heads
    c, s = cos[positions], sin[positions]  # [N, Dh/2]: the table keeps one of the two equal halves
    qk = apply_split_half(qkv[:, : heads * head_dim].view(n, heads, head_dim),
                          torch.cat((c, c), dim=-1)[:, None], torch.cat((s, s), dim=-1)[:, None])
    write_kv(k_cache, v_cache, qk[:, num_heads:], qkv[:, heads * head_dim :].view(n, num_kv_heads, head_dim),
             slot_mapping)
    return qk[:, :num_heads]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [N, Hq, Dh] over each row's first context_lens[i] cached positions.

    k_cache, v_cache: [num_blocks, block_size, Hkv, Dh]; block_tables: int [N, max_blocks];
    context_lens: int [N] ≥ 1. Softmax in float32 (float64 for float64 inputs). out: where to write
    the result (q's shape and dtype; returned), else a new tensor.
    """
    num_rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    offsets = torch.arange(max_len, device=q.device)
    blocks = block_tables.long()[:, offsets // block_size]  # [N, T]
    slots = blocks * block_size + offsets % block_size
    keys = k_cache.view(-1, num_kv_heads, head_dim)[slots]  # [N, T, Hkv, Dh]
    values = v_cache.view(-1, num_kv_heads, head_dim)[slots]
    group = num_heads // num_kv_heads
    if group > 1:
        keys = keys.repeat_interleave(group, dim=2)
        values = values.repeat_interleave(group, dim=2)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.einsum("nhd,nthd->nht", q.to(compute), keys.to(compute)) * scale
    valid = offsets[None, :] < context_lens[:, None]  # [N, T]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    result = torch.einsum("nht,nthd->nhd", probs, values.to(compute)).to(q.dtype)
    if out is None:
        return result
    check_out(out, q.shape, q.dtype, q.device)
    return out.copy_(result)


def paged_attention_rotary(
    qkv: torch.Tensor,
    rope: Rotary,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """write_kv_rotary of packed q|k|v rows at each row's slot at rope.positions[i] (block_tables[i]'s),
    then paged_attention of the rotated q: a decode batch's write and attention in one call."""
    block_size = k_cache.shape[1]
    positions = rope.positions.long()
    rows = torch.arange(len(positions), device=positions.device)
    slots = block_tables.long()[rows, positions // block_size] * block_size + positions % block_size
    q = write_kv_rotary(k_cache, v_cache, qkv, rope, slots)
    return paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out=out)


def check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """An attention's `out` must be its q's shape and dtype, on q's device."""
    if out.shape != shape or out.dtype != dtype or out.device != device:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} does not fit q {tuple(shape)} "
                         f"{dtype} on {device}")


def finalize_kv(
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    exit_depths: torch.Tensor,
) -> None:
    """LAST_EXITED finalize (SPEC §4): each row's K/V at its position, every layer, is copied from
    its exit plane (depth e, plane e − 1) into every deeper plane e … D − 1.

    kv_pool: [layers, 2, num_blocks, block_size, Hkv, Dh]; block_tables: [slots, loop planes, max_blocks];
    slots, positions, exit_depths: [R], on the pool's device. No value is read back to the host.
    """
    layers, two, _, block_size, num_kv_heads, head_dim = kv_pool.shape
    planes = block_tables.shape[1]
    blocks = block_tables[slots, :, positions // block_size].long()  # [R, planes]
    offsets = (positions % block_size)[:, None]
    src = blocks.gather(1, (exit_depths - 1)[:, None].long()) * block_size + offsets  # [R, 1]
    deeper = torch.arange(planes, device=blocks.device)[None, :] >= exit_depths[:, None]
    # Planes up to the exit keep their own K/V: their "copy" is the source onto itself, which
    # keeps the index shapes static (no boolean select, so no device→host sync).
    dst = torch.where(deeper, blocks * block_size + offsets, src)
    flat = kv_pool.view(layers, two, -1, num_kv_heads, head_dim)
    flat[:, :, dst.reshape(-1)] = flat[:, :, src.expand_as(dst).reshape(-1)]


def chunk_rows(
    cu_query_lens: torch.Tensor, start_positions: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk index, position) of every row of a chunked batch, int64 [num_rows] each.

        rows:           | chunk 0: n0 rows | chunk 1: n1 rows | …
        cu_query_lens   = [0, n0, n0 + n1, …]            [S + 1]
        start_positions = [p0, p1, …]                     [S]  (each chunk's first position)
        row r of chunk s is at position p_s + (r − cu_query_lens[s])

    Computed on the device from shapes alone (searchsorted, no readback).
    """
    cu = cu_query_lens.long()
    rows = torch.arange(num_rows, device=cu.device)
    chunks = torch.searchsorted(cu[1:], rows, right=True)
    return chunks, start_positions.long()[chunks] + rows - cu[chunks]


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of prefill chunks q [N, Hq, Dh] over their paged prefix and themselves.

    Chunk s's rows are q[cu_query_lens[s] : cu_query_lens[s + 1]], at positions start_positions[s] …;
    each reads positions 0 … its own through block_tables[s] (int [S, max_blocks], one row per
    chunk). The chunk's own K/V must already be in the cache (write_kv first). max_query_len (the
    longest chunk, host-known) sizes the Triton grid; unused here. out: as paged_attention's.
    """
    del max_query_len
    chunks, positions = chunk_rows(cu_query_lens, start_positions, q.shape[0])
    return paged_attention(q, k_cache, v_cache, block_tables[chunks], positions + 1, scale, out=out)
