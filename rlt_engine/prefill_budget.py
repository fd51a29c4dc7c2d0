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
so prompts finish in arrival order. Bucket alignment keeps that: it rounds down only to a bucket, the
smallest of which is ≥ 1 token (16 for the prefill graphs).
A capped step's prompt rows are one PrefillBatch of ≤ cap tokens, inside the prefill graphs'
largest bucket (max_num_batched_tokens) as every step's are.

    bucket-aligned (when the worker replays PREFILL passes from graphs, WorkerReady.prefill_token_buckets):
             either rule's tokens, raised to the next bucket within the decode rows' leftover of
             max_num_batched_tokens; where none fits, lowered to the bucket below if that computes
             more prompt tokens per row of the pass than padding up does (else unchanged)

A graphed batch is padded up to the next bucket (16, 32, …, 512, then multiples of 512), and past 512
rows a pass's GEMMs grow with its padded rows: a per-row cap of 16 × 70 requests (1,120 tokens) runs
as a 1,536-row pass. Raised to its bucket, a step of whole 512-token chunks fills it exactly, and the
budget cuts a prompt's chunk short less often. The cap is then exceeded by less than one bucket step
(512 tokens above 512): it bounds a step's stall, and a padded step stalled as long.
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


class BucketAlignedBudget:
    """Another budget's tokens raised to the next prefill graph bucket that fits (module docstring).

    Up where a bucket fits: fewer prompt tokens than the cap's slow the prompts, so fewer requests
    decode, so the per-row cap stays low. At c = 128 on the H200, rounding down and to the nearest
    bucket ran trace's decode passes at 34.6 rows against the plain cap's 57.7, at 2,019 and 2,063
    against 2,437 tok/s (design.md, "Prefill budget").

    Where no bucket fits in what the decode rows left (`budget`), the graph pads the tokens to the
    next bucket anyway, past max_num_batched_tokens: 1,600 tokens beside 100 decode rows run as 2,048
    + 100 rows, and at that size a pass's GEMMs cost by the row. So the tokens go down to the bucket
    below when it computes more prompt tokens per row of the pass (1,536 of 1,636), and stay (to be
    padded) when it does not: beside 1,048 decode rows, 912 tokens keep 912 of 2,072 rows rather than
    512 of 1,560."""

    def __init__(self, inner: PrefillBudget, buckets: tuple[int, ...], max_num_batched_tokens: int) -> None:
        self.inner, self.buckets = inner, tuple(sorted(buckets))
        self.max_num_batched_tokens = max_num_batched_tokens

    def tokens(self, running: list[Request], budget: int) -> int:
        tokens = self.inner.tokens(running, budget)
        # Up only within the decode rows' leftover: rows + prompt tokens stay ≤ max_num_batched_tokens.
        up = min((b for b in self.buckets if tokens <= b <= budget), default=None)
        if up is not None:
            return up
        padded = min((b for b in self.buckets if b >= tokens), default=tokens)
        down = max((b for b in self.buckets if b <= tokens), default=tokens)
        rows = self.max_num_batched_tokens - budget  # the decode rows beside the chunks
        return down if down * (padded + rows) > tokens * (down + rows) else tokens


def make_prefill_budget(max_prefill_tokens_while_decoding: int, prefill_tokens_per_decoding_row: int,
                        max_num_batched_tokens: int, prefill_token_buckets: tuple[int, ...] = ()) -> PrefillBudget:
    """0: today's rule (FullBudget); else the decode-aware cap. Either is bucket-aligned when the worker
    has prefill graph buckets."""
    budget: PrefillBudget = FullBudget()
    if max_prefill_tokens_while_decoding:
        budget = DecodeAwareBudget(max_prefill_tokens_while_decoding, prefill_tokens_per_decoding_row)
    if not prefill_token_buckets:
        return budget
    return BucketAlignedBudget(budget, prefill_token_buckets, max_num_batched_tokens)
