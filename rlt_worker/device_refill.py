"""A DecodeBatch's passes with its exits, CODA and refill on the device: no readback between passes.

DecodeLoop's host-driven passes read each pass's exit flags back to choose the next pass's rows and
the boundary work. For a gate test (OURO, OURO_DELAYED) that is one round trip per pass, and the
GPU waits for it: at c = 1 on the H200, 1.18 ms a token at 2.3 passes (docs/benchmarks.md). Here
every row of the plan stays in its rows bucket for the whole plan, and what the host decided from
the flags is decided by masks on the device instead. One pass, captured as one CUDA graph per
(rows bucket, width bucket, test):

    the rows' columns → the pass graphs' static inputs (a row that stopped: the dummy slot)
    → the loop pass → the exit test → exits = flags ∧ running
    → FINALIZE of every row (exit depth D where the row did not exit: a no-op)
    → CODA and greedy sampling of every row (the rows that did not exit drop theirs: the head is
      the model's lm_head_needed of the exits, which a gated head skips when none exited)
    → each exit's output recorded at (row, its count) → a row ends at its last output or a stop
      token (the slot's stop mask) → the others: PRELUDE of the token at position + 1 (into the
      dummy slot where the row did not exit) → a row whose new position's next one has no block
      stops there (RECURRENT at depth 0, as the host loop's coverage rule)
    → "any row running" and "rows that ended" into static flags

    host, per pass   one replay, and a copy of the flags to pinned memory; before pass p it waits
                     for pass p − LEAD's flags (LEAD passes stay queued) and stops when none runs;
                     if rows ended in that pass, the ended rows go out in an early result (one
                     copy out of the bucket's ends and outputs, turned into rows when it lands);
                     over the plan's last TAIL passes it waits for none (reads only flags landed),
                     so LEAD + TAIL passes stay queued while the engine builds the next plan
    host, per plan   one upload (the rows' columns), one copy out (every output, where each row
                     stopped), waited for only when the result is built or the host's cursors are
                     needed (DecodeLoop's landing)
    resume           a next plan of the same rows, all continuing, starts from the columns as they
                     are (`DeviceRefill.resume`: the covered positions uploaded, no readback), so
                     pipelined plans queue on the device one behind the other
    carry            a next plan whose rows differ (some joined, some left) takes the columns of its
                     rows that continue the last plan's from that plan's bucket on the device, and
                     the others from the host (`DeviceRefill.carried_rows`): no plan lands first

Every operation is the host path's on the same rows (the same pass, exit test, finalize kernel,
coda, head and sampler), so tokens and exit depths are the host loop's; only the head GEMM's row
count (the bucket's, not the exits') differs, which batch invariance does not cover on CUDA. The
price is CODA for every row at every pass instead of once per token: the head's weight is read per
pass (a greedy CODA graph of 1 row, with the Triton greedy rule: 0.075 ms of GPU time on the H200,
docs/benchmarks.md), unless the model's head is gated (FusedOuroModel's HEAD_STRIP_SETTINGS, off):
then a pass where no row exited reads no head weight. The bookkeeping between (ColumnSteps) is one
Triton launch per step on CUDA.

The buffers live per rows bucket for the worker's life (the graphs read them at fixed addresses);
graphs are captured at a bucket's first use (`lazy_captures`). When it runs (`DeviceRefill.carried_rows`
and `plan`, once per batch): `device_refill` is on, the passes and the test replay from graphs, refill is on,
the coda has no attention (Ouro), every row is greedy and none forces tokens, the plan has at most
MAX_PASSES passes, and riding prompt chunks (mixed batches) fit a mixed graph's chunk bucket.
Otherwise the host-driven loop runs. (A test's pass_listener costs a readback per pass here.)

Riding chunks. While a plan's PREFILL chunks have loops left, a pass replays the graph of the same
pass with the mixed graphs' loop over both parts (rlt_worker/mixed_graphs.py: the bucket's rows at
their slots, the chunks at loop depth + 1 from that family's static chunk buffers, staged by the host
before each replay); the passes after them replay the plain graph. A row behind its prompt's riding
last chunk (its output 0) is not among the device's rows: after the passes the chunks' loops left
run and its boundary work runs on the host, before the copies out, and its next position joins the
next plan (a plan runs at most D passes while a first token is pending, so it loses no pass).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protocol.messages import ExitTest, Stage
from rlt_worker import mixed_graphs
from rlt_worker.exit_graphs import EagerExitStep, GraphedExitStep
from rlt_worker.exit_tests import EXIT_STATE, make_exit_test
from rlt_worker.sampler import SamplingKind, SamplingTensors
from rlt_worker.step_results import ResultBuilder

if TYPE_CHECKING:
    from rlt_worker.cuda_graphs import LoopPassGraphs
    from rlt_worker.decode_loop import _Rows
    from rlt_worker.model_runner import ModelRunner
    from rlt_worker.step_results import HostCopies

log = logging.getLogger("rlt.worker")

LEAD = 2  # passes queued ahead of the one whose "any row running" flag the host waits for
# A plan's last passes, replayed without waiting for a flag: LEAD + TAIL passes stay queued when the
# plan's host work ends, to cover the engine's and the worker's work until the next plan's first
# replay, as a planned plan's passes (all queued) do. With LEAD alone, H200, c = 1, ~1.1-ms passes,
# the GPU drained at every plan boundary (docs/benchmarks.md, the profile at 3012fa6: 32 gaps of
# 0.53 ms before a plan's first pass). Costs at most LEAD + TAIL − 1 passes with no row running when
# every row stops in them (a request's last plan at c = 1); the tokens are the same.
TAIL = 2
MAX_PASSES = 64  # outputs a row may record in one plan (the buffers' width; loops_per_plan is 4·D by default)
# Rows of RefillBuffers.columns (int64 [COLUMNS, R]); RUNNING and FINISHED hold 0 or 1.
SLOTS, POSITIONS, DEPTHS, INDICES, LAST, COVERED, RUNNING, FINISHED, SEEDS, COUNT = range(10)
COLUMNS = 10
ALIVE, ENDED = range(2)  # RefillBuffers.flags
ChunkKey = tuple[int, int]  # (tokens, chunks): the prefill bucket of prompt chunks riding a pass
RefillKey = tuple[int, int, ExitTest, ChunkKey | None]  # (rows, width, test, riding chunks' bucket)


class RefillBuffers:
    """One rows bucket's device state (R rows; padding rows on the dummy slot, never running)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.columns = torch.zeros(COLUMNS, rows, dtype=torch.long, device=device)
        self.outputs = torch.zeros(2, rows, MAX_PASSES + 1, dtype=torch.long, device=device)  # tokens, depths
        self.logprobs = torch.zeros(rows, MAX_PASSES + 1, dtype=torch.float64, device=device)
        # After each pass: [ALIVE] whether any row still runs, [ENDED] how many rows ended in it.
        self.flags = torch.zeros(2, dtype=torch.long, device=device)
        # Pass p's copy of `flags` (pinned, and the event after its copy on CUDA), allocated once: a
        # plan's host loop reads pass p's only within its run_passes, before the next plan's pass p
        # writes it (stream order), so one copy per pass index serves every plan.
        cuda = device.type == "cuda"
        self.flags_host = torch.zeros(MAX_PASSES, 2, dtype=torch.long, pin_memory=cuda)
        self.flags_copied = [torch.cuda.Event() for _ in range(MAX_PASSES)] if cuda else None
        self.row_index = torch.arange(rows, device=device)
        self.boundary_slots = torch.zeros(2, rows, dtype=torch.long, device=device)  # ColumnSteps.after_sample
        self.carried = torch.tensor([[POSITIONS], [DEPTHS], [INDICES], [FINISHED]], device=device)  # see _carry
        # Greedy: the sampler reads only whether each row is greedy (all are) and draws nothing.
        self.params = SamplingTensors(temperature=torch.zeros(rows, dtype=torch.float64, device=device),
                                      top_k=torch.full((rows,), -1, dtype=torch.long, device=device),
                                      top_p=torch.ones(rows, dtype=torch.float64, device=device),
                                      seeds=self.columns[SEEDS], indices=self.columns[INDICES])


