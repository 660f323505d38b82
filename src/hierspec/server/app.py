"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health and metrics.

Every error — malformed JSON or text, schema violations, unsupported parameters, unknown model or path, over-long
prompts, an over-large body, a full queue, a missing API key — is answered with OpenAI's error JSON (``{"error":
{"message", "type", "param", "code"}}``) and a 4xx status, never a stack trace. Prompts are tokenized in a worker
thread, so a large one never stalls the event loop (``/health`` keeps answering).
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from hierspec.decode import GenerationResult
from hierspec.errors import InputError
from hierspec.server.engine import Engine, Job, QueueFull, RequestTimeout
from hierspec.server.metrics import ServerMetrics
from hierspec.server.schemas import ChatCompletionRequest, CompletionRequest
from hierspec.target import TargetModel


@dataclass(frozen=True)
class ServerConfig:
    """Server settings.

    Attributes:
        model_name: the id clients send as ``model`` (and ``/v1/models`` lists).
        api_key: when set, requests need ``Authorization: Bearer <api_key>``.
        max_queue: requests that may wait while one generates; more get 429.
        timeout_s: per-request deadline, queueing included.
        default_max_tokens: ``max_tokens`` when a request gives none.
        max_body_bytes: larger request bodies are refused with 413 before they are read in full.
        max_batch: requests generating together, verified in one forward per step (continuous batching).
        max_rows: draft-tree rows of one forward, all batched requests together.
    """

    model_name: str
    api_key: str | None = None
    max_queue: int = 64
    timeout_s: float = 300.0
    default_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    max_batch: int = 8
    max_rows: int = 64


#: the paths the server answers; metrics label every other path "other", so made-up paths add no series
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})


