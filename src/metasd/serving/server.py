"""`metasd serve`: an OpenAI-compatible HTTP API over one Decoder, with SSE streaming and Prometheus metrics.

The Decoder is synchronous and stateful (KV cache, drafters, policies), so one worker thread owns it and decodes
up to --max-batch requests together (continuous batching, `metasd.batching`: one target forward per round for all
of them; requests join from a bounded FIFO queue and leave between rounds). The event loop only validates, queues
and relays events, so /health and /metrics answer while requests decode.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from starlette.exceptions import HTTPException

from ..batching import DEFAULT_MAX_BATCH
from ..batching.batch import Batch
from ..drafters.suffix import SHARED as SHARED_HISTORY
from ..engine import Decoder, Generation
from ..stats import GenerationStats
from .detokenize import IncrementalText

log = logging.getLogger(__name__)

# OpenAI fields the decoder cannot honour: accepted only at these neutral values, rejected otherwise.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
}
MAX_STOP = 4  # as OpenAI
MAX_STOP_CHARS = 256  # per stop string: held-back text and the per-round check stay small
MAX_BODY_BYTES = 2 << 20  # default --max-body-bytes: 2 MiB, far beyond any prompt that fits a context
HISTORY_SCOPES = ("shared", "per-key", "off")


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


class _Request(BaseModel):
    """Fields both endpoints honour. Unknown fields pass (clients send many optional ones) unless in _NEUTRAL."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension, as in vLLM; 0 disables
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # int64, as OpenAI; torch rejects larger
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    metasd_policy: str | None = None
    metasd_drafters: str | list[str] | None = None

    @field_validator("temperature", "top_p", "top_k", "n", "stream", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI documents these as "number or null", and clients do send null."""
        return cls.model_fields[info.field_name].default if value is None else value

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP or not all(stops) or max(map(len, stops), default=0) > MAX_STOP_CHARS:
            raise ApiError(
                400,
                f"stop must be a non-empty string of at most {MAX_STOP_CHARS} characters or a list "
                f"of at most {MAX_STOP} of them",
                "stop",
            )
        return stops

    def check(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"only n=1 is supported (one completion per request), got n={self.n}", "n")
        for name, value in (self.model_extra or {}).items():
            if name in _NEUTRAL and value not in _NEUTRAL[name]:
                raise ApiError(400, f"{name} is not supported by this server", name, "unsupported_parameter")


class CompletionRequest(_Request):
    prompt: str | list[int]  # raw text (no chat template) or token ids


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[_TextPart]

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatRequest(_Request):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens


@dataclass(frozen=True)
class _Outcome:
    text: str
    finish_reason: str  # "stop", "length", or "abort" (client gone)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    report: dict = field(default_factory=dict)  # the `metasd` object


@dataclass
class _Job:
    """One request on its way through the worker; events flow back to the event loop through `events`."""

    prompt: str | list[int] | list[dict]
    raw: bool
    max_tokens: int | None  # None: the rest of the context
    options: dict[str, Any]
    stops: list[str]
    stream: bool
    loop: asyncio.AbstractEventLoop
    history: str | None = ""  # which suffix history the request reads and extends (None: none)
    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)

    def emit(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel.set()


class _Metrics:
    """Prometheus series in the spirit of vLLM's (`vllm:spec_decode_num_draft_tokens_total` ...), one registry per
    app so several apps can live in one process."""

    def __init__(self, drafters: list[str]):
        self.registry = r = CollectorRegistry()
        self.success = Counter(
            "metasd:request_success",
            "Finished requests by reason: stop, length, abort",
            ["finished_reason"],
            registry=r,
        )
        self.failure = Counter(
            "metasd:request_failure", "Requests answered with an error, by HTTP status", ["status"], registry=r
        )
        self.prompt_tokens = Counter("metasd:prompt_tokens", "Prompt tokens of decoded requests", registry=r)
        self.generation_tokens = Counter("metasd:generation_tokens", "Generated tokens", registry=r)
        self.rounds = Counter("metasd:spec_decode_num_rounds", "Decoding rounds, one target forward each", registry=r)
        self.drafts = Counter(
            "metasd:spec_decode_num_drafts",
            "Rounds each drafter was picked for (bandit pulls)",
            ["drafter"],
            registry=r,
        )
        self.draft_tokens = Counter(
            "metasd:spec_decode_num_draft_tokens", "Tokens proposed, by drafter", ["drafter"], registry=r
        )
        self.accepted = Counter(
            "metasd:spec_decode_num_accepted_tokens", "Draft tokens the target accepted", ["drafter"], registry=r
        )
        self.switches = Counter(
            "metasd:spec_decode_num_switches", "Rounds whose drafter differs from the last one's", registry=r
        )
        self.latency = Histogram(
            "metasd:e2e_request_latency_seconds",
            "Arrival to last token, queueing included",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640),
            registry=r,
        )
        self.waiting = Gauge("metasd:num_requests_waiting", "Requests queued for a place in the batch", registry=r)
        self.running = Gauge("metasd:num_requests_running", "Requests decoding (in the batch)", registry=r)
        self.batch_size = Histogram(
            "metasd:batch_size",
            "Requests verified by each round's target forward",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=r,
        )
        self.batch_drafted = Counter(
            "metasd:spec_decode_num_draft_tokens_by_batch_size",
            "Draft tokens verified, by the size of the batch that verified them",
            ["batch_size"],
            registry=r,
        )
        self.batch_accepted = Counter(
            "metasd:spec_decode_num_accepted_tokens_by_batch_size",
            "Draft tokens accepted, by the size of the batch that verified them",
            ["batch_size"],
            registry=r,
        )
        for name in drafters:  # export zeros from the start, so rate() works from the first scrape
            for counter in (self.drafts, self.draft_tokens, self.accepted):
                counter.labels(name)

    def record(self, stats: GenerationStats, finish_reason: str, latency: float) -> None:
        self.success.labels(finish_reason).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.new_tokens)
        self.rounds.inc(len(stats.rounds))
        self.switches.inc(stats.switches)
        for name, d in stats.drafters().items():
            self.drafts.labels(name).inc(d.pulls)
            self.draft_tokens.labels(name).inc(d.drafted)
            self.accepted.labels(name).inc(d.accepted)
        self.latency.observe(latency)


def _find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Where the first stop string begins, searching from start (the text before it was searched already)."""
    return min((i for s in stops if (i := text.find(s, start)) >= 0), default=None)


def _sendable(text: str, stops: list[str]) -> int:
    """How much of a partial text may be streamed: not a trailing incomplete character (it decodes to U+FFFD until
    its last byte arrives) nor a tail that could still grow into a stop string. O(len(stop)) per stop string: only
    the last len(stop) - 1 characters can start one."""
    end = len(text.rstrip("\ufffd"))
    held = max((_stop_prefix_at_end(text, end, s) for s in stops), default=0)
    return end - held


def _stop_prefix_at_end(text: str, end: int, stop: str) -> int:
    """The longest k < len(stop) with text[:end] ending in stop[:k] (Knuth-Morris-Pratt over the tail)."""
    if len(stop) < 2:
        return 0
    fail = [0] * len(stop)  # fail[i]: the longest proper border of stop[:i + 1]
    for i in range(1, len(stop)):
        k = fail[i - 1]
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        fail[i] = k + (stop[i] == stop[k])
    k = 0
    for ch in text[max(0, end - len(stop) + 1) : end]:
        while k and ch != stop[k]:
            k = fail[k - 1]
        if ch == stop[k]:
            k += 1
        if k == len(stop):  # a whole stop string (_find_stop cuts those): keep only its longest border
            k = fail[k - 1]
    return k


class _Progress:
    """One request's text on its way out: detokenized incrementally, cut at a stop string, streamed as far as it
    is final (no trailing incomplete character, no tail that could still become a stop string)."""

    def __init__(self, job: _Job, gen: Generation, decode):
        self.job, self.gen = job, gen
        self.text, self.sent, self.finish = "", 0, None
        self.detok = IncrementalText(decode)
        self.longest_stop = max(map(len, job.stops), default=0)

    def update(self) -> bool:
        """After a round: stream what is final; True when a stop string ended the request."""
        searched = max(len(self.text) - self.longest_stop + 1, 0)  # a stop string cannot lie wholly before this
        self.text = self.detok.update(self.gen.token_ids)
        if (cut := _find_stop(self.text, self.job.stops, searched)) is not None:
            self.text, self.finish = self.text[:cut], "stop"
        end = len(self.text) if self.finish else _sendable(self.text, self.job.stops)
        if self.job.stream and end > self.sent:
            self.job.emit("delta", self.text[self.sent : end])
            self.sent = end
        return self.finish is not None

    def outcome(self, report: dict) -> _Outcome:
        """The request is over (its generation closed): the whole text, and its last delta when streaming."""
        if self.finish is None:  # the output ended: whatever was held back as incomplete is final now
            searched = max(len(self.text) - self.longest_stop + 1, 0)
            self.text = self.detok.finish(self.gen.token_ids)
            if (cut := _find_stop(self.text, self.job.stops, searched)) is not None:
                self.text, self.finish = self.text[:cut], "stop"
        finish = self.finish or self.gen.finish_reason
        if self.job.stream and finish != "abort" and len(self.text) > self.sent:
            self.job.emit("delta", self.text[self.sent :])  # what was held back (a final U+FFFD, say)
        return _Outcome(self.text, finish, len(self.gen.prompt), len(self.gen.token_ids), report)


class _Engine:
    """The worker thread that owns the Decoder and its batch (`metasd.batching.Batch`), and the bounded FIFO of
    jobs waiting for a place in the batch. Between rounds it admits waiting jobs while the batch has room and
    drops requests whose client left; each round decodes every request in the batch."""

    def __init__(self, decoder: Decoder, max_queue: int, metrics: _Metrics, max_batch: int = 1):
        from jinja2 import TemplateError

        self._template_error = TemplateError
        self.decoder = decoder
        self.metrics = metrics
        self.batch = Batch(decoder, max_batch)
        self.max_queue = max_queue
        self.jobs: queue.Queue[_Job | None] = queue.Queue()  # arrived, not checked yet
        self.ready: deque[tuple[_Job, Generation]] = deque()  # checked, waiting for room in the batch
        self._waiting = 0  # submitted, and neither in the batch nor answered (in `jobs`, being checked, or `ready`)
        self.active: dict[int, _Progress] = {}  # id(generation) -> its job's progress
        self._stopping = threading.Event()
        self._ended = False  # the worker left its loop (stopped, or died): nothing queued would ever run
        self._lock = threading.Lock()  # orders submit against the worker's last drain of the queue
        self._thread = threading.Thread(target=self._loop, name="metasd-engine", daemon=True)
        metrics.waiting.set_function(lambda: self.waiting)
        metrics.running.set_function(lambda: len(self.batch))

    @property
    def alive(self) -> bool:
        """False from the moment the worker starts failing its jobs on the way out, not only once it has exited."""
        return not self._ended and self._thread.is_alive()

    @property
    def running(self) -> int:
        return len(self.batch)

    @property
    def waiting(self) -> int:
        """Counted, not read off the two queues: a job the worker is checking is in neither, and a request
        arriving then must still find the queue full."""
        return self._waiting

    def _left_queue(self) -> None:
        """A waiting job joined the batch or was answered."""
        with self._lock:
            self._waiting -= 1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Queued jobs get their 503 now; the worker aborts what decodes and answers the rest on its way out."""
        self._stopping.set()
        self._fail_queued()
        self.jobs.put_nowait(None)
        self._thread.join(timeout=30)

    def _fail_queued(self) -> None:
        """Answer every job still in `jobs` with 503 (a thread-safe queue: the event loop's thread may drain it;
        `ready` is the worker's own)."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", self._unavailable())
                self._left_queue()

    def submit(self, job: _Job) -> None:
        with self._lock:
            if self._ended or not self.alive:  # a dead worker: answer now rather than queue a job nobody runs
                raise self._unavailable()
            if self.waiting >= self.max_queue:
                raise ApiError(
                    429,
                    f"the server is busy: {self.max_queue} requests are already waiting (--max-queue); retry later",
                    code="queue_full",
                    kind="rate_limit_error",
                )
            self._waiting += 1
            self.jobs.put_nowait(job)

    def _unavailable(self) -> ApiError:
        if self._stopping.is_set():
            return ApiError(503, "the server is shutting down", kind="server_error")
        return ApiError(
            503, "the decoding thread has stopped (see the server log); restart the server", kind="server_error"
        )

    def _loop(self) -> None:
        try:
            while self._admit():
                if self.batch:
                    self._round()
        finally:  # stopped, or killed by what `except Exception` lets through: fail every job that would wait forever
            with self._lock:
                self._ended = True
                for progress in list(self.active.values()):  # a stream gets the error as its last event
                    progress.job.emit("error", self._unavailable())
            while self.ready:
                self.ready.popleft()[0].emit("error", self._unavailable())
                self._left_queue()
            self._fail_queued()  # after `_ended` is set under the lock: nothing can be queued behind this drain

    def _admit(self) -> bool:
        """Check every queued job now (bad input is answered whatever the batch's load), then move checked jobs
        into the batch while it has room; wait for a job when nothing decodes. False when the server stops."""
        while True:
            try:
                job = self.jobs.get(block=not self.batch and not self.ready)
            except queue.Empty:
                break
            if job is None:
                return False
            if not self._check(job):
                self._left_queue()
        if self._stopping.is_set():  # what is ready gets its 503 on the way out, not a prefill
            return False
        still = deque()  # a client that left gives its place back now, not once the batch has room
        for job, gen in self.ready:
            if self._left(job):
                self._left_queue()
            else:
                still.append((job, gen))
        self.ready = still
        while self.ready and not self.batch.full:
            job, gen = self.ready.popleft()
            self._left_queue()
            try:
                self._join(job, gen)
            except Exception as err:
                log.exception("request failed")
                self.batch.leave(gen)
                job.emit("error", ApiError(500, f"internal error: {err}", kind="server_error"))
            except BaseException:  # the worker dies: this job is in no queue the last drain sees
                job.emit("error", self._unavailable())
                raise
        return True

    def _check(self, job: _Job) -> bool:
        """A queued job becomes a request ready to join (True), or is answered now (False): its abort, its 4xx,
        a 503 once the server stops, a 500 for a bug (which fails its request, never the worker)."""
        if self._left(job):
            return False
        try:
            if self._stopping.is_set():
                raise self._unavailable()
            self.ready.append((job, self._start(job)))
            return True
        except ApiError as err:
            job.emit("error", err)
        except Exception as err:
            log.exception("request failed")
            job.emit("error", ApiError(500, f"internal error: {err}", kind="server_error"))
        except BaseException:
            job.emit("error", self._unavailable())
            self._left_queue()
            raise
        return False

    def _left(self, job: _Job) -> bool:
        """Whether the client left while its job waited (then it is answered as aborted)."""
        left = job.cancel.is_set()  # read once: the client may leave between two reads
        if left:
            self.metrics.success.labels("abort").inc()
            job.emit("done", _Outcome("", "abort"))
        return left

    def _join(self, job: _Job, gen: Generation) -> None:
        for drafter in self.decoder.drafters.values():  # the request's own history (--history-scope): its
            if hasattr(drafter, "use_history"):  # copy in the batch keeps the one chosen now
                drafter.use_history(job.history)
        progress = _Progress(job, gen, self.decoder.decode)
        self.batch.join(gen)
        self.active[id(gen)] = progress
        if job.stream:
            job.emit("start")

    def _round(self) -> None:
        try:
            out = self.batch.step()
        except Exception as err:  # a bug in a shared round fails the requests in it, never the worker
            log.exception("a batch round failed")
            for progress in list(self.active.values()):
                self._end(progress, error=ApiError(500, f"internal error: {err}", kind="server_error"))
            return
        size, drafted, accepted = self.batch.last
        self.metrics.batch_size.observe(size)
        self.metrics.batch_drafted.labels(str(size)).inc(drafted)
        self.metrics.batch_accepted.labels(str(size)).inc(accepted)
        failed = {id(gen): err for gen, err in self.batch.failed}
        for gen, _ in out:
            progress = self.active[id(gen)]
            if id(gen) in failed:  # its output is whole, but ending it failed: that request's 500
                err = failed[id(gen)]
                log.error("ending a request failed", exc_info=err)
                self._end(progress, error=ApiError(500, f"internal error: {err}", kind="server_error"))
                continue
            try:
                ended = progress.update() or gen.done
            except Exception as err:  # one request's bug (its detokenizing, say) fails that request alone
                log.exception("request failed")
                self._end(progress, error=ApiError(500, f"internal error: {err}", kind="server_error"))
                continue
            if ended:
                self._end(progress)
        for progress in list(self.active.values()):
            if progress.job.cancel.is_set() or self._stopping.is_set():
                progress.finish = "abort"
                self._end(progress)

    def _end(self, progress: _Progress, error: ApiError | None = None) -> None:
        """The request leaves the batch (if it has not already) and its client gets the outcome or the error,
        whatever fails on the way (a bug there is that request's 500, never a client left waiting)."""
        gen = progress.gen
        del self.active[id(gen)]
        try:
            self.batch.leave(gen)  # the drafters see the request's end before its row is reused
            if error is None:
                outcome = progress.outcome(self._report(gen))
                self.metrics.record(gen.stats, outcome.finish_reason, time.perf_counter() - progress.job.arrived)
                progress.job.emit("done", outcome)
                return
        except Exception as err:
            log.exception("ending a request failed")
            error = ApiError(500, f"internal error: {err}", kind="server_error")
        progress.job.emit("error", error)

    def _start(self, job: _Job) -> Generation:
        """Everything that can reject a request, before any decoding: raises ApiError."""
        dec = self.decoder
        try:
            ids = dec.encode(job.prompt, job.raw)
        except ValueError as err:
            raise ApiError(400, str(err), "prompt" if job.raw else "messages") from None
        except self._template_error as err:  # a strict chat template refused these messages: the client's error
            raise ApiError(400, f"the model's chat template rejected the messages: {err}", "messages") from None
        if not all(0 <= t < dec.target.vocab_size for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {dec.target.vocab_size})", "prompt")
        context = dec.target.max_length
        max_new = job.max_tokens or context - len(ids)
        if len(ids) >= context or len(ids) + max_new > context:
            raise ApiError(
                400,
                f"this model's context is {context} tokens, but the prompt has {len(ids)} and "
                f"max_tokens asks for {max_new} more",
                "max_tokens",
                "context_length_exceeded",
            )
        try:
            return dec.stream(ids, max_new_tokens=max_new, **job.options)
        except ValueError as err:
            raise ApiError(400, str(err)) from None

    def _report(self, gen: Generation) -> dict:
        """The request's statistics, plus the policy's state after it (cumulative under --policy-scope server)."""
        report = gen.stats.to_dict()
        if gen.policy is not None:
            names = [d.name for d in gen.pool]
            report["policy"] = {
                "scope": self.decoder.policy_scope,
                "pulls": dict(zip(names, gen.policy.pulls, strict=True)),
                "mean_rewards": {n: round(r, 4) for n, r in zip(names, gen.policy.mean_rewards, strict=True)},
            }
        return report


def _error_body(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}


_Body = TypeVar("_Body", bound=BaseModel)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 415 unless it is declared JSON (a browser sends text/plain and form types cross-site
    without a CORS preflight) and with 413 once it exceeds `limit` bytes: by its Content-Length before reading,
    and while reading (a chunked body has none)."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(
            415,
            f"Content-Type must be application/json, got {media or 'none'!r} "
            "(with curl: -H 'Content-Type: application/json')",
            code="unsupported_media_type",
        )
    too_large = ApiError(413, f"the request body exceeds {limit} bytes (--max-body-bytes)", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def _parse(request: Request, schema: type[_Body], limit: int) -> _Body:
    """The body as a JSON object of `schema`; one readable 4xx otherwise."""
    raw = await _read_body(request, limit)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "missing":
            raise ApiError(400, f"missing required field {param!r}", param) from None
        raise ApiError(400, f"{param}: {first['msg']}", param) from None


def create_app(
    decoder: Decoder,
    api_key: str | Sequence[str] | None = None,
    max_queue: int = 64,
    max_body_bytes: int = MAX_BODY_BYTES,
    history_scope: str = "shared",
    max_batch: int = DEFAULT_MAX_BATCH,
) -> FastAPI:
    """An app serving `decoder`; the worker thread runs between the app's startup and shutdown.

    api_key: one key, several (a list, or one string with commas), or None (no authentication).
    history_scope: what the `suffix` drafter learns across requests from: `shared` (every request's output, the
    default), `per-key` (only earlier outputs of requests with the same API key) or `off` (nothing).
    """
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
    model_name = decoder.target.spec
    max_chars = _max_prompt_chars(decoder.tokenizer, decoder.target.max_length)
    metrics = _Metrics(decoder.drafter_names)
    engine = _Engine(decoder, max_queue, metrics, max_batch)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="metasd", lifespan=lifespan)
    app.state.engine = engine

    def fail(err: ApiError) -> JSONResponse:
        metrics.failure.labels(str(err.status)).inc()
        return JSONResponse(_error_body(err), status_code=err.status)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return fail(err)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return fail(ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}"))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        return fail(ApiError(500, f"internal error: {exc}", kind="server_error"))

    async def authorize(request: Request) -> None:
        """401 unless a configured key is sent; request.state.history is the suffix history the request may use."""
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
            request.state.history = f"key-{matches.index(True)}"

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {
            "status": "ok" if engine.alive else "engine stopped",
            "model": model_name,
            "waiting": engine.waiting,
            "running": engine.running,
        }
        return JSONResponse(body, status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def respond(request: Request, body: _Request, prompt: Any, chat: bool, max_tokens: int | None) -> Response:
        """Queue a job and answer from its first event: an error, the whole result, or the start of a stream."""
        body.check()
        if body.model not in (None, model_name):
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; this server serves {model_name!r}",
                "model",
                "model_not_found",
            )
        _check_prompt_size(prompt, chat, max_chars, decoder.target.max_length)
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
                return StreamingResponse(
                    reply.sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            return JSONResponse(reply.whole(payload))
        finally:
            if not handed_over:  # a stream's watcher lives until `_Reply.sse` ends, even if it never starts
                watcher.cancel()
                job.cancel.set()

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.get("/models")
    async def models() -> dict:
        card = {
            "id": model_name,
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

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest, max_body_bytes)
        return await respond(request, body, body.prompt, chat=False, max_tokens=body.max_tokens or 16)

    @v1.post("/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _parse(request, ChatRequest, max_body_bytes)
        messages = [m.as_dict() for m in body.messages]
        return await respond(
            request, body, messages, chat=True, max_tokens=body.max_completion_tokens or body.max_tokens
        )

    app.include_router(v1)

    return app


def _max_prompt_chars(tokenizer: Any, context: int) -> int:
    """More characters than this cannot fit in `context` tokens: no token stands for more characters than the
    longest string in the vocabulary (+1 for a space a decoder may insert), times 4 where a normalizer could
    compose characters (NFC turns up to 3 code points into 1). Computed once, so an over-long prompt is refused
    before the worker spends seconds tokenizing it."""
    longest = max(map(len, tokenizer.get_vocab()), default=1) + 1
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizes = backend is None or backend.normalizer is not None
    return context * longest * (4 if normalizes else 1)


def _check_prompt_size(prompt: Any, chat: bool, max_chars: int, context: int) -> None:
    """Refuse, in the event loop, a prompt that surely exceeds the context: by token count for ids, by characters
    for text (the worker later checks the exact token count of what passes)."""
    if isinstance(prompt, list) and not chat:
        size, unit = len(prompt), "token ids"
        limit = context
    else:
        size = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        unit, limit = "characters", max_chars
    if chat and len(prompt) > context:  # a chat template marks every turn with at least one token
        size, unit, limit = len(prompt), "messages", context
    if size > limit:
        raise ApiError(
            400,
            f"this model's context is {context} tokens, and a prompt of {size} {unit} cannot fit in it",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )


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


def serve(
    decoder: Decoder,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | Sequence[str] | None = None,
    max_queue: int = 64,
    max_body_bytes: int = MAX_BODY_BYTES,
    history_scope: str = "shared",
    max_batch: int = DEFAULT_MAX_BATCH,
) -> None:
    """Run the server until interrupted (the `metasd serve` command)."""
    import uvicorn

    # On shutdown, give in-flight requests 10 s, then cancel them (which stops their jobs) rather than wait for
    # every queued generation to finish.
    app = create_app(
        decoder,
        api_key=api_key,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        history_scope=history_scope,
        max_batch=max_batch,
    )
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10)