class RefillGraphs:
    """The per-pass function of each (rows, width, test), captured lazily; owned by LoopPassGraphs."""

    def __init__(self, passes: LoopPassGraphs) -> None:
        self.passes = passes
        self.runner = passes.runner
        self.buffers = {b: RefillBuffers(b, self.runner.device) for b in passes.row_buckets}
        self.steps = column_steps(self.runner.device, self.runner.config.attention_backend)
        self._graphs: dict[RefillKey, Any] = {}
        self.resident: ResidentRows | None = None  # the last device-refill plan's rows (DeviceRefill.resume)
        self.error: str | None = None  # a capture failed: DecodeBatches take the host loop from now on

    def graph(self, rows: int, width: int, exit_test: ExitTest, chunks: ChunkKey | None = None) -> Any:
        """The key's graph (captured now at its first use), or None after a failed capture. `chunks`: the
        (tokens, chunks) bucket of prompt chunks riding the pass (a mixed graph's chunk rows); of those
        keys, as of mixed graphs', at most mixed_graphs.MAX_GRAPHS are captured (None past it)."""
        key = (rows, width, exit_test, chunks)
        if key not in self._graphs and chunks is not None and self.riding_keys() >= mixed_graphs.MAX_GRAPHS:
            return None
        if key not in self._graphs and self.error is None and self.passes.stats.error is None:
            # The warm-up points the bucket's rows at the dummy slot: keep the resident rows' columns.
            resident = self.buffers[rows].columns.clone()
            try:
                self._graphs[key] = self.passes._capture(
                    functools.partial(self._pass, rows, width, make_exit_test(exit_test), chunks),
                    functools.partial(self._point_at_dummy, rows, width, chunks))
                self.passes.stats.lazy_captures += 1
                self.passes.stats.refill_captures += 1
            except Exception as exc:  # keep serving: the host loop runs these batches
                log.exception("CUDA graph capture of a device-refill pass (%d rows × %d blocks) failed", rows, width)
                self.error = self.passes.stats.refill_error = f"{type(exc).__name__}: {exc}"
            self.buffers[rows].columns.copy_(resident)
        return self._graphs.get(key)

    def riding_keys(self) -> int:
        """Graphs captured with riding chunks in their pass."""
        return sum(key[3] is not None for key in self._graphs)

    def _point_at_dummy(self, rows: int, width: int, chunks: ChunkKey | None) -> None:
        """No row running, every row on the dummy slot, chunk rows on padding: warm-up passes touch only
        what no real row owns."""
        columns = self.buffers[rows].columns
        columns.zero_()
        columns[SLOTS].fill_(self.runner.dummy_slot)
        columns[LAST].fill_(-1)
        if chunks is not None:
            self.passes.mixed.point_at_padding((rows, width, *chunks))

    def _pass(self, rows: int, width: int, test: Any, chunks: ChunkKey | None) -> None:
        """The captured function: one pass of the bucket's rows with its boundary work (module docstring),
        with the riding chunks' next loop in it when `chunks` names their bucket."""
        runner, passes, b = self.runner, self.passes, self.buffers[rows]
        c, dummy = b.columns, runner.dummy_slot
        index = passes.static_rows(rows)  # the loop pass's static inputs, read by the test too
        self.steps.pass_rows(c, index, dummy)
        if chunks is None:
            passes._pass(rows, width)
        else:
            passes.mixed.stacked_pass((rows, width, *chunks))
        exits = test.apply(runner, index[0], index[1], index[2], passes.max_width, None) & (c[RUNNING] > 0)
        runner.finalize_on_device(c[SLOTS], c[POSITIONS], torch.where(exits, c[DEPTHS], runner.config.max_depth))
        tokens, logprobs = runner.sample_on_device(index[0], b.params, SamplingKind.GREEDY, needed=exits)
        self.steps.after_sample(b, exits, tokens, logprobs, runner.is_stop_token(c[SLOTS], tokens), dummy)
        exit_slots, prelude_slots = b.boundary_slots
        runner.store_tokens(exit_slots, tokens)
        runner.embed_on_device(prelude_slots, tokens, c[POSITIONS])
        runner.decode_cursors.restart_exit_states(prelude_slots)