class ApiError(Exception):
    """An error answered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code}})


_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def create_app(target: TargetModel, engine: Engine, config: ServerConfig, metrics: ServerMetrics) -> FastAPI:
    """The FastAPI application serving ``target`` through ``engine``."""
    app = FastAPI(title="hierspec", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), kind=kind, code=code).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        return ApiError(400, message, param=where or None).response()

    @app.middleware("http")
    async def _auth_and_count(request: Request, call_next):
        start = time.perf_counter()
        if config.api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                response = ApiError(401, "invalid or missing API key", code="invalid_api_key").response()
                metrics.observe_request(_route_label(request.url.path), 401, time.perf_counter() - start)
                return response
        response = await call_next(request)
        metrics.observe_request(_route_label(request.url.path), response.status_code, time.perf_counter() - start)
        return response

    @app.get("/health")
    async def health():
        problems = engine.drafter.problems()
        return {"status": "degraded" if problems else "ok", "problems": problems, "model": config.model_name,
                "queue_length": engine.queue_length, "busy": engine.busy,
                "running": engine.running}

    @app.get("/metrics")
    async def prometheus_metrics():
        metrics.queue_length.set(engine.queue_length)
        metrics.degraded.set(len(engine.drafter.problems()))
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": 0, "owned_by": "hierspec"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, config)
        gen = _generation_config(body, config)
        prompt_ids = await _encode(lambda: target.encode_prompt(body.prompt_text(), raw=True), gen.max_new_tokens,
                                   target)
        job = _submit(engine, prompt_ids, gen)
        return await _respond(job, request, body.stream, _include_usage(body), len(prompt_ids), "completion",
                              config.model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, config)
        gen = _generation_config(body, config)
        prompt_ids = await _encode(lambda: target.encode_messages(body.chat_messages()), gen.max_new_tokens, target)
        job = _submit(engine, prompt_ids, gen)
        return await _respond(job, request, body.stream, _include_usage(body), len(prompt_ids), "chat",
                              config.model_name)

    return app


def _check_model(name: str, config: ServerConfig) -> None:
    if name != config.model_name:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {config.model_name!r}",
                       param="model", code="model_not_found")


def _generation_config(body, config: ServerConfig):
    try:
        return body.generation_config(config.default_max_tokens)
    except InputError as exc:
        raise ApiError(400, str(exc)) from None


def _route_label(path: str) -> str:
    return path if path in ROUTES else "other"


async def _encode(encode, max_tokens: int, target: TargetModel) -> list[int]:
    try:
        ids = await run_in_threadpool(encode)
    except InputError as exc:
        raise ApiError(400, str(exc), param="prompt") from None
    if len(ids) + max_tokens > target.max_context:
        raise ApiError(400, f"this model's maximum context length is {target.max_context} tokens; the prompt has "
                            f"{len(ids)} and max_tokens asks for {max_tokens}", param="max_tokens",
                       code="context_length_exceeded")
    return ids


class BodyLimit:
    """ASGI middleware refusing request bodies over ``max_bytes`` with 413: at once when ``Content-Length`` says so,
    else as soon as the streamed body passes the limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await ApiError(413, self._message(), code="request_too_large").response()(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # FastAPI passes HTTPExceptions from body reading through
                    raise StarletteHTTPException(413, self._message())
            return message

        return await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"the request body exceeds this server's limit of {self.max_bytes} bytes (--max-body-bytes)"


def _submit(engine: Engine, prompt_ids: list[int], gen) -> Job:
    try:
        return engine.submit(prompt_ids, gen)
    except QueueFull as exc:
        raise ApiError(429, str(exc), kind="rate_limit_error", code="queue_full") from None


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _usage(prompt_tokens: int, result: GenerationResult) -> dict:
    completion = len(result.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _acceptance(result: GenerationResult) -> dict:
    """This request's own speculation figures (an extension field; OpenAI clients ignore it)."""
    stats = result.stats
    return {"mean_accepted_tokens": round(stats.mean_accepted, 4), "target_forwards": stats.target_forwards,
            "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_drafts}


async def _respond(job: Job, request: Request, stream: bool, include_usage: bool, prompt_tokens: int, kind: str,
                   model_name: str):
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    if stream:
        return StreamingResponse(_sse(job, request, include_usage, prompt_tokens, kind, request_id, created,
                                      model_name), media_type="text/event-stream")
    try:
        text, result = await _collect(job)
    finally:
        job.cancel()  # no-op when finished; stops the work if this handler was cancelled (client gone)
    finish = _FINISH[result.finish_reason]
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model_name, "choices": [choice],
            "usage": _usage(prompt_tokens, result), "hierspec": _acceptance(result)}


async def _collect(job: Job) -> tuple[str, GenerationResult]:
    parts: list[str] = []
    async for item in job.items():
        if isinstance(item, str):
            parts.append(item)
        elif isinstance(item, GenerationResult):
            return item.text, item
        else:
            raise _as_api_error(item)
    raise ApiError(500, "the generation ended without a result", kind="server_error")


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, RequestTimeout):
        return ApiError(504, str(exc), kind="timeout_error", code="timeout")
    if isinstance(exc, InputError):
        return ApiError(400, str(exc))
    return ApiError(500, "the generation failed; see the server log", kind="server_error")


async def _sse(job: Job, request: Request, include_usage: bool, prompt_tokens: int, kind: str, request_id: str,
               created: int, model_name: str) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(delta: str | None, finish: str | None, role: bool = False) -> str:
        if kind == "chat":
            content = ({"role": "assistant", "content": ""} if role else {}) | (
                {"content": delta} if delta is not None else {})
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        payload = {"id": request_id, "object": obj, "created": created, "model": model_name, "choices": [choice]}
        return f"data: {json.dumps(payload)}\n\n"

    try:
        if kind == "chat":
            yield chunk(None, None, role=True)
        async for item in job.items():
            if isinstance(item, str):
                yield chunk(item, None)
            elif isinstance(item, GenerationResult):
                yield chunk(None, _FINISH[item.finish_reason])
                if include_usage:
                    usage = {"id": request_id, "object": obj, "created": created, "model": model_name,
                             "choices": [], "usage": _usage(prompt_tokens, item), "hierspec": _acceptance(item)}
                    yield f"data: {json.dumps(usage)}\n\n"
            else:
                error = _as_api_error(item)
                yield f"data: {json.dumps({'error': {'message': error.message, 'type': error.kind}})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # the client disconnected (or the stream ended): free the worker
