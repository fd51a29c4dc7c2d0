"""The worker's decode loop: one DecodeBatch's passes, exit tests, boundary work and refill (SPEC §6).

    rows that enter exited    boundary work first (a row behind its prompt's riding last chunk, mixed
                              batches: once that chunk's D loops have run, then it joins the next pass)
    pass 1 … max_passes       loop d + 1 of every looping row, each at its own position and depth
                              → the exit test (rlt_worker/exit_tests.py) → one readback: who exited
                              (ExitTest.PLANNED: the engine's depths, compared on the host, no readback)
                              refill: their boundary work now; no_refill: they stop (EXITED)
    boundary work of rows E   [FINALIZE (LAST_EXITED, exit depth < D)] → CODA: output i of each row
                              → output max_tokens − 1 ends a row (its rows go out in an early
                              result before the next pass) → the others: PRELUDE of the
                              token at position + 1 (its depth 0, output i + 1), which joins the
                              next pass; the tokens stay on the device (a device test reads them
                              back with the next pass's exits: a stop token ends its row there)

Every draw is the host path's: output i's CODA uses Philox index i under the request's seed, and
Huginn's state init of position p index p; the exit tests compute what the host policies computed.
So a row's tokens and exit depths do not depend on how many passes a plan runs.

Coverage. A row loops a position only if its blocks also cover the next one (or the position
holds its last output): an exit can then always be followed by its PRELUDE, and a row the engine's
reservation does not reach stops right after a PRELUDE (RECURRENT at depth 0), never mid-boundary.

Pipelined plans. The engine may send a slot's next DecodeBatch row before it has read this one's
result: such a row `continues`, and starts where the slot's previous row stopped (position, depth,
exited, output index, exit state: the slot table's `DecodeCursors`, written as every row stops), or
does nothing if that row ended its request.

Device refill. A batch that qualifies (greedy rows under a graphed gate test on Ouro, graphs on:
rlt_worker/device_refill.py) runs its passes there instead: exits, boundary work and refill all
masked on the device, one captured graph per pass, nothing read back while the plan runs. Its rows'
outputs and ends land later (`_Landing`: when the result is built, or when a later batch needs the
host's cursors, `DecodeCursors.settle`); a next batch of the same rows, all continuing, resumes them
on the device without landing them first (`DeviceRefill.resume`), and one whose rows differ carries
its continuing rows' columns over there (`DeviceRefill.carried_rows`), landing only the plans that
hold its other continuing rows (`DecodeCursors.settle_for`). Otherwise:

The loop itself is host-driven: the host reads back a few bytes per pass to choose the next pass's
rows (a device test: `DeviceExits`; planned exits, `PlannedExits`, know them on the host, so their
plan's passes queue on the device one behind the other). Nothing else leaves the device until the
StepResult is built. The host keeps the rows' columns and sends each pass's rows in one copy
(`ModelRunner.pass_columns`: into the graph's static inputs when a graph runs the pass, and the exit
test reads them there); what the test reads per slot (limits, threshold, exit state) stays on the
device in `DecodeCursors.loop_limits` and `exit_values`, written at the plan's start, by the test,
and at each PRELUDE, so a pass needs no other upload. A device test's strategy is chosen once per
batch (`ModelRunner.exit_step`, rlt_worker/exit_graphs.py): after a graph-replayed pass, Ouro's tests
replay a graph of their own (one launch, no eager op); KL and LATENT, and every test after an eager
pass, run as eager torch ops on the state the pass left. The boundary's work is eager (CODA: a graph
when one fits):

    per pass       1 upload (slots, positions, depths)        1 readback (exits, and the tokens of the
                                                              boundaries before it)
                   1 graph replay + 1 exit-test replay (Ouro, graphs on), or the pass's and the test's eager ops
                   (PLANNED: the same, no readback)
    per boundary   ≤ 3 uploads (FINALIZE, CODA, PRELUDE)      no readback
    per plan       + 2 uploads (the rows' exit-test columns, the exit states of the rows reported RECURRENT)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from protocol.messages import DecodeBatch, ExitTest, Stage
from rlt_worker.device_refill import DeviceRefill
from rlt_worker.exit_tests import EXIT_STATE, INITIAL_EXIT_STATE
from rlt_worker.step_results import HostCopies, ResultBuilder

if TYPE_CHECKING:
    from rlt_worker.exit_graphs import EagerExitStep
    from rlt_worker.model_runner import ModelRunner, PassColumns


class ContinuationError(RuntimeError):
    """A DecodeBatch row `continues` a slot with nothing to continue."""


class DecodeCursors:
    """Per slot, where its last DecodeBatch row stopped: what a row that `continues` starts from.
    Part of the runner's slot table (it opens and closes slots); only DecodeLoop reads and writes it."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.positions = np.zeros(num_slots, dtype=np.int64)
        self.depths = np.zeros(num_slots, dtype=np.int64)
        self.exited = np.zeros(num_slots, dtype=bool)
        self.indices = np.zeros(num_slots, dtype=np.int64)
        self.ended = np.zeros(num_slots, dtype=bool)  # a token ended the slot's request
        self.is_set = np.zeros(num_slots, dtype=bool)  # the slot has run a DecodeBatch row
        self.epochs = np.zeros(num_slots, dtype=np.int64)  # times the slot opened: a landing skips reopened slots
        # Device-refill plans whose rows' stops have not landed on the host yet, in plan order: the
        # host columns above are theirs only after `settle`.
        self.pending: list[_Landing] = []
        # What the exit test reads of each slot, gathered once per pass (columns: rlt_worker/exit_tests.py):
        # int64 [slots + 1, 2] min_loops and max_loops; float64 [slots + 1, 2] threshold and exit state
        # (the test's, as the rows run). Row `slots` is the dummy slot's: graph padding rows use it.
        self.loop_limits = torch.ones(num_slots + 1, 2, dtype=torch.int64, device=device)
        self.exit_values = torch.ones(num_slots + 1, 2, dtype=torch.float64, device=device)

    def reset(self, slot: int) -> None:
        """A slot opened (admit or swap import): it has no DecodeBatch row behind it yet."""
        self.is_set[slot] = False
        self.epochs[slot] += 1

    def settle_for(self, slots: np.ndarray) -> None:
        """Land the pending plans up to the last one among whose device rows any of these slots is (their
        cursors are then the host's); those behind it stay on their way."""
        holding = [landing for landing in self.pending if np.isin(landing.device_slots, slots).any()]
        if holding:
            self.settle(upto=holding[-1])

    def settle(self, upto: _Landing | None = None) -> None:
        """Land the pending device-refill plans in order: all of them, or up to and including `upto`."""
        if upto is not None and upto.landed:
            return
        while self.pending:
            landing = self.pending.pop(0)
            landing.land()
            if landing is upto:
                return

    def restart_exit_states(self, device_slots: torch.Tensor) -> None:
        """A PRELUDE: these slots' positions start over, before their first loop (either decode loop)."""
        # index_fill_ takes the value as a kernel argument: `[slots, col] = value` copies it to the device
        # from pageable memory first, which waits for the stream (a sync per boundary on CUDA).
        self.exit_values[:, EXIT_STATE].index_fill_(0, device_slots, INITIAL_EXIT_STATE)


