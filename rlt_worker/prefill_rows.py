"""A PREFILL batch's chunks and their rows through the D loops: in passes of their own (eagerly, or
replayed from a prefill graph: rlt_worker/prefill_graphs.py), or riding the plan's loop passes
beside its slot rows (mixed batches, docs/design.md "Mixed batches").

    rows:      | chunk 0: p0 … p0+n0−1 | chunk 1: p1 … p1+n1−1 | …     (one chunk per sequence)
    state, embedded [N, H]: this plan's only; `depth` loops run so far, the same for every row
    riding pass:   | slot rows (their own depths) | the chunks' rows at loop depth + 1 |
                   one model.loop over both: one GEMM per weight; each part attends through its own
                   kernel (StackedContext); replayed from a mixed graph when the runner has one
                   (rlt_worker/mixed_graphs.py), else eager
    finish:        the loops left (all D of a batch that does not ride: a prefill graph's replays
                   when the caller has them, else eager), Huginn's coda K/V of every position, then
                   each chunk's last row's state and injected input go to its slot

A prompt position reads only its own sequence's K/V (its earlier chunks and itself) and writes only
its own blocks, and the rows of a pass belong to other requests, so riding changes no value: loop d
of a chunk computes what it computes alone (SPEC §4, both layouts; SHARED chunks are one position).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from protocol.messages import PrefillBatch
from rlt_worker.paged_context import PagedContext, PrefillChunks, StackedContext

if TYPE_CHECKING:
    from rlt_worker.model_runner import ModelRunner

# A prefill graph's D loop passes over (state, embedded) of the real rows; returns the last state.
GraphLoops = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class HostChunks:
    """A PrefillBatch's chunks on the host, one entry per chunk; rows are chunk-major."""

    slots: np.ndarray  # int64 [S]: each chunk's slot
    start_positions: np.ndarray  # int64 [S]: each chunk's first position
    query_lens: np.ndarray  # int64 [S]: each chunk's positions
    token_ids: np.ndarray  # int64 [N]
    seeds: np.ndarray  # uint64 [S] (Huginn's state init)

    @classmethod
    def of(cls, batch: PrefillBatch, slots: list[int]) -> HostChunks:
        """The batch's columns, its rows' slots given."""
        return cls(slots=np.asarray(slots, dtype=np.int64),
                   start_positions=batch.col("start_positions").astype(np.int64),
                   query_lens=batch.col("query_lens").astype(np.int64),
                   token_ids=batch.col("token_ids").astype(np.int64), seeds=batch.col("seeds"))

    @classmethod
    def empty(cls) -> HostChunks:
        """No chunk at all (a bucket's warm-up layout: padding rows only)."""
        none = np.zeros(0, dtype=np.int64)
        return cls(none, none, none, none, none.astype(np.uint64))

    @property
    def num_rows(self) -> int:
        return int(self.query_lens.sum())

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens.max())

    @property
    def max_position(self) -> int:
        return int((self.start_positions + self.query_lens).max()) - 1

    def positions(self) -> np.ndarray:
        """Every row's position, [N]."""
        return np.concatenate([np.zeros(0, dtype=np.int64)] + [
            np.arange(s, s + n) for s, n in zip(self.start_positions, self.query_lens, strict=True)])

    def row_slots(self) -> np.ndarray:
        """Every row's slot, [N]."""
        return np.repeat(self.slots, self.query_lens)

    def cu_query_lens(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.query_lens)]).astype(np.int64)

    def table_rows(self) -> np.ndarray:
        """Every row's chunk, [N]."""
        return np.repeat(np.arange(len(self.slots)), self.query_lens)


@dataclass(frozen=True)
class DeviceChunks:
    """The same chunks on the device: what PrefillRows reads (uploaded, or a prefill graph's static views)."""

    slots: torch.Tensor  # [S]
    positions: torch.Tensor  # [N]
    token_ids: torch.Tensor  # [N]
    cu_query_lens: torch.Tensor  # [S + 1]
    kernel: PrefillChunks | None  # the prefill kernel's metadata; None: every chunk is one position

    @classmethod
    def upload(cls, runner: ModelRunner, chunks: HostChunks) -> DeviceChunks:
        """The chunks' columns on the device, in one transfer (nothing is read back)."""
        positions, tokens, slots, starts, cu, table_rows = runner.upload(
            chunks.positions(), chunks.token_ids, chunks.slots, chunks.start_positions, chunks.cu_query_lens(),
            chunks.table_rows(),
        )
        # Chunks attend through the backend's prefill kernel, unless every chunk is one position
        # (SHARED always): then a row is its chunk and the decode kernel serves them.
        kernel = PrefillChunks(cu, starts, table_rows, chunks.max_query_len) if chunks.max_query_len > 1 else None
        return cls(slots, positions, tokens, cu, kernel)


class PrefillRows:
    """One PREFILL batch while its plan runs (the runner owns it; it writes the slots at `finish`)."""

    def __init__(self, runner: ModelRunner, host: HostChunks, chunks: DeviceChunks) -> None:
        self.runner = runner
        self.host = host
        self.chunks = chunks
        self._width = runner.table_width(np.array([host.max_position]))
        self.embedded = runner.model.embed(chunks.token_ids, chunks.positions, self.context(None))
        self.state = runner.initial_state(self.embedded, np.repeat(host.seeds, host.query_lens), chunks.positions)
        self.depth = 0

    @property
    def num_loops_left(self) -> int:
        return self.runner.config.max_depth - self.depth

    def context(self, depth: int | None) -> PagedContext:
        """The chunks' view of loop `depth`'s plane (None: the outer plane only)."""
        chunks = self.chunks
        depths = None if depth is None else torch.full_like(chunks.slots, depth)
        return self.runner.context(chunks.slots, chunks.positions, depths, self._width, chunks=chunks.kernel)

    def ride(self, state: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor,
             context: PagedContext) -> torch.Tensor:
        """One loop of the pass's slot rows (state, embedded, positions, context) and of the chunks at
        loop depth + 1, in one model.loop; returns the slot rows' new state."""
        n = len(state)
        stacked = StackedContext([(context, n), (self.context(self.depth + 1), len(self.state))])
        out = self.runner.model.loop(torch.cat([state, self.state]), torch.cat([embedded, self.embedded]),
                                     torch.cat([positions, self.chunks.positions]), stacked)
        self.advance(out[n:])
        return out[:n]

    def advance(self, state: torch.Tensor) -> None:
        """The chunks' state after their next loop, run by a pass they rode (eagerly, or a mixed graph)."""
        self.state, self.depth = state, self.depth + 1

    def finish(self, graph_loops: GraphLoops | None = None) -> None:
        """The loops no pass ran (`graph_loops`: all D of them, replayed from a prefill graph; only for
        a batch that rode no pass), Huginn's coda K/V, and each chunk's last row into its slot."""
        model = self.runner.model
        if graph_loops is not None:
            if self.depth:
                raise RuntimeError(f"a prefill graph runs all D loops; {self.depth} of these chunks' already ran")
            self.state, self.depth = graph_loops(self.state, self.embedded), self.runner.config.max_depth
        while self.num_loops_left:
            self.depth += 1
            self.state = model.loop(self.state, self.embedded, self.chunks.positions, self.context(self.depth))
        if model.info.num_outer_kv_layers:  # Huginn: coda K/V of every prompt position
            model.coda(self.state, self.chunks.positions, self.context(None))
        last = self.chunks.cu_query_lens[1:] - 1  # each chunk's last row
        self.runner.state[self.chunks.slots] = self.state[last]
        self.runner.embedded[self.chunks.slots] = self.embedded[last]
