"""Mixed loop passes (slot rows with riding prompt chunks) replayed from CUDA graphs, captured at first use.

A mixed pass (docs/design.md, "Mixed batches") stacks a plan's slot rows (decode or recurrent rows,
each at its own depth) and the rows of its riding prompt chunks, one loop over both: one GEMM per
weight, and per layer each part attends through its own kernel (StackedContext). Eagerly that is
about 280 launches from Python for Ouro-1.4B plus each part's attention launches, more host time
than GPU time. A graph here holds both parts, each padded as its own kind of graph pads it:

    rows      slot rows: a decode graph's width, rows padded      chunk rows: a prefill graph's (tokens, chunks) bucket
              finer (slot_rows: multiples of ROW_STEP)
    inputs    static rows of that count (LoopPassGraphs.write_rows: this graph family's own static chunk buffers
              slots, positions, depths; padding: the dummy slot)   (ChunkBuffers: each chunk's own depth;
                                                                    padding: the padding chunk)
    captured  the gather of the slot rows' state and injected input, the loop over both parts (the slot rows
              through the decode kernel, the chunks through the prefill kernel), the scatter of the slot
              rows' new state and the copy of the chunks' into the static state

So a key is (rows, width, tokens, chunks): slot_rows' counts and the decode graphs' widths
(rlt_worker/cuda_graphs.py) by the prefill graphs' buckets (rlt_worker/prefill_graphs.py), thousands
in all but few in use (the H200 benchmark with 1,024-token prompts used 4 keys at c = 32 and 12 at
c = 128 while slot rows were padded to powers of two: the scheduler's bucket-aligned budget gives
chunks a prefill bucket's size). So each key is captured at its first
use (`mixed_captures`, within `lazy_captures`), in the pool every graph shares, and at most
MAX_GRAPHS of them; past that, or with no bucket, or after a failed capture (`mixed_error`), a pass
runs eagerly (`mixed_eager`).

Exactness as for the two graph kinds it joins: padding rows of either part write K/V only into the
scratch block and attend only to it, and every other op is row-wise; a pass whose parts fill their
buckets runs the eager pass's shapes, padding makes the GEMMs taller (which BLAS may round
differently), and chunks of single positions (SHARED) go through the prefill kernel, where eagerly
they take the decode kernel (the same attention, rounded differently on the GPU; on the CPU both are
torch_ref's one definition). `emulate=True` (CPU tests) runs the captured function eagerly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlt_worker.paged_context import StackedContext
from rlt_worker.prefill_graphs import ChunkBuffers, chunk_context, pad_chunks
from rlt_worker.prefill_rows import HostChunks

if TYPE_CHECKING:
    from rlt_worker.cuda_graphs import LoopPassGraphs
    from rlt_worker.prefill_rows import PrefillRows

log = logging.getLogger("rlt.worker")

# Mixed-pass graphs a worker captures at most (each holds its kernels' launch records), and as many
# device-refill pass graphs with riding chunks (rlt_worker/device_refill.py), counted apart.
MAX_GRAPHS = 256
# Slot rows of a mixed pass are padded to a power of two below this, and to a multiple of it from there.
# Finer than the decode graphs' powers of two: with hundreds of chunk rows beside them a pass's GEMMs
# are compute-bound, so a padded slot row costs what a real one does, where a decode pass's GEMMs read
# the weights once whatever its rows. (H200, c = 128, trace: the mixed rows padded went from 7.7% to
# 7.0% with it; the rest was chunk rows, which prefill_budget's rounding down took to 0.6%.)
ROW_STEP = 16

MixedKey = tuple[int, int, int, int]  # (rows, width) of the slot rows, (tokens, chunks) of the chunk rows


class MixedGraphs:
    """Captures and replays mixed loop passes (module docstring); owned by the runner's LoopPassGraphs,
    whose pool, stream, slot-row buffers and counters it shares."""

    def __init__(self, passes: LoopPassGraphs, max_tokens: int) -> None:
        runner = passes.runner
        self.passes = passes
        self.runner = runner
        self.buffers = ChunkBuffers(runner, max_tokens)
        self._graphs: dict[MixedKey, Any] = {}

    def run(self, slots: np.ndarray, positions: np.ndarray, depths: np.ndarray, riding: PrefillRows) -> bool:
        """One loop pass of these slot rows and of the riding chunks' next loop, from a graph (the
        chunks' state then advanced); False (nothing run) when no graph takes them."""
        rows_key = self._rows_key(len(slots), int(positions.max()))
        chunk_key = self.buffers.bucket(riding.host)
        graph = None if rows_key is None or chunk_key is None else self._graph((*rows_key, *chunk_key))
        if graph is None:
            self.passes.stats.mixed_eager += 1
            return False
        self.passes.write_rows(rows_key[0], slots, positions, depths)
        self.ride(riding, chunk_key, graph.replay, len(slots), rows_key[0])
        return True

    def ride(self, riding: PrefillRows, chunk_key: tuple[int, int], replay: Callable[[], None], num_rows: int,
             padded_rows: int) -> None:
        """The riding chunks' next loop into the bucket's static chunk buffers, `replay` (a graph whose
        pass holds them and its slot rows, already staged), then the chunks' state advanced."""
        chunks = riding.host
        layout = pad_chunks(chunks, *chunk_key, self.passes.dummy_slot, depth=riding.depth + 1)  # their next loop
        static = self.buffers.upload(chunk_key, layout)
        n = chunks.num_rows
        static.state[:n] = riding.state
        static.embedded[:n] = riding.embedded
        replay()
        riding.advance(static.state[:n].clone())  # the next pass overwrites the static state
        stats = self.passes.stats
        stats.mixed_replays += 1
        stats.mixed_rows += num_rows + n
        stats.mixed_padded_rows += padded_rows + chunk_key[0] - num_rows - n

    def _rows_key(self, num_rows: int, max_position: int) -> tuple[int, int] | None:
        """The slot rows' (rows, width): the decode bucket's width, the rows padded to slot_rows(); None
        past the largest decode bucket."""
        key = self.passes.bucket(num_rows, max_position)
        return None if key is None else (slot_rows(num_rows), key[1])

    def _graph(self, key: MixedKey) -> Any:
        """The key's graph, captured now if it is not yet; None when it cannot be (a failed capture,
        now or before, or MAX_GRAPHS reached)."""
        stats = self.passes.stats
        if key in self._graphs or stats.mixed_error is not None or stats.error is not None:
            return self._graphs.get(key)
        if len(self._graphs) >= MAX_GRAPHS:
            return None
        try:
            self._graphs[key] = self.passes._capture(functools.partial(self.stacked_pass, key),
                                                     functools.partial(self.point_at_padding, key))
        except Exception as exc:  # keep serving: mixed passes run eagerly from now on
            log.exception("CUDA graph capture of a mixed pass (%d rows × %d blocks, %d tokens × %d chunks) "
                          "failed; mixed passes run eagerly", *key)
            stats.mixed_error = f"{type(exc).__name__}: {exc}"
            return None
        stats.lazy_captures += 1
        stats.mixed_captures += 1
        return self._graphs[key]

    def point_at_padding(self, key: MixedKey) -> None:
        """Point both parts at padding rows only (the dummy slot and the scratch block): a capture's warm-up."""
        rows, _, tokens, chunks = key
        none = np.zeros(0, dtype=np.int64)
        self.passes.write_rows(rows, none, none, none)
        self.buffers.upload((tokens, chunks), pad_chunks(HostChunks.empty(), tokens, chunks, self.passes.dummy_slot))

    def stacked_pass(self, key: MixedKey) -> None:
        """The captured function: one loop of the key's static slot rows and static chunk rows (also the
        loop of a device-refill pass that chunks ride: rlt_worker/device_refill.py)."""
        rows, width, tokens, chunks = key
        runner = self.runner
        slots, positions, depths = self.passes.static_rows(rows)
        static = self.buffers.views((tokens, chunks))
        context = StackedContext([(runner.context(slots, positions, depths, width, outer=False), rows),
                                  (chunk_context(runner, static, tokens), tokens)])
        state = runner.model.loop(torch.cat([runner.state[slots], static.state]),
                                  torch.cat([runner.embedded[slots], static.embedded]),
                                  torch.cat([positions, static.positions]), context)
        runner.state.index_copy_(0, slots, state[:rows])
        static.state.copy_(state[rows:])


def slot_rows(num_rows: int) -> int:
    """A mixed pass's slot rows padded: the next power of two below ROW_STEP, else the next multiple of it."""
    if num_rows <= ROW_STEP:
        return 1 << max(num_rows - 1, 0).bit_length()
    return -(-num_rows // ROW_STEP) * ROW_STEP
