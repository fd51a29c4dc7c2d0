"""How many prompt tokens one step may carry (`max_prefill_tokens_while_decoding`), chosen once at construction.

A step's prompt chunks run their D loops in passes of their own before the plan's decode passes
(separate prefill, prefill_mixing.py), so every decoding row waits for them: the ITL a delivery shows
is its plan's whole time, prompt passes included. Capping the prompt tokens of a step while anything
decodes bounds that stall; with nothing decoding nobody waits, and a lone prompt keeps the full budget
(its TTFT unchanged).

    full:    prompt tokens of a step ≤ max_num_batched_tokens − the step's decode rows
    capped:  the same, and ≤ cap while a request on the worker is past its prompt, where cap =
             max(max_prefill_tokens_while_decoding, prefill_tokens_per_decoding_row × those requests)

The per-row term (default 16; 0 turns it off) scales the cap with the decode work a prompt step delays: a
decode step of c rows takes longer as c grows, so a fixed cap that keeps the stall near one decode
step at c = 32 is needlessly tight at c = 128.

Neither starves anyone: decode rows are scheduled first and never counted against the cap, and the
first running prompt gets min(cap, prefill_chunk_size, what is left of it) tokens every step (the
full rule's budget is ≥ 1 whenever a prompt is running: rows ≤ max_num_seqs ≤ max_num_batched_tokens),
so prompts finish in arrival order.
A capped step's prompt rows are one PrefillBatch of ≤ cap tokens, inside the prefill graphs'
largest bucket (max_num_batched_tokens) as every step's are: a cap that is itself a token bucket
(a power of two ≤ 512, or a multiple of 512) pads least.
"""

from __future__ import annotations

from typing import Protocol

from rlt_engine.request import Phase, Request


class PrefillBudget(Protocol):
    def tokens(self, running: list[Request], budget: int) -> int:
        """The prompt tokens this step may carry, out of the `budget` its decode rows left."""
        ...


class FullBudget:
    """Prompt chunks take whatever the step's decode rows left of max_num_batched_tokens."""

    def tokens(self, running: list[Request], budget: int) -> int:
        return budget


class DecodeAwareBudget:
    """At most max(`cap`, `per_decoding_row` × decoding requests) prompt tokens per step while a
    request on the worker decodes (module docstring)."""

    def __init__(self, cap: int, per_decoding_row: int) -> None:
        self.cap, self.per_decoding_row = cap, per_decoding_row

    def tokens(self, running: list[Request], budget: int) -> int:
        decoding = sum(1 for r in running if r.phase != Phase.PREFILL)
        if decoding:
            return min(budget, max(self.cap, self.per_decoding_row * decoding))
        return budget


def make_prefill_budget(max_prefill_tokens_while_decoding: int, prefill_tokens_per_decoding_row: int
                        ) -> PrefillBudget:
    """0: today's rule (FullBudget); else the decode-aware cap."""
    if max_prefill_tokens_while_decoding:
        return DecodeAwareBudget(max_prefill_tokens_while_decoding, prefill_tokens_per_decoding_row)
    return FullBudget()
