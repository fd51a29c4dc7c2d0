"""The exit tests of the worker's decode loop (SPEC §3), one strategy per `ExitTest`.

After loop d of a pass, a test turns the rows' new states into an exit decision per row, with
torch ops only (no host readback, the same code on the CPU and on CUDA):

    OURO          remaining' = remaining · (1 − λ_d)             exit: d ≥ max  or  passes(d, remaining')
    OURO_DELAYED  remaining' = remaining · (1 − λ_d)             exit: d ≥ max  or  passes(d − 1, remaining)
    KL, LATENT    signal_d from the slot's state (and history)   exit: d ≥ max  or  (d ≥ min and signal_d < thr)

    passes(r, rem) = thr < 1 and r ≥ min_loops and 1 − rem ≥ thr

The float64 operations are the host policies' (rlt_engine/exit_policy.py, before the decision moved
here) and the dense reference's, in the same order, so every decision is bit-for-bit theirs.
OURO_DELAYED needs no memory of its first pass: λ ∈ [0, 1] makes `remaining` non-increasing, so a
test that passed after loop r passes after every later loop, and "exit after loop r0 + 1, r0 the
first pass" is "exit after loop d when the test passed after loop d − 1".

`apply` is a test's whole step after a pass: it gathers what the test reads of each row's slot
(DecodeCursors.loop_limits and exit_values), decides, writes the new exit states back in place and
returns the exit flags; it reads nothing from the host. The `graphable` tests (OURO, OURO_DELAYED)
read neither the rows' contexts nor the state before the pass, so their `apply` is captured as a
graph per rows bucket (rlt_worker/exit_graphs.py) and replayed right after the pass's graph; KL
(its coda attends: a context per width) and LATENT (the state before the pass) run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from protocol.messages import ExitTest

if TYPE_CHECKING:
    from rlt_worker.model_runner import ModelRunner

# Columns of DecodeCursors.loop_limits (int64) and .exit_values (float64): what a test reads of a slot.
MIN_LOOPS, MAX_LOOPS = THRESHOLD, EXIT_STATE = range(2)
INITIAL_EXIT_STATE = 1.0  # a position's exit state before its first loop (∏ (1 − λ) over no loop)


@dataclass(frozen=True)
class PassRows:
    """One decode pass's rows on the device (every tensor is [n])."""

    slots: torch.Tensor  # int64
    positions: torch.Tensor  # int64
    depths: torch.Tensor  # int64, the loop just run (1-based)
    min_loops: torch.Tensor  # int64
    max_loops: torch.Tensor  # int64
    thresholds: torch.Tensor  # float64
    width: int  # block-table columns the rows' contexts need


