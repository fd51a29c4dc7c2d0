"""Exit policies (SPEC §3): when a generated position stops looping.

A policy either knows a position's exit depth when it starts (`planned_exit`), so the engine
plans its loops (or, with several passes per plan, sends the worker's decode loop the depths of a
row's next positions: `planned_exits`), or names the test the worker applies after each loop
(`exit_test`), so the worker decides (rlt_worker/exit_tests.py holds the tests). Chosen once per
engine from `exit_mode`:

    fixed          exit after max_loops                          planned
    trace          exit after exit_depths[i]                     planned
    ouro           remaining *= 1 − λ after each loop; exit after loop d when d ≥ min_loops
                   and 1 − remaining ≥ threshold (threshold < 1), or d = max_loops
    ouro_delayed   the same test passing after loop r exits after loop min(r + 1, max_loops)
    kl, latent_diff  exit after loop d ≥ min_loops when the signal < threshold
"""

from __future__ import annotations

from protocol.messages import ExitTest, ModelInfo, SamplingParams
from rlt_engine.request import LoopLimits, Request


class ExitPolicy:
    """Base: a policy whose exit depth is known when a position starts (no test for the worker).

    A policy reads a request and returns decisions; it never changes the request. A worker-decided
    position carries the test's state between plans in `Request.exit_state` (Ouro: the product of
    1 − λ so far), starting at `initial_state`; the worker reports it back with each row.
    """

    exit_test: ExitTest | None = None  # the worker's test after each loop; None: exits are planned
    never_early_threshold = 0.0
    initial_state = 1.0

    def planned_exit(self, request: Request, output_index: int) -> int | None:
        """Exit depth of the position that produces output `output_index`, if known in advance."""
        return request.limits.max_loops

    def planned_exits(self, request: Request, first_index: int, count: int) -> list[int]:
        """Exit depths of the positions that produce outputs `first_index` … (at most `count`, none past
        the request's last output): what a DecodeBatch row under ExitTest.PLANNED carries."""
        last = min(first_index + count, request.params.max_tokens)
        return [self.planned_exit(request, i) for i in range(first_index, last)]

    def limits(self, params: SamplingParams, max_depth: int) -> LoopLimits:
        """Resolve a request's loop limits against the engine's D."""
        threshold = self.never_early_threshold if params.exit_threshold is None else params.exit_threshold
        trace = tuple(params.exit_depths) if params.exit_depths is not None else None
        return LoopLimits(params.min_loops, params.max_loops or max_depth, threshold, trace)


class FixedExit(ExitPolicy):
    """Every generated position runs max_loops."""


class TraceExit(ExitPolicy):
    """The request's exit_depths list is followed exactly."""

    def planned_exit(self, request: Request, output_index: int) -> int | None:
        assert request.limits.trace is not None
        return request.limits.trace[output_index]

    def limits(self, params: SamplingParams, max_depth: int) -> LoopLimits:
        if params.exit_depths is None:
            raise ValueError("exit_mode 'trace' needs exit_depths (one entry per output token)")
        return super().limits(params, max_depth)


class WorkerDecidedExit(ExitPolicy):
    """A test the worker applies after each loop: no exit depth is known in advance."""

    def planned_exit(self, request: Request, output_index: int) -> int | None:
        return None

    def planned_exits(self, request: Request, first_index: int, count: int) -> list[int]:
        return []


class OuroExit(WorkerDecidedExit):
    """Cumulative hazard of the Ouro gate against a threshold."""

    exit_test = ExitTest.OURO
    never_early_threshold = 1.0


class OuroDelayedExit(OuroExit):
    """Ouro's test, acted on one loop later."""

    exit_test = ExitTest.OURO_DELAYED


class KLExit(WorkerDecidedExit):
    """Huginn: exit once KL(p_{d−1} ‖ p_d) falls below the threshold."""

    exit_test = ExitTest.KL


class LatentDiffExit(WorkerDecidedExit):
    """Huginn: exit once the relative change of the loop state falls below the threshold."""

    exit_test = ExitTest.LATENT


_POLICIES: dict[str, type[ExitPolicy]] = {
    "fixed": FixedExit,
    "trace": TraceExit,
    "ouro": OuroExit,
    "ouro_delayed": OuroDelayedExit,
    "kl": KLExit,
    "latent_diff": LatentDiffExit,
}
_GATE_TESTS = (ExitTest.OURO, ExitTest.OURO_DELAYED)
_CODA_SIGNAL_TESTS = (ExitTest.KL, ExitTest.LATENT)


def worker_exit_tests(exit_mode: str | None) -> tuple[int, ...]:
    """The ExitTest values an engine of `exit_mode` may send (WorkerConfig.exit_tests). The model's
    default mode is not known before the workers load it: then OURO, which applies to gated models."""
    test = _POLICIES[exit_mode or "ouro"].exit_test
    return () if test is None else (int(test),)


def make_exit_policy(exit_mode: str | None, model: ModelInfo) -> ExitPolicy:
    """The engine's policy: `exit_mode`, or the model family's default, checked against the model."""
    mode = exit_mode or ("ouro" if model.has_exit_gate else "fixed")
    policy = _POLICIES[mode]()
    if policy.exit_test in _GATE_TESTS and not model.has_exit_gate:
        raise ValueError(f"exit_mode {mode!r} needs an exit gate, which the {model.family} model does not have")
    if policy.exit_test in _CODA_SIGNAL_TESTS and not model.has_coda_signal:
        raise ValueError(f"exit_mode {mode!r} needs a coda-based signal, which the {model.family} model lacks")
    return policy
