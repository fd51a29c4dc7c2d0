"""Request lives at the engine's edges (SPEC §6, §7): an abort ends a life at once and for good,
and a failed step leaves the engine's books and the worker's slot table in step."""

from __future__ import annotations

import pytest
from factories import make_llm, resources

from protocol.messages import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

LONG = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=1)


def drain(engine, max_steps: int = 500) -> list:
    """Step until nothing is live or in flight; every output on the way."""
    outputs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests() and not engine.has_work_in_flight:
            outputs += engine.step()  # the last releases
            return outputs
        outputs += engine.step()
    raise AssertionError("the engine did not drain")


def test_abort_returns_the_final_output_and_a_reused_id_sees_only_its_new_life():
    """The issue's reproduction: abort "x" mid-generation, add "x" again at once. abort_request
    answers with the old life's final output; every later step() output of "x" belongs to the new
    life, which equals a fresh engine's run; resources come back."""
    with make_llm("toy-ouro") as llm:
        engine = llm.engine
        before = resources(engine)
        engine.add_request("x", [5, 6, 7], LONG)
        delivered: list[int] = []
        while len(delivered) < 2:
            delivered = next((o.token_ids for o in engine.step() if o.request_id == "x"), delivered)
        final = engine.abort_request("x")
        assert final is not None and final.finished and final.finish_reason == "abort"
        assert final.token_ids == delivered and final.request_id == "x"
        assert engine.abort_request("x") is None  # no longer live
        new_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, seed=2)
        engine.add_request("x", [1, 2], new_params)
        stream = [o for o in drain(engine) if o.request_id == "x"]
        assert all(o.finish_reason != "abort" for o in stream), stream
        assert [len(o.token_ids) for o in stream] == [1, 2, 3, 4], [o.token_ids for o in stream]
        assert stream[-1].finished and stream[-1].finish_reason == "length"
        assert resources(engine) == before
    with make_llm("toy-ouro") as fresh:
        want = fresh.generate([[1, 2]], new_params, use_tqdm=False)[0]
    assert (stream[-1].token_ids, stream[-1].exit_depths) == (want.token_ids, want.exit_depths)


def test_abort_of_a_waiting_request_returns_an_empty_final_output():
    with make_llm("toy-ouro") as llm:
        engine = llm.engine
        engine.add_request("w", [1], LONG)
        final = engine.abort_request("w")
        assert final is not None and final.token_ids == [] and final.finish_reason == "abort"
        assert drain(engine) == []
