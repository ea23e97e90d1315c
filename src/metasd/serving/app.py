"""The HTTP layer: `create_app` builds a FastAPI app over one Decoder. The routes (/health, /metrics, /v1/models,
/v1/completions, /v1/chat/completions) are module-level functions that find the decoding thread, the metrics and
the app's settings on `request.app.state`; the event loop only validates, queues and relays events."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ..batching import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_SHARE
from ..drafters.suffix import SHARED as SHARED_HISTORY
from ..engine import Decoder
from ..learning import HeadLearner, LearningConfig, learn_heads
from ..openmp import release_openmp_threads
from .metrics import _Metrics
from .protocol import (
    HISTORY_SCOPES,
    MAX_BODY_BYTES,
    ApiError,
    ChatRequest,
    CompletionRequest,
    _check_prompt_size,
    _error_body,
    _max_prompt_chars,
    _parse,
    _Request,
)
from .worker import DecodingWorker, _Job, _Outcome


@dataclass(frozen=True)
class _Settings:
    """What the routes need besides the decoding thread and the metrics, fixed when the app is built."""

    decoder: Decoder
    model_name: str
    max_chars: int  # a prompt of more characters surely exceeds the context (`_max_prompt_chars`)
    max_body_bytes: int
    keys: list[str] | None  # the accepted API keys; None: no authentication
    history_scope: str


def create_app(
    decoder: Decoder,
    api_key: str | Sequence[str] | None = None,
    max_queue: int = 64,
    max_body_bytes: int = MAX_BODY_BYTES,
    history_scope: str = "shared",
    max_batch: int = DEFAULT_MAX_BATCH,
    prefill_share: float = DEFAULT_PREFILL_SHARE,
    learning: LearningConfig | None = None,
    learn_dir: str | Path | None = None,
) -> FastAPI:
    """An app serving `decoder`; the worker thread runs between the app's startup and shutdown.

    api_key: one key, several (a list, or one string with commas), or None (no authentication).
    history_scope: what the `suffix` drafter learns across requests from: `shared` (every request's output, the
    default), `per-key` (only earlier outputs of requests with the same API key) or `off` (nothing).
    prefill_share: the share of a round's time a joining prompt gets while others decode (`Batch`).
    learning: the pool's EAGLE heads learn from the traffic they draft for (`metasd.learning`), per history key
    (`history_scope`; `off` learns nothing), keeping improved heads in `learn_dir` and resuming from them.
    """
    keys = _check_options(decoder, api_key, max_queue, max_body_bytes, history_scope, max_batch)
    max_chars = _max_prompt_chars(decoder.tokenizer, decoder.target.max_length)
    metrics = _Metrics(decoder.drafter_names)
    engine = DecodingWorker(decoder, max_queue, metrics, max_batch, prefill_share)

    app = FastAPI(title="metasd", lifespan=_lifespan)
    app.state.engine = engine  # the decoding thread; Ray replicas' health check reads it too
    app.state.metrics = metrics
    app.state.learners = [] if learning is None else learn_heads(decoder, learning, learn_dir)
    for learner in app.state.learners:
        learner.busy = lambda: engine.running > 0 or engine.waiting > 0
    app.state.settings = _Settings(decoder, decoder.target.spec, max_chars, max_body_bytes, keys, history_scope)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(Exception, _bug)
    app.include_router(probes)
    app.include_router(v1)
    release_openmp_threads()  # the caller built the models; the decoding thread should be the only OpenMP team
    return app


def _check_options(
    decoder: Decoder,
    api_key: str | Sequence[str] | None,
    max_queue: int,
    max_body_bytes: int,
    history_scope: str,
    max_batch: int,
) -> list[str] | None:
    """`create_app`'s options, refused with ValueError where they cannot work; returns the API keys (None: no
    authentication)."""
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    keys = api_key.split(",") if isinstance(api_key, str) else list(api_key) if api_key is not None else None
    if keys is not None and (not keys or not all(keys)):
        raise ValueError("the API key is empty; give a real key or none")
    if history_scope not in HISTORY_SCOPES:
        raise ValueError(f"history_scope must be one of {', '.join(HISTORY_SCOPES)}, got {history_scope!r}")
    if history_scope == "per-key" and keys is None:
        raise ValueError("history scope 'per-key' needs API keys (--api-key KEY[,KEY...])")
    if history_scope != "shared" and decoder.policy_scope == "server":
        raise ValueError(
            f"history scope {history_scope!r} isolates clients, but policy scope 'server' shares one "
            "policy (and its statistics in every response) across all of them; use policy scope "
            "'request'"
        )
    return keys


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The decoding thread, and the heads' learners, run between the app's startup and shutdown."""
    engine: DecodingWorker = app.state.engine
    learners: list[HeadLearner] = app.state.learners
    engine.start()
    for learner in learners:
        learner.start()
    yield
    for learner in learners:
        learner.close()
    engine.stop()