@dataclass
class _Rows:
    """The batch's rows while the plan runs (row r is batch row r); host columns unless noted."""

    keys: np.ndarray
    generations: np.ndarray
    slots: np.ndarray  # int64
    positions: np.ndarray  # int64, the position each row is at
    depths: np.ndarray  # int64, loops run there
    exited: np.ndarray  # bool: the position has exited, its boundary work is pending
    indices: np.ndarray  # int64, the output index its CODA samples
    seeds: np.ndarray  # uint64
    covered: np.ndarray  # int64, positions the row's blocks cover
    last_index: np.ndarray  # int64, the request's last output index (max_tokens − 1)
    stop_ids: list[frozenset[int]]
    running: np.ndarray  # bool: may still loop or do boundary work in this plan
    finished: np.ndarray  # bool: a token ended its request


class DecodeLoop:
    """Runs one DecodeBatch on a runner (the runner owns every tensor; this only drives it)."""

    def __init__(self, runner: ModelRunner, batch: DecodeBatch) -> None:
        self.runner = runner
        self.batch = batch
        self.exits = (PlannedExits(batch) if batch.exit_test == ExitTest.PLANNED
                      else DeviceExits(runner.exit_step(batch.exit_test)))
        slots = np.asarray(runner.slots_of(batch.col("keys"), batch.col("generations")), dtype=np.int64)
        continues = batch.col("continues") > 0
        device_test = isinstance(self.exits, DeviceExits)
        self.resumed = None if not device_test else DeviceRefill.resume(
            runner, self.exits.exit_step, batch.refill, slots, continues, batch.max_passes)
        # The rows whose columns a device-refill plan carries over from the last one (None: the host loop).
        self.carried = None if self.resumed is not None or not device_test else DeviceRefill.carried_rows(
            runner, self.exits.exit_step, batch.refill, slots, continues, runner.decode_cursors.epochs[slots],
            batch.max_passes)
        if self.carried is not None:  # the other continuing rows go on from the host's cursors
            runner.decode_cursors.settle_for(slots[continues & ~self.carried])
        elif self.resumed is None:
            self._land_every_plan()
        self.rows = self._rows(batch, slots, continues)

    def run(self, results: ResultBuilder) -> None:
        """Passes until every row has stopped or `max_passes` ran; every row's tokens and end into `results`."""
        if self.resumed is not None:
            self._run_on_device(self.resumed, results)
            return
        on_host = np.arange(len(self.rows.slots)) if self.carried is None else np.flatnonzero(~self.carried)
        waiting = self._start_rows(on_host, results)
        on_device = self._on_device()
        if on_device is not None:
            self._run_on_device(on_device, results, waiting)
            return
        if self.carried is not None:  # the host loop after all: every row from the host's cursors
            self._land_every_plan()
            carried = np.flatnonzero(self.carried)
            self._continue_rows(self.rows, carried)
            waiting = np.union1d(waiting, self._start_rows(carried, results))
        self._host_passes(waiting, results)
        self._report_ends(results)
        self._save_cursors()

    def _start_rows(self, indices: np.ndarray, results: ResultBuilder) -> np.ndarray:
        """Before the passes, of these rows (their columns the host's): those that entered exited do
        their boundary work now, the others loop only if completable; returns the rows that wait for
        their prompt's last chunk, riding the passes (mixed batches)."""
        rows = self.rows
        running = indices[rows.running[indices]]
        exited = rows.exited[running]
        behind_prefill = exited & np.isin(rows.slots[running], self.runner.riding_slots)
        self._stop_unless_completable(running[~exited])
        self._boundary(running[exited & ~behind_prefill], results)
        return running[behind_prefill]

    def _land_every_plan(self) -> None:
        """The rows go on from the host's cursors: every device-refill plan lands, none stays resident."""
        self.runner.refill_resident = None
        self.runner.decode_cursors.settle()

    def _run_on_device(self, refill: DeviceRefill, results: ResultBuilder, waiting: np.ndarray | None = None) -> None:
        """The passes on the device, then the boundary work of the `waiting` rows (behind riding chunks:
        they join the next plan); the rows' outputs and ends land when the result is built, or when a
        later plan needs the host's cursors (DecodeCursors.settle), whichever comes first. The rows off
        the device are final on the host now: their cursors are saved at once."""
        self._send_ended(results)  # rows that ended in their boundary work before the passes
        refill.run_passes(self.rows, results)
        if waiting is not None:
            self._after_prefill(waiting, results)  # before the copies: they carry the rows' exit states
        self._save_cursors(np.setdiff1d(np.arange(len(self.rows.slots)), refill.looping))
        landing = _Landing(self, refill, refill.copy_out(self.rows))
        cursors = self.runner.decode_cursors
        cursors.pending.append(landing)

        def landed_rows() -> list[dict[str, object]]:
            cursors.settle(upto=landing)
            return landing.sink.parts()

        results.defer(landed_rows, landing.copies.event)

    def _on_device(self) -> DeviceRefill | None:
        """The batch's passes with exits and refill on the device, when they qualify (device_refill.py).
        The tokens sampled before them are checked for stop tokens there, or (a row that stopped after
        its boundary, which the device does not see) read back now."""
        if self.carried is None:
            return None
        rows, exits = self.rows, self.exits
        assert isinstance(exits, DeviceExits)
        sampled = exits.unchecked_rows()
        if not (rows.running[sampled] | rows.finished[sampled]).all():
            exits.check_sampled(self.runner, rows)
            sampled = sampled[:0]
        refill = DeviceRefill.plan(self.runner, rows, np.flatnonzero(rows.running & ~rows.exited),
                                   self.batch.max_passes, exits.exit_step.exit_test, self.carried)
        if refill is not None and len(sampled):
            refill.end_at_stop_tokens(sampled, rows.slots[sampled], exits.take_unchecked())
        return refill

    def _host_passes(self, waiting: np.ndarray, results: ResultBuilder) -> None:
        """Passes chosen by the host from each pass's exits (a readback per pass for a device test)."""
        rows = self.rows
        passes = 0
        while passes < self.batch.max_passes:
            looping = np.flatnonzero(rows.running & ~rows.exited)
            if len(waiting) and (not self.runner.has_riding_loops or not len(looping)):
                waiting = self._after_prefill(waiting, results)  # they join the next pass
                continue
            if not len(looping):
                break
            self._send_ended(results)
            exits = self._pass(looping)
            passes += 1
            if self.batch.refill:
                self._boundary(exits, results)
            else:
                rows.exited[exits] = True  # the cohort's boundary work waits for its last exit
        self._after_prefill(waiting, results)

    # ------------------------------------------------------------------ setup

    def _rows(self, batch: DecodeBatch, slots: np.ndarray, continues: np.ndarray) -> _Rows:
        """The batch's rows; resumed and carried rows keep the batch's (stale) columns until their plan
        lands."""
        runner = self.runner
        options = [runner.slot_options[slot] for slot in slots.tolist()]
        n = len(slots)
        rows = _Rows(
            keys=batch.col("keys"), generations=batch.col("generations"), slots=slots,
            positions=batch.col("positions").astype(np.int64), depths=batch.col("depths").astype(np.int64),
            exited=batch.col("exited") > 0, indices=batch.col("output_indices").astype(np.int64),
            seeds=batch.col("seeds"), covered=runner.covered_positions(slots),
            last_index=np.array([o.max_tokens - 1 for o in options], dtype=np.int64),
            stop_ids=[frozenset(o.stop_token_ids) for o in options],
            running=np.ones(n, dtype=bool), finished=np.zeros(n, dtype=bool),
        )
        if self.resumed is not None:
            rows.exited[:] = False  # a device-refill row never stops exited
            return rows
        carried = np.zeros(n, dtype=bool) if self.carried is None else self.carried
        self._continue_rows(rows, np.flatnonzero(continues & ~carried))
        self._write_exit_inputs(batch, slots, continues)
        rows.exited[carried] = False
        return rows

    def _write_exit_inputs(self, batch: DecodeBatch, slots: np.ndarray, continues: np.ndarray) -> None:
        """The limits, thresholds and exit states of the rows that do not continue into their slots'
        columns, in one upload (the float64 columns travel as their int64 bits)."""
        n, cursors = len(slots), self.runner.decode_cursors
        limits = np.column_stack([batch.col("min_loops"), batch.col("max_loops")])
        values = np.column_stack([batch.col("thresholds"), batch.col("exit_states")]).astype(np.float64)
        device_slots, device_limits, bits, device_continues = self.runner.upload(
            slots, limits, values.view(np.int64), continues)
        keep = device_continues[:, None] > 0  # a row that continues keeps its slot's
        for table, fresh in ((cursors.loop_limits, device_limits), (cursors.exit_values, bits.view(torch.float64))):
            table[device_slots] = torch.where(keep, table[device_slots], fresh.reshape(n, 2))

    def _continue_rows(self, rows: _Rows, continuing: np.ndarray) -> None:
        """Rows that `continue` take their slot's cursor instead of the batch's columns."""
        if not len(continuing):
            return
        cursors, slots = self.runner.decode_cursors, rows.slots[continuing]
        if not cursors.is_set[slots].all():
            raise ContinuationError("a DecodeBatch row continues a slot that has run no DecodeBatch row since it "
                                    "opened: the engine must send that slot's first row in full")
        ended = cursors.ended[slots]
        rows.positions[continuing] = cursors.positions[slots]
        rows.depths[continuing] = cursors.depths[slots]
        rows.exited[continuing] = cursors.exited[slots] & ~ended
        rows.indices[continuing] = cursors.indices[slots]
        rows.running[continuing] = ~ended
        rows.finished[continuing] = ended  # nothing to do, nothing to report

    # ------------------------------------------------------------------ passes

    def _pass(self, looping: np.ndarray) -> np.ndarray:
        """One loop of each looping row and its exit decision; returns the rows that exited."""
        runner, rows = self.runner, self.rows
        rows.depths[looping] += 1
        slots, positions, depths = rows.slots[looping], rows.positions[looping], rows.depths[looping]
        width = runner.table_width(positions)
        columns = runner.pass_columns(slots, positions, depths)  # the pass's one upload
        before = self.exits.before_pass(runner, columns)
        runner.loop_pass(slots, positions, depths, width, columns)
        return looping[self.exits.after_pass(runner, columns, width, before, rows, looping)]

    def _after_prefill(self, waiting: np.ndarray, results: ResultBuilder) -> np.ndarray:
        """The riding chunks' last loops done (alone if no pass is left to ride), the boundary work of
        the rows that waited for them; returns no rows."""
        if len(waiting):
            self.runner.finish_riding()
            self._boundary(waiting, results)
        return waiting[:0]

    def _boundary(self, exited: np.ndarray, results: ResultBuilder) -> None:
        """[FINALIZE →] CODA of the exited rows, then PRELUDE of the next token of each that goes on."""
        rows = self.rows
        # A row that entered exited waits (EXITED) if its next position has no block yet.
        ready = (rows.positions[exited] + 1 < rows.covered[exited]) | self._holds_last_output(exited)
        rows.running[exited[~ready]] = False
        exited = exited[ready]
        if not len(exited):
            return
        slots, positions, depths = rows.slots[exited], rows.positions[exited], rows.depths[exited]
        shallow = depths < self.runner.config.max_depth
        self.runner.finalize_rows(slots[shallow], positions[shallow], depths[shallow])
        tokens, logprobs = self.runner.sample_rows(slots, positions, rows.seeds[exited].view(np.int64),
                                                   rows.indices[exited])
        self.exits.sampled(rows, exited, tokens)
        results.add(Stage.DECODE, rows.keys[exited], rows.generations[exited], depths=depths, tokens=tokens,
                    logprobs=logprobs)
        ends = self._holds_last_output(exited)  # stop tokens: where the exits strategy reads them (sampled)
        rows.finished[exited[ends]] = True
        rows.running[exited[ends]] = False
        self._next_position(exited[~ends])

    def _next_position(self, going_on: np.ndarray) -> None:
        """PRELUDE of each row's sampled token at its next position (refill: it joins the next pass)."""
        if not len(going_on):
            return
        rows = self.rows
        rows.positions[going_on] += 1
        rows.indices[going_on] += 1
        rows.depths[going_on] = 0
        rows.exited[going_on] = False
        device_slots = self.runner.embed_rows(rows.slots[going_on], rows.positions[going_on], rows.seeds[going_on])
        self.runner.decode_cursors.restart_exit_states(device_slots)
        self._stop_unless_completable(going_on)

    def _stop_unless_completable(self, indices: np.ndarray) -> None:
        """Rows may loop their position only if its PRELUDE-to-be (the next position) has a block, and
        (planned exits) if the row knows the position's exit depth."""
        rows = self.rows
        completable = (rows.positions[indices] + 1 < rows.covered[indices]) | self._holds_last_output(indices)
        rows.running[indices[~(completable & self.exits.knows_exit(rows.indices[indices], indices))]] = False

    def _holds_last_output(self, indices: np.ndarray) -> np.ndarray:
        return self.rows.indices[indices] == self.rows.last_index[indices]

    # ------------------------------------------------------------------ results

    def _send_ended(self, results: ResultBuilder) -> None:
        """Before a further pass, the rows of requests that ended so far (their last output sampled, or
        a stop token read back) go out early: they reach the engine when the work queued up to here
        has run, not after this plan's remaining passes (ResultBuilder.send_early)."""
        ended = self.rows.keys[self.rows.finished]
        if len(ended):
            results.send_early(ended)

    def _report_ends(self, results: ResultBuilder, exit_states: np.ndarray | None = None) -> None:
        """Where each row whose request goes on stopped: RECURRENT (looping) or EXITED (`exit_states`:
        every row's, landed on the host; None: read on the device)."""
        rows = self.rows
        looping = np.flatnonzero(~rows.finished & ~rows.exited)
        exited = np.flatnonzero(~rows.finished & rows.exited)
        if len(looping):
            if exit_states is None:
                (device_slots,) = self.runner.upload(rows.slots[looping])
                states = self.runner.decode_cursors.exit_values[device_slots, EXIT_STATE]
            else:
                states = exit_states[looping]
            results.add(Stage.RECURRENT, rows.keys[looping], rows.generations[looping], depths=rows.depths[looping],
                        exit_states=states)
        if len(exited):
            results.add(Stage.EXITED, rows.keys[exited], rows.generations[exited], depths=rows.depths[exited])

    def _save_cursors(self, which: np.ndarray | None = None, epochs: np.ndarray | None = None) -> None:
        """Where the rows (`which`: these; None: all) stopped, for a pipelined row of the next plan that
        continues one (`epochs`: the slots' when the plan ran; a slot opened again since is left alone)."""
        rows, cursors = self.rows, self.runner.decode_cursors
        keep = np.arange(len(rows.slots)) if which is None else which
        if epochs is not None:
            keep = keep[cursors.epochs[rows.slots[keep]] == epochs[keep]]
        slots = rows.slots[keep]
        cursors.positions[slots], cursors.depths[slots] = rows.positions[keep], rows.depths[keep]
        cursors.exited[slots], cursors.indices[slots] = rows.exited[keep], rows.indices[keep]
        cursors.ended[slots], cursors.is_set[slots] = rows.finished[keep], True  # exit states: in exit_values


