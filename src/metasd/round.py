"""One round of a request between its phases: its clock, what the policy saw and chose, and the tree verified.

`Generation.step` runs the phases for one request (`start_round`, `choose`, `draft`, the target's forward,
`accept`); a batch (`metasd.batching`) runs each phase for every request in flight around one forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .draft import Draft
from .outcome import Extension
from .tree import DraftTree


@dataclass
class RoundClock:
    """A round's timestamps (time.perf_counter), named by what had just happened."""

    started: float = field(default_factory=lambda: time.perf_counter())
    chosen: float = 0.0  # the policy chose (drafter, k)
    drafted: float = 0.0  # the chosen drafter drafted
    verifying: float = 0.0  # any continuation appended; the target's forward starts
    forwarded: float = 0.0  # the target's forward returned
    accepting: float = 0.0  # this request's acceptance rule starts (in a batch, after other requests' acceptance)
    verified: float = 0.0  # the acceptance rule decided
    finished: float = 0.0  # the policy learned, caches synced

    @property
    def draft_seconds(self) -> float:
        return self.drafted - self.chosen

    @property
    def forward_seconds(self) -> float:
        return self.forwarded - self.verifying

    @property
    def accept_seconds(self) -> float:
        return self.verified - self.accepting

    @property
    def verify_seconds(self) -> float:
        """The forward and this request's own acceptance rule: in a batch, not the requests accepted before it."""
        return self.forward_seconds + self.accept_seconds

    @property
    def total_seconds(self) -> float:
        return self.finished - self.started


@dataclass
class RoundState:
    """One round of a request between its phases: what the policy saw, what it chose, and the tree the target
    verifies."""

    clock: RoundClock
    room: int  # the longest draft this round may verify (max_draft, and the tokens still wanted)
    remaining: int  # tokens the request may still generate
    lags: list[int]  # tokens each model drafter must take in before drafting
    fresh: list[bool]  # model drafters that have not drafted in this request yet
    proposals: dict[int, Draft]  # every free drafter's proposal (for policies that want them)
    proposal_times: dict[int, float]
    arm: int | None = None
    k: int = 0
    draft: Draft = field(default_factory=lambda: Draft([]))
    extension: Extension | None = None
    tree: DraftTree = field(default_factory=DraftTree)
