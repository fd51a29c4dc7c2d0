"""The decode-aware prefill budget (`max_prefill_tokens_while_decoding`, rlt_engine/prefill_budget.py).

Scheduler units (hand-built results): while a request decodes, a step's prompt tokens stay within the
cap and every decoding request keeps its row; with nothing decoding a step takes the full
max_num_batched_tokens; a prompt that arrives while others decode gets its first token within
⌈prompt / min(cap, chunk)⌉ steps. Engine runs (CPU, float64, toy models): tokens, exit depths and
finish reasons are exactly those of the uncapped engine and the dense reference for fixed, trace and
ouro in both KV layouts, the cap holds in every plan that carries decode rows, and under (emulated)
prefill graphs every capped prefill batch replays from a graph. Bucket-aligned budgets (the worker's
prefill graph buckets): a step's prompt tokens round down to a bucket, and under emulated prefill graphs
no capped batch is padded while the outputs stay the same.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from factories import (
    DEPTH,
    SAMPLING,
    Driver,
    Job,
    add_requests,
    assert_matches_reference,
    make_llm,
    make_scheduler,
    make_workload,
    run_step,
    run_workload,
)

from protocol.messages import ExecutionPlan, PrefillBatch
from rlt_engine.bench.throughput import parse_args
from rlt_engine.cli import engine_config, serve_parser
from rlt_engine.config import EngineConfig
from rlt_engine.prefill_budget import BucketAlignedBudget, DecodeAwareBudget, FullBudget, make_prefill_budget
from rlt_engine.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("single_thread")


def prompt_tokens(plan: ExecutionPlan) -> int:
    return sum(int(b.col("query_lens").sum()) for b in plan.batches if isinstance(b, PrefillBatch))


def decode_keys(plan: ExecutionPlan) -> set[int]:
    """Keys with rows past their prompt in the plan: rows of other stages, less the requests whose
    prompt ends in this plan (their boundary follows their last chunk in the same plan)."""
    prompting = {k for b in plan.batches if isinstance(b, PrefillBatch) for k in b.col("keys").tolist()}
    rows = {k for b in plan.batches if not isinstance(b, PrefillBatch) for k in b.col("keys").tolist()}
    return rows - prompting


def decoding_scheduler(cap: int, chunk: int, num_decoding: int = 3, per_row: int = 0) -> Scheduler:
    """A scheduler (D = 4, one loop per plan, 64 batched tokens) with `num_decoding` requests of
    12-token prompts past their prompt and far from done."""
    scheduler = make_scheduler(max_prefill_tokens_while_decoding=cap, prefill_chunk_size=chunk, num_blocks=512,
                               max_num_seqs=6, prefill_tokens_per_decoding_row=per_row)
    requests = add_requests(scheduler, num_decoding, prompt_len=12, max_tokens=60, prefix="d")
    while any(r.num_outputs == 0 for r in requests):
        run_step(scheduler)
    return scheduler


@pytest.mark.parametrize(("cap", "chunk"), [(8, 8), (8, 16), (12, 8)], ids=["cap=chunk", "cap<chunk", "cap>chunk"])
def test_cap_holds_while_decoding_and_decode_rows_keep_their_place(cap: int, chunk: int) -> None:
    """Two 40-token prompts arrive while three requests decode: every step carries a chunk of each
    prompt in arrival order (≤ chunk tokens, what is left of it) until the cap is spent, and a row of
    each of the three decoding requests; the first prompt's first token comes within
    ⌈40 / min(cap, chunk)⌉ steps."""
    scheduler = decoding_scheduler(cap, chunk)
    decoding = {r.key for r in scheduler.running[0]}
    late = add_requests(scheduler, 2, prompt_len=40, max_tokens=4, prefix="p")
    first_token_step = None
    for step in range(1, 30):
        expected, budget = 0, cap
        for request in late:
            tokens = min(request.prompt_len - request.num_prefilled, chunk, budget)
            expected, budget = expected + tokens, budget - tokens
        plan = run_step(scheduler)
        assert plan is not None
        assert prompt_tokens(plan) == expected, f"step {step}: {prompt_tokens(plan)} prompt tokens, not {expected}"
        assert decoding <= decode_keys(plan), f"step {step}: a decoding request lost its row"
        if first_token_step is None and late[0].num_outputs:
            first_token_step = step
        if all(r.num_prefilled == r.prompt_len for r in late):
            break
    assert first_token_step is not None and first_token_step <= math.ceil(40 / min(cap, chunk))


@pytest.mark.parametrize(("per_row", "num_decoding", "expected"), [(4, 3, 12), (2, 3, 8), (4, 1, 8)],
                         ids=["rows-raise-the-cap", "cap-is-the-floor", "one-row"])
def test_a_cap_per_decoding_row(per_row: int, num_decoding: int, expected: int) -> None:
    """prefill_tokens_per_decoding_row: the cap is max(cap, per_row × decoding requests), with the
    arriving prompts not counted: cap 8, chunk 16, a 40-token prompt arriving."""
    scheduler = decoding_scheduler(cap=8, chunk=16, num_decoding=num_decoding, per_row=per_row)
    (late,) = add_requests(scheduler, 1, prompt_len=40, max_tokens=4, prefix="p")
    assert prompt_tokens(run_step(scheduler)) == expected
    assert late.num_prefilled == expected


def test_full_budget_when_nothing_decodes() -> None:
    """Three 20-token prompts on an idle worker: one chunk of each per step (24, then 24 tokens, over
    the cap of 8), a lone prompt of 40 all at once with chunks of 64: TTFT is not capped."""
    scheduler = make_scheduler(max_prefill_tokens_while_decoding=8, num_blocks=512)
    add_requests(scheduler, 3, prompt_len=20, max_tokens=2)
    assert [prompt_tokens(run_step(scheduler)) for _ in range(3)] == [24, 24, 12]
    lone = make_scheduler(max_prefill_tokens_while_decoding=8, prefill_chunk_size=64, num_blocks=512)
    (request,) = add_requests(lone, 1, prompt_len=40, max_tokens=2)
    assert prompt_tokens(run_step(lone)) == 40 and request.num_outputs == 1


def test_no_cap_keeps_todays_rule() -> None:
    """0 (no cap): the same arrival as above takes the whole budget left by the decode rows."""
    scheduler = decoding_scheduler(cap=0, chunk=16)
    late = add_requests(scheduler, 2, prompt_len=40, max_tokens=4, prefix="p")
    assert prompt_tokens(run_step(scheduler)) == 32  # one chunk of 16 of each
    assert [r.num_prefilled for r in late] == [16, 16]
    assert isinstance(scheduler.prefill_budget, FullBudget)
    assert isinstance(decoding_scheduler(cap=8, chunk=8).prefill_budget, DecodeAwareBudget)


BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 1536, 2048)  # token_buckets(2048, 2048) of the prefill graphs


@pytest.mark.parametrize(("tokens", "budget", "aligned"),
                         [(560, 2000, 1024), (1120, 2000, 1536), (512, 2000, 512), (513, 2000, 1024),
                          (100, 2000, 128), (10, 2000, 16), (912, 1024, 1024),
                          (1600, 1948, 1536), (1900, 1900, 1536), (2043, 2043, 1536), (1536, 1900, 1536),
                          (912, 1000, 912), (10, 10, 10)])
def test_bucket_aligned_budget_rises_to_the_next_bucket_that_fits(tokens: int, budget: int, aligned: int) -> None:
    """The inner rule's tokens (here: a cap) rise to the next bucket, but never above what the decode
    rows left of 2,048 (`budget`). Where none fits they go down to the bucket below when that computes
    more prompt tokens per row of the padded pass (1,600 beside 100 rows: 1,536 of 1,636 rows, not 1,600
    of 2,148), and stay otherwise (912 beside 1,048 rows: 912 of 2,072, not 512 of 1,560; 10 with no
    bucket below)."""

    class Cap:
        def tokens(self, running: list, budget: int) -> int:
            return min(tokens, budget)

    assert BucketAlignedBudget(Cap(), BUCKETS, 2048).tokens([], budget) == aligned


def test_bucket_alignment_only_with_buckets() -> None:
    """No buckets (prefill runs eagerly: the CPU, or graphs off): the rule itself; with buckets, either
    rule aligned."""
    assert isinstance(make_prefill_budget(0, 0, 2048), FullBudget)
    assert isinstance(make_prefill_budget(512, 16, 2048), DecodeAwareBudget)
    aligned = make_prefill_budget(512, 16, 2048, BUCKETS)
    assert isinstance(aligned, BucketAlignedBudget) and isinstance(aligned.inner, DecodeAwareBudget)
    assert isinstance(make_prefill_budget(0, 0, 2048, BUCKETS).inner, FullBudget)


def test_aligned_steps_carry_whole_buckets() -> None:
    """Cap 12 over chunks of 8 with buckets 4, 8, 16: while three requests decode, two arriving
    40-token prompts get 16 tokens a step (the next bucket: a chunk of each), not 8 + 4."""
    scheduler = make_scheduler(max_prefill_tokens_while_decoding=12, prefill_chunk_size=8, num_blocks=512,
                               max_num_seqs=6, prefill_token_buckets=(4, 8, 16))
    decoding = add_requests(scheduler, 3, prompt_len=12, max_tokens=60, prefix="d")
    while any(r.num_outputs == 0 for r in decoding):
        run_step(scheduler)
    late = add_requests(scheduler, 2, prompt_len=40, max_tokens=4, prefix="p")
    counts = [prompt_tokens(run_step(scheduler)) for _ in range(5)]
    assert counts == [16] * 5 and [r.num_prefilled for r in late] == [40, 40]


def test_option_and_flag() -> None:
    assert EngineConfig().max_prefill_tokens_while_decoding == 512
    assert EngineConfig(max_prefill_tokens_while_decoding=0).max_prefill_tokens_while_decoding == 0
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        EngineConfig(max_prefill_tokens_while_decoding=-1)
    serve = serve_parser()
    assert engine_config(serve.parse_args([])).max_prefill_tokens_while_decoding == 512
    assert engine_config(serve.parse_args(["--max-prefill-tokens-while-decoding", "256"])) \
        .max_prefill_tokens_while_decoding == 256
    assert "--max-prefill-tokens-while-decoding" in serve.format_help()
    assert parse_args([]).max_prefill_tokens_while_decoding is None  # the bench: the engine's default
    assert parse_args(["--max-prefill-tokens-while-decoding", "0"]).max_prefill_tokens_while_decoding == 0
    assert EngineConfig().prefill_tokens_per_decoding_row == 16
    with pytest.raises(ValueError, match="prefill_tokens_per_decoding_row"):
        EngineConfig(prefill_tokens_per_decoding_row=-1)
    assert engine_config(serve.parse_args(["--prefill-tokens-per-decoding-row", "0"])) \
        .prefill_tokens_per_decoding_row == 0
    assert parse_args(["--prefill-tokens-per-decoding-row", "32"]).prefill_tokens_per_decoding_row == 32


THRESHOLDS = {"fixed": None, "trace": None, "ouro": 0.6}
CASES = [(mode, layout) for mode in THRESHOLDS for layout in ("last_exited", "shared")]


def jobs_for(mode: str) -> list[Job]:
    """Eight staggered requests (most arrive while others decode), prompts of up to 40 tokens."""
    return make_workload(random.Random(f"prefill-budget-{mode}"), 8, depth=DEPTH["toy-ouro"], exit_mode=mode,
                         threshold=THRESHOLDS[mode], sampling=tuple(SAMPLING), max_prompt_len=40, max_tokens=8,
                         spread=1)


def run_jobs(mode: str, jobs: list[Job], cap: int, emulate_graphs: bool = False, aligned: bool = False,
             **options: object) -> Driver:
    """`aligned`: the scheduler rounds to the emulated prefill graphs' buckets, as an engine does with the
    buckets a CUDA worker reports (here the graphs come after the engine started, so it is told later)."""
    settings = dict(exit_mode=mode, max_num_seqs=4, prefill_chunk_size=8, max_prefill_tokens_while_decoding=cap,
                    prefill_tokens_per_decoding_row=0)  # the fixed cap (the per-row term has its own test)
    with make_llm("toy-ouro", **(settings | options)) as llm:
        runner = llm.engine.executor._worker.runner
        assert llm.engine.scheduler.config.prefill_token_buckets == ()  # a CPU worker prefills eagerly
        if emulate_graphs:
            runner.use_pass_graphs(emulate=True, prefill=True)
        if aligned:
            llm.engine.scheduler.prefill_budget = make_prefill_budget(cap, 0, llm.engine.config.max_num_batched_tokens,
                                                                        runner.prefill_token_buckets)
        run = run_workload(llm, jobs)
        run.graph_stats = runner.graph_stats
        run.assert_resources_returned()
    return run


def finals(run: Driver) -> list[tuple]:
    return [(life.job.request_id, life.final.token_ids, life.final.exit_depths, life.final.finish_reason)
            for life in run.lives]


def over_cap(run: Driver, cap: int) -> list[int]:
    """Step ids of plans that carry decode rows and more than `cap` prompt tokens."""
    return [p.step_id for p in run.plans if decode_keys(p) and prompt_tokens(p) > cap]


@pytest.mark.parametrize(("mode", "layout"), CASES, ids=["-".join(c) for c in CASES])
def test_capped_outputs_equal_uncapped_and_the_reference(mode: str, layout: str) -> None:
    """LAST_EXITED: a cap of 12 over chunks of 8 (steps of 8 + 4); SHARED (one position per chunk): a
    cap of 1 position per step. The uncapped run exceeds the cap beside decode rows (so the workload
    exercises it); the capped run never does, and delivers the same tokens and exit depths."""
    cap = 12 if layout == "last_exited" else 1
    jobs = jobs_for(mode)
    uncapped = run_jobs(mode, jobs, 0, kv_layout=layout)
    capped = run_jobs(mode, jobs, cap, kv_layout=layout)
    assert finals(capped) == finals(uncapped)
    assert_matches_reference(capped, "toy-ouro", kv_layout=layout, exit_mode=mode)
    assert over_cap(uncapped, cap) and not over_cap(capped, cap)


def test_capped_prefill_replays_from_graphs() -> None:
    """Emulated decode and prefill graphs, a cap of 16 over chunks of 16: every PrefillBatch replays
    its D loops from a graph (none eager) and the tokens equal the uncapped eager run's."""
    jobs = jobs_for("trace")
    uncapped = run_jobs("trace", jobs, 0, prefill_chunk_size=16)
    capped = run_jobs("trace", jobs, 16, emulate_graphs=True, prefill_chunk_size=16)
    stats = capped.graph_stats
    batches = sum(isinstance(b, PrefillBatch) for p in capped.plans for b in p.batches)
    assert stats["prefill_eager"] == 0 and stats["prefill_replays"] == DEPTH["toy-ouro"] * batches > 0
    assert not over_cap(capped, 16) and over_cap(uncapped, 16)
    assert finals(capped) == finals(uncapped)


