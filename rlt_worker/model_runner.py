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
    decode_cursors where the slot's last DecodeBatch row stopped (a pipelined row continues there)

No host readback sits between a plan's stages: the sampled token stays in `tokens`, the host
keeps its own copy of the block tables (finalize addresses, table widths), and each stage's
row columns go to the device in one upload (pinned and asynchronous on CUDA). The device→host
copies are the result's, started on a side stream once the plan's work is queued (`submit`
returns before they land, so the next plan's work can queue behind), and, inside a DecodeBatch
(rlt_worker/decode_loop.py), each pass's exit decisions and the tokens sampled at its exits.

A PREFILL batch's rows (rlt_worker/prefill_rows.py) run their D loops at once, or, when the plan says
they ride (mixed batches), as extra rows of the plan's next D loop passes; whatever is left of them
runs after the batches, before any slot op that reads a slot (exports).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protocol.messages import (
    Admit,
    AppliedOps,
    BlockAppends,
    CodaBatch,
    DecodeBatch,
    ExecutionPlan,
    ExitTest,
    FinalizeBatch,
    PrefillBatch,
    PreludeBatch,
    RecurrentBatch,
    SamplingOptions,
    SlotKeys,
    Stage,
    StepResult,
)
from rlt_worker.attention import get_backend
from rlt_worker.cuda_graphs import LoopPassGraphs, StagedPass
from rlt_worker.decode_loop import DecodeCursors, DecodeLoop
from rlt_worker.exit_graphs import EagerExitStep, make_exit_step
from rlt_worker.kernels.launch import PLAIN, KernelLaunch
from rlt_worker.kv_storage import LAST_EXITED, KVStorage
from rlt_worker.models.base import LoopedModel
from rlt_worker.paged_context import PagedContext, PagedPlaneView, PrefillChunks
from rlt_worker.philox import truncated_normal
from rlt_worker.prefill_rows import DeviceChunks, HostChunks, PrefillRows
from rlt_worker.sampler import TORCH_KERNELS, SamplingKernels, SamplingKind, SamplingTensors, sample
from rlt_worker.step_results import HostCopies, PendingResult, ResultBuilder
from rlt_worker.swap import SwapStore

if TYPE_CHECKING:
    from rlt_worker.device_refill import RefillBuffers, ResidentRows


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
    prefill_graphs: bool = False  # PREFILL chunk loop passes from CUDA graphs too (with cuda_graphs)
    max_batch_tokens: int = 0  # token rows of a plan's largest batch: the prefill graphs' largest bucket
    exit_tests: tuple[ExitTest, ...] = ()  # the DecodeBatch exit tests whose graphs are captured with the passes'
    kernel_launch: KernelLaunch = PLAIN  # how the attention backend's Triton kernels launch (PDL or not)
    device_refill: bool = False  # gate exits' passes with no readback between them (rlt_worker/device_refill.py)
    mixed_graphs: bool = False  # mixed passes from CUDA graphs captured at first use (rlt_worker/mixed_graphs.py)
    fused_rotary_attention: bool = False  # a decode batch's RoPE, K/V write and attention in one launch


@dataclass(frozen=True)
class PassColumns:
    """A loop pass's rows on the device (int64 [n] each), and the staged graph that runs them (None: eager)."""

    slots: torch.Tensor
    positions: torch.Tensor
    depths: torch.Tensor
    staged: StagedPass | None


def sampling_kernels(device: torch.device, attention_backend: str) -> SamplingKernels:
    """How the sampler computes greedy batches and Philox noise: Triton's kernels on CUDA with the Triton
    backend (rlt_worker/kernels/greedy.py, philox_uniform.py); elsewhere, and on the torch path (the
    gate's reference), torch's."""
    if device.type == "cuda" and attention_backend == "triton":
        from rlt_worker.kernels.greedy import triton_greedy  # imports Triton: only when used
        from rlt_worker.kernels.philox_uniform import triton_uniform

        return SamplingKernels(greedy=triton_greedy, noise=triton_uniform)
    return TORCH_KERNELS


class ModelRunner:
    """Executes plans; owns the slot table and every per-slot device tensor."""

    def __init__(self, model: LoopedModel, storage: KVStorage, config: RunnerConfig) -> None:
        info = model.info
        self.model = model
        self.storage = storage
        self.config = config
        self.device = storage.pool.device
        self._backend = get_backend(config.attention_backend, config.kernel_launch)
        self._sampling_kernels = sampling_kernels(self.device, config.attention_backend)
        dtype = storage.pool.dtype
        slots, hidden = config.max_slots, info.hidden_size
        max_blocks = math.ceil(info.max_model_len / storage.block_size)
        # One row more than there are slots: the dummy slot of graph padding rows (never opened).
        self.state = torch.zeros(slots + 1, hidden, dtype=dtype, device=self.device)
        self.embedded = torch.zeros(slots + 1, hidden, dtype=dtype, device=self.device)
        self.tokens = torch.zeros(slots + 1, dtype=torch.long, device=self.device)  # + the dummy slot's
        # The host copy answers host-side questions (finalize addresses) without a device readback.
        self._host_tables = np.zeros((slots, config.num_planes, max_blocks), dtype=np.int32)
        self.block_tables = torch.zeros(
            slots + 1, config.num_planes, max_blocks, dtype=torch.int32, device=self.device
        )
        signal_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.prev_logp = (
            torch.zeros(slots + 1, info.vocab_size, dtype=signal_dtype, device=self.device)
            if info.has_coda_signal
            else None
        )
        self.temperature = torch.ones(slots, dtype=torch.float64, device=self.device)
        self.top_k = torch.full((slots,), -1, dtype=torch.long, device=self.device)
        self.top_p = torch.ones(slots, dtype=torch.float64, device=self.device)
        # Each slot's stop tokens as a vocabulary mask (+ the dummy slot's, empty): DeviceRefill's test.
        self.stop_mask = torch.zeros(slots + 1, info.vocab_size, dtype=torch.bool, device=self.device)
        # Each slot's admitted options, on the host: sampling needs no readback to choose its path
        # (greedy rows: temperature <= 0) or to find a forced token. Set by admit and by a swap import.
        self.slot_options = [SamplingOptions()] * slots
        self.host_greedy = np.zeros(slots, dtype=bool)
        self.host_filtered = np.zeros(slots, dtype=bool)  # top-k or top-p on: SamplingKind.FILTERED
        self._num_blocks = [0] * slots
        self.decode_cursors = DecodeCursors(slots, self.device)
        # Results leave the device on their own stream, so the next plan's work does not wait for them.
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._max_blocks = max_blocks
        self._pin = self.device.type == "cuda"
        self._slot_of: dict[tuple[int, int], int] = {}
        self._identity: dict[int, tuple[int, int]] = {}  # the inverse: slot → (key, generation)
        self._free_slots = list(range(slots - 1, -1, -1))
        self._swap = SwapStore()
        self.applied = AppliedOps()  # the slot ops of the current (or last) plan applied so far
        self.fault_hook: Callable[[str], None] | None = None  # tests: fail a plan at a chosen point
        # tests: (slots, positions, depths) of every loop pass over slot rows, as it starts, riding prompt
        # chunks' rows included (identity() names a slot; a chunk's passes of its own are not reported)
        self.pass_listener: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None
        self._graphs: LoopPassGraphs | None = None
        self._riding: PrefillRows | None = None  # the plan's PREFILL batch while its loops ride the passes
        if config.cuda_graphs and self.device.type == "cuda":
            self.use_pass_graphs(emulate=False)
            if config.graph_capture == "startup":  # before the worker reports ready: none while serving
                self.capture_pass_graphs()

    def use_pass_graphs(self, emulate: bool, prefill: bool | None = None, mixed: bool | None = None) -> None:
        """Run decode loop passes through LoopPassGraphs (emulate: eagerly, CPU tests), PREFILL chunk
        passes too when `prefill`, and mixed passes when `mixed` (defaults: the config's prefill_graphs
        and mixed_graphs)."""
        config = self.config
        if config.scratch_block < 0:
            raise ValueError("graph-captured passes need a scratch KV block (RunnerConfig.scratch_block)")
        prefill = config.prefill_graphs if prefill is None else prefill
        mixed = config.mixed_graphs if mixed is None else mixed
        if (prefill or mixed) and config.max_batch_tokens < 1:
            raise ValueError("prefill and mixed graphs need the batch token limit (RunnerConfig.max_batch_tokens)")
        self._graphs = LoopPassGraphs(self, self.dummy_slot, config.scratch_block, emulate,
                                      prefill_tokens=config.max_batch_tokens if prefill else 0,
                                      exit_tests=config.exit_tests,
                                      mixed_tokens=config.max_batch_tokens if mixed else 0)

    def capture_pass_graphs(self) -> None:
        """Capture every graph bucket now: prefill, decode pass, CODA, exit test (see LoopPassGraphs.capture_all)."""
        if self._graphs is None:
            raise ValueError("capture_pass_graphs needs use_pass_graphs first")
        self._graphs.capture_all()

    @property
    def graph_stats(self) -> dict | None:
        """Counters of graph-replayed and eager decode and prefill passes (None when graphs are off)."""
        return None if self._graphs is None else self._graphs.stats.as_dict()

    @property
    def prefill_token_buckets(self) -> tuple[int, ...]:
        """The token counts PREFILL passes replay from graphs at, ascending (empty: prefill runs eagerly)."""
        prefill = None if self._graphs is None else self._graphs.prefill
        return () if prefill is None else prefill.token_buckets

    @property
    def num_swapped(self) -> int:
        """Slots whose state and pages are held in host memory (swap preemption)."""
        return len(self._swap)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    # ------------------------------------------------------------------ plan

    def execute(self, plan: ExecutionPlan) -> list[StepResult]:
        """Run a plan and wait for its results (early ones first, then the plan's)."""
        return [r for r in (pending.result() for pending in self.submit(plan)) if r is not None]

    @torch.inference_mode()
    def submit(self, plan: ExecutionPlan) -> list[PendingResult]:
        """Apply a plan in its order (admits, appends, batches, releases); its results are on their
        way to the host when this returns (on the CPU: there already), in the order they are to be
        sent: early results of requests that ended mid-plan (ResultBuilder.send_early), then the
        plan's, which completes it.

        `applied` counts the slot ops done so far, so a plan that raises midway can say which of
        its slot ops took effect (the Worker puts it into the error result)."""
        results = ResultBuilder(plan.step_id, self._copy_stream)
        self.applied = AppliedOps()
        self._riding = None  # a failed plan's riding chunk is dropped with the plan
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
                self._recurrent(batch)
            elif isinstance(batch, FinalizeBatch):
                self._finalize(batch)
            elif isinstance(batch, CodaBatch):
                self._coda(batch, results)
            elif isinstance(batch, DecodeBatch):
                DecodeLoop(self, batch).run(results)
        self.finish_riding()
        self._swap.export(self, plan.exports)
        self._release(plan.releases)
        self._swap.drop(self, plan.swap_drops)
        return results.finish(self.num_free_slots)

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
        self._identity[slot] = identity
        self._num_blocks[slot] = 0
        self.decode_cursors.reset(slot)
        return slot

    def close_slot(self, key: int, generation: int) -> int:
        """Unmap (key, generation); returns the slot index it held."""
        slot = self._slot_of.pop((key, generation), None)
        if slot is None:
            raise SlotError(f"release of unknown slot {(key, generation)}")
        del self._identity[slot]
        self._free_slots.append(slot)
        return slot

    def identity(self, slot: int) -> tuple[int, int]:
        """The (key, generation) an open slot holds."""
        return self._identity[slot]

    def slot_blocks(self, slot: int) -> np.ndarray:
        """The slot's block ids, [planes, num_blocks] (host mirror)."""
        return self._host_tables[slot, :, : self._num_blocks[slot]]

    def covered_positions(self, row_slots: np.ndarray) -> np.ndarray:
        """Positions each slot's blocks cover (positions 0 … this − 1 have a KV address)."""
        return np.asarray(self._num_blocks)[row_slots] * self.storage.block_size

    def _admit(self, admit: Admit) -> None:
        self.set_options(self.open_slot(admit.key, admit.generation), admit.sampling)

    def set_options(self, slot: int, options: SamplingOptions) -> None:
        """A slot's sampling options (at admission, or restored by a swap import)."""
        self.slot_options[slot] = options
        self.host_greedy[slot] = options.temperature <= 0
        self.host_filtered[slot] = options.top_k > 0 or options.top_p < 1.0
        # fill_ takes the value as a kernel argument; `[slot] = value` would copy it to the device from
        # pageable memory, which waits for the stream to drain (the plans in flight) at every admit.
        self.temperature[slot].fill_(options.temperature)
        self.top_k[slot].fill_(options.top_k)
        self.top_p[slot].fill_(options.top_p)
        mask = np.zeros(self.stop_mask.shape[1], dtype=bool)
        mask[[t for t in options.stop_token_ids if 0 <= t < len(mask)]] = True
        self.upload_into(self.stop_mask[slot], mask)  # pinned, asynchronous: admitting waits for nothing

    def forces_tokens(self, slots: np.ndarray) -> bool:
        """Whether any of these slots is teacher-forced (a replay's given tokens), at any output index."""
        return any(self.slot_options[slot].forced_tokens is not None for slot in slots.tolist())

    def forced_tokens(self, slots: np.ndarray, indices: np.ndarray) -> np.ndarray | None:
        """Teacher forcing: each (slot, output index)'s given token, −1 where it samples; None when no
        row forces (the common case, answered without a loop over rows)."""
        if not self.forces_tokens(slots):
            return None
        options = [self.slot_options[slot] for slot in slots.tolist()]
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
        return self.slots_of(np.array([key]), np.array([generation]))[0]

    def slots_of(self, keys: np.ndarray, generations: np.ndarray) -> list[int]:
        try:
            return [self._slot_of[k] for k in zip(keys.tolist(), generations.tolist(), strict=True)]
        except KeyError as missing:
            raise SlotError(f"plan names unknown slot {missing.args[0]}") from None

    def _append_blocks(self, appends: BlockAppends) -> None:
        if not appends.num_rows:
            return
        slots = self.slots_of(appends.col("keys"), appends.col("generations"))
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
        s_t, p_t, c_t, v_t = self.upload(
            np.concatenate(index_slots), np.concatenate(index_planes), np.concatenate(index_cols), block_ids[:offset]
        )
        self.block_tables[s_t, p_t, c_t] = v_t.to(torch.int32)

    # ------------------------------------------------------------------ contexts

    def upload(self, *columns: np.ndarray | list[int]) -> list[torch.Tensor]:
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

    def upload_into(self, static: torch.Tensor, host: np.ndarray) -> None:
        """Write a host array into a device buffer of its shape (a graph's static inputs) in one
        host→device copy, pinned and asynchronous on CUDA as `upload`'s."""
        source = torch.from_numpy(host)
        static.copy_(source.pin_memory() if self._pin else source, non_blocking=True)

    def read_back(self, *values: torch.Tensor) -> list[np.ndarray]:
        """Device tensors' values on the host after one wait for the work queued before them (the
        decode loop's readbacks, which choose its next rows): several tensors cost one round trip."""
        if not self._pin:
            return [v.cpu().numpy() for v in values]  # the CPU's values are final: no copy
        return self.copy_out(*values).wait()

    def copy_out(self, *values: torch.Tensor) -> HostCopies:
        """Device tensors' values on their way to the host, behind the work queued before them: on
        CUDA non-blocking copies into pinned memory and an event, nothing waited for."""
        if not self._pin:
            return HostCopies([v.cpu().clone() for v in values], None)
        hosts = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for v in values]
        for host, value in zip(hosts, values, strict=True):
            host.copy_(value, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))
        return HostCopies(hosts, copied)

    def _loop_plane(self, depths: torch.Tensor) -> torch.Tensor:
        return depths - 1 if self.config.kv_layout == LAST_EXITED else torch.zeros_like(depths)

    def table_width(self, positions: np.ndarray) -> int:
        """Block-table columns the batch's longest row needs (host-side: no device readback)."""
        return min(self._max_blocks, int(positions.max()) // self.storage.block_size + 1)

    def context(
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
        return PagedContext(self.storage, self._backend, positions, loop_view, outer_view, chunks,
                            fused_rotary=self.config.fused_rotary_attention)

    def initial_state(self, embedded: torch.Tensor, seeds: np.ndarray, positions: torch.Tensor) -> torch.Tensor:
        """The state loop 1 starts from (Huginn's random init draws Philox(seed, 2, position))."""
        noise = None
        if self.model.info.family == "huginn" and self.config.state_init == "random":
            (seed_tensor,) = self.upload(seeds.view(np.int64))
            noise = truncated_normal(seed_tensor, positions, self.model.info.hidden_size)
        return self.model.init_state(embedded, noise)

    def _reset_kl(self, slots: torch.Tensor) -> None:
        if self.prev_logp is not None:
            self.prev_logp[slots] = -math.log(self.model.info.vocab_size)

    # ------------------------------------------------------------------ stages (batches)

    def _prefill(self, batch: PrefillBatch) -> None:
        chunks = HostChunks.of(batch, self.slots_of(batch.col("keys"), batch.col("generations")))
        if self.config.kv_layout != LAST_EXITED and chunks.max_query_len > 1:
            raise SlotError("SHARED prefill runs one position at a time (query_lens must be 1)")
        if batch.rides_loop_passes:  # eager: its loops join the next loop passes (a graph holds fixed rows)
            self._riding = PrefillRows(self, chunks, DeviceChunks.upload(self, chunks))
            return  # finished by the decode loop, or after the batches
        graphs = None if self._graphs is None else self._graphs.prefill
        if graphs is None or not graphs.run(chunks):
            PrefillRows(self, chunks, DeviceChunks.upload(self, chunks)).finish()

    @property
    def riding_slots(self) -> np.ndarray:
        """Slots whose prompt chunk rides this plan's loop passes and has not finished (int64, maybe empty)."""
        return np.empty(0, dtype=np.int64) if self._riding is None else self._riding.host.slots

    @property
    def has_riding_loops(self) -> bool:
        """Whether a riding prompt chunk still has loops for the next pass to run."""
        return self._riding is not None and self._riding.num_loops_left > 0

    def finish_riding(self) -> None:
        """The riding chunks' loops no pass ran, alone, then their last states into their slots."""
        if self._riding is not None:
            self._riding.finish()
            self._riding = None

    def _prelude(self, batch: PreludeBatch) -> None:
        row_slots = np.asarray(self.slots_of(batch.col("keys"), batch.col("generations")))
        self.embed_rows(row_slots, batch.col("positions"), batch.col("seeds"), batch.col("token_ids"))

    def _recurrent(self, batch: RecurrentBatch) -> None:
        """The planned loops of each row (the engine decided them: nothing is reported)."""
        row_slots = np.asarray(self.slots_of(batch.col("keys"), batch.col("generations")), dtype=np.int64)
        positions, first = batch.col("positions"), batch.col("first_depths")
        num_loops = batch.col("num_loops")
        width = self.table_width(positions)  # a row that leaves the pass only narrows what the rest need
        for j in range(int(num_loops.max())):
            active = np.flatnonzero(num_loops > j)
            self.loop_pass(row_slots[active], positions[active], first[active] + j, width)

    def _finalize(self, batch: FinalizeBatch) -> None:
        row_slots = np.asarray(self.slots_of(batch.col("keys"), batch.col("generations")))
        self.finalize_rows(row_slots, batch.col("positions"), batch.col("exit_depths"))

    def _coda(self, batch: CodaBatch, results: ResultBuilder) -> None:
        keys, generations = batch.col("keys"), batch.col("generations")
        row_slots = np.asarray(self.slots_of(keys, generations), dtype=np.int64)
        positions, indices = batch.col("positions"), batch.col("sample_indices")
        replayed = indices < 0  # a replayed position's coda runs for its K/V only
        if replayed.any():
            self.coda_kv(row_slots[replayed], positions[replayed])
        sampled = ~replayed
        if sampled.any():
            seeds = batch.col("seeds")[sampled].view(np.int64)
            tokens, logprobs = self.sample_rows(row_slots[sampled], positions[sampled], seeds, indices[sampled])
            results.add(Stage.CODA, keys[sampled], generations[sampled], depths=batch.col("exit_depths")[sampled],
                        tokens=tokens, logprobs=logprobs)

    # ------------------------------------------------------------------ stages (rows)
    # Host columns in, device work out: the batch handlers above and the decode loop share these.

    def embed_rows(
        self, row_slots: np.ndarray, host_positions: np.ndarray, seeds: np.ndarray, given: np.ndarray | None = None
    ) -> torch.Tensor:
        """PRELUDE: embed each row's input token (`given`, or −1 / None: the token its slot's last CODA
        sampled) at its position and start its state (loop depth 0); returns the rows' slots on the device."""
        slots, positions, *uploaded = self.upload(row_slots, host_positions, *([] if given is None else [given]))
        tokens = self.tokens[slots] if not uploaded else torch.where(uploaded[0] >= 0, uploaded[0], self.tokens[slots])
        context = self.context(slots, positions, None, self.table_width(host_positions))
        embedded = self.model.embed(tokens, positions, context)
        self.state[slots] = self.initial_state(embedded, seeds, positions)
        self.embedded[slots] = embedded
        self._reset_kl(slots)
        return slots

    def pass_columns(self, row_slots: np.ndarray, host_positions: np.ndarray, depths: np.ndarray) -> PassColumns:
        """A loop pass's rows on the device in one host→device copy: into the static inputs of the graph
        that will run the pass when one fits, else a plain upload (an eager pass)."""
        staged = None
        if self._graphs is not None:
            if self.has_riding_loops:
                self._graphs.stats.mixed_passes += 1  # a decode graph holds fixed rows: a mixed graph runs it
            else:
                staged = self._graphs.stage(row_slots, host_positions, depths)
        if staged is None:
            return PassColumns(*self.upload(row_slots, host_positions, depths), staged=None)
        slots, positions, device_depths = staged.columns
        return PassColumns(slots, positions, device_depths, staged)

    def loop_pass(
        self, row_slots: np.ndarray, host_positions: np.ndarray, depths: np.ndarray, width: int,
        columns: PassColumns | None = None,
    ) -> None:
        """One loop of each row at its own depth (a graph replay when one fits), with the plan's riding
        prompt chunks' next loop when they have one left (mixed batches: one pass over both, from a mixed
        graph when one takes them);
        `columns`: the rows already on the device (pass_columns)."""
        riding = self._riding if self.has_riding_loops else None
        if self.pass_listener is not None:
            self._report_pass(row_slots, host_positions, depths, riding)
        if columns is None:
            columns = self.pass_columns(row_slots, host_positions, depths)
        if columns.staged is not None:
            assert self._graphs is not None
            self._graphs.replay(columns.staged)
            return
        mixed = None if riding is None or self._graphs is None else self._graphs.mixed
        if mixed is not None and mixed.run(row_slots, host_positions, depths, riding):
            return
        slots, positions = columns.slots, columns.positions
        context = self.context(slots, positions, columns.depths, width)
        state, embedded = self.state[slots], self.embedded[slots]
        if riding is None:
            self.state[slots] = self.model.loop(state, embedded, positions, context)
        else:
            self.state[slots] = riding.ride(state, embedded, positions, context)

    def _report_pass(self, row_slots: np.ndarray, host_positions: np.ndarray, depths: np.ndarray,
                     riding: PrefillRows | None) -> None:
        if riding is not None:
            row_slots = np.concatenate([row_slots, riding.host.row_slots()])
            host_positions = np.concatenate([host_positions, riding.host.positions()])
            depths = np.concatenate([depths, np.full(riding.host.num_rows, riding.depth + 1)])
        self.pass_listener(row_slots, host_positions, depths)

    def exit_step(self, exit_test: ExitTest) -> EagerExitStep:
        """How a DecodeBatch's exit test runs after its passes: from graphs when the passes' are on and the
        test is graphable (rlt_worker/exit_graphs.py), else eagerly."""
        return make_exit_step(self, exit_test, None if self._graphs is None else self._graphs.exits)

    def finalize_rows(self, row_slots: np.ndarray, host_positions: np.ndarray, exit_depths: np.ndarray) -> None:
        """LAST_EXITED: copy each row's exit-plane K/V at its position into every deeper plane."""
        if self.config.kv_layout == LAST_EXITED and len(row_slots):
            self.finalize_on_device(*self.upload(row_slots, host_positions, exit_depths))

    def finalize_on_device(self, slots: torch.Tensor, positions: torch.Tensor, exit_depths: torch.Tensor) -> None:
        """finalize_rows of device columns (an exit depth of D copies nothing)."""
        if self.config.kv_layout != LAST_EXITED:
            return  # SHARED: the one plane already holds each position's last loop
        loop_tables = self.block_tables[:, : self.config.max_depth]  # Huginn's outer-layer plane comes after
        self._backend.finalize_kv(self.storage.pool, loop_tables, slots, positions, exit_depths)

    # ------------------------------------------------------------------ device columns (DeviceRefill)

    @property
    def dummy_slot(self) -> int:
        """The slot row of graph padding rows (never opened): every per-slot tensor but the options has it."""
        return self.config.max_slots

    @property
    def refill_resident(self) -> ResidentRows | None:
        """The last device-refill plan's rows, whose stops are in their bucket's columns (None: none)."""
        return None if self._graphs is None or self._graphs.refill is None else self._graphs.refill.resident

    @refill_resident.setter
    def refill_resident(self, rows: ResidentRows | None) -> None:
        if self._graphs is not None and self._graphs.refill is not None:
            self._graphs.refill.resident = rows

    def refill_graph(self, num_rows: int, max_position: int, exit_test: ExitTest,
                     chunks: tuple[int, int] | None = None) -> tuple[Any, RefillBuffers] | None:
        """The device-refill pass of `num_rows` rows up to `max_position` (`chunks`: with riding prompt
        chunks of that prefill bucket in it) and its bucket's buffers; None without graphs, for a coda
        that attends, when no bucket fits or capturing failed."""
        refill = None if self._graphs is None else self._graphs.refill
        key = None if refill is None else self._graphs.bucket(num_rows, max_position)
        graph = None if key is None else refill.graph(*key, exit_test, chunks)
        if graph is None:
            return None
        if chunks is None:
            self._graphs.stats.device_refill_plans += 1
        return graph, refill.buffers[key[0]]

    def riding_chunk_bucket(self) -> tuple[int, int] | None:
        """The mixed graphs' (tokens, chunks) bucket of the riding prompt chunks; None without mixed
        graphs, riding chunks, or a bucket that holds them."""
        mixed = None if self._graphs is None else self._graphs.mixed
        return None if mixed is None or self._riding is None else mixed.buffers.bucket(self._riding.host)

    def ride_refill_pass(self, replay: Callable[[], None], chunks: tuple[int, int], num_rows: int,
                         padded_rows: int) -> None:
        """A device-refill pass (`replay`) that also runs the riding chunks' next loop (their bucket `chunks`)."""
        assert self._graphs is not None and self._graphs.mixed is not None and self._riding is not None
        self._graphs.stats.mixed_passes += 1
        self._graphs.stats.refill_riding_passes += 1
        self._graphs.mixed.ride(self._riding, chunks, replay, num_rows, padded_rows)

    def count_refill_resumed(self) -> None:
        """GraphStats: a device-refill plan resumed its rows where the last one left them."""
        self._graphs.stats.device_refill_resumed += 1

    def count_refill_carried(self) -> None:
        """GraphStats: a device-refill plan carried some rows' columns over from the last one's on the device."""
        self._graphs.stats.device_refill_carried += 1

    def report_refill_pass(self, columns: torch.Tensor, running: torch.Tensor) -> None:
        """pass_listener (tests) before a device-refill pass: each running row's next loop, read back."""
        assert self.pass_listener is not None
        (slots, positions, depths), keep = self.read_back(columns, running)
        self.pass_listener(slots[keep], positions[keep], depths[keep] + 1)

    def sample_on_device(self, slots: torch.Tensor, params: SamplingTensors, kind: SamplingKind,
                         needed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """CODA of a coda without attention (Ouro) over these slots' states, then the sampler: what
        CodaGraphs captures, and DeviceRefill's CODA of every row of a pass (`needed`: the rows whose
        tokens it keeps, the model's lm_head_needed; the others' tokens are anything)."""
        positions = torch.zeros_like(slots)  # unread: this coda has no attention
        hidden = self.model.coda(self.state[slots], positions, self.context(slots, positions, None, 1))
        logits = self.model.lm_head(hidden) if needed is None else self.model.lm_head_needed(hidden, needed)
        return sample(logits, params, kind, kernels=self._sampling_kernels)

    def is_stop_token(self, slots: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """bool [n]: whether each token is one of its slot's stop tokens (the dummy slot has none)."""
        return self.stop_mask[slots, tokens]

    def store_tokens(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """The tokens a PRELUDE of these slots reads (the slot table's)."""
        self.tokens[slots] = tokens

    def embed_on_device(self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """PRELUDE of device columns for a model without outer layers (Ouro: no noise, no context read)."""
        embedded = self.model.embed(tokens, positions, self.context(slots, positions, None, 1))
        self.state[slots] = self.model.init_state(embedded, None)
        self.embedded[slots] = embedded
        self._reset_kl(slots)

    def coda_kv(self, row_slots: np.ndarray, host_positions: np.ndarray) -> None:
        """The coda of each row's state for its K/V only (a replayed position: nothing is sampled)."""
        slots, positions = self.upload(row_slots, host_positions)
        context = self.context(slots, positions, None, self.table_width(host_positions))
        self.model.coda(self.state[slots], positions, context)

    def sample_rows(
        self, row_slots: np.ndarray, host_positions: np.ndarray, seeds: np.ndarray, indices: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """CODA: coda + LM head on each row's state, then its output `indices[r]` (seeds: int64 views of
        the uint64 seeds), or its slot's forced token; the token also goes to the slot for the next
        PRELUDE. Returns (tokens, logprobs) on the device."""
        host_forced = self.forced_tokens(row_slots, indices)
        kind = SamplingKind.of(self.host_greedy[row_slots], self.host_filtered[row_slots])
        coda_graphs = None if self._graphs is None else self._graphs.coda
        if coda_graphs is not None and host_forced is None:
            done = coda_graphs.run(row_slots, seeds, indices, kind)
            if done is not None:
                return done
        slots, positions, seed_tensor, sample_indices, *forced = self.upload(
            row_slots, host_positions, seeds, indices, *([] if host_forced is None else [host_forced])
        )
        context = self.context(slots, positions, None, self.table_width(host_positions))
        hidden = self.model.coda(self.state[slots], positions, context)
        params = SamplingTensors(temperature=self.temperature[slots], top_k=self.top_k[slots],
                                 top_p=self.top_p[slots], seeds=seed_tensor, indices=sample_indices)
        tokens, logprobs = sample(self.model.lm_head(hidden), params, kind, forced=forced[0] if forced else None,
                                  kernels=self._sampling_kernels)
        self.tokens[slots] = tokens
        return tokens, logprobs
