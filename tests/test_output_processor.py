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
