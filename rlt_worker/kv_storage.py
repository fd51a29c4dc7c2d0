"""The physical depth-aware paged KV pool of one worker.

One pool of blocks serves every plane; a block stores `block_size` positions of every
attention layer of its plane:

    pool[layer, 0 = K | 1 = V, block, offset, kv_head, head_dim]

Planes (which blocks a slot uses for what) are named by the slot table's block tables:
    LAST_EXITED: planes 0 … D−1 hold loop depths 1 … D of the loop layers
    SHARED:      plane 0 holds each position's last loop of the loop layers
    and, for models with layers outside the loop (Huginn prelude/coda), one more plane last.
The engine's KV manager decides which block ids a slot owns; this class only stores them.
"""

from __future__ import annotations

import torch

from protocol.messages import ModelInfo

LAST_EXITED = "last_exited"
SHARED = "shared"


def num_planes(info: ModelInfo, kv_layout: str, max_depth: int) -> int:
    """How many planes each slot's block table has."""
    loop_planes = max_depth if kv_layout == LAST_EXITED else 1
    return loop_planes + (1 if info.num_outer_kv_layers else 0)


def bytes_per_block(info: ModelInfo, block_size: int, dtype: torch.dtype) -> int:
    """Device bytes one block occupies."""
    layers = max(info.num_loop_kv_layers, info.num_outer_kv_layers)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return layers * 2 * block_size * info.num_kv_heads * info.head_dim * itemsize


class KVStorage:
    """Owns the pool tensor; hands out per-layer cache views."""

    def __init__(
        self, info: ModelInfo, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        layers = max(info.num_loop_kv_layers, info.num_outer_kv_layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = torch.zeros(
            layers, 2, num_blocks, block_size, info.num_kv_heads, info.head_dim, dtype=dtype, device=device
        )
        # Views made once: every attention call of every layer asks for its pair.
        self._caches = [(self.pool[i, 0], self.pool[i, 1]) for i in range(layers)]

    def caches(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each [num_blocks, block_size, Hkv, Dh] (views of the pool)."""
        return self._caches[layer_index]

