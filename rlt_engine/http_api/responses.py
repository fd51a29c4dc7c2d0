"""OpenAI-shaped JSON for completions and chat completions, whole or as SSE chunks.

Each choice carries rlt's extra fields next to OpenAI's: `token_ids` and `exit_depths` (the loops
each generated token ran), and `seed` (the seed used, drawn by the engine when none was given).
In a stream they hold the chunk's new tokens only.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from protocol.messages import RequestOutput
from rlt_engine.client import GenerateOutput
from rlt_engine.http_api.generation import Generation
from rlt_engine.http_api.schemas import APIError
from rlt_engine.tokenizer import Tokenizer


def usage(prompt_lens: list[int], outputs: list[GenerateOutput]) -> dict[str, Any]:
    """OpenAI's usage object (`cached_tokens`: prompt tokens the prefix cache held)."""
    prompt, completion = sum(prompt_lens), sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}}


def _raise_if_failed(reason: str | None, error: str | None) -> None:
    if reason == "error":
        raise APIError(500, error or "the engine failed this request", kind="internal_error", code="internal")


class Shape:
    """What differs between /v1/completions and /v1/chat/completions: the choice objects."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, want_logprobs: bool, n: int) -> None:
        self.request_id, self.model, self.tokenizer, self.want_logprobs = request_id, model, tokenizer, want_logprobs
        self.created = int(time.time())
        self._offsets = [0] * n  # completions: text_offset of the next token, per choice
        self._started = [False] * n  # chat: whether the choice's first chunk (with the role) went out

    def envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """The fields around the choices."""
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def response(self, outputs: list[GenerateOutput], prompt_lens: list[int]) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        choices = []
        for i, out in enumerate(outputs):
            _raise_if_failed(out.finish_reason, out.error)
            choices.append(self.choice(i, out.text, out.token_ids, out.exit_depths, out.logprobs,
                                       out.finish_reason, out.seed, final=True))
        return self.envelope(self.object_name, choices, usage=usage(prompt_lens, outputs))

    def chunk(self, index: int, delta: RequestOutput, include_usage: bool) -> dict[str, Any]:
        """One SSE chunk for one delta."""
        _raise_if_failed(delta.finish_reason, delta.error)
        choice = self.choice(index, delta.text, delta.token_ids, delta.exit_depths, delta.logprobs,
                             delta.finish_reason if delta.finished else None, delta.seed, final=False)
        return self.envelope(self.chunk_object_name, [choice], **({"usage": None} if include_usage else {}))

    def choice(self, index: int, text: str, token_ids: list[int], exit_depths: list[int], logprobs: list[float],
               finish_reason: str | None, seed: int | None, final: bool) -> dict[str, Any]:
        """One choice object (whole, or the delta of a chunk)."""
        raise NotImplementedError

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text."""
        return [self.tokenizer.decode([t]) for t in token_ids]


class CompletionShape(Shape):
    """text_completion choices: `text`, legacy `logprobs` (tokens, token_logprobs, text_offset)."""

    object_name = chunk_object_name = "text_completion"

    def choice(self, index: int, text: str, token_ids: list[int], exit_depths: list[int], logprobs: list[float],
               finish_reason: str | None, seed: int | None, final: bool) -> dict[str, Any]:
        lp = None
        if self.want_logprobs:
            tokens = self.token_texts(token_ids)
            offsets = []
            for token in tokens:
                offsets.append(self._offsets[index])
                self._offsets[index] += len(token)
            lp = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason,
                "token_ids": token_ids, "exit_depths": exit_depths, "seed": seed}


class ChatShape(Shape):
    """chat.completion choices: `message` (or `delta` in chunks), `logprobs.content`."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def choice(self, index: int, text: str, token_ids: list[int], exit_depths: list[int], logprobs: list[float],
               finish_reason: str | None, seed: int | None, final: bool) -> dict[str, Any]:
        lp = None
        if self.want_logprobs:
            lp = {"content": [{"token": tok, "logprob": value, "bytes": list(tok.encode()), "top_logprobs": []}
                              for tok, value in zip(self.token_texts(token_ids), logprobs, strict=False)]}
        if final:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            key = "message"
        else:
            message = {"content": text}
            if not self._started[index]:
                self._started[index] = True
                message = {"role": "assistant", "content": text}
            key = "delta"
        return {"index": index, key: message, "logprobs": lp, "finish_reason": finish_reason,
                "token_ids": token_ids, "exit_depths": exit_depths, "seed": seed}


def sse_event(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def sse_stream(generation: Generation, shape: Shape, prompt_lens: list[int],
                     include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body: a chunk per delta, the usage chunk if asked, `[DONE]`; an error becomes an event.

    Leaving early (the client disconnected, so the server cancels this) aborts what still runs.
    """
    try:
        try:
            async for index, delta in generation.deltas():
                yield sse_event(shape.chunk(index, delta, include_usage))
            if include_usage:
                outputs = [s.output for s in generation.streams]
                yield sse_event(shape.envelope(shape.chunk_object_name, [], usage=usage(prompt_lens, outputs)))
        except APIError as exc:
            yield sse_event(exc.body())
        yield sse_event("[DONE]")
    finally:
        generation.close()
