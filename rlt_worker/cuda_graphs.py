"""Decode loop passes replayed from CUDA graphs, bucketed by row count and block-table width.

An eager loop pass of the Ouro-1.4B shape is ~1,300 kernel launches, so at every batch size its
host time exceeds its GPU time (docs/benchmarks.md). A captured pass is one graph launch.

What a graph captures: one loop pass of `rows` decode rows (RecurrentBatch rows, or the rows of a
DecodeBatch pass, whose exit test then reads the pass's rows from the graph's static inputs: `stage`
writes them, `replay` runs them; Ouro's test replays a graph of its own per rows bucket right after,
rlt_worker/exit_graphs.py, the others run eagerly on the state the graph left), from the gather
of their state and injected input out of the runner's per-slot tensors to the scatter of the new
state back, the K/V writes and the Triton attention included. Its only
inputs are three static index vectors (slots, positions, depths) of `rows` entries, written by
one host→device copy before each replay; every other tensor it touches (per-slot state, block
tables, the KV pool, weights) lives at a fixed address for the worker's life.

    rows bucket   the next of 1, 2, 4, …, 256 (capped at the slot count) ≥ the pass's rows;
                  padding rows run on a dummy slot whose block table points at a scratch block
                  that the engine never allocates, at position 0, loop 1 — they read and write
                  only that block and the dummy slot's state row
    width bucket  the block-table columns the attention reads: the next power of two (≥ 4)
                  ≥ the longest row's blocks, capped at max_model_len / block_size; shorter rows
                  are masked by their context lengths, so padding never changes a value. The
                  Triton kernel's split count depends on (rows, width) only, so it is fixed per
                  graph as well

Capture. `capture_all()` (the worker calls it at start-up under `cuda_graph_capture="startup"`,
the default) captures every rows × width bucket before the worker reports ready, so no capture
lands inside a request's latency; with "lazy" a bucket is captured the first time it is needed
(and a bucket that start-up missed would be too: `lazy_captures` counts those). Each capture is
two warm-up passes on dummy rows only (Triton compilation, cuBLAS workspaces) on a side stream,
then the capture, which runs nothing. All graphs share one memory pool (they are replayed one at a
time and keep no outputs), so the captures cost the pool's largest pass plus the graphs
themselves: `capture_mib` is the growth of the caching allocator's reserved memory over
`capture_all()` (free device memory would also count other objects of the process being freed). Passes with more
rows than the largest bucket run eagerly (`eager_passes` counts them). PREFILL chunk passes have graphs
of their own (rlt_worker/prefill_graphs.py), captured first (they are the largest) in the same pool;
`prefill_capture_s` and `prefill_capture_mib` are their share of the totals. CODA's graphs and the
exit tests' (per rows bucket only) are captured last, in the same pool. Device-refill passes
(rlt_worker/device_refill.py: a pass with its exit test and boundary work, per rows × width × test)
and mixed passes (rlt_worker/mixed_graphs.py: slot rows with riding prompt chunks, per rows × width ×
tokens × chunks) are not captured at start-up but at first use, in the same pool (`lazy_captures`).

`emulate=True` (CPU tests) runs the same padded, bucketed, static-buffer function eagerly in
place of a replay, after the capture's warm-up pointing (what it does to the buffers): everything
but the capture itself is exercised against the float64 oracle.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protocol.messages import ExitTest
from rlt_worker.coda_graphs import CodaGraphs
from rlt_worker.device_refill import RefillGraphs
from rlt_worker.exit_graphs import ExitTestGraphs
from rlt_worker.mixed_graphs import MixedGraphs
from rlt_worker.prefill_graphs import PrefillGraphs, next_pow2

if TYPE_CHECKING:
    from rlt_worker.model_runner import ModelRunner

log = logging.getLogger("rlt.worker")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_WIDTH = 4  # block-table columns of the narrowest width bucket


@dataclass
class GraphStats:
    """Counters of the decode loop passes (reported by the runner, printed by rlt-bench)."""

    replays: int = 0  # passes run from a graph
    eager_passes: int = 0  # decode loop passes that fit no bucket
    mixed_passes: int = 0  # decode loop passes that prompt chunks rode (mixed batches; see mixed_replays)
    captures: int = 0
    capture_s: float = 0.0
    startup_captures: int = 0  # captured by capture_all() before serving
    startup_capture_s: float = 0.0  # wall time of capture_all()
    lazy_captures: int = 0  # captured at first use, while serving (0 after a complete start-up capture)
    capture_mib: float = 0.0  # device memory capture_all() took (growth of reserved memory), MiB
    coda_replays: int = 0  # CODA batches run from a graph (rlt_worker/coda_graphs.py)
    device_refill_plans: int = 0  # DecodeBatches whose passes ran with no readback (rlt_worker/device_refill.py)
    device_refill_resumed: int = 0  # of those, resumed where the last one left its rows (no readback between)
    device_refill_carried: int = 0  # of those, other rows than the last one's: its continuing rows carried over
    refill_captures: int = 0  # device-refill pass graphs, captured at a bucket's first use (within lazy_captures)
    refill_riding_passes: int = 0  # device-refill passes that prompt chunks rode (within mixed_replays)
    refill_error: str | None = None  # a device-refill pass capture failed: those batches take the host loop
    coda_eager: int = 0  # CODA batches that could not (forced tokens, replay rows, too many rows)
    coda_error: str | None = None  # a CODA capture failed: CODA runs eagerly (the passes keep their graphs)
    exit_replays: int = 0  # DecodeBatch exit tests run from a graph (rlt_worker/exit_graphs.py)
    exit_eager: int = 0  # graphable exit tests run eagerly, after a pass that ran eagerly
    exit_error: str | None = None  # an exit-test capture failed: exit tests run eagerly (the passes keep theirs)
    rows: int = 0  # real rows run from graphs
    padded_rows: int = 0  # bucket rows beyond them
    buckets: dict[str, int] = field(default_factory=dict)  # "rows x width" → replays
    error: str | None = None  # a capture failed: every later pass runs eagerly
    prefill_replays: int = 0  # PREFILL loop passes run from a graph (D per batch)
    prefill_eager: int = 0  # PREFILL loop passes run eagerly (single positions, too many tokens, a failed capture)
    prefill_rows: int = 0  # real token rows of the replayed prefill passes
    prefill_padded_rows: int = 0  # bucket rows beyond them
    prefill_startup_captures: int = 0  # prefill graphs captured by capture_all() (within startup_captures)
    prefill_capture_s: float = 0.0  # their share of startup_capture_s
    prefill_capture_mib: float = 0.0  # their share of capture_mib (captured first: the pool's growth)
    prefill_buckets: dict[str, int] = field(default_factory=dict)  # "tokens x chunks" → batches
    prefill_error: str | None = None  # a prefill capture failed: prefill runs eagerly (the rest keep graphs)
    mixed_replays: int = 0  # mixed passes run from a graph (rlt_worker/mixed_graphs.py)
    mixed_eager: int = 0  # mixed passes run eagerly (no bucket, a failed capture, a graph cap reached)
    mixed_captures: int = 0  # their graphs, captured at a key's first use (within lazy_captures)
    mixed_rows: int = 0  # real rows (slot rows and chunk rows) of the replayed mixed passes
    mixed_padded_rows: int = 0  # bucket rows beyond them
    mixed_error: str | None = None  # a mixed-pass capture failed: those passes run eagerly (the rest keep graphs)

    def as_dict(self) -> dict[str, Any]:
        return {
            "replays": self.replays, "eager_passes": self.eager_passes, "mixed_passes": self.mixed_passes,
            "captures": self.captures,
            "capture_s": round(self.capture_s, 3), "startup_captures": self.startup_captures,
            "startup_capture_s": round(self.startup_capture_s, 3), "lazy_captures": self.lazy_captures,
            "capture_mib": round(self.capture_mib, 1), "rows": self.rows, "padded_rows": self.padded_rows,
            "coda_replays": self.coda_replays, "coda_eager": self.coda_eager, "coda_error": self.coda_error,
            "device_refill_plans": self.device_refill_plans,
            "device_refill_resumed": self.device_refill_resumed,
            "device_refill_carried": self.device_refill_carried, "refill_captures": self.refill_captures,
            "refill_riding_passes": self.refill_riding_passes,
            "refill_error": self.refill_error,
            "exit_replays": self.exit_replays, "exit_eager": self.exit_eager, "exit_error": self.exit_error,
            "buckets": dict(self.buckets), "error": self.error,
            "prefill_replays": self.prefill_replays, "prefill_eager": self.prefill_eager,
            "prefill_rows": self.prefill_rows, "prefill_padded_rows": self.prefill_padded_rows,
            "prefill_startup_captures": self.prefill_startup_captures,
            "prefill_capture_s": round(self.prefill_capture_s, 3),
            "prefill_capture_mib": round(self.prefill_capture_mib, 1),
            "prefill_buckets": dict(self.prefill_buckets), "prefill_error": self.prefill_error,
            "mixed_replays": self.mixed_replays, "mixed_eager": self.mixed_eager,
            "mixed_captures": self.mixed_captures, "mixed_rows": self.mixed_rows,
            "mixed_padded_rows": self.mixed_padded_rows, "mixed_error": self.mixed_error,
        }


@dataclass(frozen=True)
class StagedPass:
    """A decode pass ready to replay: its bucket's graph, and its rows in the bucket's static inputs."""

    graph: Any
    key: tuple[int, int]  # (rows, width) bucket
    num_rows: int
    columns: torch.Tensor  # [3, num_rows] view of the static inputs: slots, positions, depths (int64)


class _EagerReplay:
    """emulate=True: the captured function, run eagerly at every replay."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.replay = fn


