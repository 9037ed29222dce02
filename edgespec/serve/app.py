"""The OpenAI-compatible HTTP API (Starlette): /v1/chat/completions, /v1/models, /health, /metrics.

Requests are validated here and answered by the session pool (worker.py). Errors use OpenAI's
shape, {"error": {"message", "type", "param", "code"}}, so SDKs raise their usual exceptions:
400 invalid_request_error (bad JSON, bad fields, a prompt that does not fit), 401 (api key),
404 (unknown model or path), 429 (queue full), 503 (models loading, verifier unavailable),
500 (anything else). A failed request never takes the daemon down.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import queue
import time
import uuid
from typing import Any, AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgespec.common.constraints import Grammar
from edgespec.common.errors import (
    ContextOverflowError,
    InvalidRequestError,
    SessionClosedError,
    VerifierUnavailableError,
)
from edgespec.serve.metrics import EdgeMetrics
from edgespec.serve.worker import Job, Outcome, Params, SessionWorker

log = logging.getLogger("edgespec.serve")

ROLES = ("system", "user", "assistant", "developer", "tool")
UNSUPPORTED = ("tools", "functions", "tool_choice", "function_call", "logprobs", "audio", "prediction", "logit_bias")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_for(exc: BaseException) -> APIError:
    """The HTTP answer for an exception raised while answering."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return APIError(400, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if type(exc).__name__ == "PrivacyError":   # strict PII masking refused to send the request
        return APIError(400, str(exc), code="pii_refused", param="messages")
    if isinstance(exc, VerifierUnavailableError):
        return APIError(503, f"verifier unavailable: {exc}", "server_error", code="verifier_unavailable")
    if isinstance(exc, SessionClosedError):
        return APIError(503, "the daemon is shutting down", "server_error", code="shutting_down")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


class Service:
    """State shared by the routes: the session pool, the queue, the metrics, readiness."""

    def __init__(self, cfg: Any, metrics: EdgeMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or EdgeMetrics()
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.workers: list[SessionWorker] = []
        self.pending = 0                 # queued + running (touched on the event loop only)
        self.ready = False
        self.load_error: str | None = None
        self.started = time.time()

    # -- pool -----------------------------------------------------------------------------------
    def add_session(self, session: Any) -> None:
        worker = SessionWorker(len(self.workers), session, self.jobs, self._start, self._done)
        self.workers.append(worker)
        worker.start()

    def _start(self, job: Job) -> None:
        """Session thread: a job left the queue."""
        self.metrics.queue_depth.dec()
        self.metrics.in_flight.inc()
        self.metrics.queue_seconds.observe(time.monotonic() - job.enqueued)

    def _done(self, index: int, job: Job, outcome: Outcome | None, exc: BaseException | None) -> None:
        """Session thread: the job is over and its session free (whatever happened to the client)."""
        m = self.metrics
        m.in_flight.dec()
        if outcome is not None:
            m.requests.labels("ok").inc()
            m.observe_request(outcome.stats, outcome.prompt_tokens, session=index)
        elif exc is not None:
            m.requests.labels("client_error" if error_for(exc).status < 500 else "error").inc()
        else:
            m.requests.labels("abandoned").inc()
        job.release()

    def stalled(self) -> str | None:
        """What is wrong, for /health and the systemd watchdog; None when healthy."""
        if self.load_error:
            return self.load_error
        limit = self.cfg.get("serve.hang_timeout_s")
        for w in self.workers:
            stalled = w.heartbeat.stalled_for()
            if stalled > limit:
                return f"session {w.index}: no progress for {stalled:.0f} s (serve.hang_timeout_s = {limit:g})"
            if not w.thread.is_alive():
                return f"session {w.index}: its thread died"
        return None

    def close(self) -> None:
        for _ in self.workers:
            self.jobs.put(None)
        for w in self.workers:
            w.thread.join(timeout=10)
            try:
                w.session.close()
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                log.warning("closing session %d: %s", w.index, exc)

    # -- requests -------------------------------------------------------------------------------
    def submit(self, messages: list[dict[str, str]], params: Params) -> Job:
        if not self.ready:
            raise APIError(503, self.load_error or "the models are still loading; retry shortly", "server_error",
                           code="loading")
        limit = len(self.workers) + self.cfg.get("serve.max_queue")
        if self.pending >= limit:
            raise APIError(429, f"{self.pending} requests are already queued or running (serve.sessions + "
                           f"serve.max_queue = {limit}); retry later", "rate_limit_error", code="queue_full")
        loop = asyncio.get_running_loop()
        job = Job(messages, params, loop)
        self.pending += 1
        job.on_release = lambda: loop.call_soon_threadsafe(self._finished)
        self.metrics.queue_depth.inc()
        self.jobs.put(job)
        return job

    def _finished(self) -> None:
        self.pending -= 1


def _number(body: dict, name: str, low: float, high: float, default: float, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise APIError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}",
                       param=name, code="invalid_type")
    if not (low <= value <= high) or not math.isfinite(value):
        raise APIError(400, f"'{name}' must be between {low:g} and {high:g}, got {value!r}", param=name,
                       code="invalid_value")
    return value


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):   # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", param=f"messages[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content", code="invalid_type")


