"""The OpenAI-compatible HTTP app: a FastAPI client of rlt-serve's IPC frontend (no torch).

Routes: POST /v1/completions, POST /v1/chat/completions (checkpoints with a chat template),
GET /v1/models, GET /health (503 until the engine answers with a live worker, and while it
drains), GET /metrics (Prometheus). Every error is OpenAI-style JSON.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocol.messages import HealthReport, SamplingParams
from rlt_engine.client import AsyncClient, RequestError
from rlt_engine.errors import EngineDeadError
from rlt_engine.http_api.chat import ChatTemplateError, load_chat_template
from rlt_engine.http_api.generation import Generation
from rlt_engine.http_api.metrics import Metrics
from rlt_engine.http_api.responses import ChatShape, CompletionShape, Shape, sse_stream
from rlt_engine.http_api.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Prompt,
    StreamOptions,
    check_int64,
    check_text,
    validation_message,
)
from rlt_engine.tokenizer import load_tokenizer

MAX_BODY_BYTES = 4 * 1024 * 1024  # the IPC frame limit: a larger body could never be sent on
HEALTH_TIMEOUT_S = 1.0
log = logging.getLogger("rlt.http")
T = TypeVar("T")


@dataclass(frozen=True)
class HttpSettings:
    """What the HTTP app serves: the engine's IPC address and the model it runs."""

    engine_address: str
    model: str
    max_body_bytes: int = MAX_BODY_BYTES
    health_timeout: float = HEALTH_TIMEOUT_S


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


class Server:
    """State shared by the routes: the IPC client, tokenizer, chat template and metrics."""

    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings
        self.model_name = settings.model
        self.tokenizer = load_tokenizer(settings.model)
        self.chat_template = load_chat_template(settings.model)
        self.metrics = Metrics()
        self.created = int(time.time())
        self.client: AsyncClient | None = None

    def engine(self) -> AsyncClient:
        """The IPC client (created in the app's lifespan, inside the event loop)."""
        if self.client is None:
            raise APIError(503, "the server is starting", kind="service_unavailable")
        return self.client

    async def health(self) -> HealthReport | None:
        """The engine's HealthReport, or None when it does not answer in time; refreshes the metrics."""
        report = None
        try:
            report = await asyncio.wait_for(self.engine().health(), self.settings.health_timeout)
        except (TimeoutError, EngineDeadError, RequestError, APIError):
            pass
        self.metrics.engine.update(report)
        return report

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is the served one (or omitted)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server runs `{self.model_name}`",
                           code="model_not_found", param="model")

    def token_ids(self, prompt: Prompt) -> list[int]:
        """A prompt as token ids (text is tokenized here, so that usage counts it)."""
        if isinstance(prompt, list):
            check_int64("prompt", prompt)
            return prompt
        check_text("prompt", prompt)
        try:
            return self.tokenizer.encode(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from None

    async def run(self, request: Request, prompts: list[list[int]], params: SamplingParams, shape: Shape,
                  stream: bool, stream_options: StreamOptions | None) -> Response:
        """Generate for `prompts` and answer whole or as an SSE stream; aborts if the client leaves."""
        generation = Generation(self.engine(), self.metrics, shape.request_id)
        prompt_lens = [len(p) for p in prompts]
        handed_over = False  # the SSE body owns the generation (its `finally` closes it)
        try:
            await until_disconnected(request, generation.start(prompts, params))
            if stream:
                include_usage = bool(stream_options and stream_options.include_usage)
                body = sse_stream(generation, shape, prompt_lens, include_usage)
                handed_over = True
                return StreamingResponse(body, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            outputs = await until_disconnected(request, generation.collect())
            return JSONResponse(shape.response(outputs, prompt_lens))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        finally:
            if not handed_over:
                generation.close()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (ClientGone) if the HTTP client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, APIError):
            pass
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes` (by Content-Length, or as it streams in)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[], None]) -> None:
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            self.on_reject()
            error = APIError(413, self._message(), code="request_too_large")
            return await JSONResponse(error.body(), status_code=413)(scope, receive, send)
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"the request body exceeds {self.max_bytes} bytes"


def build_app(settings: HttpSettings) -> FastAPI:
    """The FastAPI app for one engine."""
    server = Server(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        server.client = AsyncClient(settings.engine_address)
        yield
        await server.client.close()

    app = FastAPI(title="rlt", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes,  # type: ignore[arg-type]
                       on_reject=lambda: server.metrics.rejected.labels("413").inc())

    def error_response(error: APIError) -> JSONResponse:
        server.metrics.rejected.labels(str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(APIError(500, f"{type(exc).__name__}: {exc}", kind="internal_error", code="internal"))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail), kind=kind, code=code))

    @app.get("/health")
    async def health() -> JSONResponse:
        report = await server.health()
        if report is None:
            return JSONResponse({"status": "unavailable", "detail": "the engine does not answer (starting or gone)"},
                                status_code=503)
        alive = sum(w.alive for w in report.workers)
        status = "draining" if report.draining else "ok" if alive else "no_workers"
        return JSONResponse({"status": status, "workers_alive": alive, "running": report.running,
                             "waiting": report.waiting}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        await server.health()
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "rlt", "has_chat_template": server.chat_template is not None}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        params = body.params()
        prompts = [server.token_ids(p) for p in body.prompts()]
        shape = CompletionShape(f"cmpl-{uuid.uuid4().hex}", server.model_name, server.tokenizer,
                                body.logprobs is not None, len(prompts))
        return await server.run(request, prompts, params, shape, body.stream, body.stream_options)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        template = server.chat_template
        if template is None:
            raise APIError(400, f"the model `{server.model_name}` has no chat template (its checkpoint ships no "
                           "chat_template); use /v1/completions with a prompt instead", code="no_chat_template")
        params = body.params()
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
        for message in messages:
            check_text("messages", message["content"])
        try:
            text = template.render(messages, body.add_generation_prompt, **(body.chat_template_kwargs or {}))
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        shape = ChatShape(f"chatcmpl-{uuid.uuid4().hex}", server.model_name, server.tokenizer, body.logprobs, 1)
        return await server.run(request, [server.token_ids(text)], params, shape, body.stream, body.stream_options)

    return app
