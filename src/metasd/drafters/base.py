"""The drafter interface: propose up to k tokens for the current context, with q or without (then q is one-hot)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..sampling import SamplingParams, pick


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None = None  # [len(tokens), V] probabilities the tokens were drawn from; None = one-hot
    # Per token, the drafter's own signal in [0, 1] of how sure it is (n-gram match length, the suffix index's
    # continuation share, a model's probability of its token); None when it has none (NaN: none for that token).
    # Policies learn what each level of a drafter's signal is worth in accepted tokens (metasd.policy.acceptance), so
    # the scale need not be calibrated.
    confidence: list[float] | None = None
    # Forwards a model drafter ran for this draft (0 for free drafters): as many as its tokens, one more when it
    # stopped before drawing a token, whose q it computed and paid for. Its cache then holds forwards - 1 of them.
    forwards: int = 0
    # A model drafter's second choice at each of its tokens: (the likeliest token of q_j other than the one drawn,
    # its probability). A draft tree can verify it as a sibling (EAGLE-2's top-k expansion at one more token),
    # tried after the drawn token is rejected, so sampling stays exact (`metasd.verify`).
    runners_up: list[tuple[int, float]] | None = None

    def truncated(self, k: int) -> Draft:
        """The first k tokens. Lossless for one-hot drafts (q None): their tokens are deterministic, so cutting
        after looking at them biases nothing; a sampled draft may only be cut by a rule that sees earlier tokens."""
        if k >= len(self.tokens):
            return self
        return Draft(
            self.tokens[:k],
            None if self.q is None else self.q[:k],
            None if self.confidence is None else self.confidence[:k],
            self.forwards,
            None if self.runners_up is None else self.runners_up[:k],
        )

    def followed_by(self, tail: Draft) -> Draft:
        """This draft, then `tail`: a one-hot draft proposed for the context extended by this one's tokens.

        Sampled verification stays exact: each tail token is a deterministic function of the context and the
        tokens before it, so its q is one-hot, and rows of the one-hot draft are written out only where this
        draft carries q rows. A side without confidence gets NaN (no signal) for its tokens."""
        if tail.q is not None:
            raise ValueError("only a one-hot draft (q None) can follow another: its tokens must be deterministic")
        q = self.q
        if q is not None and tail.tokens:
            one_hot = torch.zeros(len(tail.tokens), q.shape[-1], dtype=q.dtype)
            one_hot[torch.arange(len(tail.tokens)), torch.tensor(tail.tokens)] = 1.0
            q = torch.cat([q, one_hot])
        confidence = None
        if self.confidence is not None or tail.confidence is not None:
            confidence = [
                *(self.confidence or [math.nan] * len(self.tokens)),
                *(tail.confidence or [math.nan] * len(tail.tokens)),
            ]
        return Draft(self.tokens + tail.tokens, q, confidence, self.forwards, self.runners_up)


class StopRule(Protocol):
    """How a policy ends a model drafter's draft early, asked twice per token j:

    - `before(j, q_j)`: q_j computed (that forward is paid), token j not yet drawn: is it worth verifying?
    - `after(j, q_j, token)`: token j drawn: is another drafter forward, for token j + 1, worth paying for?

    Neither may drop a drawn token, so the draft stays a sample of q and sampled verification stays exact: `before`
    decides on q_j alone, and `after` only ends the draft *after* token j (a stopping time, which the acceptance
    rule does not care about), while a cut that looked at a drawn token and dropped it would favour tokens the
    drafter liked.
    """

    def before(self, j: int, q: torch.Tensor) -> bool: ...
    def after(self, j: int, q: torch.Tensor, token: int) -> bool: ...


@runtime_checkable
class StoppableDrafter(Protocol):
    """A drafter that lets a `StopRule` end its draft early."""

    def propose_until(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None, stop: StopRule
    ) -> Draft: ...


@runtime_checkable
class Drafter(Protocol):
    name: str
    has_cache: bool  # True when sitting out rounds leaves state to catch up on (counted by the engine)
    # An optional attribute, not part of the protocol (default False): `learns_across_requests = True` when `end`
    # teaches the drafter something the next request drafts from (the suffix drafter indexes outputs). The
    # benchmark snapshots exactly these drafters so that every method meets the same history (bench/history.py);
    # the others may hold unpicklable shared state, such as a datastore's memory maps.

    def begin(self, prompt: list[int]) -> None:
        """A new request starts from this prompt."""

    def end(self, context: list[int]) -> None:
        """The request ended (finished or abandoned) with this context: prompt + every generated token.

        Drafters that learn across requests index the output here, not only the part they happened to draft on.
        """

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        """Up to k tokens to follow context (fewer or none is allowed), drawn under params."""


def for_request(drafter: Drafter) -> Drafter:
    """The drafter for one request among several in flight (a batch): its own per-request state (`begin` makes it),
    the weights and what it learns across requests shared. A drafter with more per-request state than `begin`
    rebuilds (a model drafter's KV cache) defines `fork()`; the others are copied shallowly."""
    fork = getattr(drafter, "fork", None)
    return fork() if fork is not None else copy.copy(drafter)


def draft_autoregressively(
    next_q: Callable[[list[int]], torch.Tensor],
    context: list[int],
    k: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    stop: StopRule | None,
) -> Draft:
    """A model drafter's draft: up to k tokens, each drawn from next_q(sequence so far), one forward per call; the
    stop rule may end it before token j is drawn or after it (`StopRule`). Each token's confidence is the largest
    probability of its q (for greedy drafting, that of the token itself); its runner-up the likeliest other token."""
    seq = list(context)
    rows: list[torch.Tensor] = []
    confidence: list[float] = []
    runners_up: list[tuple[int, float]] = []
    forwards = 0
    for j in range(k):
        q = next_q(seq)
        forwards += 1
        if stop is not None and stop.before(j, q):
            break
        seq.append(pick(q, params, generator))
        rows.append(q)
        confidence.append(float(q.max()))
        top = torch.topk(q, 2)
        second = 1 if int(top.indices[0]) == seq[-1] else 0
        runners_up.append((int(top.indices[second]), float(top.values[second])))
        if stop is not None and j + 1 < k and stop.after(j, q, seq[-1]):
            break
    return Draft(seq[len(context) :], torch.stack(rows) if rows else None, confidence, forwards, runners_up)


class AutoregressiveDrafter:
    """A model drafter: one forward per drafted token, each token drawn from the q its `next_q` computes; the
    engine's policy may stop it early (`StoppableDrafter`). Subclasses set `name` and implement `begin`, `next_q`."""

    has_cache = True

    def end(self, context: list[int]) -> None:
        pass

    def next_q(self, context: list[int], params: SamplingParams) -> Callable[[list[int]], torch.Tensor] | None:
        """For a draft after `context`: a function from the sequence so far to the next token's q (one forward per
        call), or None when no draft can be made now."""
        raise NotImplementedError

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        return self.propose_until(context, k, params, generator, None)

    def propose_until(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        stop: StopRule | None,
    ) -> Draft:
        next_q = self.next_q(context, params)
        if next_q is None:
            return Draft([], None, [], 0)
        return draft_autoregressively(next_q, context, k, params, generator, stop)
