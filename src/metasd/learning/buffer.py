"""A bounded buffer of verified sequences: what a head learns from, per history key.

Every verification forward computes, at each position it accepts, what an EAGLE head trains on: the target's
features (and from the final norm's, its next-token distribution). A request's sequence joins the buffer when it
ends; the oldest sequences leave once the buffer holds more than its cap in tokens, so memory stays bounded
(D bfloat16 values per token: 2 * D bytes).
"""

from __future__ import annotations

from collections import deque

import torch

from ..specialists.eagle_corpus import TokenFeatures


class TrafficBuffer:
    """Sequences (`TokenFeatures`: tokens, features, prompt length) of finished requests, oldest first, at most
    `cap_tokens` tokens in all; a sequence keeps its last `longest` tokens at most (training's window: a long
    prompt cut from its start leaves the answer, what drafting is judged on; the features carry the context)."""

    def __init__(self, cap_tokens: int, longest: int | None = None):
        if cap_tokens < 2 or (longest is not None and longest < 2):
            raise ValueError(f"a traffic buffer keeps at least 2 tokens, got a cap of {cap_tokens}, longest {longest}")
        self.cap_tokens = cap_tokens
        self.longest = cap_tokens if longest is None else min(longest, cap_tokens)
        self.sequences: deque[TokenFeatures] = deque()
        self.tokens = 0  # held now
        self.added = 0  # ever added: what "new since the last training" counts from

    def add(self, tokens: torch.Tensor, features: torch.Tensor, prompt: int) -> None:
        """Append a request's tokens [n] and features [n, D]; drop the oldest sequences past the cap."""
        if len(tokens) != len(features):
            raise ValueError(f"{len(tokens)} tokens and {len(features)} feature rows")
        cut = max(0, len(tokens) - self.longest)
        seq = TokenFeatures(tokens[cut:].clone(), features[cut:].clone(), max(0, prompt - cut))
        self.sequences.append(seq)
        self.tokens += len(seq.tokens)
        self.added += len(seq.tokens)
        while self.tokens > self.cap_tokens:
            self.tokens -= len(self.sequences.popleft().tokens)

    def split(
        self, held_share: float, max_tokens: int | None = None
    ) -> tuple[list[TokenFeatures], list[TokenFeatures]]:
        """(held out, to train on): the newest sequences holding about `held_share` of the tokens (at most about
        `max_tokens`; at least one sequence), and the rest. The newest are held out: what the head will meet next
        is more like them."""
        seqs = list(self.sequences)
        want = held_share * self.tokens if max_tokens is None else min(held_share * self.tokens, max_tokens)
        held, tokens = [], 0
        while seqs and (not held or tokens < want) and len(seqs) > 1:
            held.append(seqs.pop())
            tokens += len(held[-1].tokens)
        return held[::-1], seqs
