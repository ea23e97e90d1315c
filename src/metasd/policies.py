"""Drafter-selection policies: choosing a drafter each round is a multi-armed bandit (MetaSD).

Every policy sees only the arm it picked and the reward in [0, 1] the engine computed for it, and keeps
per-arm ``pulls`` and ``mean_rewards`` so the engine can report statistics whichever policy ran.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Policy(Protocol):
    """What the engine needs: pick an arm, learn from its reward, forget at the start of a request."""

    reward: str  # which reward update() receives: see metasd.rewards.REWARDS
    full_information: bool  # also updated, in hindsight, for every free drafter that did not draft the round
    pulls: list[int]
    mean_rewards: list[float]

    def select(self) -> int: ...
    def update(self, arm: int, reward: float) -> None: ...
    def observe(self, arm: int, reward: float) -> None: ...  # a hindsight reward for an arm that did not play
    def reset(self) -> None: ...


class _ArmStats:
    """Per-arm counts and running means shared by all policies; reset() forgets them."""

    full_information = False

    def __init__(self, n_arms: int, reward: str = "bd") -> None:
        if n_arms < 1:
            raise ValueError("a policy needs at least one drafter")
        self.n_arms = n_arms
        self.reward = reward
        self.reset()

    def reset(self) -> None:
        self.pulls = [0] * self.n_arms
        self.mean_rewards = [0.0] * self.n_arms
        self.rounds = 0

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
            self._schedule: list[int] = []
            return
        share = (self.budget - self.rounds) // ((self.n_phases - self._phase) * len(self._survivors))
        self._schedule = self._survivors * max(1, share)  # interleaved, so drift in the text hits all arms alike

    def select(self) -> int:
        return self._schedule[self._pos] if self._schedule else self._survivors[0]

    def update(self, arm: int, reward: float) -> None:
        reward = self._record(arm, reward)
        if not self._schedule:
            return
        self._phase_sum[arm] += reward
        self._phase_n[arm] += 1
        self._pos += 1
        if self._pos < len(self._schedule):
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
    "metasd-ucb", "metasd-ucb-cost", "metasd-fi", "ucb-be", "exp3", "sequential-halving", "random", "round-robin",
    "none",
)
_UCB_REWARDS = {"metasd-ucb": "bd", "metasd-ucb-cost": "bd-cost", "metasd-fi": "be-cost", "ucb-be": "be"}
# beta 1 is the paper's. Ours default to 0.1: a request is ~50 rounds and reward gaps are ~0.1, so beta 1 spends most
# of a request exploring a slow drafter (measured with `metasd bench --quick`, see README "Beyond the paper").
_DEFAULTS: dict[str, float] = {"metasd-ucb": 1.0, "ucb-be": 1.0, "metasd-ucb-cost": 0.1, "metasd-fi": 0.1,
                               "exp3": 0.1, "sequential-halving": 32}
_CHOICES = (
    "metasd-ucb[:BETA], metasd-ucb-cost[:BETA], metasd-fi[:BETA], ucb-be[:BETA], exp3[:GAMMA], "
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


def build_policy(name: str, drafter_names: Sequence[str], seed: int | None = None) -> Policy | None:
    """Build a policy from its CLI name (``base`` or ``base:PARAM``); ``none`` means plain autoregressive decoding."""
    base, sep, param = name.strip().partition(":")
    if base not in POLICY_NAMES and base != "fixed":
        raise ValueError(f"unknown policy {name!r}; valid choices: {_CHOICES}")
    if sep and (not param or base not in _DEFAULTS and base != "fixed"):
        raise ValueError(f"policy {name!r}: bad parameter; valid choices: {_CHOICES}")
    if base == "none":
        return None
    if not drafter_names:
        raise ValueError(f"policy {name!r} needs at least one drafter (use 'none' for plain decoding)")
    k = len(drafter_names)
    if base == "fixed":
        if param not in drafter_names:
            raise ValueError(f"policy {name!r}: use fixed:<drafter> with one of {list(drafter_names)}")
        return Fixed(k, list(drafter_names).index(param))
    if base == "random":
        return RandomPolicy(k, seed)
    if base == "round-robin":
        return RoundRobin(k)
    value = _parse(name, param, int if base == "sequential-halving" else float) if sep else _DEFAULTS[base]
    if base == "exp3":
        if not 0 < value <= 1:
            raise ValueError(f"policy {name!r}: gamma must be in (0, 1]")
        return EXP3(k, value, seed)
    if base == "sequential-halving":
        if value < 1:
            raise ValueError(f"policy {name!r}: budget must be >= 1")
        return SequentialHalving(k, int(value))
    if value < 0:
        raise ValueError(f"policy {name!r}: beta must be >= 0")
    return UCB(k, value, reward=_UCB_REWARDS[base], full_information=base == "metasd-fi")