def _fail(request: Request, err: ApiError) -> JSONResponse:
    request.app.state.metrics.failure.labels(str(err.status)).inc()
    return JSONResponse(_error_body(err), status_code=err.status)


async def _api_error(request: Request, err: ApiError) -> JSONResponse:
    return _fail(request, err)


async def _http(request: Request, exc: HTTPException) -> JSONResponse:
    return _fail(request, ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}"))


async def _bug(request: Request, exc: Exception) -> JSONResponse:
    return _fail(request, ApiError(500, f"internal error: {exc}", kind="server_error"))


async def authorize(request: Request) -> None:
    """401 unless a configured key is sent; request.state.history is the suffix history the request may use."""
    settings: _Settings = request.app.state.settings
    keys, history_scope = settings.keys, settings.history_scope
    request.state.history = None if history_scope == "off" else SHARED_HISTORY
    if keys is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare with every key (no early exit), so timing does not tell which one nearly matched
    matches = [hmac.compare_digest(token.encode(), key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise ApiError(
            401,
            "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            kind="authentication_error",
        )
    if history_scope == "per-key":
        request.state.history = history_key(keys[matches.index(True)])


def history_key(api_key: str) -> str:
    """A client's history key under `--history-scope per-key`: a hash of its API key (BLAKE2b, 8 bytes), the same
    whatever the key's place in `--api-key` and across restarts, so a learned head saved under it (`--learn-heads`)
    returns to its own client only; the key itself is never written anywhere."""
    digest = hashlib.blake2b(api_key.encode(), digest_size=8, person=b"metasd-history").hexdigest()
    return f"key-{digest}"


probes = APIRouter()  # unauthenticated: load balancers and Prometheus poll these


@probes.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while the decoding thread runs (503 once it stopped), with queue and batch sizes."""
    engine: DecodingWorker = request.app.state.engine
    body = {
        "status": "ok" if engine.alive else "engine stopped",
        "model": request.app.state.settings.model_name,
        "waiting": engine.waiting,
        "running": engine.running,
    }
    return JSONResponse(body, status_code=200 if engine.alive else 503)


@probes.get("/metrics")
async def prometheus(request: Request) -> Response:
    """The Prometheus metrics, the heads' learning state refreshed first."""
    request.app.state.metrics.record_learning([learner.stats() for learner in request.app.state.learners])
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])


@v1.get("/models")
async def models(request: Request) -> dict:
    """The served model as OpenAI's /v1/models lists it, with its drafters and policy."""
    settings: _Settings = request.app.state.settings
    decoder = settings.decoder
    card = {
        "id": settings.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "metasd",
        "metasd": {
            "drafters": decoder.drafter_names,
            "policy": decoder.default_policy,
            "policy_scope": decoder.policy_scope,
        },
    }
    return {"object": "list", "data": [card]}


@v1.get("/learning")
async def learning(request: Request) -> dict:
    """The heads learning from traffic: per drafter and history key, the version in service, its held-out
    expected tokens per draft over the rounds of learning, the buffer's size and the trainer's share of a core. A
    client sees its own history key's only (`per-key`)."""
    key = request.state.history
    out = []
    for learner in request.app.state.learners:
        report = learner.report(key)
        if report is not None:
            out.append(report)
    return {"object": "list", "data": out}


@v1.post("/completions")
async def completions(request: Request) -> Response:
    """OpenAI's /v1/completions (streamed with `stream: true`)."""
    body = await _parse(request, CompletionRequest, request.app.state.settings.max_body_bytes)
    return await respond(request, body, body.prompt, chat=False, max_tokens=body.max_tokens or 16)


