"""Depth-faithful replay after a worker loss (in-process worker, restarted): same outputs."""

from __future__ import annotations

import random

import pytest

from rlt_engine import LLM, SamplingParams
from rlt_engine.executor import WorkerLost

pytestmark = pytest.mark.usefixtures("single_thread")


def run(model: str, layout: str, mode: str, lose_worker_at_step: int | None, loops_per_plan: int = 1):
    """Six seeded temperature-1 requests; optionally lose the worker before one step."""
    llm = LLM(model, workers=0, device="cpu", dtype="float64", exit_mode=mode, kv_layout=layout,
              restart_workers=True, max_num_seqs=4, prefill_chunk_size=4, loops_per_plan=loops_per_plan)
    rng = random.Random(1)
    depth = llm.engine.max_depth
    for i in range(6):
        max_tokens = rng.randint(3, 9)
        options = dict(max_tokens=max_tokens, temperature=1.0, seed=50 + i, ignore_eos=True)
        if mode == "trace":
            options["exit_depths"] = [depth] + [rng.randint(1, depth) for _ in range(max_tokens - 1)]
        elif mode == "ouro":
            options["exit_threshold"] = 0.5
        elif mode in ("latent_diff", "kl"):
            options["exit_threshold"] = 0.3
        prompt = [rng.randrange(256) for _ in range(rng.randint(2, 10))]
        llm.engine.add_request(f"r{i}", prompt, SamplingParams(**options))
    streams: dict[str, list[int]] = {}
    finals, step = {}, 0
    while llm.engine.has_unfinished_requests():
        step += 1
        if step == lose_worker_at_step:
            llm.engine._on_worker_lost(0, WorkerLost(0, "injected by the test"))
        for out in llm.engine.step():
            seen = streams.setdefault(out.request_id, [])
            assert out.token_ids[: len(seen)] == seen, "a delivered token changed after replay"
            streams[out.request_id] = out.token_ids
            if out.finished:
                finals[out.request_id] = (out.token_ids, out.exit_depths, out.finish_reason)
    replays = llm.engine.scheduler.stats.num_replays
    llm.close()
    return finals, replays


@pytest.mark.parametrize(
    ("model", "layout", "mode", "step", "loops_per_plan"),
    [
        ("toy-ouro", "last_exited", "ouro", 9, 1),
        ("toy-ouro", "shared", "fixed", 22, 1),
        ("toy-huginn", "last_exited", "latent_diff", 14, 1),
        ("toy-huginn", "shared", "trace", 30, 1),
        # exits decided in the worker, plans of several passes: the lost plan's tokens were never applied
        ("toy-ouro", "shared", "ouro_delayed", 4, 8),
        ("toy-huginn", "last_exited", "kl", 5, 12),
    ],
)
def test_replay_after_worker_loss_gives_the_fault_free_outputs(model, layout, mode, step, loops_per_plan):
    expected, _ = run(model, layout, mode, None, loops_per_plan)
    replayed, replays = run(model, layout, mode, step, loops_per_plan)
    assert replays >= 2
    assert replayed == expected