class DeviceExitTest:
    """Base: decides after each loop; `exit_states` is the test's per-row state (unused here)."""

    needs_previous_state = False  # whether `decide` reads the state before the pass
    updates_exit_state = False  # whether `decide` returns new exit states (else it returns them unchanged)
    graphable = False  # whether `apply` may run from a graph per rows bucket (no context, no previous state)

    def apply(
        self, runner: ModelRunner, slots: torch.Tensor, positions: torch.Tensor, depths: torch.Tensor, width: int,
        previous: torch.Tensor | None,
    ) -> torch.Tensor:
        """The test after the pass of these rows (int64 [n] each): exits bool [n]; the rows' new exit
        states go to their slots' DecodeCursors.exit_values."""
        cursors = runner.decode_cursors
        limits, values = cursors.loop_limits[slots], cursors.exit_values[slots]
        rows = PassRows(slots, positions, depths, limits[:, MIN_LOOPS], limits[:, MAX_LOOPS], values[:, THRESHOLD],
                        width)
        exits, states = self.decide(runner, rows, previous, values[:, EXIT_STATE])
        if self.updates_exit_state:
            cursors.exit_values[slots, EXIT_STATE] = states
        return exits

    def decide(
        self, runner: ModelRunner, rows: PassRows, previous: torch.Tensor | None, exit_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(exits bool [n], the rows' new exit states float64 [n]) after the pass of `rows`."""
        raise NotImplementedError


class OuroTest(DeviceExitTest):
    """Cumulative hazard of the Ouro gate: remaining = ∏ (1 − λ) over the position's loops."""

    updates_exit_state = True
    graphable = True  # the gate reads only the state after the pass

    def decide(
        self, runner: ModelRunner, rows: PassRows, previous: torch.Tensor | None, exit_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate = runner.model.exit_gate(runner.state[rows.slots]).double()
        remaining = exit_states * (1.0 - gate)
        return (rows.depths >= rows.max_loops) | self._passed(rows, exit_states, remaining), remaining

    @staticmethod
    def _passes(rows: PassRows, depth: torch.Tensor, remaining: torch.Tensor) -> torch.Tensor:
        thr = rows.thresholds
        return (thr < 1.0) & (depth >= rows.min_loops) & (1.0 - remaining >= thr)

    def _passed(self, rows: PassRows, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        """Whether the test passes now (after the pass's loop)."""
        return self._passes(rows, rows.depths, after)


class OuroDelayedTest(OuroTest):
    """Ouro's test acted on one loop later: whether it passed after the previous loop."""

    def _passed(self, rows: PassRows, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        return self._passes(rows, rows.depths - 1, before)


class BelowThresholdTest(DeviceExitTest):
    """Huginn: exit once the signal between successive loops falls below the threshold."""

    def decide(
        self, runner: ModelRunner, rows: PassRows, previous: torch.Tensor | None, exit_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        signal = self.signal(runner, rows, previous)
        below = (rows.depths >= rows.min_loops) & (signal < rows.thresholds)
        return (rows.depths >= rows.max_loops) | below, exit_states

    def signal(self, runner: ModelRunner, rows: PassRows, previous: torch.Tensor | None) -> torch.Tensor:
        """The rows' signal after the pass, float64 [n]."""
        raise NotImplementedError


class KLTest(BelowThresholdTest):
    """KL(p_{d−1} ‖ p_d) of the next-token distributions; the slot keeps p_{d−1} (uniform after PRELUDE)."""

    def signal(self, runner: ModelRunner, rows: PassRows, previous: torch.Tensor | None) -> torch.Tensor:
        # This coda's K/V is overwritten by the position's final CODA, computed from the same state.
        context = runner.context(rows.slots, rows.positions, None, rows.width)
        hidden = runner.model.coda(runner.state[rows.slots], rows.positions, context)
        assert runner.prev_logp is not None, "KL needs a model with a coda signal"
        logp = torch.log_softmax(runner.model.lm_head(hidden).to(runner.prev_logp.dtype), dim=-1)
        prev = runner.prev_logp[rows.slots]
        runner.prev_logp[rows.slots] = logp
        return (prev.exp() * (prev - logp)).sum(dim=-1).double()


class LatentTest(BelowThresholdTest):
    """Relative change of the raw loop state, ‖s_d − s_{d−1}‖ / ‖s_d‖."""

    needs_previous_state = True

    def signal(self, runner: ModelRunner, rows: PassRows, previous: torch.Tensor | None) -> torch.Tensor:
        assert previous is not None
        state = runner.state[rows.slots]
        return (state - previous).double().norm(dim=-1) / state.double().norm(dim=-1)


_TESTS: dict[ExitTest, type[DeviceExitTest]] = {
    ExitTest.OURO: OuroTest,
    ExitTest.OURO_DELAYED: OuroDelayedTest,
    ExitTest.KL: KLTest,
    ExitTest.LATENT: LatentTest,
}


def make_exit_test(test: ExitTest) -> DeviceExitTest:
    """The strategy of a DecodeBatch's `exit_test`."""
    return _TESTS[test]()
