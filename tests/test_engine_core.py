"""Engine core (SPEC §3–§5, §7, §8): the engine equals the dense reference across the
configuration matrix, the plans show the depth batching it claims, resources come back, and
bad requests fail alone with a clear error."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from factories import (
    DEPTH,
    MAX_MODEL_LEN,
    MODELS,
    Driver,
    Job,
    all_pairs,
    assert_matches_reference,
    compositions,
    depth_mix,
    make_llm,
    make_params,
    make_prompt,
    make_workload,
    refills,
    run_workload,
)

from protocol.messages import SamplingParams
from rlt_engine import CapacityError, InvalidRequestError

pytestmark = pytest.mark.usefixtures("single_thread")

MATRIX: dict[str, tuple] = {
    "model": MODELS,
    "kv_layout": ("last_exited", "shared"),
    "scheduling": ("refill", "no_refill"),
    "max_num_seqs": (1, 3, 8),
    "prefill_chunk_size": (1, 5, 128),
    "exit_mode": ("fixed", "trace"),
}
PAIRWISE = all_pairs(MATRIX)
FULL_PRODUCT = [dict(zip(MATRIX, values, strict=True)) for values in itertools.product(*MATRIX.values())]


def config_id(config: dict) -> str:
    return "-".join(f"{k}={v}" if isinstance(v, int) else str(v) for k, v in config.items())


def core_workload(model: str, exit_mode: str) -> list[Job]:
    """Eight greedy requests, prompts of 1 … 32 tokens, staggered arrivals; the same for every
    engine configuration of a (model, exit mode), so references are computed once."""
    return make_workload(
        random.Random(f"core-{model}-{exit_mode}"), 8, depth=DEPTH[model], exit_mode=exit_mode, vary_limits=True
    )


def check_against_reference(config: dict) -> None:
    options = dict(config)
    model = options.pop("model")
    with make_llm(model, **options) as llm:
        run = run_workload(llm, core_workload(model, config["exit_mode"]))
        assert_matches_reference(run, model, kv_layout=config["kv_layout"], exit_mode=config["exit_mode"])
        run.assert_resources_returned()


def test_all_pairs_covers_every_pair():
    for a, b in itertools.combinations(MATRIX, 2):
        wanted = set(itertools.product(MATRIX[a], MATRIX[b]))
        assert {(row[a], row[b]) for row in PAIRWISE} == wanted, (a, b)
    assert len(PAIRWISE) <= 12 < len(FULL_PRODUCT)
    assert all_pairs(MATRIX) == PAIRWISE  # deterministic


@pytest.mark.parametrize("config", PAIRWISE, ids=config_id)
def test_engine_matches_reference(config):
    check_against_reference(config)


@pytest.mark.slow
@pytest.mark.parametrize("config", FULL_PRODUCT, ids=config_id)
def test_engine_matches_reference_full_product(config):
    check_against_reference(config)


# ------------------------------------------------------------------------------- batching


@pytest.mark.parametrize("model", MODELS)
def test_plans_show_depth_batching_and_refill(model):
    """From the plans: rows at different depths share a loop batch, an exit's row is refilled
    at once under `refill` (see factories.refills for the precise definition), `no_refill`
    never does so and runs cohorts at one depth, and the two differ on the same workload."""
    depth = DEPTH[model]
    jobs = make_workload(
        random.Random(f"batching-{model}"), 6, depth=depth, exit_mode="trace", max_prompt_len=8, spread=1
    )
    plans = {}
    for scheduling in ("refill", "no_refill"):
        with make_llm(model, exit_mode="trace", scheduling=scheduling, max_num_seqs=4, prefill_chunk_size=4) as llm:
            run = run_workload(llm, jobs)
            assert_matches_reference(run, model, kv_layout="last_exited", exit_mode="trace")
            run.assert_resources_returned()
            plans[scheduling] = run.plans

    mixes = depth_mix(plans["refill"])
    assert len(set().union(*mixes)) >= 3, f"loop depths run: {set().union(*mixes)}"
    assert any(len(mix) >= 2 for mix in mixes), f"no RecurrentBatch mixes depths: {mixes}"
    assert any(len(mix) >= 3 for mix in mixes), f"no RecurrentBatch holds 3 depths: {mixes}"
    assert refills(plans["refill"]), "no exit's row was taken by new work while another row kept looping"

    assert not refills(plans["no_refill"]), refills(plans["no_refill"])
    assert all(len(mix) == 1 for mix in depth_mix(plans["no_refill"])), depth_mix(plans["no_refill"])
    assert compositions(plans["refill"]) != compositions(plans["no_refill"])


# ------------------------------------------------------------------------------- bad requests


D = DEPTH["toy-ouro"]  # the bad-request engine's depth


def greedy(max_tokens: int = 4, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=7, **kw)


@dataclass(frozen=True)
class BadRequest:
    """A request the engine must refuse. `make` builds its (prompt, params) and may itself
    raise (SamplingParams validates at construction); the error message must contain every
    one of `names` (the field or limit at fault and the numbers involved)."""

    exit_mode: str
    make: Callable[[], tuple[list[int], SamplingParams]]
    error: type[Exception]
    names: tuple[str, ...]
    live_id: bool = False  # re-add the id of a live request


BAD_REQUESTS = {
    # 60 + 10 − 1 positions: 5 blocks per plane × D planes = 20 > the engine's 16 blocks
    "never_fits": BadRequest("fixed", lambda: ([7] * 60, greedy(10)), CapacityError, ("KV", "20", "16")),
    "prompt_over_limit": BadRequest(
        "fixed", lambda: ([7] * (MAX_MODEL_LEN + 1), greedy(1)), InvalidRequestError, ("prompt", "513", "512")),
    "prompt_and_outputs_over_limit": BadRequest(
        "fixed", lambda: ([7] * MAX_MODEL_LEN, greedy(2)), InvalidRequestError, ("max_tokens", "513", "512")),
    "empty_prompt": BadRequest("fixed", lambda: ([], greedy()), InvalidRequestError, ("prompt", "empty")),
    "token_outside_vocab": BadRequest("fixed", lambda: ([1, 264], greedy()), InvalidRequestError, ("token", "264")),
    "max_tokens_zero": BadRequest("fixed", lambda: ([1], greedy(0)), ValueError, ("max_tokens", "1")),
    "min_loops_over_max_loops": BadRequest(
        "fixed", lambda: ([1], greedy(min_loops=3, max_loops=2)), ValueError, ("min_loops", "max_loops", "3", "2")),
    "min_loops_over_depth": BadRequest(
        "fixed", lambda: ([1], greedy(min_loops=D + 1)), InvalidRequestError, ("min_loops", "5", "4")),
    "max_loops_over_depth": BadRequest(
        "fixed", lambda: ([1], greedy(max_loops=D + 1)), InvalidRequestError, ("max_loops", "5", "D = 4")),
    "live_id": BadRequest("fixed", lambda: ([1, 2], greedy()), InvalidRequestError, ("req0", "live"), live_id=True),
    "trace_without_depths": BadRequest("trace", lambda: ([1], greedy(2)), InvalidRequestError, ("exit_depths",)),
    "depths_without_trace": BadRequest(
        "fixed", lambda: ([1], greedy(1, exit_depths=[D])), InvalidRequestError, ("exit_depths", "trace")),
    "trace_shorter_than_max_tokens": BadRequest(
        "trace", lambda: ([1], greedy(3, exit_depths=[D, 1])), ValueError, ("exit_depths", "max_tokens", "2", "3")),
    "trace_longer_than_max_tokens": BadRequest(
        "trace", lambda: ([1], greedy(1, exit_depths=[D, 1])), ValueError, ("exit_depths", "max_tokens", "2", "1")),
    "trace_entry_0_not_D": BadRequest(
        "trace", lambda: ([1], greedy(3, exit_depths=[3, 2, 1])), InvalidRequestError, ("exit_depths[0]", "4", "3")),
    "trace_entry_zero": BadRequest(
        "trace", lambda: ([1], greedy(3, exit_depths=[D, 0, 1])), InvalidRequestError, ("exit_depths", "1", "4")),
    "trace_entry_over_D": BadRequest(
        "trace", lambda: ([1], greedy(2, exit_depths=[D, D + 1])), InvalidRequestError, ("exit_depths", "1", "4")),
}


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_fails_alone(case):
    """The bad request raises its own error at once, of the right type and naming the problem;
    requests before and after it complete exactly as the reference (for a live id: its owner
    too); a refused id stays free; resources come back."""
    model = "toy-ouro"
    rng = random.Random(f"bad-{case.names}")
    jobs = make_workload(rng, 4, depth=D, exit_mode=case.exit_mode, max_prompt_len=20, spread=1)
    bad_id = "req0" if case.live_id else "bad"
    errors = []

    def add_bad_request(step: int, driver: Driver) -> None:
        if step != 1:
            return
        if case.live_id:
            assert driver.engine.scheduler.is_live(bad_id), "the live-id case needs req0 still running"
        with pytest.raises(ValueError) as caught:  # every refusal is a ValueError subclass
            driver.engine.add_request(bad_id, *case.make())
        errors.append(caught.value)
        assert driver.engine.scheduler.is_live(bad_id) == case.live_id

    with make_llm(model, exit_mode=case.exit_mode, num_blocks=16, max_num_seqs=3, prefill_chunk_size=5) as llm:
        run = run_workload(llm, jobs, before_step=add_bad_request)
        assert len(errors) == 1
        assert type(errors[0]) is case.error, f"{type(errors[0]).__name__}: {errors[0]}"
        missing = [name for name in case.names if name not in str(errors[0])]
        assert not missing, f"the message {str(errors[0])!r} does not name {missing}"
        assert_matches_reference(run, model, kv_layout="last_exited", exit_mode=case.exit_mode)
        run.assert_resources_returned()
        # The refused id is free now: a good request under it completes normally.
        retry = Job(bad_id, make_prompt(rng, 5), make_params(rng, depth=D, exit_mode=case.exit_mode, max_tokens=3))
        again = run_workload(llm, [retry])
        assert_matches_reference(again, model, kv_layout="last_exited", exit_mode=case.exit_mode)
        again.assert_resources_returned()