class _Landing:
    """A device-refill plan's rows on the host: outputs, ends and cursors, once its copies are waited
    for (`land`, once: when its result is built or a later plan settles the cursors)."""

    def __init__(self, loop: DecodeLoop, refill: DeviceRefill, copies: HostCopies) -> None:
        self.loop, self.refill, self.copies = loop, refill, copies
        self.epochs = loop.runner.decode_cursors.epochs[loop.rows.slots].copy()
        self.device_slots = loop.rows.slots[refill.looping]  # whose cursors are stale until it lands
        self.sink = ResultBuilder(step_id=-1)  # a collector: its parts take the plan's place in its result
        self.landed = False

    def land(self) -> None:
        if self.landed:
            return
        self.landed = True
        loop = self.loop
        exit_states = self.refill.land(loop.rows, self.copies.wait(), self.sink)
        loop._report_ends(self.sink, exit_states)
        loop._save_cursors(epochs=self.epochs)


@dataclass
class _SampledTokens:
    """A boundary's tokens, on the device until the next pass's readback checks them for stop tokens."""

    rows: np.ndarray  # the batch's rows that sampled them
    tokens: torch.Tensor
    stop_ids: list[frozenset[int]]


class DeviceExits:
    """Exits decided by a device test (OURO*, KL, LATENT) after each pass, read back once per pass.

    A boundary's tokens ride the next pass's readback instead of one of their own, so CODA, PRELUDE
    and that pass queue without a sync between them (one sync per pass, not two per token). A stop
    token then ends its row at that readback: the row has run its next position's PRELUDE and one
    loop, whose work is dropped, and samples nothing after the stop token, since sampling comes
    only at a boundary and a boundary only after a readback."""

    def __init__(self, exit_step: EagerExitStep) -> None:
        self.exit_step = exit_step  # eager, or graphs after graph-replayed passes (ModelRunner.exit_step)
        self._unchecked: list[_SampledTokens] = []

    def knows_exit(self, output_indices: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Whether each row may loop the position of its output (a test decides every exit: always)."""
        return np.ones(len(rows), dtype=bool)

    def before_pass(self, runner: ModelRunner, columns: PassColumns) -> torch.Tensor | None:
        """What the test reads of the state before the pass (LATENT: the state itself)."""
        return runner.state[columns.slots] if self.exit_step.test.needs_previous_state else None

    def after_pass(self, runner: ModelRunner, columns: PassColumns, width: int, before: torch.Tensor | None,
                   rows: _Rows, looping: np.ndarray) -> np.ndarray:
        """bool [len(looping)]: which of the pass's rows exited, read back with the tokens sampled
        since the last readback; a row that sampled a stop token ends here (not an exit)."""
        exited, stopped = self._read_back(runner, rows, self.exit_step.after_pass(columns, width, before))
        return exited & ~np.isin(looping, stopped)

    def check_sampled(self, runner: ModelRunner, rows: _Rows) -> None:
        """Read back the tokens sampled since the last readback now (before DeviceRefill takes the rows)."""
        if self._unchecked:
            self._read_back(runner, rows, None)

    def _read_back(self, runner: ModelRunner, rows: _Rows, flags: torch.Tensor | None
                   ) -> tuple[np.ndarray | None, np.ndarray]:
        """(the flags on the host, the rows ended by a stop token among the tokens sampled since the
        last readback), in one readback; the stopped rows are finished."""
        sampled, self._unchecked = self._unchecked, []
        values = runner.read_back(*([] if flags is None else [flags]), *(s.tokens for s in sampled))
        exited = None if flags is None else values.pop(0)
        tokens = values
        if not sampled:
            return exited, np.zeros(0, dtype=np.int64)
        tokens = np.concatenate(tokens).tolist()
        stop_ids = [ids for s in sampled for ids in s.stop_ids]
        is_stop = np.array([t in ids for t, ids in zip(tokens, stop_ids, strict=True)], dtype=bool)
        stopped = np.concatenate([s.rows for s in sampled])[is_stop]
        rows.finished[stopped] = True
        rows.running[stopped] = False
        return exited, stopped

    def unchecked_rows(self) -> np.ndarray:
        """The rows whose tokens, sampled since the last readback, are not checked for stop tokens yet."""
        return np.concatenate([s.rows for s in self._unchecked]) if self._unchecked else np.zeros(0, dtype=np.int64)

    def take_unchecked(self) -> torch.Tensor:
        """Those rows' tokens (on the device, in that order), for a device-refill plan to check."""
        sampled, self._unchecked = self._unchecked, []
        return torch.cat([s.tokens for s in sampled])

    def sampled(self, rows: _Rows, sampling: np.ndarray, tokens: torch.Tensor) -> None:
        """A boundary's tokens (on the device): the next pass's readback checks them for stop tokens."""
        self._unchecked.append(_SampledTokens(sampling, tokens, [rows.stop_ids[r] for r in sampling.tolist()]))


class PlannedExits:
    """Exits the engine planned (fixed, trace): row r's positions of outputs base[r], base[r] + 1, …
    exit at the depths the batch carries (`planned_depths`). Decided on the host, so a plan reads
    nothing back: its passes and boundaries queue on the device without waiting for it. A stop token
    does not end its row mid-plan; the engine ends the request at it and drops the row's later outputs
    as stale, so only the compute of at most this plan and the next is lost, once per request."""

    def __init__(self, batch: DecodeBatch) -> None:
        self._counts = batch.col("num_planned").astype(np.int64)
        self._starts = np.cumsum(self._counts) - self._counts  # row r's first entry in _depths
        self._depths = batch.col("planned_depths").astype(np.int64)
        self._base = batch.col("output_indices").astype(np.int64)  # kept for rows that continue

    def _entries(self, output_indices: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(whether each row was sent its output's exit depth, that entry's index into _depths)."""
        k = output_indices - self._base[rows]
        known = (k >= 0) & (k < self._counts[rows])
        return known, self._starts[rows] + np.where(known, k, 0)

    def knows_exit(self, output_indices: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Whether each row was sent the exit depth of its output's position (else it stops before looping it)."""
        return self._entries(output_indices, rows)[0]

    def before_pass(self, runner: ModelRunner, columns: PassColumns) -> None:
        return None

    def after_pass(self, runner: ModelRunner, columns: PassColumns, width: int, before: None,
                   rows: _Rows, looping: np.ndarray) -> np.ndarray:
        """bool [len(looping)]: the rows whose position reached its planned depth (no readback)."""
        _, entries = self._entries(rows.indices[looping], looping)
        return rows.depths[looping] >= self._depths[entries]

    def sampled(self, rows: _Rows, sampling: np.ndarray, tokens: torch.Tensor) -> None:
        """Nothing: a stop token does not end a planned row mid-plan (the class docstring)."""
