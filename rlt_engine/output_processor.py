"""The one output processor: each step's new tokens become deltas, text and stop-string hits.

Every consumer reads the deltas built here: the IPC frontend sends them as they are, `LLM.generate`
keeps the final output, the benchmarks count new tokens. The cost per step is O(new tokens):

    request outputs  [t0 t1 … tk-1 | tk …]      sent = k: only tk … are decoded this step
    text             released pieces | held     held = an incomplete character (inside the
                                                tokenizer's decode stream) + the last
                                                len(stop) − 1 characters, which may begin a stop string

A stop string is searched for only in `held + new text` (an earlier match would have been found
an earlier step), token by token; a hit cuts the text where the stop string starts and ends the
request ("stop") at the token that completed it: outputs after it (a plan may bring several tokens
at once) are dropped by the scheduler before any output is built, so they are never delivered.
The cumulative fields of an output (token_ids, exit_depths, logprobs, text) are prefixes of the
life's append-only lists, built only when read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlt_engine.request import Request
from rlt_engine.tokenizer import TextDecoder, Tokenizer


@dataclass(eq=False)
class _History:
    """A life's append-only outputs, shared by all of its GenerationOutputs (each sees a prefix)."""

    token_ids: list[int]
    exit_depths: list[int]
    logprobs: list[float]
    text_pieces: list[str] = field(default_factory=list)


@dataclass(eq=False)
class GenerationOutput:
    """What one step changed of a request (SPEC §8): the delta, plus the cumulative fields.

    `new_*` hold the outputs first_index … first_index + len(new_token_ids) − 1 and `new_text` the
    text released with them; `token_ids`, `exit_depths`, `logprobs` and `text` are cumulative.
    """

    request_id: str
    prompt_token_ids: list[int]
    first_index: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    new_exit_depths: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    seed: int | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (vLLM's name)
    _history: _History | None = field(default=None, repr=False)
    _num_pieces: int = field(default=0, repr=False)

    @property
    def num_tokens(self) -> int:
        """Outputs delivered up to and including this one."""
        return self.first_index + len(self.new_token_ids)

    def _prefix(self, name: str) -> list:
        if self._history is None:
            return list(getattr(self, f"new_{name}"))
        return getattr(self._history, name)[: self.num_tokens]

    @property
    def token_ids(self) -> list[int]:
        return self._prefix("token_ids")

    @property
    def exit_depths(self) -> list[int]:
        return self._prefix("exit_depths")

    @property
    def logprobs(self) -> list[float]:
        return self._prefix("logprobs")

    @property
    def text(self) -> str:
        """The text released so far (all of it once finished, cut before a stop string)."""
        if self._history is None:
            return self.new_text
        return "".join(self._history.text_pieces[: self._num_pieces])


class TextStream:
    """Incremental text of one request: decode new tokens, hold back what a stop string may claim.

    Tokens are matched one at a time, as if each had arrived in a step of its own, so a plan that
    brings several tokens stops at the same token (and cuts the same text) as single-token steps."""

    def __init__(self, decoder: TextDecoder, stop: list[str]) -> None:
        self._decoder = decoder
        self._stops = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.stopped = False  # a stop string matched: nothing more is released
        self.num_needed = 0  # after a match: how many of the matching add()'s tokens it took

    def add(self, token_ids: list[int], final: bool) -> str:
        """The text that `token_ids` release (all that is held when `final`); a stop string match
        ends the stream after the token that completed it (`num_needed` says which)."""
        if self.stopped:
            return ""
        released = []
        for n, token in enumerate(token_ids, start=1):
            released.append(self._release(self._held + self._decoder.step(token), n, final=False))
            if self.stopped:
                return "".join(released)
        if final:
            released.append(self._release(self._held + self._decoder.flush(), len(token_ids), final=True))
        return "".join(released)

    def _release(self, window: str, num_tokens: int, final: bool) -> str:
        """What `window` (held text + new text) releases; a stop string in it ends the stream."""
        hits = [i for i in (window.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped, self._held, self.num_needed = True, "", num_tokens
            return window[: min(hits)]
        keep = 0 if final else min(self._hold, len(window))
        self._held = window[len(window) - keep :]
        return window[: len(window) - keep]


@dataclass(eq=False)
class _Tracked:
    text: TextStream
    history: _History
    decoded: int = 0  # outputs fed to the text stream
    sent: int = 0  # outputs delivered in a GenerationOutput
    seed: int | None = None  # reported in every output (the RngRegistry drops it when the life ends)
    unsent_text: str = ""  # text released since the last GenerationOutput
    flushed: bool = False


class OutputProcessor:
    """Turns requests whose outputs changed into GenerationOutputs; owns each live life's text state."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._tracked: dict[int, _Tracked] = {}  # request key → state, while the life is live

    def __len__(self) -> int:
        return len(self._tracked)

    def track(self, request: Request, seed: int) -> None:
        """Start the text state of a new life (its seed is reported with each of its outputs)."""
        history = _History(request.output_token_ids, request.exit_depths, request.logprobs)
        text = TextStream(self.tokenizer.decode_stream(), request.params.stop)
        self._tracked[request.key] = _Tracked(text, history, seed=seed)

    def _state(self, request: Request) -> _Tracked:
        return self._tracked[request.key]

    def holds_first_output(self, request: Request) -> bool:
        """Whether the request has outputs and none of them was delivered yet (its first token is due)."""
        state = self._tracked.get(request.key)
        return state is not None and state.sent == 0 and request.num_outputs > 0

    def decode(self, request: Request) -> int | None:
        """Decode the request's outputs not decoded yet (flushing once it has finished). When a stop
        string matches in them: the number of outputs that stay, up to and including the token that
        completed the match (the request ends there; the caller tells the scheduler); else None."""
        state = self._state(request)
        final = request.is_finished and not state.flushed
        if state.decoded >= request.num_outputs and not final:
            return None
        stopped_before = state.text.stopped
        new = request.output_token_ids[state.decoded :]
        state.unsent_text += state.text.add(new, final)
        state.flushed = state.flushed or final
        if state.text.stopped and not stopped_before:
            state.decoded += state.text.num_needed
            return state.decoded
        state.decoded = request.num_outputs
        return None

    def output(self, request: Request) -> GenerationOutput:
        """The delta since the request's previous output (its final one once it has finished)."""
        self.decode(request)
        state = self._state(request)
        start, end = state.sent, request.num_outputs
        history = state.history
        if state.unsent_text:
            history.text_pieces.append(state.unsent_text)
        out = GenerationOutput(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids, first_index=start,
            new_token_ids=request.output_token_ids[start:end], new_exit_depths=request.exit_depths[start:end],
            new_logprobs=request.logprobs[start:end], new_text=state.unsent_text, finished=request.is_finished,
            finish_reason=request.finish_reason, seed=state.seed,
            num_cached_tokens=max(request.num_cached_tokens, 0), _history=history,
            _num_pieces=len(history.text_pieces),
        )
        state.sent, state.unsent_text = end, ""
        if request.is_finished:
            del self._tracked[request.key]
        return out
