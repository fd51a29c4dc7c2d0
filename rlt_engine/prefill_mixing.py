"""How a step's prompt chunks share the loop passes (`mixed_batches`), chosen once at construction.

    separate:  | chunks, loops 1 … D (passes of their own) | [FINALIZE] CODA PRELUDE | pass 1 … P |
    mixed:     | [FINALIZE] CODA PRELUDE | pass 1: rows + chunks at loop 1 | … | pass D: … loop D | … pass P |
               (a plan with no loop rows keeps the separate layout: there is nothing to ride)

Mixed, the chunks' loops run inside the first D of the plan's P loop passes (P is what it would be
anyway: loops_per_plan for a DecodeBatch), so the rows that are decoding keep going while a prompt
prefills, and `max_num_batched_tokens` (rows + chunk tokens) bounds each of those passes. A chunk
that completes its prompt is followed by its boundary in the same plan only as a DecodeBatch row,
which the worker holds until the chunk's last loop has run; otherwise (planned exits, a replayed
first output) its boundary waits for the next plan.
"""

from __future__ import annotations

from typing import Protocol

from rlt_engine.plan_builder import PlanBuilder


class PrefillMixing(Protocol):
    def rides(self, plan: PlanBuilder) -> bool:
        """Whether this plan's prompt chunks ride its loop passes (decided before the first chunk)."""
        ...


class SeparatePrefill:
    """Prompt chunks run their D loops in passes of their own, first in the plan."""

    def rides(self, plan: PlanBuilder) -> bool:
        return False


class MixedPrefill:
    """Prompt chunks ride the loop passes of every plan that has loop rows (module docstring)."""

    def rides(self, plan: PlanBuilder) -> bool:
        if not plan.has_loop_rows:
            return False
        plan.ride_prefill()
        return True


def make_prefill_mixing(mixed_batches: bool) -> PrefillMixing:
    return MixedPrefill() if mixed_batches else SeparatePrefill()
