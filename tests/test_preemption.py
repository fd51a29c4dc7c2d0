"""Preemption and resume (swap and depth-faithful recompute), on-demand KV, priorities.

CPU, float64, tiny models: every preempted request must still equal the dense reference.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from rlt_engine import LLM, SamplingParams
from rlt_engine.request import Phase
from rlt_worker.models.loader import load_model
from rlt_worker.models.reference import ReferenceConfig, generate_reference

PLANES = {("toy-ouro", "last_exited"): 4, ("toy-ouro", "shared"): 1,
          ("toy-huginn", "last_exited"): 7, ("toy-huginn", "shared"): 2}
EXIT = {"toy-ouro": ("ouro", 0.5), "toy-huginn": ("latent_diff", 0.3)}
BLOCKS_PER_PLANE = 10  # about two requests' worth: growth must preempt
MAX_NUM_SEQS = 8


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def reference_models():
    return {name: load_model(name, dtype=torch.float64, device="cpu") for name in EXIT}


def make_llm(model: str, layout: str, preemption: str, scheduling: str = "refill", **overrides) -> LLM:
    options = dict(
        workers=0, device="cpu", dtype="float64", exit_mode=EXIT[model][0], kv_layout=layout,
        scheduling=scheduling, kv_growth="on_demand", preemption=preemption, block_size=4,
        num_blocks=BLOCKS_PER_PLANE * PLANES[(model, layout)], max_num_seqs=MAX_NUM_SEQS, prefill_chunk_size=8,
    )
    options.update(overrides)
    return LLM(model, **options)


def workload(model: str, sampled: bool, n: int = 14) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(3)
    prompts, params = [], []
    for i in range(n):
        prompts.append([rng.randrange(256) for _ in range(rng.randint(3, 8))])
        params.append(SamplingParams(max_tokens=rng.randint(12, 20), temperature=1.0 if sampled else 0.0,
                                     seed=7 + i, ignore_eos=True, exit_threshold=EXIT[model][1]))
    return prompts, params


def assert_equal_to_reference(reference_model, llm: LLM, layout: str, prompts, params, outputs) -> None:
    config = ReferenceConfig(max_depth=llm.engine.max_depth, kv_layout=layout, exit_mode=llm.engine.config.exit_mode)
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        ref = generate_reference(reference_model, prompt, p, p.seed, config)
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), out.request_id


def assert_resources_back(llm: LLM) -> None:
    engine = llm.engine
    runner = engine.executor._worker.runner
    assert engine.kv_managers[0].num_free_blocks == engine.kv_managers[0].num_blocks
    assert runner.num_free_slots == MAX_NUM_SEQS
    assert runner.num_swapped == 0
    assert len(engine.rng) == 0


# A pairwise cover of model × layout × preemption × sampling × scheduling (8 configurations).
PAIRWISE = [
    ("toy-ouro", "last_exited", "swap", False, "refill"),
    ("toy-ouro", "shared", "recompute", True, "refill"),
    ("toy-huginn", "last_exited", "recompute", False, "no_refill"),
    ("toy-huginn", "shared", "swap", True, "no_refill"),
    ("toy-ouro", "last_exited", "recompute", True, "no_refill"),
    ("toy-ouro", "shared", "swap", False, "no_refill"),
    ("toy-huginn", "last_exited", "swap", True, "refill"),
    ("toy-huginn", "shared", "recompute", False, "refill"),
]


@pytest.mark.parametrize(("model", "layout", "preemption", "sampled", "scheduling"), PAIRWISE)
def test_preempted_requests_equal_the_reference(reference_models, model, layout, preemption, sampled, scheduling):
    llm = make_llm(model, layout, preemption, scheduling)
    prompts, params = workload(model, sampled)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions >= 10
    assert_equal_to_reference(reference_models[model], llm, layout, prompts, params, outputs)
    assert_resources_back(llm)
    llm.close()


def pages_of(llm: LLM, request, positions: int) -> torch.Tensor:
    """K/V of the request's first `positions` positions, every plane and layer."""
    runner = llm.engine.executor._worker.runner
    slot = runner.slot_of(request.key, request.generation)
    blocks = torch.as_tensor(runner.slot_blocks(slot), dtype=torch.long)
    pool = runner.storage.pool[:, :, blocks]  # [layers, 2, planes, blocks, block_size, H, Dh]
    flat = pool.flatten(3, 4)
    return flat[:, :, :, :positions].clone()


