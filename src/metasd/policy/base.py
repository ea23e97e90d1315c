"""The policy interface the engine drives, and the arm statistics every classic bandit shares.

Choosing a drafter each round is a multi-armed bandit (MetaSD, Kim, Jung & Yun, arXiv 2604.05417): a classic
policy sees only the arm it picked and the reward in [0, 1] the engine computed for it, and keeps per-arm
``pulls`` and ``mean_rewards`` so the engine can report statistics whichever policy ran.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol, Self

import numpy as np

from ..costs import CostModel
from ..draft import Draft
from ..drafters.base import StopRule
from ..outcome import RoundOutcome
from ..tree import DraftTree
from .hindsight import Hindsight
from .rewards import reward


class Policy(Protocol):
    """What the engine needs: choose (drafter, draft length), learn from the round, forget at a request's start.

    The classic bandits below choose only the drafter (k is the decoder's draft length) and learn through
    select / update / observe; `metasd.policy.adaptive` chooses both from measured costs.
    """

    reward: str  # which reward the policy learns from: see metasd.policy.rewards.REWARDS ("rate" for metasd-adaptive)
    full_information: bool  # also learns, in hindsight, from every free drafter that did not draft the round
    wants_proposals: bool  # the engine asks every free drafter for a proposal each round, before choose()
    extends: bool  # the engine offers a model drafter's draft for continuation by a free drafter (`extension`)
    grows_trees: bool  # the engine asks which free proposals to verify beside the chosen draft (`branches`)
    max_draft: int | None  # longest draft it may choose; None: the decoder's draft_len
    uses_costs: bool  # plans from the machine's cost model (`attach`), within the T(M) range calibrated for it
    carries_over: bool  # kept from request to request whatever the decoder's policy scope (reset() starts a request)
    pulls: list[int]
    mean_rewards: list[float]

    def choose(
        self,
        k: int,
        proposals: Mapping[int, Draft],
        lags: Sequence[int],
        *,
        remaining: int | None = None,
        fresh: Sequence[bool] | None = None,
    ) -> tuple[int | None, int]:
        """The drafter (None: a plain step) and draft length (<= k) of this round. lags: tokens each drafter must
        take in before drafting (its prompt when fresh: it has not drafted in this request yet); remaining: the
        tokens the request may still generate."""

    def stop_rule(self, arm: int, k: int) -> StopRule | None:
        """How model drafter `arm`, sent out for up to `k` tokens, ends its draft early (None: it drafts them all)."""

    def extension(self, arm: int, draft: Draft, proposals: Mapping[int, Draft]) -> tuple[int, int] | None:
        """After model drafter `arm` drafted: which free drafter's proposal for the context extended by the draft
        to append, and how many of its tokens (None: none). Asked only of policies with `extends`."""

    def branches(self, tree: DraftTree, proposals: Mapping[int, Draft], max_nodes: int) -> list[tuple[int, Draft]]:
        """Branches (drafter, deterministic draft) to join the round's tree, which holds the chosen draft; the tree
        stays within max_nodes. Asked only of policies with `grows_trees`."""

    def feedback(self, outcome: RoundOutcome) -> float | None:
        """Learn from a verified round; returns the reward the policy scored it with (None: it scored nothing, as
        for a plain step), which the engine reports."""

    def finish(self, context: list[int]) -> None:
        """The request ended with `context`: judge the proposals still waiting on output by the output there is."""

    def reset(self) -> None:
        """Start a request: forget what was learned, or (`carries_over`) only what belongs to the last request."""

    def revise(self, revisions: Sequence[Hashable]) -> None:
        """A request starts with the drafters at these revisions (`Drafter.revision`): what the policy carried
        across requests of a drafter whose revision changed described another drafter, and is forgotten."""

    def attach(
        self, costs: CostModel, names: Sequence[str], free: Sequence[bool], stoppable: Sequence[bool], regime: str
    ) -> None:
        """The engine hands over the machine's cost model and what each drafter is (policies with `uses_costs`)."""

    def options(self, k: int, proposals: Mapping[int, Draft], lags: Sequence[int], **seen) -> list | None:
        """For a batch's decision: every (drafter, length) it would consider with its expected tokens and drafting
        time (`adaptive.Option`), or None: it fixes its own choice (`choose`), as the paper's bandits do."""

    def ceiling(self, k: int) -> np.ndarray | None:
        """Expected tokens of the best draft of 0..k tokens any drafter could offer now (None: no bound known)."""

    def set_bar(self, rate: float) -> None:
        """The rate a batch's round reached: what the round's later choices must beat."""

    def snapshot(self) -> dict:
        """Everything the policy learned, as a value (`Learned`)."""

    def restore(self, snapshot: dict) -> None:
        """Back to what `snapshot` holds."""

    def for_request(self) -> Policy:
        """A copy for one request among several in flight, starting from what this policy learned."""

    def copy_start(self) -> dict | None:
        """What `take_back` needs of this policy when a copy of it starts."""

    def take_back(self, copy: Policy, start: dict | None) -> None:
        """A request's copy ended: what it learned since `start` becomes this policy's."""


class Learned:
    """What a policy has learned, as a value: `snapshot` it, `restore` it later or into a copy (`for_request`).
    Attributes named in `shared` (the machine's cost model) are the decoder's, live, and never part of it."""

    shared: tuple[str, ...] = ("costs",)
    revisions: tuple = ()  # the drafters' revisions (`Drafter.revision`) the statistics were learned under

    def revise(self, revisions: Sequence[Hashable]) -> None:
        """Forget what was learned of each drafter whose revision differs from the one it was learned under
        (`forget_drafters`)."""
        revisions = tuple(revisions)
        learned_under = self.revisions or revisions  # the first request: nothing learned yet
        changed = [arm for arm, (was, now) in enumerate(zip(learned_under, revisions, strict=True)) if was != now]
        self.revisions = revisions
        if changed:
            self.forget_drafters(changed)

    def forget_drafters(self, arms: Sequence[int]) -> None:
        """Forget what was learned of these drafters (default: everything, since the statistics compare them)."""
        self.reset()

    def snapshot(self) -> dict:
        """A deep copy of everything the policy learned, and the revisions it was learned under."""
        learned = {k: v for k, v in vars(self).items() if k not in self.shared}
        return copy.deepcopy({"revisions": self.revisions, **learned})

    def restore(self, snapshot: dict) -> None:
        """Back to what `snapshot` holds (a copy of it: the snapshot can be restored again)."""
        vars(self).update(copy.deepcopy(snapshot))

    def for_request(self) -> Self:
        """A policy of its own for one request among several in flight, starting from what this one has learned,
        sharing its cost model."""
        twin = copy.copy(self)
        vars(twin).update(self.snapshot())  # a deep copy already: restore() would copy it again
        return twin

    def copy_start(self) -> dict | None:
        """What `take_back` needs of this policy when a copy of it starts (default: nothing)."""
        return None

    def take_back(self, copy: Self, start: dict | None) -> None:
        """A request's copy (`for_request`) ended: what it learned becomes this policy's, for the requests after
        it (default: its state replaces this one's; the copy is done with, so its objects are taken, not copied),
        unless a drafter was revised since the copy started: then it learned of a drafter that is no more."""
        if copy.revisions == self.revisions:
            vars(self).update({k: v for k, v in vars(copy).items() if k not in self.shared})


def state_delta(a: dict, b: dict | None) -> dict:
    """a - b, statistic by statistic, of two `ArmStats.state()`s (b None: zero): what a policy learned since b."""
    if b is None:
        return {"pulls": list(a["pulls"]), "sums": list(a["sums"]), "rounds": a["rounds"]}
    return {
        "pulls": [x - y for x, y in zip(a["pulls"], b["pulls"], strict=True)],
        "sums": [x - y for x, y in zip(a["sums"], b["sums"], strict=True)],
        "rounds": a["rounds"] - b["rounds"],
    }


class ArmStats(Learned):
    """Per-arm counts and running means shared by the classic bandits; reset() forgets them.

    It also adapts them to the engine's interface: choose() is select() at the full draft length, feedback()
    computes the policy's reward and calls update(), and (full information) scores every other free drafter's
    proposal once the output has decided it (`metasd.policy.hindsight`), through observe().
    """

    full_information = False
    extends = False  # the paper's bandits score whole drafts of the drafter they picked
    grows_trees = False  # and verify that drafter's draft alone
    max_draft: int | None = None
    uses_costs = False  # the reward prices a round, no plan does
    carries_over = False

    def __init__(self, n_arms: int, reward: str = "bd") -> None:
        if n_arms < 1:
            raise ValueError("a policy needs at least one drafter")
        self.n_arms = n_arms
        self.reward = reward
        self.hindsight = Hindsight()
        self.reset()

    @property
    def wants_proposals(self) -> bool:
        """Whether the engine asks every free drafter for a proposal each round: with full information only."""
        return self.full_information

    def reset(self) -> None:
        self.pulls = [0] * self.n_arms
        self.mean_rewards = [0.0] * self.n_arms
        self.rounds = 0
        self.hindsight.clear()

    def state(self) -> dict:
        """Sufficient statistics (per-arm pulls and reward sums, rounds played): what replicas share."""
        return {
            "pulls": list(self.pulls),
            "sums": [m * n for m, n in zip(self.mean_rewards, self.pulls, strict=True)],
            "rounds": self.rounds,
        }

    def attach(
        self, costs: CostModel, names: Sequence[str], free: Sequence[bool], stoppable: Sequence[bool], regime: str
    ) -> None:
        pass

    def options(self, k: int, proposals: Mapping[int, Draft], lags: Sequence[int], **seen) -> None:
        return None  # a bandit fixes its own choice

    def ceiling(self, k: int) -> None:
        return None

    def set_bar(self, rate: float) -> None:
        pass

    def copy_start(self) -> dict:
        return self.state()

    def take_back(self, copy: ArmStats, start: dict | None) -> None:
        """Add the statistics the copy gathered to those other copies added meanwhile, unless a drafter was
        revised since the copy started (its statistics compare drafters one of which is no more)."""
        if copy.revisions == self.revisions:
            self.merge(state_delta(copy.state(), start))

    def merge(self, delta: dict) -> None:
        """Add statistics learned elsewhere (a `state()`, or the difference of two) to this policy's."""
        if len(delta["pulls"]) != self.n_arms or len(delta["sums"]) != self.n_arms:
            raise ValueError(f"statistics of {len(delta['pulls'])} arms cannot merge into {self.n_arms}")
        for arm, (n, total) in enumerate(zip(delta["pulls"], delta["sums"], strict=True)):
            pulls = self.pulls[arm] + n
            if pulls < 0:
                raise ValueError(f"merging leaves arm {arm} with {pulls} pulls")
            self.mean_rewards[arm] = (self.mean_rewards[arm] * self.pulls[arm] + total) / pulls if pulls else 0.0
            self.pulls[arm] = pulls
        self.rounds += delta["rounds"]

    def choose(
        self,
        k: int,
        proposals: Mapping[int, Draft],
        lags: Sequence[int],
        *,
        remaining: int | None = None,
        fresh: Sequence[bool] | None = None,
    ) -> tuple[int | None, int]:
        return self.select(), k

    def select(self) -> int:
        """The arm (drafter index) to play this round: the bandit's own rule."""
        raise NotImplementedError

    def stop_rule(self, arm: int, k: int) -> StopRule | None:
        return None

    def feedback(self, outcome: RoundOutcome) -> float | None:
        if outcome.arm is None:
            return None
        d = outcome.draft
        score = reward(
            self.reward,
            outcome.p,
            d.q,
            d.tokens,
            outcome.accepted,
            outcome.k,
            outcome.draft_time,
            outcome.verify_time,
            outcome.target_tokens,
        )
        self.update(outcome.arm, score)
        if self.full_information:
            for arm, draft in outcome.proposals.items():
                if arm != outcome.arm:  # an empty proposal is decided at once: it earns the target's token only
                    self.hindsight.add(arm, outcome.start, draft.tokens[: outcome.k] or [-1], outcome)
            self._judge(outcome.context, final=False)
        return score

    def finish(self, context: list[int]) -> None:
        self._judge(context, final=True)

    def _judge(self, context: list[int], final: bool) -> None:
        """Hindsight rewards (be-cost style: a drafter's accepted length is all a draft without q shows)."""
        for d in self.hindsight.resolve(context, final):
            o: RoundOutcome = d.pending.info
            self.observe(
                d.pending.arm,
                reward(
                    self.reward,
                    None,
                    None,
                    d.pending.tokens,
                    d.matched,
                    o.k,
                    0.0,
                    o.verify_time,
                    d.pending.tokens[: d.matched],
                ),
            )

    def update(self, arm: int, reward: float) -> None:
        """Learn the reward in [0, 1] that the played `arm` earned this round."""
        self._record(arm, reward)

    def observe(self, arm: int, reward: float) -> None:
        """Learn an arm's reward without a round played: t in UCB's bonus counts selections only, or the arms
        that are never observed for free would get an exploration bonus that grows with every free observation."""
        self._record(arm, reward, played=False)

    def _record(self, arm: int, reward: float, played: bool = True) -> float:
        """Validate and record one observation; returns the reward clipped to [0, 1]."""
        if not 0 <= arm < self.n_arms:
            raise ValueError(f"arm {arm} out of range for {self.n_arms} drafters")
        if not -1e-9 <= reward <= 1 + 1e-9:  # tolerate float round-off only; NaN fails here too
            raise ValueError(f"reward must be in [0, 1], got {reward}")
        reward = min(max(reward, 0.0), 1.0)
        self.pulls[arm] += 1
        self.mean_rewards[arm] += (reward - self.mean_rewards[arm]) / self.pulls[arm]
        self.rounds += played
        return reward
