"""The dense reference: SPEC §4's worked example, full-depth parity, exit rules, state init."""

from __future__ import annotations

import pytest
import torch

from protocol.messages import SamplingParams
from rlt_worker.models.base import LayerId
from rlt_worker.models.loader import load_model
from rlt_worker.models.reference import ReferenceConfig, generate_reference, prompt_logits

PROMPT = [72, 101, 108, 108, 111, 44, 32, 108, 111, 111, 112]


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def ouro():
    return load_model("toy-ouro", dtype=torch.float64, device="cpu")


@pytest.fixture(scope="module")
def huginn():
    return load_model("toy-huginn", dtype=torch.float64, device="cpu")


# SPEC §4 worked example: D = 3; p0, p1 prompt (e = 3); p2 exited after loop 1; p3 computed.
SPEC_TABLE = {
    "last_exited": {
        (1, 1): [(0, 1), (1, 1)],
        (1, 2): [(0, 2), (1, 2)],
        (3, 1): [(0, 1), (1, 1), (2, 1), (3, 1)],
        (3, 2): [(0, 2), (1, 2), (2, 1), (3, 2)],
        (3, 3): [(0, 3), (1, 3), (2, 1), (3, 3)],
    },
    "shared": {
        (1, 1): [(0, 3), (1, 1)],
        (1, 2): [(0, 3), (1, 2)],
        (3, 1): [(0, 3), (1, 3), (2, 1), (3, 1)],
        (3, 2): [(0, 3), (1, 3), (2, 1), (3, 2)],
        (3, 3): [(0, 3), (1, 3), (2, 1), (3, 3)],
    },
}


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_reads_reproduce_the_spec_table(ouro, layout):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, exit_depths=[3, 1, 3])
    config = ReferenceConfig(max_depth=3, kv_layout=layout, exit_mode="trace")
    result = generate_reference(ouro, [5, 6], params, seed=0, config=config, record_reads=True)
    assert result.exit_depths == [3, 1, 3]
    for query, expected in SPEC_TABLE[layout].items():
        assert result.reads[query] == expected, (layout, query)


class CausalSameLoopContext:
    """A plain forward: all positions at once, each loop attending to the same loop, causal."""

    def attend(self, layer: LayerId, q, k, v):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return out.transpose(0, 1)


def plain_forward_logits(model, prompt: list[int], depth: int) -> torch.Tensor:
    ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    ctx = CausalSameLoopContext()
    embedded = model.embed(ids, positions, ctx)
    state = model.init_state(embedded, None)
    for _ in range(depth):
        state = model.loop(state, embedded, positions, ctx)
    return model.lm_head(model.coda(state, positions, ctx))[-1:]


@pytest.mark.parametrize("name", ["ouro", "huginn"])
def test_full_depth_last_exited_is_the_plain_forward_and_shared_is_not(name, request):
    model = request.getfixturevalue(name)
    depth = model.info.default_depth
    expected = plain_forward_logits(model, PROMPT, depth)
    last_exited = prompt_logits(model, PROMPT, 0, ReferenceConfig(depth, "last_exited", state_init="zero"))
    shared = prompt_logits(model, PROMPT, 0, ReferenceConfig(depth, "shared", state_init="zero"))
    assert (last_exited - expected).abs().max() < 1e-9
    assert (shared - expected).abs().max() > 1e-6


@pytest.mark.parametrize(("mode", "expected_depth"), [("ouro", 2), ("ouro_delayed", 3)])
def test_spec_exit_example(ouro, monkeypatch, mode, expected_depth):
    """λ = 0.4 every loop, threshold 0.6, min_loops 2 → exit after loop 2 (delayed: 3)."""
    monkeypatch.setattr(ouro, "exit_gate", lambda state: torch.full(state.shape[:1], 0.4, dtype=torch.float64))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, exit_threshold=0.6, min_loops=2)
    result = generate_reference(ouro, PROMPT, params, 0, ReferenceConfig(4, exit_mode=mode))
    assert result.exit_depths == [4] + [expected_depth] * 3


def test_trace_is_followed_and_exit_depths_index_outputs(ouro):
    trace = [4, 1, 3, 2, 4, 1]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, exit_depths=trace)
    result = generate_reference(ouro, PROMPT, params, 0, ReferenceConfig(4, exit_mode="trace"), record_reads=True)
    assert result.exit_depths == trace
    # exit_depths[i] is the depth of the position that produced output i: output 0 from the
    # last prompt position (P−1), output i from position P−1+i.
    last_prompt = len(PROMPT) - 1
    for i, depth in enumerate(trace):
        position = last_prompt + i
        assert max(loop for (t, loop) in result.reads if t == position) == depth


def test_huginn_zero_init_is_deterministic_and_random_init_follows_the_seed(huginn):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    zero = ReferenceConfig(6, state_init="zero")
    assert generate_reference(huginn, PROMPT, params, 1, zero).token_ids == \
        generate_reference(huginn, PROMPT, params, 2, zero).token_ids
    random = ReferenceConfig(6, state_init="random")
    first = generate_reference(huginn, PROMPT, params, 1, random)
    again = generate_reference(huginn, PROMPT, params, 1, random)
    other = generate_reference(huginn, PROMPT, params, 2, random)
    assert first.token_ids == again.token_ids
    assert first.logprobs != other.logprobs
