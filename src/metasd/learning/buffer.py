"""A bounded buffer of verified sequences: what a head learns from, per history key.

Every verification forward computes, at each position it accepts, what an EAGLE head trains on: the target's
features (and from the final norm's, its next-token distribution). A request's sequence joins the buffer when it
ends; the oldest sequences leave once the buffer holds more than its cap in tokens, so memory stays bounded
(D bfloat16 values per token: 2 * D bytes).
"""

from __future__ import annotations

from collections import deque

import torch

from ..specialists.eagle_sequences import TokenFeatures


class TrafficBuffer:
    """Sequences (`TokenFeatures`: tokens, features, prompt length) of finished requests, oldest first, at most
    `cap_tokens` tokens in all; a sequence keeps its last `longest` tokens at most (training's window: a long
    prompt cut from its start leaves the answer, what drafting is judged on; the features carry the context).

    What a head in service was trained on is a prefix of the sequences in the order they came (`split` trains on
    all but the newest): `trained` counts the sequences ever added that it may have learned, so a held-out set is
    drawn only from the ones after them, however closely the rounds follow each other."""

    def __init__(self, cap_tokens: int, longest: int | None = None):
        if cap_tokens < 2 or (longest is not None and longest < 2):
            raise ValueError(f"a traffic buffer keeps at least 2 tokens, got a cap of {cap_tokens}, longest {longest}")
        self.cap_tokens = cap_tokens
        self.longest = cap_tokens if longest is None else min(longest, cap_tokens)
        self.sequences: deque[TokenFeatures] = deque()
        self.tokens = 0  # held now
        self.added = 0  # tokens ever added: what "new since the last training" counts from
        self.dropped = 0  # sequences ever dropped (the oldest first)
        self.trained = 0  # sequences ever added that a head in service may have trained on

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
            self.drop_oldest()

    def drop_oldest(self) -> int:
        """Drop the oldest sequence (a cap over several buffers makes room); the tokens freed."""
        freed = len(self.sequences.popleft().tokens)
        self.tokens -= freed
        self.dropped += 1
        return freed

    def split(
        self, held_share: float, max_tokens: int | None = None
    ) -> tuple[list[TokenFeatures], list[TokenFeatures], int]:
        """(held out, to train on, mark): the newest sequences holding about `held_share` of the tokens (at most
        about `max_tokens`; at least one sequence), none of them trained on by a head in service, and the rest.
        The newest are held out: what the head will meet next is more like them. Once a head trained on the rest
        is in service, `mark_trained(mark)`. Nothing to hold out or nothing left to train on: both empty."""
        seqs = list(self.sequences)
        fresh = len(seqs) - max(0, self.trained - self.dropped)  # the newest sequences no head in service learned
        want = held_share * self.tokens if max_tokens is None else min(held_share * self.tokens, max_tokens)
        held, tokens = [], 0
        while fresh > len(held) and (not held or tokens < want) and len(seqs) > 1:
            held.append(seqs.pop())
            tokens += len(held[-1].tokens)
        if not held or not seqs:
            return [], [], self.trained
        return held[::-1], seqs, self.dropped + len(seqs)

    def mark_trained(self, mark: int) -> None:
        """A head trained on a split's sequences (`split`'s mark) is in service: later held-out sets leave them out."""
        self.trained = max(self.trained, mark)
