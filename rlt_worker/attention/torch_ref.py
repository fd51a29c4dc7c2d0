"""Paged attention in plain torch: the CPU path and the oracle of the Triton kernels.

Every query row is one token with its own block table and context length (its position
+ 1), so decode rows at mixed loop depths and prefill-chunk rows share one call:

    row i:  block_tables[i] = [b0, b1, …]   context_lens[i] = position_i + 1
            reads cache slots b0*bs … b0*bs+bs−1, b1*bs …, up to context_lens[i] − 1
"""

from __future__ import annotations

import torch


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k/v [N, Hkv, Dh] at flat cache slots (block * block_size + offset) [N]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of q [N, Hq, Dh] over each row's first context_lens[i] cached positions.

    k_cache, v_cache: [num_blocks, block_size, Hkv, Dh]; block_tables: int [N, max_blocks];
    context_lens: int [N] ≥ 1. Softmax in float32 (float64 for float64 inputs).
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
    out = torch.einsum("nht,nthd->nhd", probs, values.to(compute))
    return out.to(q.dtype)


def copy_kv_slots(kv_pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy every layer's K and V at flat slots src → dst (LAST_EXITED finalize).

    kv_pool: [layers, 2, num_blocks, block_size, Hkv, Dh].
    """
    layers, two, _, _, num_kv_heads, head_dim = kv_pool.shape
    flat = kv_pool.view(layers, two, -1, num_kv_heads, head_dim)
    flat[:, :, dst_slots] = flat[:, :, src_slots]
