"""Full-information feedback without censoring: a proposal is judged against the tokens actually generated after it.

A drafter without a model proposes in microseconds and deterministically, so it can be asked every round, whether
or not it drafts. Judging its proposal against only the tokens verified that round would cap it at the chosen
drafter's accepted length; instead the proposal waits until the output has decided it: at its first mismatch, or
once the output covers all its tokens. Under greedy decoding the output is the target's own choice at every
position, so "matches the output" is exactly "would have been accepted". Under sampling, for a one-hot draft it has
the same probability (a token x is accepted with probability p(x), the chance the target samples x), so the estimate
stays unbiased.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Pending:
    """A proposal waiting for the output to decide it: drafter `arm`'s `tokens`, proposed at output position
    `start`."""

    arm: int
    start: int  # context length when proposed: the output position of its first token
    tokens: list[int]
    info: Any = None  # whatever the policy needs back (signals, timings)


@dataclass(frozen=True)
class Decided:
    """A proposal the output has decided: how many of its leading tokens matched, and how many positions are known."""

    pending: Pending
    matched: int  # leading tokens equal to the output
    decided: int  # positions whose fate is known (a mismatch decides everything after it too)


class Hindsight:
    """The proposals of one request still waiting for the output to decide them."""

    def __init__(self) -> None:
        self.pending: list[Pending] = []

    def clear(self) -> None:
        """Forget every waiting proposal (a request starts)."""
        self.pending = []

    def add(self, arm: int, start: int, tokens: list[int], info: Any = None) -> None:
        """Wait on drafter `arm`'s `tokens` proposed at output position `start` (an empty proposal is dropped);
        `info` comes back with its verdict."""
        if tokens:
            self.pending.append(Pending(arm, start, list(tokens), info))

    def resolve(self, context: list[int], final: bool = False) -> list[Decided]:
        """Proposals the output now decides; with final (the request ended), all the rest, as far as the output
        goes (positions past its end stay unknown)."""
        done, waiting = [], []
        for p in self.pending:
            seen = context[p.start : p.start + len(p.tokens)]
            matched = next((i for i, (a, b) in enumerate(zip(p.tokens, seen, strict=False)) if a != b), len(seen))
            if matched < len(seen):  # a mismatch: the rest of the proposal cannot be accepted either
                done.append(Decided(p, matched, matched + 1))
            elif len(seen) == len(p.tokens) or final:
                done.append(Decided(p, matched, len(seen)))
            else:
                waiting.append(p)
        self.pending = waiting
        return done
