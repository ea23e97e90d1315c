"""The decoding thread: it owns the Decoder and its batch (continuous batching, `metasd.batching`), takes requests
from a bounded FIFO queue between rounds, and hands each request's events (deltas, outcome, error) back to the
event loop."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..batching import DEFAULT_PREFILL_SHARE
from ..batching.batch import Batch
from ..engine import Decoder
from ..generation import Generation
from .detokenize import IncrementalText
from .metrics import _Metrics
from .protocol import ApiError
from .stop_strings import _find_stop, _sendable

log = logging.getLogger(__name__)


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


class DecodingWorker:
    """The worker thread that owns the Decoder and its batch (`metasd.batching.Batch`), and the bounded FIFO of
    jobs waiting for a place in the batch. Between rounds it admits waiting jobs while the batch has room and
    drops requests whose client left; each round decodes every request in the batch."""

    def __init__(
        self,
        decoder: Decoder,
        max_queue: int,
        metrics: _Metrics,
        max_batch: int = 1,
        prefill_share: float = DEFAULT_PREFILL_SHARE,
    ):
        from jinja2 import TemplateError

        self._template_error = TemplateError
        self.decoder = decoder
        self.metrics = metrics
        self.batch = Batch(decoder, max_batch, prefill_share)
        self.max_queue = max_queue
        self.jobs: queue.Queue[_Job | None] = queue.Queue()  # arrived, not checked yet
        self.ready: deque[tuple[_Job, Generation]] = deque()  # checked, waiting for room in the batch
        self._waiting = 0  # submitted, and neither in the batch nor answered (in `jobs`, being checked, or `ready`)
        self.active: dict[int, _Progress] = {}  # id(generation) -> its job's progress
        self._stopping = threading.Event()
        self._ended = False  # the worker left its loop (stopped, or died): nothing queued would ever run
        self._lock = threading.Lock()  # orders submit against the worker's last drain of the queue
        self._thread = threading.Thread(target=self._loop, name="metasd-engine", daemon=True)
        self.threads = torch.get_num_threads()  # the process's setting now, before any learner's trainer starts
        metrics.waiting.set_function(lambda: self.waiting)
        metrics.running.set_function(lambda: len(self.batch))

    @property
    def alive(self) -> bool:
        """False from the moment the worker starts failing its jobs on the way out, not only once it has exited."""
        return not self._ended and self._thread.is_alive()

    @property
    def running(self) -> int:
        """Requests decoding now."""
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
        """Queue a job for the decoding thread (429 when the queue is full, 503 once the thread stopped)."""
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
        # torch's intra-op threads are per thread, each initialised from a process-wide default at its first parallel
        # op, and a trainer thread setting its own count (metasd.learning) moves that default: pin this thread's
        torch.get_num_threads()
        torch.set_num_threads(self.threads)
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
            drafter.use_history(job.history)  # copy in the batch keeps the one chosen now
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
        if size:  # a step that only prefilled ran no round
            self.metrics.batch_size.observe(size)
            self.metrics.batch_drafted.labels(str(size)).inc(drafted)
            self.metrics.batch_accepted.labels(str(size)).inc(accepted)
        failed = {id(gen): err for gen, err in self.batch.failed}
        for gen, _ in out:
            progress = self.active[id(gen)]
            if id(gen) in failed:  # its prompt's prefill, or ending it, failed: that request's 500
                err = failed[id(gen)]
                log.error("prefilling or ending a request failed", exc_info=err)
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