def test_aligned_prefill_pads_less() -> None:
    """Emulated decode and prefill graphs, prompts of whole 16-token chunks and a cap of 40 while
    decoding, which the plain rule fills as 16 + 16 + 8 (padded to the 64-token bucket, and the prompt
    cut at 8 is misaligned from then on): aligned to the worker's buckets (16, 32, 64), plans with decode
    rows carry at most 32 prompt tokens, no prefill row is padded (every batch is 16 or 32 whole-chunk
    tokens), and the tokens and exit depths
    are those of the unaligned run and the dense reference."""
    jobs = [dataclasses.replace(job, prompt=(job.prompt * 48)[: 16 * math.ceil(len(job.prompt) / 16)])
            for job in jobs_for("trace")]
    options = dict(emulate_graphs=True, prefill_chunk_size=16, max_num_seqs=8)
    plain = run_jobs("trace", jobs, 40, **options)
    aligned = run_jobs("trace", jobs, 40, aligned=True, **options)
    assert plain.graph_stats["prefill_padded_rows"] > aligned.graph_stats["prefill_padded_rows"]
    assert over_cap(aligned, 40) and not over_cap(aligned, 64)
    assert all(prompt_tokens(p) % 16 == 0 for p in aligned.plans)
    assert finals(aligned) == finals(plain)
    assert_matches_reference(aligned, "toy-ouro", kv_layout="last_exited", exit_mode="trace")


