"""The paper's bandits and the classic baselines (MetaSD, Kim, Jung & Yun, arXiv 2604.05417): UCB1 (Auer,
Cesa-Bianchi & Fischer 2002) with the block-divergence and block-efficiency rewards (`rewards.py`), discounted and
sliding-window UCB for drift (Garivier & Moulines, arXiv 0805.3415), EXP3 (Auer, Cesa-Bianchi, Freund & Schapire
2002), sequential halving (Karnin, Koren & Somekh 2013), random, round-robin and a fixed drafter."""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from .base import ArmStats


class UCB(ArmStats):
    """MetaSD-UCB: UCB1's mean + beta * sqrt(2 ln t / n_i), optimism in the face of uncertainty; beta scales the
    exploration bonus (1: UCB1 as published; 0: greedy)."""

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


# Forgetting bandits, for drift within a request (MetaSD's appendix; Garivier & Moulines, ALT 2011, arXiv
# 0805.3415). A request is some tens to a hundred rounds (128 new tokens by default, one to a few a round), and a
# task switch inside it (copying, then reasoning) changes which drafter is best. Defaults: gamma 0.95 remembers about
# 1 / (1 - gamma) = 20 rounds (evidence 50 rounds old weighs 0.08), a window of 32 rounds a fraction of a request:
# both long enough to average BD's noise over ~10 pulls per arm of a 3-drafter pool, short enough to follow a switch
# well before the request ends. beta defaults to 0.1 as for the cost-aware UCB (docs/policies.md, "Beyond the
# paper"): discounted counts stay below 1 / (1 - gamma), so the bonus never shrinks below ~0.5 / sqrt(share), and
# with beta 1 it would swamp the small gaps between drafters' mean rewards for good.
# `pulls` and `mean_rewards` stay undiscounted totals over the request (what the engine reports); only select()
# uses the discounted / windowed statistics.
_UNSEEN = 1e-12  # a discounted count below this is an arm never (or ~500+ rounds ago) played: try it first


class DiscountedUCB(ArmStats):
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


class SlidingWindowUCB(ArmStats):
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


class EXP3(ArmStats):
    """EXP3 (Auer et al. 2002): adversarial bandit, robust when drafter quality drifts within a request."""

    def __init__(self, n_arms: int, gamma: float = 0.1, seed: int | None = None, reward: str = "bd") -> None:
        self.gamma = gamma
        self.seed = seed
        super().__init__(n_arms, reward)

    def reset(self) -> None:
        super().reset()
        self.rng = np.random.default_rng(self.seed)
        self._log_w = np.zeros(self.n_arms)  # log-weights: each update adds at most 1, and max is subtracted before exp

    def probabilities(self) -> np.ndarray:
        """[n_arms] the chance of picking each arm: the exponential weights mixed with a uniform share gamma."""
        w = np.exp(self._log_w - self._log_w.max())
        return (1.0 - self.gamma) * w / w.sum() + self.gamma / self.n_arms

    def select(self) -> int:
        return int(self.rng.choice(self.n_arms, p=self.probabilities()))

    def update(self, arm: int, reward: float) -> None:
        p = self.probabilities()[arm]
        reward = self._record(arm, reward)
        self._log_w[arm] += self.gamma * (reward / p) / self.n_arms  # importance-weighted: unbiased for every arm


class SequentialHalving(ArmStats):
    """Sequential halving (Karnin et al. 2013): spend a fixed budget of rounds finding the best drafter, then commit.

    Each of ceil(log2 K) phases pulls the survivors in turn, then keeps the better half by that phase's mean.
    Leftover rounds from integer division carry over to later phases, so the phases use about `budget` rounds.
    The default of 32 rounds lets it commit within a typical request (128 new tokens at one to a few tokens a
    round), since policy state resets per request by default.
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
        """The arms still in the running, in index order (one once it has committed)."""
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


class RandomPolicy(ArmStats):
    """Uniform random drafter: the no-learning baseline."""

    def __init__(self, n_arms: int, seed: int | None = None, reward: str = "bd") -> None:
        self.seed = seed
        super().__init__(n_arms, reward)

    def reset(self) -> None:
        super().reset()
        self.rng = np.random.default_rng(self.seed)

    def select(self) -> int:
        return int(self.rng.integers(self.n_arms))


class RoundRobin(ArmStats):
    """Cycle 0, 1, ..., K-1, 0, ... (advancing on update): equal share for every drafter."""

    def select(self) -> int:
        return self.rounds % self.n_arms


class Fixed(ArmStats):
    """Always the same drafter: the single-drafter speculative decoding baseline."""

    def __init__(self, n_arms: int, arm: int, reward: str = "bd") -> None:
        if not 0 <= arm < n_arms:
            raise ValueError(f"arm {arm} out of range for {n_arms} drafters")
        self.arm = arm
        super().__init__(n_arms, reward)

    def select(self) -> int:
        return self.arm