class ColumnSteps:
    """A pass's bookkeeping over a bucket's columns, in torch ops: the CPU path and the reference of
    the Triton kernels that do the same in one launch each on CUDA (kernels/refill_columns.py)."""

    @staticmethod
    def pass_rows(c: torch.Tensor, index: torch.Tensor, dummy: int) -> None:
        """Before the pass: each running row goes one loop deeper; the loop's static rows (`index`,
        [3, R]: slots, positions, depths) hold the running rows, the others on the dummy slot."""
        running = c[RUNNING] > 0
        c[DEPTHS] += running
        index.copy_(torch.stack([torch.where(running, c[SLOTS], dummy), torch.where(running, c[POSITIONS], 0),
                                 torch.where(running, c[DEPTHS], 1)]))

    @staticmethod
    def after_sample(b: RefillBuffers, exits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
                     stops: torch.Tensor, dummy: int) -> None:
        """After the sampler: the exited rows record their outputs (the others write the spare column);
        a row ends at its last output or a stop token (`stops`), else its next position starts at
        depth 0; a row whose next position has no block stops running. `b.boundary_slots` gets the
        exited rows' slots and the going rows' (both else the dummy), and `b.flags` whether any runs and
        how many ended."""
        c = b.columns
        running = c[RUNNING] > 0
        slots, positions, depths, indices = c[SLOTS], c[POSITIONS], c[DEPTHS], c[INDICES]
        at = torch.where(exits, c[COUNT], MAX_PASSES)
        b.outputs[0, b.row_index, at] = tokens
        b.outputs[1, b.row_index, at] = depths
        b.logprobs[b.row_index, at] = logprobs
        c[COUNT] += exits
        ends = exits & ((indices == c[LAST]) | stops)
        going = exits & ~ends
        b.boundary_slots[0] = torch.where(exits, slots, dummy)
        b.boundary_slots[1] = torch.where(going, slots, dummy)
        positions += going
        indices += going
        depths.masked_fill_(going, 0)
        completable = (positions + 1 < c[COVERED]) | (indices == c[LAST])
        c[FINISHED] |= ends
        c[RUNNING] = running & ~ends & ~(going & ~completable)
        b.flags.copy_(torch.stack((c[RUNNING].any().long(), ends.sum())))


