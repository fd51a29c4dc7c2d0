"""The output processor: incremental text, stop strings in one place, deltas built once."""

from __future__ import annotations

import pytest
from factories import make_llm

from protocol.messages import SamplingParams
from rlt_engine.output_processor import TextStream
from rlt_engine.tokenizer import ByteTokenizer, load_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


def released(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.add([t], final=False) for t in ids]


def test_text_holds_back_incomplete_utf8_and_flushes_at_the_end():
    data = list("aé€😀b".encode())
    stream = TextStream(ByteTokenizer().decode_stream(), stop=[])
    pieces = released(stream, data)
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) + stream.add([], final=True) == "aé€😀b"
    stream = TextStream(ByteTokenizer().decode_stream(), stop=[])
    assert released(stream, [ord("x"), 0xE2]) == ["x", ""]  # a byte that never completes …
    assert stream.add([], final=True) == "\ufffd"  # … is delivered once the request ends, as decode() would


def test_stop_string_start_waits_and_a_match_cuts_the_text():
    stream = TextStream(ByteTokenizer().decode_stream(), stop=["END"])
    assert "".join(released(stream, list(b"abcEN"))) == "abc"
    assert stream.add([ord("D")], final=False) == "" and stream.stopped
    assert stream.add(list(b"more"), final=True) == ""
    stream = TextStream(ByteTokenizer().decode_stream(), stop=["xyz", "b"])
    assert "".join(released(stream, list(b"aab"))) == "aa" and stream.stopped


def test_hf_decode_stream_equals_whole_decode():
    tokenizer = load_tokenizer("tiny-ouro-py")
    ids = tokenizer.encode("def f(x):\n    return x + 1  # é€😀\n")
    stream = tokenizer.decode_stream()
    assert "".join(stream.step(t) for t in ids) + stream.flush() == tokenizer.decode(ids)


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting every token its decoders are handed (and whole decodes)."""

    def __init__(self) -> None:
        self.tokens_decoded = 0
        self.whole_decodes = 0

    def decode(self, token_ids: list[int]) -> str:
        self.whole_decodes += 1
        return super().decode(token_ids)

    def decode_stream(self):
        inner, outer = super().decode_stream(), self

        class Counting:
            def step(self, token_id: int) -> str:
                outer.tokens_decoded += 1
                return inner.step(token_id)

            def flush(self) -> str:
                return inner.flush()

        return Counting()


def test_each_step_touches_only_new_tokens_and_deltas_add_up():
    """Three requests of 40 tokens, one with a stop string that never matches: the decoders see
    each output token exactly once (a whole-text decode per step would touch ~40²/2 per request),
    and the deltas of every request concatenate to its final cumulative output."""
    counting = CountingTokenizer()
    with make_llm("toy-ouro") as llm:
        engine = llm.engine
        engine.outputs.tokenizer = counting
        for i in range(3):
            stop = ["\x00never\x00"] if i == 0 else []
            engine.add_request(f"r{i}", [10 + i, 20], SamplingParams(max_tokens=40, ignore_eos=True, seed=i, stop=stop))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
    assert counting.whole_decodes == 0
    assert counting.tokens_decoded == 3 * 40
    for i in range(3):
        mine = [o for o in outputs if o.request_id == f"r{i}"]
        final = mine[-1]
        assert final.finished and not any(o.finished for o in mine[:-1])
        assert [o.first_index for o in mine] == list(range(40))
        assert sum((o.new_token_ids for o in mine), []) == final.token_ids
        assert sum((o.new_exit_depths for o in mine), []) == final.exit_depths
        assert "".join(o.new_text for o in mine) == final.text == ByteTokenizer().decode(final.token_ids)


def test_stop_string_ends_the_request_and_is_cut_from_the_text():
    with make_llm("toy-ouro") as llm:
        params = SamplingParams(max_tokens=30, ignore_eos=True, seed=5, temperature=1.0)
        (free,) = llm.generate([[7, 8]], params, use_tqdm=False)
        stop = next(ch for ch in free.text[3:] if ch.isascii() and ch.isprintable())
        (cut,) = llm.generate([[7, 8]], SamplingParams(**{**_fields(params), "stop": [stop]}), use_tqdm=False)
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def test_several_tokens_at_once_stop_where_single_tokens_would():
    """A plan may bring several tokens of a request at once: the stop string is matched token by
    token, so the text, the stopping token and which stop string wins are those of single-token
    steps (here "c" completes before "abcd", whose match would start earlier)."""
    for stops, tokens in ((["END"], b"xyENDzz"), (["abcd", "c"], b"abcdef"), (["zz"], b"abc")):
        single = TextStream(ByteTokenizer().decode_stream(), stop=stops)
        pieces = []
        for token in tokens:
            pieces.append(single.add([token], final=False))
            if single.stopped:
                break
        batched = TextStream(ByteTokenizer().decode_stream(), stop=stops)
        assert batched.add(list(tokens), final=False) == "".join(pieces)
        assert batched.stopped == single.stopped
        assert batched.num_needed == (len(pieces) if single.stopped else 0)


def test_outputs_past_a_stop_string_are_dropped_and_never_delivered():
    """Four outputs arrive in one step and the stop string ends with the third: the request keeps
    three outputs (tokens, exit depths, logprobs), ends with `stop`, and its output says so."""
    with make_llm("toy-ouro") as llm:
        engine = llm.engine
        engine.add_request("r", [7, 8], SamplingParams(max_tokens=8, ignore_eos=True, seed=1, stop=["yz"]))
        request = engine.scheduler._live["r"]
        request.output_token_ids.extend(b"xyzw")
        request.exit_depths.extend([4, 1, 2, 3])
        request.logprobs.extend([-1.0, -2.0, -3.0, -4.0])
        kept = engine.outputs.decode(request)
        assert kept == 3
        engine.scheduler.stop_at(request, kept)
        assert (request.output_token_ids, request.exit_depths, request.logprobs) == (
            list(b"xyz"), [4, 1, 2], [-1.0, -2.0, -3.0])
        out = engine.outputs.output(request)
    assert out.finished and out.finish_reason == "stop"
    assert (out.token_ids, out.new_exit_depths, out.text) == (list(b"xyz"), [4, 1, 2], "x")
