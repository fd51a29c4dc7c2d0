"""How a step's prompt chunks share the loop passes (`mixed_batches`), chosen once at construction.

    separate:  | chunks, loop 1 … D (passes of their own) | CODA, PRELUDE … | loop passes of slot rows |
    mixed:     | loop pass 1: slot rows + chunks at loop 1 | … | pass D: slot rows + chunks at loop D |
               (a plan with no loop rows keeps the separate layout: there is nothing to ride)

Mixed, every pass of the plan carries the chunks, so `max_num_batched_tokens` (slot rows + chunk
tokens) bounds each pass, as vLLM's per-step budget bounds each forward pass, and a new prompt
no longer stalls the rows that are decoding. A DecodeBatch then runs min(D, loops_per_plan)
passes instead of loops_per_plan: the chunks' loops, no more, so the next chunks ride the next
plan instead of waiting for a long plan to end. A chunk that completes its prompt leaves its
boundary work (CODA of output 0) to the next plan: the state it needs comes out of the last pass.
"""

from __future__ import annotations

from typing import Protocol

from rlt_engine.plan_builder import PlanBuilder


class PrefillMixing(Protocol):
    def rides(self, plan: PlanBuilder) -> bool:
        """Whether this plan's prompt chunks ride its loop passes (decided before the first chunk)."""
        ...


class SeparatePrefill:
    """Prompt chunks run their D loops in passes of their own, first in the plan; a chunk that
    completes its prompt has its boundary work in the same plan."""

    def rides(self, plan: PlanBuilder) -> bool:
        return False


class MixedPrefill:
    """Prompt chunks ride the loop passes of every plan that has loop rows (module docstring)."""

    def __init__(self, num_passes: int) -> None:
        self.num_passes = num_passes  # min(D, loops_per_plan): a DecodeBatch's passes in a mixed plan

    def rides(self, plan: PlanBuilder) -> bool:
        if not plan.has_loop_rows:
            return False
        plan.ride_prefill(self.num_passes)
        return True


def make_prefill_mixing(mixed_batches: bool, max_depth: int, loops_per_plan: int) -> PrefillMixing:
    return MixedPrefill(min(max_depth, loops_per_plan)) if mixed_batches else SeparatePrefill()
