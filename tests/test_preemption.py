"""Recompute preemption under on-demand KV growth, and priority scheduling (CPU, float64)."""

from __future__ import annotations

import random

import pytest
import torch

from rlt_engine import LLM, SamplingParams
from rlt_worker.models.loader import load_model
from rlt_worker.models.reference import ReferenceConfig, generate_reference


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def workload(rng: random.Random, n: int, depth: int, mode: str) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = [], []
    for i in range(n):
        max_tokens = rng.randint(4, 12)
        options = dict(max_tokens=max_tokens, temperature=rng.choice([0.0, 1.0]), seed=7 + i, ignore_eos=True)
        if mode == "trace":
            options["exit_depths"] = [depth] + [rng.randint(1, depth) for _ in range(max_tokens - 1)]
        elif mode == "ouro":
            options["exit_threshold"] = 0.5
        prompts.append([rng.randrange(256) for _ in range(rng.randint(3, 14))])
        params.append(SamplingParams(**options))
    return prompts, params


@pytest.mark.parametrize(
    ("model", "layout", "mode", "scheduling", "num_blocks"),
    [("toy-ouro", "last_exited", "ouro", "refill", 36), ("toy-ouro", "shared", "trace", "no_refill", 12)],
)
def test_preempted_requests_equal_the_reference(model, layout, mode, scheduling, num_blocks):
    llm = LLM(model, workers=0, device="cpu", dtype="float64", exit_mode=mode, kv_layout=layout,
              scheduling=scheduling, kv_growth="on_demand", num_blocks=num_blocks, block_size=4,
              max_num_seqs=8, prefill_chunk_size=8)
    depth = llm.engine.max_depth
    prompts, params = workload(random.Random(3), 16, depth, mode)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions >= 3
    reference_model = load_model(model, dtype=torch.float64, device="cpu")
    config = ReferenceConfig(max_loops=depth, kv_layout=layout, exit_mode=mode)
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        ref = generate_reference(reference_model, prompt, p, p.seed, config)
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths)
    assert llm.engine.kv_managers[0].num_free_blocks == num_blocks
    assert llm.engine.executor._worker.runner.num_free_slots == 8
    assert len(llm.engine.rng) == 0
    llm.close()


def test_high_priority_arrival_preempts_and_finishes_first_and_low_priority_still_finishes():
    llm = LLM("toy-ouro", workers=0, device="cpu", dtype="float64", exit_mode="fixed",
              scheduling_policy="priority", max_num_seqs=2)
    engine = llm.engine
    for i in range(2):
        engine.add_request(f"low{i}", [1, 2, 3], SamplingParams(max_tokens=12, temperature=0, priority=5,
                                                                ignore_eos=True))
    finished: list[str] = []
    for _ in range(3):
        finished += [o.request_id for o in engine.step() if o.finished]
    engine.add_request("high", [4, 5, 6], SamplingParams(max_tokens=3, temperature=0, priority=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert engine.scheduler.stats.num_preemptions >= 1
    assert finished[0] == "high"
    assert sorted(finished) == ["high", "low0", "low1"]
    llm.close()