@pytest.mark.parametrize("model", ["toy-ouro", "toy-huginn"])
def test_recompute_reproduces_the_kv_planes_and_the_continuation(reference_models, model):
    layout = "last_exited"
    llm = make_llm(model, layout, "recompute", num_blocks=512, kv_growth="reserve")
    engine = llm.engine
    prompt = [11, 22, 33, 44, 55, 66]
    params = SamplingParams(max_tokens=14, temperature=1.0, seed=5, ignore_eos=True, exit_threshold=EXIT[model][1])
    engine.add_request("victim", prompt, params)
    request = engine.scheduler._live["victim"]
    while not (request.num_outputs >= 6 and request.phase == Phase.LOOP and request.depth == 1):
        engine.step()
    assert len(set(request.exit_depths[1:])) >= 2, "the test wants mixed exit depths before preemption"
    done_positions = request.position  # every earlier position has finished (and finalized)
    before = pages_of(llm, request, done_positions)
    engine.scheduler.preempt(request)
    while not (request.status.value == "running" and request.position == done_positions and request.depth >= 1
               and request.phase == Phase.LOOP):
        engine.step()
    engine.step()  # the replayed prompt and positions are computed by now
    after = pages_of(llm, request, done_positions)
    assert torch.allclose(before, after, rtol=0, atol=1e-12)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    config = ReferenceConfig(max_depth=engine.max_depth, kv_layout=layout, exit_mode=engine.config.exit_mode)
    ref = generate_reference(reference_models[model], prompt, params, params.seed, config)
    assert (outputs[0].token_ids, outputs[0].exit_depths) == (ref.token_ids, ref.exit_depths)
    llm.close()


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_abort_while_preempted_frees_everything_and_the_id_is_reusable(preemption):
    llm = make_llm("toy-ouro", "last_exited", preemption, num_blocks=512, kv_growth="reserve")
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    engine.add_request("r", [1, 2, 3], params)
    for _ in range(4):
        engine.step()
    request = engine.scheduler._live["r"]
    engine.scheduler.preempt(request)
    engine.step()  # the export (swap) or release (recompute) runs
    engine.abort_request("r")
    while engine.step() or engine.has_work_in_flight:
        pass
    assert_resources_back(llm)
    engine.add_request("r", [1, 2, 3], params)
    reused = []
    while engine.has_unfinished_requests():
        reused += [o for o in engine.step() if o.finished]
    fresh = make_llm("toy-ouro", "last_exited", preemption, num_blocks=512, kv_growth="reserve")
    expected = fresh.generate([[1, 2, 3]], params, use_tqdm=False)[0]
    assert reused[0].token_ids == expected.token_ids
    llm.close()
    fresh.close()


def test_high_priority_arrival_preempts_and_finishes_first_and_low_priority_still_finishes():
    llm = LLM("toy-ouro", workers=0, device="cpu", dtype="float64", exit_mode="fixed",
              scheduling_policy="priority", max_num_seqs=2)
    engine = llm.engine
    for i in range(2):
        engine.add_request(f"low{i}", [1, 2, 3],
                           SamplingParams(max_tokens=12, temperature=0, priority=5, ignore_eos=True))
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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "layout", "preemption", "sampled", "scheduling"),
    list(itertools.product(["toy-ouro", "toy-huginn"], ["last_exited", "shared"], ["swap", "recompute"],
                           [False, True], ["refill", "no_refill"])),
)
def test_full_product_equals_the_reference(reference_models, model, layout, preemption, sampled, scheduling):
    test_preempted_requests_equal_the_reference(reference_models, model, layout, preemption, sampled, scheduling)