def column_steps(device: torch.device, attention_backend: str) -> ColumnSteps:
    """The pass's bookkeeping: one Triton launch per step on CUDA with the Triton backend; torch's ops
    elsewhere and on the torch path (the gate's reference)."""
    if device.type == "cuda" and attention_backend == "triton":
        from rlt_worker.kernels.refill_columns import TritonColumnSteps  # imports Triton: only when used

        return TritonColumnSteps()
    return ColumnSteps()


@dataclass
class ResidentRows:
    """The last device-refill plan's rows. Their bucket's columns hold where each stopped (position,
    depth, output index, finished), which the host learns only when that plan's copies land; a next
    plan whose rows are these, in this order, all continuing, resumes them there (`DeviceRefill.resume`)."""

    buffers: RefillBuffers
    slots: np.ndarray
    epochs: np.ndarray  # the slots' DecodeCursors.epochs: a slot opened again since is not these rows'
    exit_test: ExitTest
    position_bound: int  # ≥ every row's position (a pass advances a position by at most one)

    def index_of(self, slots: np.ndarray) -> np.ndarray:
        """Each slot's row among these (−1: not one of them)."""
        order = np.argsort(self.slots, kind="stable")
        at = np.minimum(np.searchsorted(self.slots, slots, sorter=order), len(order) - 1)
        found = order[at]
        return np.where(self.slots[found] == slots, found, -1)


@dataclass(frozen=True)
class RidingGraph:
    """The pass graph of a plan's first passes, while prompt chunks ride them (mixed batches)."""

    graph: Any
    chunks: ChunkKey  # their prefill bucket