@v1.post("/chat/completions")
async def chat(request: Request) -> Response:
    """OpenAI's /v1/chat/completions, the prompt built by the model's chat template."""
    body = await _parse(request, ChatRequest, request.app.state.settings.max_body_bytes)
    messages = [m.as_dict() for m in body.messages]
    return await respond(request, body, messages, chat=True, max_tokens=body.max_completion_tokens or body.max_tokens)


async def respond(request: Request, body: _Request, prompt: Any, chat: bool, max_tokens: int | None) -> Response:
    """Queue a job and answer from its first event: an error, the whole result, or the start of a stream."""
    settings: _Settings = request.app.state.settings
    model_name, decoder = settings.model_name, settings.decoder
    engine: DecodingWorker = request.app.state.engine
    body.check()
    if body.model not in (None, model_name):
        raise ApiError(
            404,
            f"model {body.model!r} does not exist; this server serves {model_name!r}",
            "model",
            "model_not_found",
        )
    _check_prompt_size(prompt, chat, settings.max_chars, decoder.target.max_length)
    options = {
        "temperature": body.temperature,
        "top_k": body.top_k,
        "top_p": body.top_p,
        "seed": body.seed,
        "policy": body.metasd_policy,
        "drafters": body.metasd_drafters,
    }
    job = _Job(
        prompt,
        not chat,
        max_tokens,
        options,
        body.stops(),
        body.stream,
        asyncio.get_running_loop(),
        history=request.state.history,
    )
    engine.submit(job)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
    reply = _Reply(job, model_name, chat, watcher)
    handed_over = False
    try:
        kind, payload = await job.events.get()
        if kind == "error":
            raise payload
        if kind == "done" and payload.finish_reason == "abort":
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        if kind == "start":
            handed_over = True
            return StreamingResponse(reply.sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(reply.whole(payload))
    finally:
        if not handed_over:  # a stream's watcher lives until `_Reply.sse` ends, even if it never starts
            watcher.cancel()
            job.cancel.set()


async def _cancel_on_disconnect(request: Request, job: _Job) -> None:
    """Until the answer is over (queued, decoding, streaming): a client that hangs up cancels its job. While
    streaming, StreamingResponse may also close `_Reply.sse`, but not if the client left before the stream's first
    step, when the generator's `finally` never runs."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel.set()


class _Reply:
    """OpenAI response and chunk bodies for one job, for /v1/completions or /v1/chat/completions."""

    def __init__(self, job: _Job, model: str, chat: bool, watcher: asyncio.Task):
        self.job, self.model, self.chat, self.watcher = job, model, chat, watcher
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _body(self, obj: str, choice: dict, **extra: Any) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, **choice, "logprobs": None}],
            **extra,
        }

    @staticmethod
    def _usage(out: _Outcome) -> dict:
        return {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
        }

    def whole(self, out: _Outcome) -> dict:
        if self.chat:
            choice = {"message": {"role": "assistant", "content": out.text}, "finish_reason": out.finish_reason}
            return self._body("chat.completion", choice, usage=self._usage(out), metasd=out.report)
        choice = {"text": out.text, "finish_reason": out.finish_reason}
        return self._body("text_completion", choice, usage=self._usage(out), metasd=out.report)

    def chunk(self, text: str = "", out: _Outcome | None = None, first: bool = False) -> str:
        """One SSE event; the last one (with `out`) carries finish_reason, usage and the metasd object."""
        finish = out.finish_reason if out else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {"content": text} if text else {}
            body = self._body("chat.completion.chunk", {"delta": delta, "finish_reason": finish})
        else:
            body = self._body("text_completion", {"text": text, "finish_reason": finish})
        if out:
            body.update(usage=self._usage(out), metasd=out.report)
        return f"data: {_json(body)}\n\n"

    async def sse(self) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield self.chunk(first=True)  # the role comes first, as OpenAI sends it
            while True:
                kind, payload = await self.job.events.get()
                if kind == "delta":
                    yield self.chunk(payload)
                elif kind == "done":
                    yield self.chunk(out=payload)
                    break
                else:
                    yield f"data: {_json(_error_body(payload))}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # reached too when the client disconnects and the stream is cancelled
            self.job.cancel.set()
            self.watcher.cancel()


def _json(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))
