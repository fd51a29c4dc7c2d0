"""A DecodeBatch's passes with its exits, CODA and refill on the device: no readback between passes.

DecodeLoop's host-driven passes read each pass's exit flags back to choose the next pass's rows and
the boundary work. For a gate test (OURO, OURO_DELAYED) that is one round trip per pass, and the
GPU waits for it: at c = 1 on the H200, 1.18 ms a token at 2.3 passes (docs/benchmarks.md). Here
every row of the plan stays in its rows bucket for the whole plan, and what the host decided from
the flags is decided by masks on the device instead:

    per pass     the rows' columns → the bucket's static inputs (a stopped row: the dummy slot)
                 → pass replay → exit-test replay → exits = flags ∧ running
                 → FINALIZE of every row (exit depth D where the row did not exit: a no-op)
                 → CODA and greedy sampling of every row (the rows that did not exit drop theirs)
                 → each exit's output recorded at (row, its count) → a row ends at its last output
                 or a stop token → the others: PRELUDE of the token at position + 1 (written to
                 the dummy slot where the row did not exit) → a row whose new position's next one
                 has no block stops there (RECURRENT at depth 0, as the host loop's coverage rule)
    host         launches only; before pass p it waits for pass p − LEAD's "any row running"
                 flag (LEAD passes stay queued, so the GPU does not idle) and stops when none is
    per plan     1 upload (the rows' columns), 1 readback (every output, where each row stopped)

Every operation is the host path's on the same rows (the same exit test graph, finalize kernel,
coda, head and sampler), so tokens and exit depths are the host loop's; only the GEMMs' row count
(the bucket's, not the exits') differs, which batch invariance of the head does not cover on CUDA.
The price is CODA for every row at every pass instead of once per token: the head's weight is
read per pass (0.12 ms for greedy at 1 row on the H200).

When it runs (`DeviceRefill.plan`, chosen once per batch): `device_refill` is on, the passes and the
test replay from graphs, refill is on, the coda has no attention (Ouro), every row is greedy and
none forces tokens, and no prompt chunk rides the passes. Otherwise the host-driven loop runs. (A
test's pass_listener costs a readback per pass here.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from protocol.messages import Stage
from rlt_worker.exit_graphs import EagerExitStep, GraphedExitStep
from rlt_worker.exit_tests import EXIT_STATE
from rlt_worker.sampler import SamplingTensors

if TYPE_CHECKING:
    from rlt_worker.cuda_graphs import StagedPass
    from rlt_worker.decode_loop import _Rows
    from rlt_worker.model_runner import ModelRunner
    from rlt_worker.step_results import ResultBuilder

LEAD = 2  # passes queued ahead of the one whose "any row running" flag the host waits for
INITIAL_EXIT_STATE = 1.0  # a position's exit state before its first loop (∏ (1 − λ) over no loop)


class DeviceRefill:
    """One plan's rows on the device (bucket rows R; padding rows on the dummy slot, never running)."""

    def __init__(self, runner: ModelRunner, exit_step: GraphedExitStep, staged: StagedPass, rows: _Rows,
                 looping: np.ndarray, max_passes: int) -> None:
        self.runner, self.exit_step, self.staged = runner, exit_step, staged
        self.looping, self.max_passes = looping, max_passes
        self.dummy = runner.dummy_slot
        bucket = staged.key[0]
        n = len(looping)

        def padded(values: np.ndarray, fill: int) -> np.ndarray:
            out = np.full(bucket, fill, dtype=np.int64)
            out[:n] = values
            return out

        stop_ids = [sorted(rows.stop_ids[r]) for r in looping.tolist()]
        width = max([1] + [len(ids) for ids in stop_ids])
        host_stops = np.full((bucket, width), -1, dtype=np.int64)  # −1 matches no token
        for r, ids in enumerate(stop_ids):
            host_stops[r, :len(ids)] = ids
        (self.slots, self.positions, self.depths, self.indices, self.last, self.covered, running, seeds,
         stops) = runner.upload(
            padded(rows.slots[looping], self.dummy), padded(rows.positions[looping], 0),
            padded(rows.depths[looping], 0), padded(rows.indices[looping], 0), padded(rows.last_index[looping], -1),
            padded(rows.covered[looping], 0), padded(np.ones(n, dtype=np.int64), 0),
            padded(rows.seeds[looping].view(np.int64), 0), host_stops)
        self.running = running > 0
        self.finished = torch.zeros_like(self.running)
        self.stop_ids = stops.reshape(bucket, width)
        # Greedy: the sampler reads only whether each row is greedy (all are) and draws nothing.
        self.params = SamplingTensors(temperature=torch.zeros(bucket, dtype=torch.float64, device=runner.device),
                                      top_k=torch.full_like(self.slots, -1), top_p=torch.ones_like(self.slots,
                                      dtype=torch.float64), seeds=seeds, indices=self.indices)
        # Each row's outputs in order; column max_passes takes the writes of rows that did not exit.
        self.count = torch.zeros_like(self.slots)
        self.out_tokens = torch.zeros(bucket, max_passes + 1, dtype=torch.long, device=runner.device)
        self.out_depths = torch.zeros_like(self.out_tokens)
        self.out_logprobs = torch.zeros(bucket, max_passes + 1, dtype=torch.float64, device=runner.device)
        self.rows_index = torch.arange(bucket, device=runner.device)

    @classmethod
    def plan(cls, runner: ModelRunner, exit_step: EagerExitStep, refill: bool, rows: _Rows, looping: np.ndarray,
             max_passes: int) -> DeviceRefill | None:
        """The batch's passes on the device when they qualify (module docstring), else None."""
        if not (runner.config.device_refill and refill and len(looping) and isinstance(exit_step, GraphedExitStep)):
            return None
        slots = rows.slots[looping]
        if (runner.has_riding_loops or not runner.host_greedy[slots].all()
                or runner.forced_tokens(slots, rows.indices[looping]) is not None):
            return None
        # Positions advance at most one a pass: the widest context any pass of the plan can need.
        staged = runner.device_pass(len(looping), int(rows.positions[looping].max()) + max_passes)
        return None if staged is None else cls(runner, exit_step, staged, rows, looping, max_passes)

    def run(self, rows: _Rows, results: ResultBuilder) -> None:
        """Up to max_passes passes, then the rows' outputs into `results` and their ends into `rows`."""
        alive: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        for p in range(self.max_passes):
            if p >= LEAD and not self._still_running(*alive[p - LEAD]):
                break
            self._pass()
            alive.append(self._running_flag())
        self._report(rows, results)

    # ------------------------------------------------------------------ device work

    def _pass(self) -> None:
        runner, running = self.runner, self.running
        self.depths += running
        index = self.staged.columns  # [3, R]: the pass graph's and the exit test's static inputs
        index.copy_(torch.stack([torch.where(running, self.slots, self.dummy),
                                 torch.where(running, self.positions, 0), torch.where(running, self.depths, 1)]))
        if runner.pass_listener is not None:  # tests: a readback per pass
            runner.report_device_pass(index, running)
        runner.replay_pass(self.staged)
        exits = self.exit_step.graphs.replay(self.exit_step.exit_test, self.staged) & running
        runner.finalize_on_device(self.slots, self.positions, torch.where(exits, self.depths, runner.config.max_depth))
        tokens, logprobs = runner.sample_on_device(torch.where(running, self.slots, self.dummy), self.params, True)
        outputs = torch.where(exits, self.count, self.max_passes)
        self.out_tokens[self.rows_index, outputs] = tokens
        self.out_depths[self.rows_index, outputs] = self.depths
        self.out_logprobs[self.rows_index, outputs] = logprobs
        self.count += exits
        stop = (tokens[:, None] == self.stop_ids).any(dim=1)
        ends = exits & ((self.indices == self.last) | stop)
        self.finished |= ends
        going = exits & ~ends
        runner.store_tokens(torch.where(exits, self.slots, self.dummy), tokens)
        self.positions += going
        self.indices += going
        self.depths.masked_fill_(going, 0)
        prelude_slots = torch.where(going, self.slots, self.dummy)
        runner.embed_on_device(prelude_slots, tokens, self.positions)
        runner.decode_cursors.exit_values[:, EXIT_STATE].index_fill_(0, prelude_slots, INITIAL_EXIT_STATE)
        completable = (self.positions + 1 < self.covered) | (self.indices == self.last)
        self.running &= ~ends & ~(going & ~completable)

    def _running_flag(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Whether any row still runs after this pass, copied out without waiting (CUDA: pinned + event)."""
        flag = self.running.any()
        if self.runner.device.type != "cuda":
            return flag, None
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    @staticmethod
    def _still_running(flag: torch.Tensor, event: torch.cuda.Event | None) -> bool:
        if event is not None:
            event.synchronize()
        return bool(flag)

    # ------------------------------------------------------------------ results

    def _report(self, rows: _Rows, results: ResultBuilder) -> None:
        """One readback; the outputs in order per row, and each row's position, depth and end into `rows`."""
        n, looping = len(self.looping), self.looping
        positions, depths, indices, running, finished, count, tokens, exit_depths, logprobs = (
            v[:n] for v in self.runner.read_back(self.positions, self.depths, self.indices, self.running,
                                                 self.finished, self.count, self.out_tokens, self.out_depths,
                                                 self.out_logprobs))
        for j in range(int(count.max(initial=0))):
            has = count > j
            rs = looping[has]
            results.add(Stage.DECODE, rows.keys[rs], rows.generations[rs], depths=exit_depths[has, j],
                        tokens=tokens[has, j], logprobs=logprobs[has, j])
        rows.positions[looping], rows.depths[looping], rows.indices[looping] = positions, depths, indices
        rows.running[looping], rows.finished[looping] = running, finished