@pytest.mark.parametrize(("concurrency", "same"), [(32, True), (128, False)])
def test_alignment_moves_only_steps_the_cap_would_pad(concurrency: int, same: bool) -> None:
    """The benchmark's closed loop at scheduler level (2·c requests of 1,024-token prompts, chunks of
    512, cap 512 and 16 per decoding row, the worker's buckets up to 2,048): at c = 32 the cap is 512, a
    bucket, and alignment changes no step; at c = 128 it changes steps and pads fewer rows, never the
    prompt tokens in all."""
    from rlt_worker.prefill_graphs import token_buckets

    def prompt_steps(buckets: tuple[int, ...]) -> list[int]:
        scheduler = make_scheduler(max_prefill_tokens_while_decoding=512, prefill_tokens_per_decoding_row=16,
                                   prefill_chunk_size=512, num_blocks=40_000, block_size=16,
                                   max_num_seqs=concurrency, max_num_batched_tokens=2048,
                                   prefill_token_buckets=buckets)
        add_requests(scheduler, 2 * concurrency, prompt_len=1024, max_tokens=32)
        steps = []
        while (plan := run_step(scheduler)) is not None:
            steps.append(prompt_tokens(plan))
        return steps

    buckets = token_buckets(2048, 4096)

    def padding(steps: list[int]) -> int:
        return sum(min(b for b in buckets if b >= tokens) - tokens for tokens in steps if tokens)

    plain, aligned = prompt_steps(()), prompt_steps(buckets)
    assert sum(plain) == sum(aligned) == 2 * concurrency * 1024
    assert (plain == aligned) == same
    assert padding(aligned) < padding(plain) or same
