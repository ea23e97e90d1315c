"""Continuous batching: requests join and leave between rounds; every round verifies all of them in one forward.

Each request keeps what it has alone (`Generation`: its drafters' state, its policy's state, its sampling generator,
its statistics); the batch gives it a row of the target's KV slots (`slots.BatchedTarget`), and its own copies of
the drafters (weights and cross-request history shared) and of the policy (what it learns is written back to the
decoder's policy when it leaves, for the requests after it). A round runs each request's phases in turn, one target
forward for all, then each request's acceptance rule: `Batch.step`. Which drafter and how many tokens each request
drafts is chosen for the whole batch (`decision.decide`) from the measured cost of batch forwards (`costs`).

A request alone in the batch decodes as `Generation.step` does (its own choice, stop rules and T(M)), so a batch of
one is the single-request engine.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..cached_model import feature_layers_read_by
from ..engine import Decoder, Generation
from ..policy import Policy
from ..round import RoundState
from .costs import BatchCost, load_or_calibrate_batch
from .decision import Plan, decide
from .slots import BatchedTarget, check_batched_logits


@dataclass
class BatchStats:
    """Rounds by batch size, and per batch size the tokens drafted and accepted: how speculation follows load."""

    rounds: Counter = field(default_factory=Counter)
    drafted: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)


class Batch:
    """Up to `max_batch` requests of one decoder in flight. `join` a request from `Decoder.stream`, call `step`
    while the batch is not empty; a request that ends leaves by itself, `leave` takes one out early (cancelled,
    stopped by a stop string). The decoder's `generate` and `stream` must not run while a batch holds requests."""

    def __init__(self, decoder: Decoder, max_batch: int = 8):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.decoder = decoder
        self.max_batch = max_batch
        check_batched_logits(decoder.target.model)  # a model the slots would decode unlike itself: refused now
        readers = [d for d in decoder.drafters.values() if d.reads_target_features]
        self.target = BatchedTarget(
            decoder.target.model,
            rows=max_batch,
            keep_features=bool(readers),
            feature_layers=feature_layers_read_by(readers),
        )
        costs = decoder.cost_model()
        tables = {}
        if max_batch > 1:
            widths = costs.target.max_tokens
            tables = load_or_calibrate_batch(decoder.target.spec, decoder.target.model, max_batch, widths)
        self.costs = BatchCost(costs, tables, max_batch)
        self.requests: list[Generation] = []
        self.failed: list[tuple[Generation, Exception]] = []  # the last step's requests whose leaving raised
        self.stats = BatchStats()
        self.last = (0, 0, 0)  # the last round's batch size, tokens drafted, tokens accepted
        # id(request) -> the decoder's policy its copy came from, and a bandit's statistics when it was copied
        self._policies: dict[int, tuple[Policy, dict | None]] = {}

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def full(self) -> bool:
        return len(self.requests) >= self.max_batch

    def join(self, request: Generation) -> None:
        """Start a request from `Decoder.stream` (not iterated yet) in this batch; its prompt is prefilled now."""
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
            if shared is not None:
                request.policy = shared.for_request()
            request.begin()
            self.target.prefill(row, request.context)
        except BaseException:
            self.target.remove_row(row)
            raise
        if shared is not None:
            self._policies[id(request)] = (shared, shared.copy_start())
        self.requests.append(request)

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
            shared, start = self._policies.pop(id(request), (None, None))
            if shared is not None:  # what the request learned, for the requests after it
                shared.take_back(request.policy, start)

    def step(self) -> list[tuple[Generation, list[int]]]:
        """One round for every request in flight: the tokens each one added. Requests that ended have left; one
        whose leaving raised (a drafter's `end`, the policy's `finish`) is in `failed` with its error, for its caller
        to fail that request alone."""
        self.failed = []
        if not self.requests:
            return []
        if len(self.requests) == 1:
            request = self.requests[0]
            out = [(request, request.step())]
            self._count(1, [request])
        else:
            out = self._round()
        for request, _ in out:
            if request.done:
                try:
                    self.leave(request)
                except Exception as err:
                    self.failed.append((request, err))
        return out

    def _round(self) -> list[tuple[Generation, list[int]]]:
        requests, size = self.requests, len(self.requests)
        times = self.costs.widths(size, max(r.room for r in requests) + 1)
        drafts = self._may_draft(times)
        states = [request.start_round(propose=drafts) for request in requests]
        if drafts:
            decision = decide([_plan(request, state) for request, state in zip(requests, states, strict=True)], times)
            for request, state, (arm, k) in zip(requests, states, decision.choices, strict=True):
                state.arm, state.k = arm, min(k, state.room)
                if request.policy is not None:
                    request.policy.set_bar(decision.rate)
        for request, state in zip(requests, states, strict=True):
            request.draft(state, stop_rules=False)  # the batch chose k; a stop rule prices rounds of one
        started = time.perf_counter()
        logits = self.target.forward([(r.target, r.context, t.tree) for r, t in zip(requests, states, strict=True)])
        ended = time.perf_counter()
        self.costs.observe(size, max(t.tree.size for t in states) + 1, ended - started)
        out = []
        for request, state, rows in zip(requests, states, logits, strict=True):
            state.clock.verifying, state.clock.forwarded = started, ended
            out.append((request, request.accept(state, rows, prefilled=False, alone=False)))
        self._count(size, requests)
        return out

    def _may_draft(self, times: list[float]) -> bool:
        """Whether any drafting could pay this round: False when every request drafting k tokens at its policy's
        ceiling (`Policy.ceiling`: the best acceptance it has seen, drafting free) still yields fewer tokens
        per second than a plain batch step, for every k. The round then skips every request's proposals and
        options, work it would pay for nothing. Policies without a ceiling (the bandits) always decide."""
        ceilings = []
        for request in self.requests:
            if request.policy is None or request.room <= 0:
                ceilings.append(np.ones(len(times)))
            elif (ceiling := request.policy.ceiling(request.room)) is not None:
                ceilings.append(np.concatenate([ceiling, np.full(len(times) - len(ceiling), ceiling[-1])]))
            else:
                return True
        rates = np.sum(ceilings, axis=0) / np.asarray(times)
        return bool(rates[1:].max(initial=0.0) > rates[0])

    def _count(self, size: int, requests: list[Generation]) -> None:
        rounds = [request.stats.rounds[-1] for request in requests]
        drafted = sum(r.drafted + r.branch_nodes for r in rounds)
        accepted = sum(r.accepted + r.branch_accepted for r in rounds)
        self.stats.rounds[size] += 1
        self.stats.drafted[size] += drafted
        self.stats.accepted[size] += accepted
        self.last = (size, drafted, accepted)


def _plan(request: Generation, state: RoundState) -> Plan:
    policy = request.policy
    if policy is None or state.room <= 0:
        return Plan(fixed=(None, 0))
    options = policy.options(state.room, state.proposals, state.lags, remaining=state.remaining, fresh=state.fresh)
    if options is not None:
        return Plan(options)
    return Plan(
        fixed=policy.choose(state.room, state.proposals, state.lags, remaining=state.remaining, fresh=state.fresh)
    )
