"""The attention context the runner hands to a model: one batch's rows over paged planes."""

from __future__ import annotations

from types import ModuleType

import torch

from rlt_worker.kv_storage import KVStorage
from rlt_worker.models.base import LayerId


class PagedPlaneView:
    """Where a batch's rows read and write one plane family: block table rows and write slots."""

    def __init__(self, block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> None:
        self.block_tables = block_tables  # int32 [N, max_blocks], each row's plane
        rows = torch.arange(len(positions), device=positions.device)
        blocks = block_tables[rows, positions // block_size].long()
        self.slot_mapping = blocks * block_size + positions % block_size


class PagedContext:
    """Implements models.base.AttentionContext over the worker's KV pool.

    Loop layers use `loop_view` (each row's depth plane); layers outside the loop use
    `outer_view` (one version per position). Every row reads positions 0 … its own.
    """

    def __init__(
        self,
        storage: KVStorage,
        backend: ModuleType,
        positions: torch.Tensor,
        loop_view: PagedPlaneView | None,
        outer_view: PagedPlaneView | None,
    ) -> None:
        self._storage = storage
        self._backend = backend
        self._context_lens = (positions + 1).to(torch.int32)
        self._loop_view = loop_view
        self._outer_view = outer_view

    def attend(self, layer: LayerId, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        view = self._loop_view if layer.in_loop else self._outer_view
        if view is None:
            raise RuntimeError(f"this batch has no {'loop' if layer.in_loop else 'outer'} plane view")
        k_cache, v_cache = self._storage.caches(layer.index)
        self._backend.write_kv(k_cache, v_cache, k, v, view.slot_mapping)
        scale = q.shape[-1] ** -0.5
        return self._backend.paged_attention(q, k_cache, v_cache, view.block_tables, self._context_lens, scale)