def parse_chat(body: Any, cfg: Any) -> tuple[list[dict[str, str]], Params, bool, bool]:
    """(messages, params, stream, include_usage) from a request body, or APIError naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required", param="model", code="missing_required_parameter")
    if model != cfg.get("serve.model_name"):
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{cfg.get('serve.model_name')}'",
                       param="model", code="model_not_found")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "'messages' must be a non-empty list", param="messages", code="invalid_type")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}",
                           param=f"messages[{i}].role", code="invalid_value")
        messages.append({"role": "system" if role == "developer" else role, "content": _content(m, i)})
    if not any(m["content"].strip() for m in messages):
        raise APIError(400, "the prompt is empty", param="messages", code="invalid_value")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], False):
            raise APIError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    _number(body, "n", 1, 1, 1, integer=True)   # one choice per request
    limit = cfg.get("serve.max_tokens_limit")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number({name: max_tokens}, name, 1, limit, cfg.get("serve.max_tokens"), integer=True)
    temperature = _number(body, "temperature", 0, 2, 0.0)
    top_p = _number(body, "top_p", 0, 1, 1.0)
    if top_p == 0:   # greedy ignores it; sampling needs some probability mass
        if temperature > 0:
            raise APIError(400, "'top_p' must be > 0 when sampling", param="top_p", code="invalid_value")
        top_p = 1.0
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise APIError(400, f"'seed' must be an integer, got {seed!r}", param="seed", code="invalid_type")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise APIError(400, "'stop' must be a string or a list of at most 4 strings", param="stop",
                       code="invalid_value")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be a boolean, got {stream!r}", param="stream", code="invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    response_format = body.get("response_format")
    if response_format is not None:   # refused here, with its reason, rather than in the session thread
        try:
            response_format = Grammar.from_response_format(response_format)   # chat() uses it as built
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="response_format", code="invalid_value") from None
    params = Params(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                    seed=seed if seed is None else seed % 2**63, stop=stops, response_format=response_format)
    return messages, params, stream, bool(options.get("include_usage"))


def _usage(outcome: Outcome) -> dict:
    s = outcome.stats
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            # not OpenAI's, ignored by its SDKs: what the speculation did for this answer
            "edgespec": {"target_steps": s.steps, "tau": round(s.tau, 3), "acceptance": round(s.acceptance_rate, 3),
                         "tokens_per_second": round(s.tokens_per_second, 2)}}


def build_app(service: Service) -> Starlette:
    cfg = service.cfg

    def check_key(request: Request) -> None:
        key = cfg.get("serve.api_key")
        if key and request.headers.get("authorization", "") != f"Bearer {key}":
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error",
                           code="invalid_api_key")

    async def chat(request: Request) -> Response:
        try:
            check_key(request)
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise APIError(400, f"the request body is not valid JSON: {exc}") from None
            messages, params, stream, include_usage = parse_chat(body, cfg)
            job = service.submit(messages, params)
        except APIError as exc:
            service.metrics.requests.labels("client_error" if exc.status < 500 else "refused").inc()
            return exc.response()
        # The queue and metrics bookkeeping is the session thread's (Service._start/_done): it runs
        # once per job whatever the client does, so a client that vanishes leaks nothing.
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), cfg.get("serve.model_name")
        try:
            kind, value = await job.events.get()       # the first event: waits for a session
            if kind == "error":
                return error_for(value).response()
            if stream:
                return StreamingResponse(_sse(job, (kind, value), rid, created, model, include_usage),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            text = []
            while kind == "chunk":
                text.append(value)
                kind, value = await job.events.get()
        except BaseException:
            job.cancelled.set()
            raise
        if kind == "error":
            return error_for(value).response()
        outcome: Outcome = value
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                         "logprobs": None, "finish_reason": outcome.finish_reason}],
            "usage": _usage(outcome)})

    async def models(request: Request) -> Response:
        try:
            check_key(request)
        except APIError as exc:
            return exc.response()
        return JSONResponse({"object": "list", "data": [
            {"id": cfg.get("serve.model_name"), "object": "model", "created": int(service.started),
             "owned_by": "edgespec"}]})

    async def health(request: Request) -> Response:
        problem = service.stalled()
        status = "ok" if service.ready and problem is None else ("loading" if problem is None else "unhealthy")
        body: dict[str, Any] = {"status": status, "sessions": len(service.workers), "pending": service.pending}
        if problem:
            body["problem"] = problem
        failover = [w.session.stats.extra.get("failover") for w in service.workers]
        body["verifier"] = [{"mode": f.get("mode"), "breaker": f.get("breaker"), "address": f.get("address")}
                            for f in failover if f]
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()

    async def crashed(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_for(exc).response()

    return Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={HTTPException: not_found, Exception: crashed})


async def _sse(job: Job, first: tuple[str, Any], rid: str, created: int, model: str,
               include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    def event(payload: dict) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    def chunk(delta: dict, finish: str | None = None) -> bytes:
        return event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                      "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    kind, value = first
    done = False
    try:
        yield chunk({"role": "assistant", "content": ""})
        while kind == "chunk":
            yield chunk({"content": value})
            kind, value = await job.events.get()
        done = True
        if kind == "error":
            yield event(error_for(value).body())
        else:
            yield chunk({}, value.finish_reason)
            if include_usage:
                yield event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": [], "usage": _usage(value)})
        yield b"data: [DONE]\n\n"
    finally:
        if not done:
            job.cancelled.set()     # the client went away: the session stops after this step
