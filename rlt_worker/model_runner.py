"""The ModelRunner: the slot table, the model and the sampler of one worker.

It executes an ExecutionPlan's stage batches against per-slot device state and returns one
StepResult. It never sees a Request: rows arrive as (key, generation) columns and the slot
table maps them to device rows.

Per-slot device state (one row per slot):
    state      the current position's loop state (Ouro: normed h; Huginn: s)
    embedded   the current position's injected input (Ouro: embedding; Huginn: prelude e)
    tokens     the token the slot's last CODA sampled (the next PRELUDE's input)
    prev_logp  Huginn KL: the previous loop's next-token log-distribution
    block_tables [planes, max_blocks]: the mirror of the engine's allocation, grown by deltas

No host readback sits between a plan's stages: the sampled token stays in `tokens`, the host
keeps its own copy of the block tables (finalize addresses, table widths), and each stage's
row columns go to the device in one upload (pinned and asynchronous on CUDA). The only
device→host copies are the result's, once per plan, when the StepResult is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from protocol.messages import (
    Admit,
    AppliedOps,
    BlockAppends,
    CodaBatch,
    ExecutionPlan,
    FinalizeBatch,
    PrefillBatch,
    PreludeBatch,
    RecurrentBatch,
    SamplingOptions,
    Signal,
    SlotKeys,
    Stage,
    StepResult,
)
from rlt_worker.attention import get_backend
from rlt_worker.cuda_graphs import LoopPassGraphs
from rlt_worker.kv_storage import LAST_EXITED, KVStorage
from rlt_worker.models.base import LoopedModel
from rlt_worker.paged_context import PagedContext, PagedPlaneView, PrefillChunks
from rlt_worker.philox import truncated_normal
from rlt_worker.sampler import SamplingTensors, sample
from rlt_worker.step_results import ResultBuilder
from rlt_worker.swap import SwapStore


class SlotError(RuntimeError):
    """A plan named a slot the runner does not hold (or one it already holds)."""


@dataclass(frozen=True)
class RunnerConfig:
    """What the runner needs beyond the model and the storage."""

    kv_layout: str
    max_depth: int  # D
    num_planes: int
    max_slots: int
    attention_backend: str
    state_init: str  # Huginn: "random" | "zero"
    # A KV block the engine never allocates: padding rows of graph-captured passes use it (-1: none).
    scratch_block: int = -1
    cuda_graphs: bool = False  # decode loop passes from CUDA graphs (needs scratch_block and CUDA)
    graph_capture: str = "lazy"  # "startup": every graph bucket in the constructor | "lazy": at first use


class ModelRunner:
    """Executes plans; owns the slot table and every per-slot device tensor."""

    def __init__(self, model: LoopedModel, storage: KVStorage, config: RunnerConfig) -> None:
        info = model.info
        self.model = model
        self.storage = storage
        self.config = config
        self.device = storage.pool.device
        self._backend = get_backend(config.attention_backend)
        dtype = storage.pool.dtype
        slots, hidden = config.max_slots, info.hidden_size
        max_blocks = math.ceil(info.max_model_len / storage.block_size)
        # One row more than there are slots: the dummy slot of graph padding rows (never opened).
        self.state = torch.zeros(slots + 1, hidden, dtype=dtype, device=self.device)
        self.embedded = torch.zeros(slots + 1, hidden, dtype=dtype, device=self.device)
        self.tokens = torch.zeros(slots, dtype=torch.long, device=self.device)
        # The host copy answers host-side questions (finalize addresses) without a device readback.
        self._host_tables = np.zeros((slots, config.num_planes, max_blocks), dtype=np.int32)
        self.block_tables = torch.zeros(
            slots + 1, config.num_planes, max_blocks, dtype=torch.int32, device=self.device
        )
        signal_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.prev_logp = (
            torch.zeros(slots, info.vocab_size, dtype=signal_dtype, device=self.device)
            if info.has_coda_signal
            else None
        )
        self.temperature = torch.ones(slots, dtype=torch.float64, device=self.device)
        self.top_k = torch.full((slots,), -1, dtype=torch.long, device=self.device)
        self.top_p = torch.ones(slots, dtype=torch.float64, device=self.device)
        # Each slot's admitted options, on the host: sampling needs no readback to choose its path
        # (greedy rows: temperature <= 0) or to find a forced token. Set by admit and by a swap import.
        self.slot_options = [SamplingOptions()] * slots
        self.host_greedy = np.zeros(slots, dtype=bool)
        self._num_blocks = [0] * slots
        self._max_blocks = max_blocks
        self._pin = self.device.type == "cuda"
        self._slot_of: dict[tuple[int, int], int] = {}
        self._free_slots = list(range(slots - 1, -1, -1))
        self._swap = SwapStore()
        self.applied = AppliedOps()  # the slot ops of the current (or last) plan applied so far
        self.fault_hook: Callable[[str], None] | None = None  # tests: fail a plan at a chosen point
        self._graphs: LoopPassGraphs | None = None
        if config.cuda_graphs and self.device.type == "cuda":
            self.use_pass_graphs(emulate=False)
            if config.graph_capture == "startup":  # before the worker reports ready: none while serving
                self.capture_pass_graphs()

    def use_pass_graphs(self, emulate: bool) -> None:
        """Run no-signal decode loop passes through LoopPassGraphs (emulate: eagerly, CPU tests)."""
        if self.config.scratch_block < 0:
            raise ValueError("graph-captured passes need a scratch KV block (RunnerConfig.scratch_block)")
        self._graphs = LoopPassGraphs(self, self.config.max_slots, self.config.scratch_block, emulate)

    def capture_pass_graphs(self) -> None:
        """Capture every decode-pass graph bucket now (see LoopPassGraphs.capture_all)."""
        if self._graphs is None:
            raise ValueError("capture_pass_graphs needs use_pass_graphs first")
        self._graphs.capture_all()

    @property
    def graph_stats(self) -> dict | None:
        """Counters of graph-replayed and eager decode passes (None when graphs are off)."""
        return None if self._graphs is None else self._graphs.stats.as_dict()

    @property
    def num_swapped(self) -> int:
        """Slots whose state and pages are held in host memory (swap preemption)."""
        return len(self._swap)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    # ------------------------------------------------------------------ plan

    @torch.inference_mode()
    def execute(self, plan: ExecutionPlan) -> StepResult:
        """Apply a plan in its order (admits, appends, batches, releases) and report its rows.

        `applied` counts the slot ops done so far, so a plan that raises midway can say which of
        its slot ops took effect (the Worker puts it into the error result)."""
        results = ResultBuilder(plan.step_id)
        self.applied = AppliedOps()
        for admit in plan.admits:
            self.fault_point("admit")
            self._admit(admit)
            self.applied.admits += 1
        imported = self._swap.open_imports(self, plan.imports)
        self._append_blocks(plan.block_appends)
        self._swap.restore_pages(self, imported)
        for batch in plan.batches:
            self.fault_point("batch")
            if isinstance(batch, PrefillBatch):
                self._prefill(batch)
            elif isinstance(batch, PreludeBatch):
                self._prelude(batch)
            elif isinstance(batch, RecurrentBatch):
                self._recurrent(batch, results)
            elif isinstance(batch, FinalizeBatch):
                self._finalize(batch)
            elif isinstance(batch, CodaBatch):
                self._coda(batch, results)
        self._swap.export(self, plan.exports)
        self._release(plan.releases)
        self._swap.drop(self, plan.swap_drops)
        return results.build(num_free_slots=self.num_free_slots)

    # ------------------------------------------------------------------ slot table

    def open_slot(self, key: int, generation: int) -> int:
        """Map (key, generation) to a free slot with an empty block table."""
        identity = (key, generation)
        if identity in self._slot_of:
            raise SlotError(f"slot {identity} is already open")
        if not self._free_slots:
            raise SlotError(f"no free slot for {identity}: all {self.config.max_slots} are in use")
        slot = self._free_slots.pop()
        self._slot_of[identity] = slot
        self._num_blocks[slot] = 0
        return slot

    def close_slot(self, key: int, generation: int) -> int:
        """Unmap (key, generation); returns the slot index it held."""
        slot = self._slot_of.pop((key, generation), None)
        if slot is None:
            raise SlotError(f"release of unknown slot {(key, generation)}")
        self._free_slots.append(slot)
        return slot

    def slot_blocks(self, slot: int) -> np.ndarray:
        """The slot's block ids, [planes, num_blocks] (host mirror)."""
        return self._host_tables[slot, :, : self._num_blocks[slot]]

    def _admit(self, admit: Admit) -> None:
        self.set_options(self.open_slot(admit.key, admit.generation), admit.sampling)

    def set_options(self, slot: int, options: SamplingOptions) -> None:
        """A slot's sampling options (at admission, or restored by a swap import)."""
        self.slot_options[slot] = options
        self.host_greedy[slot] = options.temperature <= 0
        self.temperature[slot] = options.temperature
        self.top_k[slot] = options.top_k
        self.top_p[slot] = options.top_p

    def forced_tokens(self, slots: np.ndarray, indices: np.ndarray) -> np.ndarray | None:
        """Teacher forcing: each (slot, output index)'s given token, −1 where it samples; None when no
        row forces (the common case, answered without a loop over rows)."""
        options = [self.slot_options[slot] for slot in slots.tolist()]
        if all(o.forced_tokens is None for o in options):
            return None
        return np.array([-1 if o.forced_tokens is None else o.forced_tokens[i]
                         for o, i in zip(options, indices.tolist(), strict=True)], dtype=np.int64)

    def _release(self, releases: SlotKeys) -> None:
        for key, generation in zip(releases.col("keys").tolist(), releases.col("generations").tolist(), strict=True):
            self.fault_point("release")
            self.close_slot(key, generation)
            self.applied.releases += 1

    def fault_point(self, point: str) -> None:
        """A test hook: `fault_hook(point)` runs before each slot op and batch (it may raise)."""
        if self.fault_hook is not None:
            self.fault_hook(point)

    def slot_of(self, key: int, generation: int) -> int:
        """The slot index of an open (key, generation)."""
        return self._slots(np.array([key]), np.array([generation]))[0]

    def _slots(self, keys: np.ndarray, generations: np.ndarray) -> list[int]:
        try:
            return [self._slot_of[k] for k in zip(keys.tolist(), generations.tolist(), strict=True)]
        except KeyError as missing:
            raise SlotError(f"plan names unknown slot {missing.args[0]}") from None

    def _append_blocks(self, appends: BlockAppends) -> None:
        if not appends.num_rows:
            return
        slots = self._slots(appends.col("keys"), appends.col("generations"))
        block_ids = appends.col("block_ids")
        planes, offset = self.config.num_planes, 0
        index_slots, index_planes, index_cols = [], [], []
        for slot, count in zip(slots, appends.col("num_new").tolist(), strict=True):
            ids = block_ids[offset : offset + planes * count].reshape(planes, count)
            offset += planes * count
            start = self._num_blocks[slot]
            self._host_tables[slot, :, start : start + count] = ids
            self._num_blocks[slot] = start + count
            # ids.ravel() is plane-major: plane p holds columns start … start + count − 1.
            index_slots.append(np.full(planes * count, slot))
            index_planes.append(np.repeat(np.arange(planes), count))
            index_cols.append(np.tile(np.arange(start, start + count), planes))
        if not offset:
            return
        # One upload and one scatter for the whole plan: (slot, plane, column) → block id.
        s_t, p_t, c_t, v_t = self._upload(
            np.concatenate(index_slots), np.concatenate(index_planes), np.concatenate(index_cols), block_ids[:offset]
        )
        self.block_tables[s_t, p_t, c_t] = v_t.to(torch.int32)

    # ------------------------------------------------------------------ contexts

    def _tensor(self, values: np.ndarray | list[int]) -> torch.Tensor:
        return self._upload(values)[0]

    def _upload(self, *columns: np.ndarray | list[int]) -> list[torch.Tensor]:
        """int64 device copies of host columns, in one host→device transfer.

        On CUDA the columns go through one pinned buffer with a non-blocking copy, so the host
        never waits for the GPU to drain the work already queued (a pageable copy would).
        """
        arrays = [np.asarray(c, dtype=np.int64).reshape(-1) for c in columns]
        host = torch.from_numpy(np.concatenate(arrays))  # a fresh, writable buffer
        if self._pin:
            device = host.pin_memory().to(self.device, non_blocking=True)
        else:
            device = host.to(self.device)
        return list(torch.split(device, [len(a) for a in arrays])) if len(arrays) > 1 else [device]

    def _loop_plane(self, depths: torch.Tensor) -> torch.Tensor:
        return depths - 1 if self.config.kv_layout == LAST_EXITED else torch.zeros_like(depths)

    def _width(self, positions: np.ndarray) -> int:
        """Block-table columns the batch's longest row needs (host-side: no device readback)."""
        return min(self._max_blocks, int(positions.max()) // self.storage.block_size + 1)

    def _context(
        self, slots: torch.Tensor, positions: torch.Tensor, depths: torch.Tensor | None, width: int,
        outer: bool = True, chunks: PrefillChunks | None = None,
    ) -> PagedContext:
        """Views of each row's depth plane (when depths are given) and of the outer plane (unless not `outer`).

        With `chunks` (a PREFILL batch), slots and depths are per chunk, [S], and the views hold
        one block-table row per chunk. Tables are trimmed to `width` columns (the batch's longest
        row), which the attention backends read as the batch's longest context (the Triton split
        heuristic among them).
        """
        block_size = self.storage.block_size
        tables = self.block_tables[:, :, :width]
        table_rows = None if chunks is None else chunks.table_rows
        loop_view = outer_view = None
        if depths is not None:
            loop_view = PagedPlaneView(tables[slots, self._loop_plane(depths)], positions, block_size, table_rows)
        if outer and self.model.info.num_outer_kv_layers:
            outer_tables = tables[:, self.config.num_planes - 1][slots]
            outer_view = PagedPlaneView(outer_tables, positions, block_size, table_rows)
        return PagedContext(self.storage, self._backend, positions, loop_view, outer_view, chunks)

    def _initial_state(self, embedded: torch.Tensor, seeds: np.ndarray, positions: torch.Tensor) -> torch.Tensor:
        noise = None
        if self.model.info.family == "huginn" and self.config.state_init == "random":
            (seed_tensor,) = self._upload(seeds.view(np.int64))
            noise = truncated_normal(seed_tensor, positions, self.model.info.hidden_size)
        return self.model.init_state(embedded, noise)

    def _reset_kl(self, slots: torch.Tensor) -> None:
        if self.prev_logp is not None:
            self.prev_logp[slots] = -math.log(self.model.info.vocab_size)

    # ------------------------------------------------------------------ stages

    def _prefill(self, batch: PrefillBatch) -> None:
        query_lens = batch.col("query_lens")
        if self.config.kv_layout != LAST_EXITED and query_lens.max() > 1:
            raise SlotError("SHARED prefill runs one position at a time (query_lens must be 1)")
        row_slots = self._slots(batch.col("keys"), batch.col("generations"))
        starts = batch.col("start_positions")
        host_positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, query_lens, strict=True)])
        cu_query_lens = np.concatenate([[0], np.cumsum(query_lens)])
        positions, tokens, rows, start_positions, cu, table_rows = self._upload(
            host_positions, batch.col("token_ids"), row_slots, starts, cu_query_lens,
            np.repeat(np.arange(len(row_slots)), query_lens),
        )
        # Chunks attend through the backend's prefill kernel, unless every chunk is one position
        # (SHARED always): then a row is its chunk and the decode kernel serves them.
        max_query_len = int(query_lens.max())
        chunks = PrefillChunks(cu, start_positions, table_rows, max_query_len) if max_query_len > 1 else None
        width = self._width(host_positions)

        def context(depth: int | None) -> PagedContext:
            depths = None if depth is None else torch.full_like(rows, depth)
            return self._context(rows, positions, depths, width, chunks=chunks)

        embedded = self.model.embed(tokens, positions, context(None))
        state = self._initial_state(embedded, np.repeat(batch.col("seeds"), query_lens), positions)
        for depth in range(1, self.config.max_depth + 1):
            state = self.model.loop(state, embedded, positions, context(depth))
        if self.model.info.num_outer_kv_layers:  # Huginn: coda K/V of every prompt position
            self.model.coda(state, positions, context(None))
        last = cu[1:] - 1  # each chunk's last row
        self.state[rows] = state[last]
        self.embedded[rows] = embedded[last]

    def _prelude(self, batch: PreludeBatch) -> None:
        host_positions = batch.col("positions")
        slots, positions, given = self._upload(
            self._slots(batch.col("keys"), batch.col("generations")), host_positions, batch.col("token_ids")
        )
        tokens = torch.where(given >= 0, given, self.tokens[slots])
        context = self._context(slots, positions, None, self._width(host_positions))
        embedded = self.model.embed(tokens, positions, context)
        self.state[slots] = self._initial_state(embedded, batch.col("seeds"), positions)
        self.embedded[slots] = embedded
        self._reset_kl(slots)

    def _recurrent(self, batch: RecurrentBatch, results: ResultBuilder) -> None:
        keys, generations = batch.col("keys"), batch.col("generations")
        row_slots = np.asarray(self._slots(keys, generations), dtype=np.int64)
        positions, first = batch.col("positions"), batch.col("first_depths")
        num_loops = batch.col("num_loops")
        if batch.signal != Signal.NONE and num_loops.max() > 1:
            raise SlotError("rows that return a signal run one loop per plan")
        signals = None
        if batch.signal != Signal.NONE:
            signals = torch.full((len(row_slots),), math.nan, dtype=torch.float64, device=self.device)
        graphs = self._graphs if batch.signal == Signal.NONE else None
        uploaded: list[torch.Tensor] | None = None
        width = self._width(positions)
        for j in range(int(num_loops.max())):
            active = np.flatnonzero(num_loops > j)
            if graphs is not None and graphs.run(row_slots[active], positions[active], first[active] + j):
                continue
            if uploaded is None:
                uploaded = self._upload(row_slots, positions, first)
            all_slots, all_pos, all_first = uploaded
            if len(active) == len(row_slots):
                rows = None
                slots, pos, depths = all_slots, all_pos, all_first + j
            else:  # rows with fewer loops left the batch; the trimmed width still covers the rest
                (rows,) = self._upload(active)
                slots, pos, depths = all_slots[rows], all_pos[rows], all_first[rows] + j
            previous = self.state[slots]
            state = self.model.loop(previous, self.embedded[slots], pos, self._context(slots, pos, depths, width))
            if signals is not None:
                value = self._signal(batch.signal, slots, pos, previous, state, width)
                if rows is None:
                    signals = value
                else:
                    signals[rows] = value
            self.state[slots] = state
        results.add(Stage.RECURRENT, keys, generations, depths=first + num_loops - 1, signals=signals)

    def _signal(
        self,
        kind: Signal,
        slots: torch.Tensor,
        positions: torch.Tensor,
        previous: torch.Tensor,
        state: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        if kind == Signal.GATE:
            return self.model.exit_gate(state).double()
        if kind == Signal.LATENT:
            change = (state - previous).double().norm(dim=-1)
            return change / state.double().norm(dim=-1)
        # KL(p_{d-1} ‖ p_d); this coda's K/V is overwritten by the position's final CODA.
        hidden = self.model.coda(state, positions, self._context(slots, positions, None, width))
        logp = torch.log_softmax(self.model.lm_head(hidden).to(self.prev_logp.dtype), dim=-1)
        prev = self.prev_logp[slots]
        self.prev_logp[slots] = logp
        return (prev.exp() * (prev - logp)).sum(dim=-1).double()

    def _finalize(self, batch: FinalizeBatch) -> None:
        if self.config.kv_layout != LAST_EXITED:
            return  # SHARED: the one plane already holds each position's last loop
        slots = self._slots(batch.col("keys"), batch.col("generations"))
        slots, positions, depths = self._upload(slots, batch.col("positions"), batch.col("exit_depths"))
        loop_tables = self.block_tables[:, : self.config.max_depth]  # Huginn's outer-layer plane comes after
        self._backend.finalize_kv(self.storage.pool, loop_tables, slots, positions, depths)

    def _coda(self, batch: CodaBatch, results: ResultBuilder) -> None:
        keys, generations = batch.col("keys"), batch.col("generations")
        row_slots = np.asarray(self._slots(keys, generations), dtype=np.int64)
        host_positions = batch.col("positions")
        indices = batch.col("sample_indices")
        sampled = np.flatnonzero(indices >= 0)  # the others ran only for their coda K/V (replay)
        seeds = batch.col("seeds")[sampled].view(np.int64)
        host_forced = self.forced_tokens(row_slots[sampled], indices[sampled])
        exit_depths = batch.col("exit_depths")[sampled]
        # The general path is exact for greedy rows too; the shortcut only skips the noise.
        all_greedy = bool(self.host_greedy[row_slots[sampled]].all())
        coda_graphs = None if self._graphs is None else self._graphs.coda
        if coda_graphs is not None and len(sampled) == len(row_slots) and host_forced is None:
            done = coda_graphs.run(row_slots, seeds, indices, all_greedy)
            if done is not None:
                results.add(Stage.CODA, keys, generations, depths=exit_depths, tokens=done[0], logprobs=done[1])
                return
        columns = [row_slots, host_positions, sampled, seeds, indices[sampled]]
        slots, positions, rows, seeds, sample_indices, *forced = self._upload(
            *columns, *([] if host_forced is None else [host_forced])
        )
        context = self._context(slots, positions, None, self._width(host_positions))
        hidden = self.model.coda(self.state[slots], positions, context)
        if not len(sampled):
            return
        if len(sampled) < len(row_slots):
            slots, hidden = slots[rows], hidden[rows]
        params = SamplingTensors(
            temperature=self.temperature[slots],
            top_k=self.top_k[slots],
            top_p=self.top_p[slots],
            seeds=seeds,
            indices=sample_indices,
        )
        tokens, logprobs = sample(
            self.model.lm_head(hidden), params, all_greedy=all_greedy, forced=forced[0] if forced else None
        )
        self.tokens[slots] = tokens
        results.add(Stage.CODA, keys[sampled], generations[sampled], depths=exit_depths, tokens=tokens,
                    logprobs=logprobs)
