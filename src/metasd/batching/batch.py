"""Continuous batching: requests join and leave between rounds; every round verifies all of them in one forward.

Each request keeps what it has alone (`Generation`: its drafters' state, its policy's state, its sampling generator,
its statistics); the batch gives it a row of the target's KV slots (`slots.BatchedTarget`), and its own copies of
the drafters (weights and cross-request history shared) and of the policy (what it learns is written back to the
decoder's policy when it leaves, for the requests after it). A step runs one round (`round.run_round`, the round a
request decoding alone runs) over the requests whose prompts are in, with one decision for the whole batch
(`decision.BatchDecision`, priced by the measured cost of batch forwards, `costs`); a request alone in the batch
makes its own choice, as `Generation.step` does.

A joining request's prompt enters in chunks (chunked prefill, as Sarathi-Serve, Agrawal et al., OSDI 2024, and
vLLM do): each step's forward carries a chunk of the waiting prompts, in the order they joined, beside the
decoding rows (packed, `ragged`, unless the chunk is short beside wide drafts), sized from measured step times so
that it takes a share of the step (`prefill_share`) and the requests decoding keep their pace while a long prompt
joins. A batch where nobody decodes prefills its joiners whole: nobody waits for them.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

from ..engine import Decoder
from ..generation import OWN_CHOICE, Generation
from ..models.features import feature_layers_read_by
from ..policy import Policy
from ..round import run_round
from ..slots import BatchedTarget, check_batched_logits
from . import DEFAULT_PREFILL_SHARE
from .decision import BatchDecision


@dataclass
class BatchStats:
    """Rounds by batch size, and per batch size the tokens drafted and accepted: how speculation follows load."""

    rounds: Counter = field(default_factory=Counter)
    drafted: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)


class Batch:
    """Up to `max_batch` requests of one decoder in flight. `join` a request from `Decoder.stream`, call `step`
    while the batch is not empty; a request that ends leaves by itself, `leave` takes one out early (cancelled,
    stopped by a stop string). The decoder's `generate` and `stream` must not run while a batch holds requests.

    prefill_share: the share of a step's time that joining prompts get while other requests decode, in (0, 1]
    (more where more prompts wait than decode, `_share`):
    a chunk then costs about share / (1 - share) rounds, so each decoding request waits about 1 / (1 - share)
    rounds between two of its rounds (2 at the default 0.5) and a prompt enters in about 1 / share of its
    prefill time; 1 prefills a joining prompt whole in one step."""

    MIN_CHUNK = 16  # prompt tokens a step prefills at least while others decode

    def __init__(self, decoder: Decoder, max_batch: int = 8, prefill_share: float = DEFAULT_PREFILL_SHARE):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not 0 < prefill_share <= 1:
            raise ValueError(f"prefill_share must be in (0, 1], got {prefill_share!r}")
        self.decoder = decoder
        self.max_batch = max_batch
        self.prefill_share = prefill_share
        check_batched_logits(decoder.target.model)  # a model the slots would decode unlike itself: refused now
        readers = [d for d in decoder.drafters.values() if d.reads_target_features]
        self.target = BatchedTarget(
            decoder.target.model,
            rows=max_batch,
            keep_features=bool(readers),
            feature_layers=feature_layers_read_by(readers),
        )
        self.costs = decoder.cost_model(max_batch=max_batch)  # T(B, W) is the decoder's: later batches keep what
        # rounds taught it, and it follows the decoder's T(M) to wider drafts
        self.decision = BatchDecision(self.costs)
        self.requests: list[Generation] = []
        self.joining: list[Generation] = []  # requests whose prompts are not all in yet, in the order they joined
        self.failed: list[tuple[Generation, Exception]] = []  # the last step's requests whose prefill or leaving raised
        self.stats = BatchStats()
        self.last = (0, 0, 0)  # the last step's round: batch size, tokens drafted, tokens accepted (0s: no round)
        self._chunk = self.MIN_CHUNK  # prompt tokens the next chunk prefills while others decode (`_timed`)
        # id(request) -> the decoder's policy its copy came from, and a bandit's statistics when it was copied
        self._policies: dict[int, tuple[Policy, dict | None]] = {}

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def full(self) -> bool:
        """Whether the batch holds `max_batch` requests (a new one must wait)."""
        return len(self.requests) >= self.max_batch

    def join(self, request: Generation) -> None:
        """Start a request from `Decoder.stream` (not iterated yet) in this batch; its prompt enters over the
        next steps (whole at the next step if nobody decodes then)."""
        if self.full:
            raise RuntimeError(f"the batch is full ({self.max_batch} requests)")
        if request.decoder is not self.decoder or request.started:
            raise ValueError("a batch takes requests of its own decoder that have not started")
        row = self.target.add_row()
        try:
            request.target = row
            request.pool = [d.fork() for d in request.pool]
            for drafter in request.pool:
                if drafter.reads_target_features:
                    drafter.read_features_from(row)
            shared = request.policy
            if shared is not None:  # its copy starts from what was learned of these drafters (`Policy.revise`)
                shared.revise([d.revision() for d in request.pool])
                request.policy = shared.for_request()
            request.begin()
        except BaseException:
            self.target.remove_row(row)
            raise
        if shared is not None:
            self._policies[id(request)] = (shared, shared.copy_start())
        self.requests.append(request)
        self.joining.append(request)

    def leave(self, request: Generation) -> None:
        """The request ends now (finished, or abandoned): drafters and policy see its end, its row is freed. What
        a drafter's or the policy's end raises is raised after the request has left all the same: the batch never
        keeps a request its caller no longer tracks."""
        if request not in self.requests:
            return
        try:
            request.finish()
        finally:
            self.target.remove_row(request.target)
            self.requests.remove(request)
            if request in self.joining:
                self.joining.remove(request)
            shared, start = self._policies.pop(id(request), (None, None))
            if shared is not None:  # what the request learned, for the requests after it
                shared.take_back(request.policy, start)

    def step(self) -> list[tuple[Generation, list[int]]]:
        """One round for every request whose prompt is in, sharing its forward with chunks of the joining prompts
        (`_chunks`): the tokens each request added (a joiner adds none). Requests that ended have left; one whose
        leaving or prefill raised is in `failed` with its error (and in the list with no tokens), for its caller to
        fail that request alone."""
        self.failed, out, self.last = [], [], (0, 0, 0)
        if self.joining and len(self.joining) == len(self.requests):  # nobody decodes: nobody waits for them
            for request in list(self.joining):
                out += self._prefill(request)
        decoding = [request for request in self.requests if request not in self.joining]
        if decoding:
            chunks = self._chunks() if self.prefill_share < 1 else []
            held, started = sum(len(r.target.tokens) for r, _ in chunks), time.perf_counter()
            share = self._share(len(self.joining), len(decoding))
            decision = OWN_CHOICE if len(decoding) == 1 else self.decision
            prefill = [(r.target, tokens) for r, tokens in chunks if len(tokens) > len(r.target.tokens)]
            out += zip(decoding, run_round(decoding, self.target, decision, prefill=prefill), strict=True)
            self._count(len(decoding), decoding)
            if sum(len(tokens) for _, tokens in chunks) - held == self._chunk:  # the whole budget: time it
                self._timed(time.perf_counter() - started, share)
            for joiner, tokens in chunks:
                if len(tokens) == len(joiner.context) - 1:
                    self.joining.remove(joiner)
            if self.joining and self.prefill_share == 1:  # the prompt enters whole
                out += self._prefill(self.joining[0])
        for request, _ in out:
            if request.done:
                try:
                    self.leave(request)
                except Exception as err:
                    self.failed.append((request, err))
        return out

    def _chunks(self) -> list[tuple[Generation, list[int]]]:
        """The prompt tokens joining requests' rows should hold after this step's forward: the step's chunk of
        `_chunk` tokens filled in the order they joined (as Sarathi-Serve fills its token budget), so that short
        prompts waiting behind a prompt's last tokens enter in the same step. A prompt with nothing left to feed (one
        token: decoding feeds it) is in, budget or not."""
        out, budget = [], self._chunk
        for request in self.joining:
            have, last = len(request.target.tokens), len(request.context) - 1
            goal = min(have + budget, last)
            if goal > have or have == last:
                out.append((request, request.context[:goal]))
            budget -= goal - have
        return out

    def _share(self, joining: int, decoding: int) -> float:
        """The share of a step that `joining` prompts get beside `decoding` requests: `prefill_share`, or each
        request's equal part where more requests wait for their prompts than that gives them (joining / (joining +
        decoding): seven prompts arriving while one request decodes enter at seven eighths of the steps, not at the
        pace of one)."""
        return max(self.prefill_share, joining / max(joining + decoding, 1))

    def _timed(self, step_seconds: float, share: float) -> None:
        """The next chunk's length from this step's: a chunk should take `share` of a step (`_share`). The forward's
        time is a pass over the weights, T(1) (`costs`), shared by every row, plus about the same time for each
        position it computed (`last_forward`: the rows' tokens, and the padding where it was padded); the chunk's
        time is its tokens' part, the rest of the step is what the decoding
        requests would have waited anyway. Its length is scaled by the time allowed over the time taken, growing at
        most by half and shrinking at most by half a step (a long chunk overshooting is a long gap for everyone), at
        least `MIN_CHUNK` tokens (every prompt gets in) and at most `PREFILL_CHUNK`."""
        tokens, seconds = self.target.last_forward
        took = max(seconds - self.costs.forward(1, 1), 0.0) * self._chunk / max(tokens, 1)
        allowed = max(step_seconds - took, 0.0) * share / (1 - share)
        scaled = self._chunk * min(max(allowed / max(took, 1e-6), 0.5), 1.5)
        self._chunk = max(self.MIN_CHUNK, min(int(scaled), self.target.PREFILL_CHUNK))

    def _prefill(self, request: Generation) -> list[tuple[Generation, list[int]]]:
        """Prefill a joining request's whole prompt on its own. A prefill that raises fails this request alone: it
        leaves, and is returned with no tokens beside its error in `failed`."""
        try:
            self.target.prefill(request.target, request.context)
        except Exception as err:
            self.failed.append((request, err))
            with contextlib.suppress(Exception):  # the prefill's error is the one its caller reports
                self.leave(request)
            return [(request, [])]
        self.joining.remove(request)
        return []

    def _count(self, size: int, requests: list[Generation]) -> None:
        rounds = [request.stats.rounds[-1] for request in requests]
        drafted = sum(r.drafted + r.branch_nodes for r in rounds)
        accepted = sum(r.accepted + r.branch_accepted for r in rounds)
        self.stats.rounds[size] += 1
        self.stats.drafted[size] += drafted
        self.stats.accepted[size] += accepted
        self.last = (size, drafted, accepted)
