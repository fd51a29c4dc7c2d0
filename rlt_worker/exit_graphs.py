"""A DecodeBatch pass's exit test: eagerly, or replayed from a CUDA graph right after the pass's graph.

Eager after a graph-replayed pass, Ouro's test is ~13 launches (the gathers of the rows' limits and
exit values, the gate's GEMV, the float64 hazard math, the index_put of the exit states) that the
GPU waits for while the host issues them. A graphable test (rlt_worker/exit_tests.py: OURO,
OURO_DELAYED) is captured once per (rows bucket, test): the graph reads the pass graphs' static rows
of its bucket (slots, positions, depths, written by the pass's one upload), runs the test's `apply`
(its exit states updated in DecodeCursors.exit_values in place) and copies the exit flags into a
static bool [rows] buffer. The host does one pass replay, one exit-test replay and one readback.

    padding rows  the pass graphs' dummy slot: DecodeCursors' device tables have a row for it, so
                  padding rows read its limits and write its exit state, never a real slot's
    width         the graphed tests read no context; `PassRows.width` is the widest bucket's
    capture       with the pass graphs (`LoopPassGraphs.capture_all`), for the tests the worker's
                  config names (`RunnerConfig.exit_tests`) when the model has an exit gate; a test
                  captured at start-up costs one graph per rows bucket (9 at 256 slots), each a few
                  kernels over a few KiB of the shared pool. A test named by a DecodeBatch and not
                  captured yet is captured when that batch starts, before any of its passes staged
                  rows (a capture's warm-up points the static rows at the dummy slot); those count in
                  `lazy_captures`
    fallback      a pass that ran eagerly (no bucket fits, or prompt chunks ride it) runs its test
                  eagerly (`exit_eager`); a failed capture turns exit-test graphs off (`exit_error`),
                  the passes keep theirs

`make_exit_step` chooses once per DecodeBatch: `GraphedExitStep` (graphs on, a graphable test) or
`EagerExitStep` (graphs off, or KL and LATENT, which read a context per width or the state before
the pass). Both run the same `apply`, so the decisions and exit states are the same bits.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch

from protocol.messages import ExitTest
from rlt_worker.exit_tests import DeviceExitTest, make_exit_test

if TYPE_CHECKING:
    from rlt_worker.cuda_graphs import LoopPassGraphs, StagedPass
    from rlt_worker.model_runner import ModelRunner, PassColumns

log = logging.getLogger("rlt.worker")


class EagerExitStep:
    """The test's torch ops on the state the pass left, launched one by one."""

    def __init__(self, runner: ModelRunner, test: DeviceExitTest) -> None:
        self.runner = runner
        self.test = test

    def after_pass(self, columns: PassColumns, width: int, previous: torch.Tensor | None) -> torch.Tensor:
        """Exits bool [n] of the pass's rows (on the device); their exit states updated in place."""
        return self.test.apply(self.runner, columns.slots, columns.positions, columns.depths, width, previous)


class GraphedExitStep(EagerExitStep):
    """The test replayed from its bucket's graph after a graph-replayed pass, eagerly after an eager one."""

    def __init__(self, runner: ModelRunner, test: DeviceExitTest, exit_test: ExitTest, graphs: ExitTestGraphs) -> None:
        super().__init__(runner, test)
        self.exit_test = exit_test
        self.graphs = graphs

    def after_pass(self, columns: PassColumns, width: int, previous: torch.Tensor | None) -> torch.Tensor:
        if columns.staged is None:  # the graph reads the pass graphs' static rows: an eager pass has none
            self.graphs.passes.stats.exit_eager += 1
            return super().after_pass(columns, width, previous)
        return self.graphs.replay(self.exit_test, columns.staged)


def make_exit_step(runner: ModelRunner, exit_test: ExitTest, graphs: ExitTestGraphs | None) -> EagerExitStep:
    """How a DecodeBatch's `exit_test` runs after each of its passes (module docstring)."""
    test = make_exit_test(exit_test)
    if graphs is not None and test.graphable and graphs.ready(exit_test):
        return GraphedExitStep(runner, test, exit_test, graphs)
    return EagerExitStep(runner, test)


class ExitTestGraphs:
    """Captures and replays exit tests per (rows bucket, test); owned by the runner's LoopPassGraphs."""

    def __init__(self, passes: LoopPassGraphs, exit_tests: tuple[ExitTest, ...]) -> None:
        self.passes = passes
        self.runner = passes.runner
        # The graphable tests read the exit gate: a model without one (Huginn, whose default is fixed) has none.
        gated = self.runner.model.info.has_exit_gate
        self.startup_tests = tuple(t for t in exit_tests if gated and make_exit_test(t).graphable)
        device = self.runner.device
        self._exits = {b: torch.zeros(b, dtype=torch.bool, device=device) for b in passes.row_buckets}
        self._graphs: dict[tuple[int, ExitTest], Any] = {}
        self.error: str | None = None  # a capture failed: every later exit test runs eagerly

    def capture_all(self) -> int:
        """Capture every (rows bucket, start-up test) not captured yet; the number captured."""
        before = len(self._graphs)
        for test in self.startup_tests:
            self._capture_test(test)
        return len(self._graphs) - before

    def ready(self, exit_test: ExitTest) -> bool:
        """Whether every rows bucket of the test has its graph, capturing the missing ones now (lazily)."""
        before = len(self._graphs)
        captured = self._capture_test(exit_test)
        self.passes.stats.lazy_captures += len(self._graphs) - before
        return captured

    def replay(self, exit_test: ExitTest, staged: StagedPass) -> torch.Tensor:
        """The staged pass's exits bool [n] (a view of the bucket's static buffer, valid until its next replay)."""
        rows = staged.key[0]
        self._graphs[(rows, exit_test)].replay()
        self.passes.stats.exit_replays += 1
        return self._exits[rows][: staged.num_rows]

    def _capture_test(self, exit_test: ExitTest) -> bool:
        """Capture the test's missing buckets, largest first; False when capturing failed (now or before)."""
        if self.error is not None or self.passes.stats.error is not None:
            return False
        for rows in reversed(self.passes.row_buckets):
            key = (rows, exit_test)
            if key in self._graphs:
                continue
            try:
                self._graphs[key] = self.passes._capture(functools.partial(self._test, rows, make_exit_test(exit_test)),
                                                         self.passes._warm_up(rows))
            except Exception as exc:  # keep serving: exit tests run eagerly from now on
                log.exception("CUDA graph capture of the %s exit test of %d rows failed; exit tests run eagerly",
                              exit_test.name, rows)
                self.error = self.passes.stats.exit_error = f"{type(exc).__name__}: {exc}"
                return False
        return True

    def _test(self, rows: int, test: DeviceExitTest) -> None:
        """The captured function: the test after the pass of the bucket's static rows."""
        slots, positions, depths = self.passes.static_rows(rows)
        exits = test.apply(self.runner, slots, positions, depths, self.passes.max_width, None)
        self._exits[rows].copy_(exits)
