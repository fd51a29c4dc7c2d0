"""Exit policies (SPEC §3): when a generated position stops looping.

The runner only computes the signal a policy asks for; the policy, in the engine, decides.
Chosen once per engine from `exit_mode`:

    fixed          exit after max_loops                          (no signal)
    trace          exit after exit_depths[i]                     (no signal)
    ouro           remaining *= 1 − λ after each loop; exit after loop d when d ≥ min_loops
                   and 1 − remaining ≥ threshold (threshold < 1), or d = max_loops
    ouro_delayed   the same test passing after loop r exits after loop min(r + 1, max_loops):
                   loop r + 1 may be submitted before loop r's signal is read
    kl, latent_diff  exit after loop d ≥ min_loops when the signal < threshold
"""

from __future__ import annotations

from protocol.messages import ModelInfo, SamplingParams, Signal
from rlt_engine.request import LoopLimits, Request


class ExitPolicy:
    """Base: a policy with no signal whose exit depth is known when a position starts.

    A policy reads a request and returns decisions; it never changes the request. Its per-position
    state (Ouro: the product of 1 − λ so far) comes back from `observe`, and the scheduler stores it
    in `Request.exit_state`, starting each position at `initial_state`.
    """

    signal = Signal.NONE
    never_early_threshold = 0.0
    initial_state = 1.0

    def planned_exit(self, request: Request, output_index: int) -> int | None:
        """Exit depth of the position that produces output `output_index`, if known in advance."""
        return request.limits.max_loops

    def observe(self, request: Request, depth: int, signal: float) -> tuple[int | None, float]:
        """After loop `depth` returned `signal`: the decided exit depth (None: go on) and the new state."""
        return None, request.exit_state

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


class OuroExit(ExitPolicy):
    """Cumulative hazard of the Ouro gate against a threshold."""

    signal = Signal.GATE
    never_early_threshold = 1.0

    def planned_exit(self, request: Request, output_index: int) -> int | None:
        return None

    def observe(self, request: Request, depth: int, signal: float) -> tuple[int | None, float]:
        remaining = request.exit_state * (1.0 - signal)  # ∏ (1 − λ) over the position's loops
        limits = request.limits
        if depth >= limits.max_loops:
            return depth, remaining
        if self._passes(limits, depth, 1.0 - remaining):
            return self._exit_after_pass(depth, limits.max_loops), remaining
        return None, remaining

    @staticmethod
    def _passes(limits: LoopLimits, depth: int, cumulative: float) -> bool:
        return limits.threshold < 1.0 and depth >= limits.min_loops and cumulative >= limits.threshold

    def _exit_after_pass(self, depth: int, max_loops: int) -> int:
        return depth


class OuroDelayedExit(OuroExit):
    """Ouro's test, acted on one loop later (so loop r + 1 never waits for loop r's signal)."""

    def _exit_after_pass(self, depth: int, max_loops: int) -> int:
        return min(depth + 1, max_loops)


class SignalBelowThreshold(ExitPolicy):
    """Huginn: exit once the signal between successive loops falls below the threshold."""

    def planned_exit(self, request: Request, output_index: int) -> int | None:
        return None

    def observe(self, request: Request, depth: int, signal: float) -> tuple[int | None, float]:
        limits = request.limits
        if depth >= limits.max_loops or (depth >= limits.min_loops and signal < limits.threshold):
            return depth, request.exit_state
        return None, request.exit_state


class KLExit(SignalBelowThreshold):
    signal = Signal.KL


class LatentDiffExit(SignalBelowThreshold):
    signal = Signal.LATENT


_POLICIES: dict[str, type[ExitPolicy]] = {
    "fixed": FixedExit,
    "trace": TraceExit,
    "ouro": OuroExit,
    "ouro_delayed": OuroDelayedExit,
    "kl": KLExit,
    "latent_diff": LatentDiffExit,
}


def make_exit_policy(exit_mode: str | None, model: ModelInfo) -> ExitPolicy:
    """The engine's policy: `exit_mode`, or the model family's default, checked against the model."""
    mode = exit_mode or ("ouro" if model.has_exit_gate else "fixed")
    policy = _POLICIES[mode]()
    if policy.signal == Signal.GATE and not model.has_exit_gate:
        raise ValueError(f"exit_mode {mode!r} needs an exit gate, which the {model.family} model does not have")
    if policy.signal in (Signal.KL, Signal.LATENT) and not model.has_coda_signal:
        raise ValueError(f"exit_mode {mode!r} needs a coda-based signal, which the {model.family} model lacks")
    return policy
