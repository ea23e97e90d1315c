"""A draft: the tokens a drafter proposes for one round, with the distribution q they were drawn from (None when
they are deterministic), the drafter's confidence per token, and a model drafter's forwards and runners-up. The
engine, trees, policies and drafters all read it, so it sits at the bottom of the package; beside it `DraftJob`, a
draft one request asks of its model drafter in a batch's round."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .sampling import SamplingParams


@dataclass
class Draft:
    """The tokens a drafter proposes for one round, with what the acceptance rule and the policies read of them."""

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
    # Tokens a model drafter took in before drafting, where it knows them better than the engine's count of what
    # it missed (a fork that moves to a row of its own in a batch takes in its whole context there); None: the
    # engine's count. The drafter's costs learn from it.
    taken_in: int | None = None

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
            self.taken_in,
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
        return Draft(self.tokens + tail.tokens, q, confidence, self.forwards, self.runners_up, self.taken_in)


@dataclass(frozen=True)
class DraftJob:
    """One request's model draft in a batch's round: its fork of the chosen drafter (a `drafters.base.Drafter`),
    the context, the length the batch's decision chose, and the request's sampling."""

    drafter: Any
    context: list[int]
    k: int
    params: SamplingParams
    generator: torch.Generator | None
