"""One speculative round, for one request or a batch: `run_round`, and what a request carries between its phases
(`RoundState`: its clock, what the policy saw and chose, the tree verified).

A request decoding alone (`Generation.step`) and a batch (`metasd.batching`) run the same round; they differ in
the verifier (the decoder's cache, or the batch's rows) and in who decides each request's draft (`OwnChoice`, or
the batch's decision).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .draft import Draft, DraftJob
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
        """Seconds the chosen drafter drafted."""
        return self.drafted - self.chosen

    @property
    def forward_seconds(self) -> float:
        """Seconds of the target's forward."""
        return self.forwarded - self.verifying

    @property
    def accept_seconds(self) -> float:
        """Seconds of this request's acceptance rule."""
        return self.verified - self.accepting

    @property
    def verify_seconds(self) -> float:
        """The forward and this request's own acceptance rule: in a batch, not the requests accepted before it."""
        return self.forward_seconds + self.accept_seconds

    @property
    def total_seconds(self) -> float:
        """Seconds from the round's start to the end of its learning."""
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
    forward: tuple[int, int] = (1, 1)  # the target forward's rows and padded width (B, W): T(B, W) prices it


class RoundRequest(Protocol):
    """What a round needs of a request in flight (`generation.Generation`)."""

    context: list[int]
    target: Any  # its handle in the verifier's cache: the decoder's `CachedModel`, or a batch's row
    policy: Any  # its `Policy`, or None (plain decoding)

    @property
    def room(self) -> int: ...

    def start_round(self, propose: bool = True) -> RoundState: ...

    def choose(self, state: RoundState) -> None: ...

    def draft_job(self, state: RoundState) -> DraftJob | None: ...

    def draft(self, state: RoundState, stop_rules: bool = True, drafted: tuple[Draft, float] | None = None) -> None: ...

    def accept(self, state: RoundState, logits: torch.Tensor, prefilled: bool, alone: bool) -> list[int]: ...


class Verifier(Protocol):
    """The target over one request's cache or a batch's rows: logits [1 + tree.size, V] per (handle, context,
    tree), row 0 after the context and 1 + i after node i, all in one model call."""

    def forward(
        self, items: list[tuple[Any, list[int], DraftTree]], prefill: Sequence[tuple[Any, list[int]]] = ()
    ) -> list[torch.Tensor]:
        """prefill: joining requests' handles and the prompt tokens each should hold after this forward (chunks
        of their prompts sharing the forward; a batch's verifier only)."""
        ...


class RoundDecision(Protocol):
    """Which drafter and how many tokens each request drafts: its own choice alone (`OwnChoice`), or one decision
    for a batch (`metasd.batching.decision.BatchDecision`)."""

    def start(self, requests: Sequence[RoundRequest]) -> list[RoundState]: ...

    def choose(self, requests: Sequence[RoundRequest], states: Sequence[RoundState]) -> None: ...

    def observe(self, size: int, width: int, seconds: float) -> None: ...


class OwnChoice:
    """A request's own choice (its policy's, with its stop rule and T(M)): what a request decoding alone uses. Its
    acceptance measures T(M) from the round's clock, so nothing is observed here."""

    def start(self, requests: Sequence[RoundRequest]) -> list[RoundState]:
        return [request.start_round() for request in requests]

    def choose(self, requests: Sequence[RoundRequest], states: Sequence[RoundState]) -> None:
        for request, state in zip(requests, states, strict=True):
            request.choose(state)

    def observe(self, size: int, width: int, seconds: float) -> None:
        pass


def drafts_together(jobs: Sequence[DraftJob | None]) -> list[tuple[Draft, float] | None]:
    """A batch's model drafts, drafted together where several requests chose forks that share a `batch_key` (one
    forward per drafted token for all, vLLM's batch-first proposers); None where a job is None or alone (its request
    drafts it as it would alone). Each draft comes with the seconds it is charged (`Drafter.draft_batch`)."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, job in enumerate(jobs):
        key = None if job is None else job.drafter.batch_key()
        if key is not None:
            groups[(type(job.drafter), key)].append(i)
    out: list[tuple[Draft, float] | None] = [None] * len(jobs)
    for (kind, _), members in groups.items():
        if len(members) < 2:
            continue
        for i, drafted in zip(members, kind.draft_batch([jobs[i] for i in members]), strict=True):
            out[i] = drafted
    return out


def run_round(
    requests: Sequence[RoundRequest],
    verifier: Verifier,
    decision: RoundDecision,
    prefill: Sequence[tuple[Any, list[int]]] = (),
) -> list[list[int]]:
    """One speculative round for one request or many, in EAGLE's phases (Li et al., arXiv 2401.15077): start and
    decide, draft, one target forward over every request's context and tree, then each request's acceptance rule,
    emission and learning. prefill: chunks of joining prompts that share the forward (chunked prefill); the
    forward then measures no cost of its own shape. Returns the tokens each request added."""
    alone = len(requests) == 1 and not prefill
    states = decision.start(requests)  # 1. lags, room and the free drafters' proposals
    decision.choose(requests, states)  # 2. (drafter, k) per request
    single = len(requests) == 1  # 3. drafts: in a batch, its decision chose k, and forks of one model draft together
    drafted = [None] if single else drafts_together([r.draft_job(s) for r, s in zip(requests, states, strict=True)])
    for request, state, together in zip(requests, states, drafted, strict=True):
        request.draft(state, stop_rules=single, drafted=together)
    fed = [request.target.fed_tokens for request in requests]
    items = [(request.target, request.context, state.tree) for request, state in zip(requests, states, strict=True)]
    started = time.perf_counter()
    logits = verifier.forward(items, prefill=prefill)  # 4. one target forward
    ended = time.perf_counter()
    shape = (len(requests), max(state.tree.size for state in states) + 1)
    if not prefill:
        decision.observe(*shape, ended - started)
    added = []
    for request, state, rows, before in zip(requests, states, logits, fed, strict=True):  # 5. accept, emit, learn
        state.clock.verifying, state.clock.forwarded, state.forward = started, ended, shape
        # the forward took in a prompt too (its own, or a joiner's chunk): the policy is rewarded as without it
        prefilled = bool(prefill) or request.target.fed_tokens - before > state.tree.size + 1
        added.append(request.accept(state, rows, prefilled=prefilled, alone=alone))
    return added