class DeviceRefill:
    """One plan's passes through its bucket's RefillBuffers and graph (`riding`: the graph whose passes
    also run the riding chunks' next loop, while they have loops left)."""

    def __init__(self, runner: ModelRunner, graph: Any, buffers: RefillBuffers, looping: np.ndarray,
                 max_passes: int, exit_test: ExitTest, position_bound: int, riding: RidingGraph | None) -> None:
        self.runner, self.graph, self.buffers = runner, graph, buffers
        self.looping, self.max_passes = looping, max_passes
        self.exit_test, self.position_bound = exit_test, position_bound
        self.riding = riding
        self._sent = np.zeros(len(looping), dtype=bool)  # rows an early result carries (_send_ended)

    @classmethod
    def carried_rows(cls, runner: ModelRunner, exit_step: EagerExitStep, refill: bool, slots: np.ndarray,
                     continues: np.ndarray, epochs: np.ndarray, max_passes: int) -> np.ndarray | None:
        """None when the batch takes the host loop (module docstring; every plan lands first); else,
        per row, whether it continues a row of the last device-refill plan (`ResidentRows`), whose
        columns `plan` carries over on the device, so that plan need not land first."""
        if not cls._qualifies(runner, exit_step, refill, slots, max_passes) or runner.forces_tokens(slots):
            return None
        resident = runner.refill_resident
        if resident is None or resident.exit_test != exit_step.exit_test:
            return np.zeros(len(slots), dtype=bool)
        at = resident.index_of(slots)
        return continues & (at >= 0) & (resident.epochs[at] == epochs)

    @classmethod
    def plan(cls, runner: ModelRunner, rows: _Rows, looping: np.ndarray, max_passes: int, exit_test: ExitTest,
             carried: np.ndarray) -> DeviceRefill | None:
        """The passes of a batch that qualified (`carried_rows`) on the device, their columns in place:
        the `carried` rows' (bool per batch row) from the resident bucket, the others' uploaded from
        `rows`; None when no row loops or no graph takes them."""
        if not len(looping):
            return None
        from_device = carried[looping]
        resident = runner.refill_resident
        # Positions advance at most one a pass: the widest context any pass of the plan can need.
        bound = max(int(rows.positions[looping[~from_device]].max(initial=0)),
                    resident.position_bound if from_device.any() else 0)
        found = runner.refill_graph(len(looping), bound + max_passes, exit_test)
        riding = None if found is None else cls._riding_graph(runner, len(looping), bound + max_passes, exit_test)
        if found is None or (runner.has_riding_loops and riding is None):
            return None
        graph, buffers = found
        bucket, n = buffers.columns.shape[1], len(looping)
        host = np.zeros((COLUMNS, bucket), dtype=np.int64)
        host[SLOTS], host[LAST] = runner.dummy_slot, -1
        for row, values in ((SLOTS, rows.slots), (POSITIONS, rows.positions), (DEPTHS, rows.depths),
                            (INDICES, rows.indices), (LAST, rows.last_index), (COVERED, rows.covered),
                            (SEEDS, rows.seeds.view(np.int64))):
            host[row, :n] = values[looping]
        host[RUNNING, :n] = 1
        if from_device.any():
            cls._carry(runner, resident, buffers, host, rows.slots[looping], np.flatnonzero(from_device))
        else:
            runner.upload_into(buffers.columns, host)
        return cls(runner, graph, buffers, looping, max_passes, exit_test, bound, riding)

    @staticmethod
    def _carry(runner: ModelRunner, resident: ResidentRows, buffers: RefillBuffers, host: np.ndarray,
               slots: np.ndarray, carried: np.ndarray) -> None:
        """The host's columns into the bucket, then the `carried` rows' positions, depths, output indices
        and finished flags from where the last plan left them (gathered before the upload: the two
        buckets may be one), and the device restarts every row not finished whose next position has a
        block, as `resume` does. Nothing is read back."""
        source, target = runner.upload(resident.index_of(slots[carried]), carried)
        values = resident.buffers.columns[buffers.carried, source]
        runner.upload_into(buffers.columns, host)
        buffers.columns[buffers.carried, target] = values
        _restart(buffers.columns)
        runner.count_refill_carried()

    def end_at_stop_tokens(self, rows: np.ndarray, slots: np.ndarray, tokens: torch.Tensor) -> None:
        """Tokens the host's boundary work sampled before the plan (`rows`: batch rows): a looping row
        whose token is a stop token is finished, on the device, before it loops (no readback)."""
        bucket_rows = np.searchsorted(self.looping, rows)
        looping = (bucket_rows < len(self.looping)) & (self.looping[np.minimum(bucket_rows, len(self.looping) - 1)]
                                                       == rows)
        if not looping.any():
            return
        target, device_slots, picked = self.runner.upload(bucket_rows[looping], slots[looping],
                                                          np.flatnonzero(looping))
        ends = self.runner.is_stop_token(device_slots, tokens[picked]).long()
        c = self.buffers.columns
        c[FINISHED, target] |= ends
        c[RUNNING, target] &= 1 - ends

    @classmethod
    def resume(cls, runner: ModelRunner, exit_step: EagerExitStep, refill: bool, slots: np.ndarray,
               continues: np.ndarray, max_passes: int) -> DeviceRefill | None:
        """The batch's passes resumed where the last device-refill plan left its rows, when these are
        its rows in its order, all continuing, and the batch qualifies; else None. Nothing is read back:
        only the rows' covered positions go up, and the device restarts the rows that may run."""
        resident = runner.refill_resident
        if (resident is None or not continues.all() or not np.array_equal(slots, resident.slots)
                or not cls._qualifies(runner, exit_step, refill, slots, max_passes)
                or exit_step.exit_test != resident.exit_test or runner.forces_tokens(slots)):
            return None
        # The same rows: the same rows bucket, so the graph found runs over the resident buffers.
        max_position = resident.position_bound + max_passes
        found = runner.refill_graph(len(slots), max_position, resident.exit_test)
        riding = None if found is None else cls._riding_graph(runner, len(slots), max_position, resident.exit_test)
        if found is None or (runner.has_riding_loops and riding is None):
            return None
        runner.count_refill_resumed()
        c, n = resident.buffers.columns, len(slots)
        (covered,) = runner.upload(runner.covered_positions(slots))
        c[COVERED, :n] = covered
        _restart(c)
        return cls(runner, found[0], resident.buffers, np.arange(n), max_passes, resident.exit_test,
                   resident.position_bound, riding)

    @staticmethod
    def _qualifies(runner: ModelRunner, exit_step: EagerExitStep, refill: bool, slots: np.ndarray,
                   max_passes: int) -> bool:
        return (runner.config.device_refill and refill and max_passes <= MAX_PASSES
                and isinstance(exit_step, GraphedExitStep) and bool(runner.host_greedy[slots].all()))

    @staticmethod
    def _riding_graph(runner: ModelRunner, num_rows: int, max_position: int, exit_test: ExitTest
                      ) -> RidingGraph | None:
        """The pass graph with the riding chunks in it, when chunks ride and a mixed graph takes them."""
        chunks = runner.riding_chunk_bucket() if runner.has_riding_loops else None
        found = None if chunks is None else runner.refill_graph(num_rows, max_position, exit_test, chunks)
        return None if found is None else RidingGraph(found[0], chunks)

    def run_passes(self, rows: _Rows, results: ResultBuilder) -> None:
        """Up to max_passes passes, the first ones with the riding chunks' loops while they have any;
        nothing waited for at the end. When a flag the host reads says rows ended in its pass, the
        rows that ended so far go out early (`_send_ended`)."""
        flags: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        runner, bucket = self.runner, self.buffers.columns.shape[1]
        for p in range(self.max_passes):
            if p >= LEAD:
                flag, event = flags[p - LEAD]
                if not self._may_run(flag, event, waits=p < self.max_passes - TAIL):
                    break
                if (event is None or event.query()) and int(flag[ENDED]) > 0:
                    self._send_ended(rows, results)
            if runner.pass_listener is not None:  # tests: a readback per pass
                runner.report_refill_pass(self.buffers.columns[[SLOTS, POSITIONS, DEPTHS]],
                                          self.buffers.columns[RUNNING] > 0)
            if self.riding is not None and runner.has_riding_loops:
                runner.ride_refill_pass(self.riding.graph.replay, self.riding.chunks, len(self.looping), bucket)
            else:
                self.graph.replay()
            flags.append(self._running_flag(p))
        slots = rows.slots[self.looping]
        runner.refill_resident = ResidentRows(self.buffers, slots, runner.decode_cursors.epochs[slots].copy(),
                                              self.exit_test, self.position_bound + len(flags))

    def _send_ended(self, rows: _Rows, results: ResultBuilder) -> None:
        """The bucket's ends and outputs as they are after the passes queued so far, on their way to
        the host; once landed, the rows that ended in this plan and no earlier early result carried
        go out in an early result (ResultBuilder.defer_early)."""
        n, b = len(self.looping), self.buffers
        copies = self.runner.copy_out(b.columns[[FINISHED, COUNT], :n], b.outputs[:, :n], b.logprobs[:n])
        results.defer_early(lambda: self._ended_parts(rows, copies.wait()), copies.event)

    def _ended_parts(self, rows: _Rows, values: list[np.ndarray]) -> list[dict[str, object]]:
        (finished, count), outputs, logprobs = values
        ended = (finished > 0) & (count > 0) & ~self._sent  # count 0: it had ended before this plan
        self._sent |= ended
        sink = ResultBuilder(step_id=-1)
        self._add_outputs(rows, ended, outputs, logprobs, count, sink)
        return sink.parts()

    def copy_out(self, rows: _Rows) -> HostCopies:
        """The looping rows' columns and outputs and every row's exit state on their way to the host."""
        n, b = len(self.looping), self.buffers
        (device_slots,) = self.runner.upload(rows.slots)
        return self.runner.copy_out(b.columns[:, :n], b.outputs[:, :n], b.logprobs[:n],
                                    self.runner.decode_cursors.exit_values[device_slots, EXIT_STATE])

    def _running_flag(self, p: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Pass p's flags (whether any row still runs, how many ended), copied out without waiting
        (CUDA: into pass p's pinned copy, then its event)."""
        b = self.buffers
        host = b.flags_host[p]
        host.copy_(b.flags, non_blocking=b.flags_copied is not None)
        if b.flags_copied is None:
            return host, None
        b.flags_copied[p].record()
        return host, b.flags_copied[p]

    @staticmethod
    def _may_run(flag: torch.Tensor, event: torch.cuda.Event | None, waits: bool) -> bool:
        """Whether a row may still run after the flag's pass (False: none does, the plan stops): the flag
        waited for, or (`waits` False, a plan's last TAIL passes) read only if it has landed, else
        assumed. Rows only stop within a plan, so a later pass's flag says the same or less."""
        if event is not None:
            if not waits and not event.query():
                return True
            event.synchronize()
        return bool(flag[ALIVE])

    def land(self, rows: _Rows, values: list[np.ndarray], results: ResultBuilder) -> np.ndarray:
        """The copies landed: the outputs in order per row into `results`, each row's position, depth
        and end into `rows`; returns every row's exit state."""
        looping = self.looping
        columns, outputs, logprobs, states = values
        self._add_outputs(rows, np.ones(len(looping), dtype=bool), outputs, logprobs, columns[COUNT], results)
        rows.positions[looping], rows.depths[looping] = columns[POSITIONS], columns[DEPTHS]
        rows.indices[looping] = columns[INDICES]
        rows.running[looping], rows.finished[looping] = columns[RUNNING] > 0, columns[FINISHED] > 0
        return states

    def _add_outputs(self, rows: _Rows, which: np.ndarray, outputs: np.ndarray, logprobs: np.ndarray,
                     count: np.ndarray, results: ResultBuilder) -> None:
        """The outputs of the bucket rows `which` (bool [looping]), in order per row, as DECODE rows."""
        tokens, exit_depths = outputs[0], outputs[1]
        for j in range(int(count[which].max(initial=0))):
            has = which & (count > j)
            picked = self.looping[has]
            results.add(Stage.DECODE, rows.keys[picked], rows.generations[picked], depths=exit_depths[has, j],
                        tokens=tokens[has, j], logprobs=logprobs[has, j])


def _restart(columns: torch.Tensor) -> None:
    """A plan's start over a bucket's columns: no outputs yet, and every row not finished whose next
    position has a block (or that holds its last output) runs; padding rows (no block) do not."""
    columns[COUNT].zero_()
    columns[RUNNING] = (columns[FINISHED] == 0) & ((columns[POSITIONS] + 1 < columns[COVERED])
                                                   | (columns[INDICES] == columns[LAST]))
