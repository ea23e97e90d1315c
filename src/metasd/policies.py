"""Drafter-selection policies: choosing a drafter each round is a multi-armed bandit (MetaSD).

Every policy sees only the arm it picked and the reward in [0, 1] the engine computed for it, and keeps
per-arm ``pulls`` and ``mean_rewards`` so the engine can report statistics whichever policy ran.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from . import adaptive
from .drafters.base import Draft, StopRule
from .hindsight import Hindsight
from .outcome import RoundOutcome
from .rewards import reward


class Policy(Protocol):
    """What the engine needs: choose (drafter, draft length), learn from the round, forget at a request's start.

    The classic bandits below choose only the drafter (k is the decoder's draft length) and learn through
    select / update / observe; `metasd.adaptive` chooses both from measured costs.
    """

    reward: str  # which reward the policy learns from: see metasd.rewards.REWARDS ("rate" for metasd-adaptive)
    full_information: bool  # also learns, in hindsight, from every free drafter that did not draft the round
    wants_proposals: bool  # the engine asks every free drafter for a proposal each round, before choose()
    extends: bool  # the engine offers a model drafter's draft for continuation by a free drafter (`extension`)
    max_draft: int | None  # longest draft it may choose; None: the decoder's draft_len
    pulls: list[int]
    mean_rewards: list[float]

    def choose(self, k: int, proposals: Mapping[int, Draft], lags: Sequence[int], *, remaining: int | None = None,
               fresh: Sequence[bool] | None = None) -> tuple[int | None, int]:
        """The drafter (None: a plain step) and draft length (<= k) of this round. lags: tokens each drafter must
        take in before drafting (its prompt when fresh: it has not drafted in this request yet); remaining: the
        tokens the request may still generate."""
    def stop_rule(self, arm: int, k: int) -> StopRule | None: ...
    def extension(self, arm: int, draft: Draft, proposals: Mapping[int, Draft]) -> tuple[int, int] | None:
        """After model drafter `arm` drafted: which free drafter's proposal for the context extended by the draft
        to append, and how many of its tokens (None: none). Asked only of policies with `extends`."""
    def feedback(self, outcome: RoundOutcome) -> float | None: ...
    def finish(self, context: list[int]) -> None: ...  # the request ended with this context
    def reset(self) -> None: ...


class _ArmStats:
    """Per-arm counts and running means shared by the classic bandits; reset() forgets them.

    It also adapts them to the engine's interface: choose() is select() at the full draft length, feedback()
    computes the policy's reward and calls update(), and (full information) scores every other free drafter's
    proposal once the output has decided it (`metasd.hindsight`), through observe().
    """

    full_information = False
    extends = False  # the paper's bandits score whole drafts of the drafter they picked
    max_draft: int | None = None

    def __init__(self, n_arms: int, reward: str = "bd") -> None:
        if n_arms < 1:
            raise ValueError("a policy needs at least one drafter")
        self.n_arms = n_arms
        self.reward = reward
        self.hindsight = Hindsight()
        self.reset()

    @property
    def wants_proposals(self) -> bool:
        return self.full_information

    def reset(self) -> None:
        self.pulls = [0] * self.n_arms
        self.mean_rewards = [0.0] * self.n_arms
        self.rounds = 0
        self.hindsight.clear()

    def state(self) -> dict:
        """Sufficient statistics (per-arm pulls and reward sums, rounds played): what replicas share."""
        return {"pulls": list(self.pulls), "sums": [m * n for m, n in zip(self.mean_rewards, self.pulls, strict=True)],
                "rounds": self.rounds}

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

    def choose(self, k: int, proposals: Mapping[int, Draft], lags: Sequence[int], *, remaining: int | None = None,
               fresh: Sequence[bool] | None = None) -> tuple[int | None, int]:
        return self.select(), k

    def select(self) -> int:
        raise NotImplementedError

    def stop_rule(self, arm: int, k: int) -> StopRule | None:
        return None

    def feedback(self, outcome: RoundOutcome) -> float | None:
        if outcome.arm is None:
            return None
        d = outcome.draft
        score = reward(self.reward, outcome.p, d.q, d.tokens, outcome.accepted, outcome.k, outcome.draft_time,
                       outcome.verify_time, outcome.target_tokens)
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
            self.observe(d.pending.arm, reward(self.reward, None, None, d.pending.tokens, d.matched, o.k, 0.0,
                                               o.verify_time, d.pending.tokens[: d.matched]))

    def update(self, arm: int, reward: float) -> None:
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


class UCB(_ArmStats):
    """MetaSD-UCB: optimism in the face of uncertainty; beta scales the exploration bonus (0 = greedy)."""

    def __init__(self, n_arms: int, beta: float = 1.0, reward: str = "bd", full_information: bool = False) -> None:
        self.beta = beta
        self.full_information = full_information
        super().__init__(n_arms, reward)

    def select(self) -> int:
        for arm, n in enumerate(self.pulls):
            if n == 0:  # every arm once first, in index order
                return arm
        bonus = np.sqrt(2.0 * math.log(max(self.rounds, 1)) / np.asarray(self.pulls, dtype=float))
        return int(np.argmax(np.asarray(self.mean_rewards) + self.beta * bonus))  # argmax: ties -> lowest index


# Forgetting bandits, for drift within a request (MetaSD's appendix; Garivier & Moulines, ALT 2011). A request is
# about 50-100 rounds (128 tokens at 1.3-2.5 tokens a round), and a task switch inside it (copying, then reasoning)
# changes which drafter is best. Defaults: gamma 0.95 remembers about 1 / (1 - gamma) = 20 rounds (evidence 50 rounds
# old weighs 0.08), a window of 32 rounds about a third of a request: both long enough to average BD's noise over
# ~10 pulls per arm of a 3-drafter pool, short enough to follow a switch well before the request ends. beta defaults
# to 0.1 as for the cost-aware UCB (README "Beyond the paper"): discounted counts stay below 1 / (1 - gamma), so
# the bonus never shrinks below ~0.5 / sqrt(share), and with beta 1 it would swamp reward gaps of ~0.1 for good.
# `pulls` and `mean_rewards` stay undiscounted totals over the request (what the engine reports); only select()
# uses the discounted / windowed statistics.
_UNSEEN = 1e-12  # a discounted count below this is an arm never (or ~500+ rounds ago) played: try it first


class DiscountedUCB(_ArmStats):
    """D-UCB: discounted counts and sums, both decayed by gamma every played round; the bonus uses the discounted
    total count, sqrt(2 ln n_t(gamma) / N_t(gamma, i)), scaled by beta (Garivier & Moulines' c_t with B = 1, xi = 1/2
    is beta = 1)."""

    def __init__(self, n_arms: int, gamma: float = 0.95, beta: float = 0.1, reward: str = "bd") -> None:
        self.gamma = gamma
        self.beta = beta
        super().__init__(n_arms, reward)

    def reset(self) -> None:
        super().reset()
        self._n = np.zeros(self.n_arms)  # discounted pulls
        self._s = np.zeros(self.n_arms)  # discounted reward sums

    def discounted(self) -> tuple[list[float], list[float]]:
        """Discounted counts and means (0 for an arm without weight)."""
        means = np.divide(self._s, self._n, out=np.zeros(self.n_arms), where=self._n > _UNSEEN)
        return self._n.tolist(), means.tolist()

    def select(self) -> int:
        unseen = np.flatnonzero(self._n <= _UNSEEN)
        if unseen.size:  # every arm once first, in index order
            return int(unseen[0])
        bonus = np.sqrt(2.0 * math.log(max(float(self._n.sum()), 1.0)) / self._n)
        return int(np.argmax(self._s / self._n + self.beta * bonus))

    def update(self, arm: int, reward: float) -> None:
        reward = self._record(arm, reward)
        self._n *= self.gamma
        self._s *= self.gamma
        self._n[arm] += 1.0
        self._s[arm] += reward

    def observe(self, arm: int, reward: float) -> None:
        reward = self._record(arm, reward, played=False)  # a free observation: no round passes, nothing decays
        self._n[arm] += 1.0
        self._s[arm] += reward


class SlidingWindowUCB(_ArmStats):
    """SW-UCB: counts and means over the last `window` played rounds only; bonus sqrt(2 ln min(t, W) / N_W(i))
    scaled by beta. An arm that falls out of the window is tried again (its count is 0)."""

    def __init__(self, n_arms: int, window: int = 32, beta: float = 0.1, reward: str = "bd") -> None:
        self.window = window
        self.beta = beta
        super().__init__(n_arms, reward)

    def reset(self) -> None:
        super().reset()
        self._recent: deque[tuple[int, float]] = deque()
        self._n = np.zeros(self.n_arms, dtype=np.int64)
        self._s = np.zeros(self.n_arms)

    def select(self) -> int:
        unseen = np.flatnonzero(self._n == 0)
        if unseen.size:
            return int(unseen[0])
        means = np.clip(self._s / self._n, 0.0, 1.0)  # clip: float round-off of the running sums
        bonus = np.sqrt(2.0 * math.log(max(min(self.rounds, self.window), 1)) / self._n)
        return int(np.argmax(means + self.beta * bonus))

    def update(self, arm: int, reward: float) -> None:
        reward = self._record(arm, reward)
        self._recent.append((arm, reward))
        self._n[arm] += 1
        self._s[arm] += reward
        if len(self._recent) > self.window:
            old, r = self._recent.popleft()
            self._n[old] -= 1
            self._s[old] = self._s[old] - r if self._n[old] else 0.0  # exact 0 once empty: no residue builds up


class EXP3(_ArmStats):
    """EXP3 (Auer et al.): adversarial bandit, robust when drafter quality drifts within a request."""

    def __init__(self, n_arms: int, gamma: float = 0.1, seed: int | None = None, reward: str = "bd") -> None:
        self.gamma = gamma
        self.seed = seed
        super().__init__(n_arms, reward)

    def reset(self) -> None:
        super().reset()
        self.rng = np.random.default_rng(self.seed)
        self._log_w = np.zeros(self.n_arms)  # log-weights: each update adds at most 1, and max is subtracted before exp

    def probabilities(self) -> np.ndarray:
        w = np.exp(self._log_w - self._log_w.max())
        return (1.0 - self.gamma) * w / w.sum() + self.gamma / self.n_arms

    def select(self) -> int:
        return int(self.rng.choice(self.n_arms, p=self.probabilities()))

    def update(self, arm: int, reward: float) -> None:
        p = self.probabilities()[arm]
        reward = self._record(arm, reward)
        self._log_w[arm] += self.gamma * (reward / p) / self.n_arms  # importance-weighted: unbiased for every arm


class SequentialHalving(_ArmStats):
    """Sequential halving (Karnin et al.): spend a fixed budget of rounds finding the best drafter, then commit.

    Each of ceil(log2 K) phases pulls the survivors in turn, then keeps the better half by that phase's mean.
    Leftover rounds from integer division carry over to later phases, so the phases use about `budget` rounds.
    The default of 32 rounds lets it commit within a typical request (about 100 rounds for 128 tokens at 1.3
    tokens a round, about 30 at 4.5), since policy state resets per request by default.
    """

    def __init__(self, n_arms: int, budget: int = 32, reward: str = "bd") -> None:
        self.budget = budget
        self.n_phases = math.ceil(math.log2(n_arms)) if n_arms > 1 else 0
        super().__init__(n_arms, reward)

    def reset(self) -> None:
        super().reset()
        self._survivors = list(range(self.n_arms))
        self._phase = 0
        self._start_phase()

    def survivors(self) -> list[int]:
        return list(self._survivors)

    def _start_phase(self) -> None:
        self._pos = 0
        self._phase_sum = [0.0] * self.n_arms
        self._phase_n = [0] * self.n_arms
        if len(self._survivors) == 1:
            self._phase_len = 0  # committed
            return
        share = (self.budget - self.rounds) // ((self.n_phases - self._phase) * len(self._survivors))
        # The phase pulls the survivors in turn (interleaved, so drift in the text hits all arms alike), `share`
        # times each: position i plays survivors[i % len]. Kept as arithmetic, not a list: O(K) memory whatever
        # the budget.
        self._phase_len = len(self._survivors) * max(1, share)

    def select(self) -> int:
        return self._survivors[self._pos % len(self._survivors)] if self._phase_len else self._survivors[0]

    def update(self, arm: int, reward: float) -> None:
        reward = self._record(arm, reward)
        if not self._phase_len:
            return
        self._phase_sum[arm] += reward
        self._phase_n[arm] += 1
        self._pos += 1
        if self._pos < self._phase_len:
            return
        ranked = sorted(self._survivors, key=lambda a: (-self._phase_sum[a] / max(self._phase_n[a], 1), a))
        keep = 1 if self.rounds >= self.budget else math.ceil(len(ranked) / 2)
        self._survivors = sorted(ranked[:keep])
        self._phase += 1
        self._start_phase()


class RandomPolicy(_ArmStats):
    """Uniform random drafter: the no-learning baseline."""

    def __init__(self, n_arms: int, seed: int | None = None, reward: str = "bd") -> None:
        self.seed = seed
        super().__init__(n_arms, reward)

    def reset(self) -> None:
        super().reset()
        self.rng = np.random.default_rng(self.seed)

    def select(self) -> int:
        return int(self.rng.integers(self.n_arms))


class RoundRobin(_ArmStats):
    """Cycle 0, 1, ..., K-1, 0, ... (advancing on update): equal share for every drafter."""

    def select(self) -> int:
        return self.rounds % self.n_arms


class Fixed(_ArmStats):
    """Always the same drafter: the single-drafter speculative decoding baseline."""

    def __init__(self, n_arms: int, arm: int, reward: str = "bd") -> None:
        if not 0 <= arm < n_arms:
            raise ValueError(f"arm {arm} out of range for {n_arms} drafters")
        self.arm = arm
        super().__init__(n_arms, reward)

    def select(self) -> int:
        return self.arm


POLICY_NAMES: tuple[str, ...] = (
    "metasd-ucb", "metasd-ucb-cost", "metasd-fi", "metasd-adaptive", "ducb", "swucb", "ducb-cost", "swucb-cost",
    "ucb-be", "exp3", "sequential-halving", "random", "round-robin", "none",
)
_UCB_REWARDS = {"metasd-ucb": "bd", "metasd-ucb-cost": "bd-cost", "metasd-fi": "be-cost", "ucb-be": "be"}
# beta 1 is the paper's. Ours default to 0.1: a request is ~50 rounds and reward gaps are ~0.1, so beta 1 spends most
# of a request exploring a slow drafter (measured with `metasd bench --quick`, see README "Beyond the paper").
_DEFAULTS: dict[str, float] = {"metasd-ucb": 1.0, "ucb-be": 1.0, "metasd-ucb-cost": 0.1, "metasd-fi": 0.1,
                               "exp3": 0.1, "sequential-halving": 32}
# The forgetting bandits (see DiscountedUCB): base -> (class, reward, first parameter's name, kind, default, bounds).
_DRIFTING: dict[str, tuple] = {
    "ducb": (DiscountedUCB, "bd", "gamma", float, 0.95, (0.0, 1.0)),
    "swucb": (SlidingWindowUCB, "bd", "window", int, 32, (1, 100_000)),
    "ducb-cost": (DiscountedUCB, "bd-cost", "gamma", float, 0.95, (0.0, 1.0)),
    "swucb-cost": (SlidingWindowUCB, "bd-cost", "window", int, 32, (1, 100_000)),
}
_DRIFT_BETA = 0.1
# Upper bounds on client-chosen parameters (a server takes them from requests): far above any useful value, low
# enough that nothing a client sends can cost memory or time.
MAX_BETA = 100.0
MAX_BUDGET = 1_000_000
_CHOICES = (
    "metasd-adaptive[:beta=B,gamma=G,max=K,spread=S,prior=W,extend=E], "
    "metasd-ucb[:BETA], metasd-ucb-cost[:BETA], metasd-fi[:BETA], ducb[:GAMMA[:BETA]], swucb[:WINDOW[:BETA]], "
    "ducb-cost[:GAMMA[:BETA]], swucb-cost[:WINDOW[:BETA]], ucb-be[:BETA], exp3[:GAMMA], "
    "sequential-halving[:BUDGET], random, round-robin, fixed:<drafter>, none"
)


def _parse(name: str, param: str, kind: type[float] | type[int]) -> float:
    try:
        value = kind(param)
    except ValueError:
        raise ValueError(f"policy {name!r}: parameter {param!r} is not a valid {kind.__name__}") from None
    if not math.isfinite(value):
        raise ValueError(f"policy {name!r}: parameter {param!r} must be finite")
    return value


def _drifting_params(name: str, base: str, param: str) -> tuple[float, float]:
    """`GAMMA[:BETA]` (ducb) or `WINDOW[:BETA]` (swucb), defaults filled in, bounds checked."""
    _, _, what, kind, default, (lo, hi) = _DRIFTING[base]
    first, sep, second = param.partition(":")
    if sep and not second.strip() or param and not first.strip():
        raise ValueError(f"policy {name!r}: bad parameter; valid choices: {_CHOICES}")
    value = _parse(name, first.strip(), kind) if first.strip() else default
    beta = _parse(name, second.strip(), float) if sep else _DRIFT_BETA
    if kind is float and not lo < value <= hi:
        raise ValueError(f"policy {name!r}: {what} must be in ({lo:g}, {hi:g}]")
    if kind is int and not lo <= value <= hi:
        raise ValueError(f"policy {name!r}: {what} must be an integer in [{lo}, {hi}]")
    if not 0 <= beta <= MAX_BETA:
        raise ValueError(f"policy {name!r}: beta must be in [0, {MAX_BETA:g}]")
    return value, beta


def build_policy(name: str, drafter_names: Sequence[str], seed: int | None = None) -> Policy | None:
    """Build a policy from its CLI name (``base`` or ``base:PARAM``); ``none`` means plain autoregressive decoding."""
    base, sep, param = _split(name)
    if base not in POLICY_NAMES and base != "fixed":
        raise ValueError(f"unknown policy {name!r}; valid choices: {_CHOICES}")
    takes_param = base in _DEFAULTS or base in _DRIFTING or base in ("fixed", "metasd-adaptive")
    if sep and (not param or not takes_param):
        raise ValueError(f"policy {name!r}: bad parameter; valid choices: {_CHOICES}")
    if base == "none":
        return None
    if not drafter_names:
        raise ValueError(f"policy {name!r} needs at least one drafter (use 'none' for plain decoding)")
    k = len(drafter_names)
    if base == "metasd-adaptive":
        return adaptive.AdaptivePolicy(k, **adaptive.parse_params(param))
    if base == "fixed":
        if param not in drafter_names:
            raise ValueError(f"policy {name!r}: use fixed:<drafter> with one of {list(drafter_names)}")
        return Fixed(k, list(drafter_names).index(param))
    if base == "random":
        return RandomPolicy(k, seed)
    if base == "round-robin":
        return RoundRobin(k)
    if base in _DRIFTING:
        cls, kind = _DRIFTING[base][0], _DRIFTING[base][1]
        return cls(k, *_drifting_params(name, base, param), reward=kind)
    value = _parse(name, param, int if base == "sequential-halving" else float) if sep else _DEFAULTS[base]
    if base == "exp3":
        if not 0 < value <= 1:
            raise ValueError(f"policy {name!r}: gamma must be in (0, 1]")
        return EXP3(k, value, seed)
    if base == "sequential-halving":
        if not 1 <= value <= MAX_BUDGET:
            raise ValueError(f"policy {name!r}: budget must be an integer in [1, {MAX_BUDGET}]")
        return SequentialHalving(k, int(value))
    if not 0 <= value <= MAX_BETA:
        raise ValueError(f"policy {name!r}: beta must be in [0, {MAX_BETA:g}]")
    return UCB(k, value, reward=_UCB_REWARDS[base], full_information=base == "metasd-fi")


def canonical_policy(name: str, drafter_names: Sequence[str]) -> str:
    """One spelling per policy: defaults filled in and numbers normalised (`metasd-ucb`, `metasd-ucb:1` and
    ` metasd-ucb:1.0` are one policy), so caches keyed by it cannot grow with every spelling a client sends.
    Raises ValueError for what build_policy would refuse."""
    build_policy(name, drafter_names)  # validates
    base, sep, param = _split(name)
    if base == "metasd-adaptive":
        return adaptive.canonical(adaptive.parse_params(param))
    if base in _DRIFTING:
        return ":".join([base, *map(_number, _drifting_params(name, base, param))])
    if base in _DEFAULTS:
        value = _parse(name, param, int if base == "sequential-halving" else float) if sep else _DEFAULTS[base]
        return f"{base}:{_number(value)}"
    return f"{base}:{param}" if base == "fixed" else base


def _split(name: str) -> tuple[str, str, str]:
    """`base:param` with the spaces around either part removed."""
    base, sep, param = name.strip().partition(":")
    return base.strip(), sep, param.strip()


def _number(value: float) -> str:
    """Integers as integers, floats in their shortest round-trip form: 1, 1.0 and 1e0 all give `1.0` (not `:g`,
    which would merge 0.1234567 and 0.1234568)."""
    return str(value) if isinstance(value, int) else repr(float(value))
