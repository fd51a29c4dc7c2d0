"""A PREFILL batch's rows through their D loops: in passes of their own, or riding the plan's loop
passes beside its slot rows (mixed batches, docs/design.md "Mixed batches").

    rows:      | chunk 0: p0 … p0+n0−1 | chunk 1: p1 … p1+n1−1 | …     (one chunk per sequence)
    state, embedded [N, H]: this plan's only; `depth` loops run so far, the same for every row
    riding pass:   | slot rows (their own depths) | the chunks' rows at loop depth + 1 |
                   one model.loop over both: one GEMM per weight; each part attends through its own
                   kernel (StackedContext)
    finish:        the loops left run alone, Huginn's coda K/V of every position, then each chunk's
                   last row's state and injected input go to its slot

A prompt position reads only its own sequence's K/V (its earlier chunks and itself) and writes only
its own blocks, and the rows of a pass belong to other requests, so riding changes no value: loop d
of a chunk computes what it computes alone (SPEC §4, both layouts; SHARED chunks are one position).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from protocol.messages import PrefillBatch
from rlt_worker.kv_storage import LAST_EXITED
from rlt_worker.paged_context import PagedContext, PrefillChunks, StackedContext

if TYPE_CHECKING:
    from rlt_worker.model_runner import ModelRunner


class PrefillRows:
    """One PREFILL batch while its plan runs (the runner owns it; it writes the slots at `finish`)."""

    def __init__(self, runner: ModelRunner, batch: PrefillBatch) -> None:
        query_lens = batch.col("query_lens")
        if runner.config.kv_layout != LAST_EXITED and query_lens.max() > 1:
            raise ValueError("SHARED prefill runs one position at a time (query_lens must be 1)")
        self.runner = runner
        row_slots = runner.slots_of(batch.col("keys"), batch.col("generations"))
        starts = batch.col("start_positions")
        host_positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, query_lens, strict=True)])
        cu_query_lens = np.concatenate([[0], np.cumsum(query_lens)])
        self.positions, tokens, self._slots, start_positions, self._cu, table_rows = runner.upload(
            host_positions, batch.col("token_ids"), row_slots, starts, cu_query_lens,
            np.repeat(np.arange(len(row_slots)), query_lens),
        )
        self.chunk_slots = np.asarray(row_slots, dtype=np.int64)
        self.host_slots = np.repeat(self.chunk_slots, query_lens)  # per row, for the pass listener
        self.host_positions = host_positions
        # Chunks attend through the backend's prefill kernel, unless every chunk is one position
        # (SHARED always): then a row is its chunk and the decode kernel serves them.
        max_query_len = int(query_lens.max())
        self._chunks = (PrefillChunks(self._cu, start_positions, table_rows, max_query_len)
                        if max_query_len > 1 else None)
        self._width = runner.table_width(host_positions)
        self.embedded = runner.model.embed(tokens, self.positions, self.context(None))
        self.state = runner.initial_state(self.embedded, np.repeat(batch.col("seeds"), query_lens), self.positions)
        self.depth = 0

    @property
    def num_loops_left(self) -> int:
        return self.runner.config.max_depth - self.depth

    def context(self, depth: int | None) -> PagedContext:
        """The chunks' view of loop `depth`'s plane (None: the outer plane only)."""
        depths = None if depth is None else torch.full_like(self._slots, depth)
        return self.runner.context(self._slots, self.positions, depths, self._width, chunks=self._chunks)

    def ride(self, state: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor,
             context: PagedContext) -> torch.Tensor:
        """One loop of the pass's slot rows (state, embedded, positions, context) and of the chunks at
        loop depth + 1, in one model.loop; returns the slot rows' new state."""
        n, depth = len(state), self.depth + 1
        stacked = StackedContext([(context, n), (self.context(depth), len(self.state))])
        out = self.runner.model.loop(torch.cat([state, self.state]), torch.cat([embedded, self.embedded]),
                                     torch.cat([positions, self.positions]), stacked)
        self.state, self.depth = out[n:], depth
        return out[:n]

    def finish(self) -> None:
        """The loops no pass ran, Huginn's coda K/V, and each chunk's last row into its slot."""
        model = self.runner.model
        while self.num_loops_left:
            self.depth += 1
            self.state = model.loop(self.state, self.embedded, self.positions, self.context(self.depth))
        if model.info.num_outer_kv_layers:  # Huginn: coda K/V of every prompt position
            model.coda(self.state, self.positions, self.context(None))
        last = self._cu[1:] - 1  # each chunk's last row
        self.runner.state[self._slots] = self.state[last]
        self.runner.embedded[self._slots] = self.embedded[last]