class LoopPassGraphs:
    """Captures and replays the runner's decode loop passes (see the module docstring)."""

    def __init__(
        self, runner: ModelRunner, dummy_slot: int, scratch_block: int, emulate: bool, prefill_tokens: int = 0,
        exit_tests: tuple[ExitTest, ...] = (), mixed_tokens: int = 0,
    ) -> None:
        self.runner = runner
        self.emulate = emulate
        self.dummy_slot = dummy_slot
        self.block_size = runner.storage.block_size
        self.max_width = runner.block_tables.shape[2]
        largest = min(ROW_BUCKETS[-1], next_pow2(runner.config.max_slots))
        self.row_buckets = tuple(b for b in ROW_BUCKETS if b <= largest)
        # Static inputs, one contiguous [3, rows] buffer per row count: slots, positions, depths (the
        # decode graphs' buckets now; a mixed pass's finer slot-row counts at their first use).
        self._index: dict[int, torch.Tensor] = {}
        for rows in self.row_buckets:
            self.static_rows(rows)
        runner.block_tables[dummy_slot] = scratch_block
        self._graphs: dict[tuple[int, int], Any] = {}
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self.stats = GraphStats()
        # A coda without attention (Ouro) is graphed too; Huginn's reads its coda K/V and stays eager.
        self.coda = CodaGraphs(self) if runner.model.info.num_outer_kv_layers == 0 else None
        # PREFILL chunk passes of up to prefill_tokens rows (0: prefill runs eagerly).
        self.prefill = PrefillGraphs(self, prefill_tokens) if prefill_tokens else None
        # Mixed passes (slot rows and riding chunks of up to mixed_tokens rows), captured at first use.
        self.mixed = MixedGraphs(self, mixed_tokens) if mixed_tokens else None
        # DecodeBatch exit tests after a replayed pass; `exit_tests` are captured at start-up.
        self.exits = ExitTestGraphs(self, exit_tests)
        # DecodeBatches with exits and refill on the device (Ouro's coda: no attention), captured at first use.
        self.refill = RefillGraphs(self) if self.coda is not None else None

    def widths(self) -> tuple[int, ...]:
        """Every width bucket: MIN_WIDTH, 2·MIN_WIDTH, … below max_width, then max_width."""
        widths, width = [], MIN_WIDTH
        while width < self.max_width:
            widths.append(width)
            width *= 2
        return (*widths, self.max_width)

    def capture_all(self) -> None:
        """Capture every prefill bucket, then every rows × width bucket, then CODA's and the exit tests':
        largest first, so the shared pool grows once."""
        t0, reserved_before = time.perf_counter(), self._reserved()
        if self.prefill is not None:
            captured = self.prefill.capture_all()
            self.stats.startup_captures += captured
            self.stats.prefill_startup_captures += captured
            self.stats.prefill_capture_s = time.perf_counter() - t0
            self.stats.prefill_capture_mib = (self._reserved() - reserved_before) / 2**20
        for rows in reversed(self.row_buckets):
            for width in reversed(self.widths()):
                if (rows, width) not in self._graphs and self.stats.error is None:
                    graph = self.capture_or_none(functools.partial(self._pass, rows, width),
                                                 self._warm_up(rows), f"{rows} rows × {width} blocks")
                    if graph is not None:
                        self._graphs[(rows, width)] = graph
                        self.stats.startup_captures += 1
        if self.coda is not None:
            self.stats.startup_captures += self.coda.capture_all()
        self.stats.startup_captures += self.exits.capture_all()
        self.stats.startup_capture_s = time.perf_counter() - t0
        self.stats.capture_mib = (self._reserved() - reserved_before) / 2**20
        log.info("captured %d graphs (%d of prefill passes in %.1f s, %.0f MiB; decode passes: %d row × %d width "
                 "buckets) in %.1f s, %.0f MiB", self.stats.startup_captures, self.stats.prefill_startup_captures,
                 self.stats.prefill_capture_s, self.stats.prefill_capture_mib, len(self.row_buckets),
                 len(self.widths()), self.stats.startup_capture_s, self.stats.capture_mib)

    def _reserved(self) -> int:
        """Reserved device memory of the caching allocator, after a sync (0 when emulating)."""
        if self.emulate:
            return 0
        torch.cuda.synchronize(self.runner.device)
        return torch.cuda.memory_reserved(self.runner.device)

    def bucket(self, num_rows: int, max_position: int) -> tuple[int, int] | None:
        """The (rows, width) bucket of a pass, or None when it has more rows than the largest bucket."""
        rows = next((b for b in self.row_buckets if b >= num_rows), None)
        if rows is None:
            return None
        width = min(self.max_width, max(MIN_WIDTH, next_pow2(max_position // self.block_size + 1)))
        return rows, width

    def run(self, slots: np.ndarray, positions: np.ndarray, depths: np.ndarray) -> bool:
        """One loop pass of these rows from a graph; False (nothing run) when no bucket fits."""
        staged = self.stage(slots, positions, depths)
        if staged is not None:
            self.replay(staged)
        return staged is not None

    def stage(self, slots: np.ndarray, positions: np.ndarray, depths: np.ndarray) -> StagedPass | None:
        """The pass's bucket graph with these rows written into its static inputs (one host→device
        copy), captured now if it is not yet; None (nothing written) when no bucket fits."""
        n = len(slots)
        key = self.bucket(n, int(positions.max()))
        graph = None if key is None else self.graph_for(key)
        if graph is None:
            self.stats.eager_passes += 1
            return None
        index = self.write_rows(key[0], slots, positions, depths)
        return StagedPass(graph, key, n, index[:, :n])

    def write_rows(self, rows: int, slots: np.ndarray, positions: np.ndarray, depths: np.ndarray) -> torch.Tensor:
        """Rows into a rows bucket's static inputs, padded with the dummy slot's (one host→device copy)."""
        n = len(slots)
        host = np.empty((3, rows), dtype=np.int64)
        host[0, n:], host[1, n:], host[2, n:] = self.dummy_slot, 0, 1
        host[0, :n], host[1, :n], host[2, :n] = slots, positions, depths
        index = self.static_rows(rows)
        self.runner.upload_into(index, host)
        return index

    def graph_for(self, key: tuple[int, int]) -> Any:
        """A (rows, width) bucket's graph, captured now if it is not yet; None after a failed capture."""
        if self.stats.error is not None:
            return None
        graph = self._graphs.get(key)
        if graph is None:
            rows, width = key
            graph = self.capture_or_none(functools.partial(self._pass, rows, width), self._warm_up(rows),
                                         f"{rows} rows × {width} blocks")
            if graph is None:
                return None
            self._graphs[key] = graph
            self.stats.lazy_captures += 1
        return graph

    def replay(self, staged: StagedPass) -> None:
        """Run a staged pass (its static inputs hold its rows until the next stage of its bucket)."""
        staged.graph.replay()
        stats = self.stats
        rows, width = staged.key
        stats.replays += 1
        stats.rows += staged.num_rows
        stats.padded_rows += rows - staged.num_rows
        name = f"{rows}x{width}"
        stats.buckets[name] = stats.buckets.get(name, 0) + 1

    def static_rows(self, rows: int) -> torch.Tensor:
        """The static inputs of `rows` rows, [3, rows]: slots, positions, depths (what `write_rows` wrote
        last; made on first use, pointing at the dummy slot)."""
        index = self._index.get(rows)
        if index is None:
            index = self._index[rows] = torch.zeros(3, rows, dtype=torch.long, device=self.runner.device)
            index[0].fill_(self.dummy_slot)
            index[2].fill_(1)
        return index

    def _pass(self, rows: int, width: int) -> None:
        """The captured function: one loop pass of the bucket's static rows."""
        runner = self.runner
        slots, positions, depths = self._index[rows]
        context = runner.context(slots, positions, depths, width, outer=False)
        state = runner.model.loop(runner.state[slots], runner.embedded[slots], positions, context)
        runner.state.index_copy_(0, slots, state)

    def _warm_up(self, rows: int) -> Callable[[], None]:
        """Point a bucket's static rows at the dummy slot and the scratch block (warm-up passes)."""
        def point() -> None:
            index = self._index[rows]
            index[0].fill_(self.dummy_slot)
            index[1].zero_()
            index[2].fill_(1)
        return point

    def capture_or_none(self, fn: Callable[[], None], warm_up: Callable[[], None], what: str) -> Any:
        """A graph of fn (emulate: fn itself), or None after logging a failed capture; a failure
        sets stats.error, after which every pass and CODA runs eagerly."""
        try:
            return self._capture(fn, warm_up)
        except Exception as exc:  # keep serving, eagerly
            log.exception("CUDA graph capture of %s failed; decode passes and CODA run eagerly", what)
            self.stats.error = f"{type(exc).__name__}: {exc}"
            return None

    def _capture(self, fn: Callable[[], None], warm_up: Callable[[], None]) -> Any:
        if self.emulate:
            warm_up()  # what a capture does to the buffers before it, so the CPU tests see it too
            self.stats.captures += 1
            return _EagerReplay(fn)
        t0 = time.perf_counter()
        warm_up()  # warm-up rows read and write only what no real row owns
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.runner.device)
            self._pool = torch.cuda.graph_pool_handle()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
            fn()
        torch.cuda.synchronize(self.runner.device)
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t0
        return graph
