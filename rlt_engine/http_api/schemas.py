"""OpenAI-style request bodies, their mapping to SamplingParams, and OpenAI-style errors (no torch).

Unknown fields are refused (400), as on the IPC path; OpenAI fields rlt does not implement are
accepted only with their neutral value (`n: 1`, `frequency_penalty: 0`, …) so that stock clients
that send them explicitly still work.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from protocol.messages import SamplingParams

Prompt = str | list[int]


class APIError(Exception):
    """An error answered as OpenAI-style JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response (also the payload of an SSE error event)."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# The IPC frontend's refusal codes (RequestError.code) and how HTTP answers them.
RETRY_AFTER_S = 1
_ENGINE_CODES: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "protocol": (400, "invalid_request_error"),
    "overload": (429, "rate_limit_error"),
    "shutting_down": (503, "service_unavailable"),
    "engine_dead": (503, "service_unavailable"),
    "internal": (500, "internal_error"),
}


def engine_error(code: str, message: str) -> APIError:
    """The APIError for an engine refusal; `overload` gets 429 with Retry-After."""
    status, kind = _ENGINE_CODES.get(code, (500, "internal_error"))
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return APIError(status, message, kind=kind, code=code, headers=headers)


# Integers cross the IPC boundary as msgpack ints: anything outside int64 could never be sent.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_int64(name: str, value: int | list[int] | None) -> None:
    """APIError(400) naming `name` when an integer (or any in a list) does not fit in 64 bits."""
    values = value if isinstance(value, list) else [value]
    if any(v is not None and not INT64_MIN <= v <= INT64_MAX for v in values):
        raise APIError(400, f"{name} is out of range (a 64-bit integer)", param=name)


def check_text(name: str, text: str) -> None:
    """APIError(400) naming `name` when `text` is not valid Unicode (a lone surrogate such as \\udc80)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{name} is not valid UTF-8 text: a lone surrogate at index {exc.start}",
                       param=name) from None


def validation_message(exc: ValidationError | Any) -> tuple[str, str | None]:
    """A one-line message and the offending parameter for a pydantic validation error."""
    errors = exc.errors()
    if not errors:
        return str(exc), None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    elif param:
        message = f"{param}: {message}"
    return message, param


class StreamOptions(BaseModel):
    """`stream_options`: only `include_usage` (a final chunk with the usage, `choices: []`)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _GenerationFields(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions (OpenAI names, then rlt's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None  # None: the served model
    temperature: float | None = Field(default=None, ge=0)  # None: 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI fields accepted with their neutral value only.
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # rlt extensions (pass them with the openai client's `extra_body=`).
    top_k: int | None = None
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0

    @field_validator("temperature", "top_p", "exit_threshold", "frequency_penalty", "presence_penalty",
                     mode="before")
    @classmethod
    def _int_is_a_float(cls, value: Any) -> Any:
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    def check_neutral(self) -> None:
        """Refuse OpenAI options rlt does not implement unless they ask for nothing."""
        unsupported = {
            "n": self.n not in (None, 1),
            "frequency_penalty": self.frequency_penalty not in (None, 0.0),
            "presence_penalty": self.presence_penalty not in (None, 0.0),
            "logit_bias": bool(self.logit_bias),
        }
        for name, bad in unsupported.items():
            if bad:
                raise APIError(400, f"{name} is not supported by rlt (only its default value)", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def sampling_params(self, max_tokens: int, logprobs: bool) -> SamplingParams:
        """The SamplingParams this request asks for; APIError(400) when they are invalid."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for text in stop:
            check_text("stop", text)
        for name in ("top_k", "min_loops", "max_loops", "priority", "stop_token_ids"):
            check_int64(name, getattr(self, name))
        check_int64("max_tokens", max_tokens)
        fields: dict[str, Any] = {
            "max_tokens": max_tokens, "stop": stop, "ignore_eos": self.ignore_eos, "logprobs": int(logprobs),
            "priority": self.priority, "stop_token_ids": list(self.stop_token_ids or []), "seed": self.seed,
            "max_loops": self.max_loops, "exit_threshold": self.exit_threshold,
        }
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "min_loops": self.min_loops}
        fields.update({k: v for k, v in optional.items() if v is not None})
        try:
            return SamplingParams(**fields)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from None


class CompletionRequest(_GenerationFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None  # None: 16, as OpenAI's
    logprobs: int | None = None  # 0 or 1: each sampled token's logprob (top alternatives are not computed)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[Prompt]:
        """The prompts of this request (a list of several is a batch: one choice each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "the prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def params(self) -> SamplingParams:
        """Check the OpenAI-only options and build the SamplingParams."""
        self.check_neutral()
        if self.echo or self.best_of not in (None, 1) or self.suffix:
            raise APIError(400, "echo, best_of and suffix are not supported by rlt")
        if self.logprobs is not None and self.logprobs not in (0, 1):
            raise APIError(400, "logprobs must be 0 or 1: rlt returns the sampled token's logprob only",
                           param="logprobs")
        return self.sampling_params(16 if self.max_tokens is None else self.max_tokens, self.logprobs is not None)


class ChatMessage(BaseModel):
    """One chat message; `content` as a string or a list of {"type": "text", "text": …} parts."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's content as plain text (text parts joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


DEFAULT_CHAT_MAX_TOKENS = 256


class ChatCompletionRequest(_GenerationFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def params(self) -> SamplingParams:
        """Check the OpenAI-only options and build the SamplingParams."""
        self.check_neutral()
        if self.top_logprobs not in (None, 0):
            raise APIError(400, "top_logprobs is not supported: rlt returns the sampled token's logprob only",
                           param="top_logprobs")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(DEFAULT_CHAT_MAX_TOKENS if limit is None else limit, self.logprobs)
