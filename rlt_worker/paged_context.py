"""The attention context the runner hands to a model: one batch's rows over paged planes."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch

from rlt_worker.kv_storage import KVStorage
from rlt_worker.models.base import LayerId, Rotary


@dataclass(frozen=True)
class PrefillChunks:
    """A PREFILL batch's rows as whole chunks, one per sequence (the prefill kernel's metadata):

        rows:            | chunk 0: p0 … p0+n0−1 | chunk 1: p1 … p1+n1−1 | …
        cu_query_lens    = [0, n0, n0 + n1, …]     int [S + 1]
        start_positions  = [p0, p1, …]             int [S]
        table_rows[r]    = the chunk of row r      int [N] (each view's block tables are per chunk)
        max_query_len    = max n_s, on the host    (sizes the kernel's grid without a readback)
    """

    cu_query_lens: torch.Tensor
    start_positions: torch.Tensor
    table_rows: torch.Tensor
    max_query_len: int


class PagedPlaneView:
    """Where a batch's rows read and write one plane family: block table rows and write slots.

    block_tables has one row per query row, or one per chunk when `table_rows` (row → table row)
    is given.
    """

    def __init__(
        self, block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
        table_rows: torch.Tensor | None = None,
    ) -> None:
        self.block_tables = block_tables  # int32 [N or S, max_blocks], each row's (or chunk's) plane
        rows = torch.arange(len(positions), device=positions.device) if table_rows is None else table_rows
        blocks = block_tables[rows, positions // block_size].long()
        self.slot_mapping = blocks * block_size + positions % block_size


class PagedContext:
    """Implements models.base.RotaryAttentionContext over the worker's KV pool.

    Loop layers use `loop_view` (each row's depth plane); layers outside the loop use
    `outer_view` (one version per position). Every row reads positions 0 … its own: through
    the backend's prefill_attention when the rows come as `chunks` (views with one table row
    per chunk), else through paged_attention, one row at a time.

    `fused_rotary` (rows not in chunks): attend_rotary rotates, writes and attends in one launch
    (paged_attention_rotary), which asks that no row read a position another row of the batch
    writes: the runner's decode batches, one row a slot, each slot its own sequence. Chosen once,
    by the runner (RunnerConfig.fused_rotary_attention).
    """

    def __init__(
        self,
        storage: KVStorage,
        backend: ModuleType | SimpleNamespace,  # attention.get_backend's
        positions: torch.Tensor,
        loop_view: PagedPlaneView | None,
        outer_view: PagedPlaneView | None,
        chunks: PrefillChunks | None = None,
        fused_rotary: bool = False,
    ) -> None:
        self._storage = storage
        self._fused_rotary = fused_rotary and chunks is None
        self._backend = backend
        self._context_lens = (positions + 1).to(torch.int32) if chunks is None else None
        self._loop_view = loop_view
        self._outer_view = outer_view
        self._chunks = chunks

    def attend(self, layer: LayerId, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """This batch's K/V written, then q's attention over the caches (into `out` when given)."""
        view = self._view(layer)
        k_cache, v_cache = self._storage.caches(layer.index)
        self._backend.write_kv(k_cache, v_cache, k, v, view.slot_mapping)
        return self._attention(view, q, k_cache, v_cache, out)

    def attend_rotary(self, layer: LayerId, qkv: torch.Tensor, rope: Rotary, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """`attend` with q/k rotated in the K/V write's launch (the backend's write_kv_rotary), or with
        `fused_rotary` in the attention's launch too (the backend's paged_attention_rotary)."""
        if self._fused_rotary:
            view = self._view(layer)
            k_cache, v_cache = self._storage.caches(layer.index)
            return self._backend.paged_attention_rotary(qkv, rope, k_cache, v_cache, view.block_tables,
                                                        self._context_lens, rope.head_dim ** -0.5, out=out)

        view = self._view(layer)
        k_cache, v_cache = self._storage.caches(layer.index)
        q = self._backend.write_kv_rotary(k_cache, v_cache, qkv, rope, view.slot_mapping)
        return self._attention(view, q, k_cache, v_cache, out)

    def _view(self, layer: LayerId) -> PagedPlaneView:
        view = self._loop_view if layer.in_loop else self._outer_view
        if view is None:
            raise RuntimeError(f"this batch has no {'loop' if layer.in_loop else 'outer'} plane view")
        return view

    def _attention(
        self, view: PagedPlaneView, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """q's rows over the caches, once this batch's K/V is in them."""
        scale = q.shape[-1] ** -0.5
        chunks = self._chunks
        if chunks is None:
            return self._backend.paged_attention(q, k_cache, v_cache, view.block_tables, self._context_lens, scale,
                                                 out=out)
        return self._backend.prefill_attention(
            q, k_cache, v_cache, view.block_tables, chunks.cu_query_lens, chunks.start_positions, scale,
            max_query_len=chunks.max_query_len, out=out,
        )


class StackedContext:
    """Several contexts' rows stacked in one batch (a mixed pass: slot rows, then prompt-chunk rows):

        rows:  | part 0: n0 rows | part 1: n1 rows | …

    Each part writes its rows' K/V and attends through its own kernel (decode rows through
    paged_attention, chunks through prefill_attention); the model runs one GEMM per weight over all
    rows. The parts' rows never read each other's K/V (they are other sequences), so the order in
    which the parts write and read does not matter. Each part's kernel writes its rows of one output
    tensor (no concatenation after them).
    """

    def __init__(self, parts: list[tuple[PagedContext, int]]) -> None:
        self._parts = parts

    def attend(self, layer: LayerId, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for context, rows in self._rows():
            context.attend(layer, q[rows], k[rows], v[rows], out=out[rows])
        return out

    def attend_rotary(self, layer: LayerId, qkv: torch.Tensor, rope: Rotary) -> torch.Tensor:
        """Each part's attend_rotary over its rows (its rows' positions)."""
        out = qkv.new_empty(qkv.shape[0], rope.num_heads, rope.head_dim)
        for context, rows in self._rows():
            context.attend_rotary(layer, qkv[rows], rope._replace(positions=rope.positions[rows]), out=out[rows])
        return out

    def _rows(self) -> list[tuple[PagedContext, slice]]:
        """Each part's context and its rows in the batch."""
        parts, start = [], 0
        for context, num_rows in self._parts:
            parts.append((context, slice(start, start + num_rows)))
            start += num_rows
        return parts
