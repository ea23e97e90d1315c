"""How likely a drafted token is to be accepted: per drafter, per level of its own confidence signal, per position.

A cell holds (accepted, tried) for "token j of a draft from drafter d, with signal level b, given that tokens
0..j-1 were accepted". The expected tokens of a k-token draft are then 1 + sum_j prod_{i<=j} a_i, which is what the
adaptive policy weighs against T(k + 1). Estimates shrink toward the drafter's position-level mean (all signal
levels pooled), and that toward an uninformed 1/2, so a fresh cell borrows what its neighbours know.

Across requests: counts also accumulate in a history; `reset` starts a request from that history scaled down, so a
request starts informed but its own evidence soon dominates. How far down: with `spread` (the adaptive policy's
default), per drafter, to as many observations as the spread of its first-token acceptance between earlier requests
justifies (`prior_strength`: a drafter equally poor everywhere is not explored afresh on every request, one whose
acceptance depends on the text starts nearly fresh); otherwise to at most `prior_weight` observations per cell
(prior_weight 0 is the paper's per-query reset). `gamma` < 1 forgets old rounds geometrically, for text whose
character changes within a request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SIGNAL_LEVELS = 5  # confidence in [0, 1] -> 5 equal bins; one more bin for drafts without a signal
# Position cells: the first of each. Acceptance given the earlier tokens were accepted keeps changing deep into a
# draft (a copied span runs out), and where T(M) is flat the policy sends drafts up to its longest: one rate from
# token 3 on would price the tail of such a draft like its head.
CELL_STARTS = (0, 1, 2, 3, 4, 6, 9)
POSITIONS = len(CELL_STARTS)
_CELL_OF = np.searchsorted(CELL_STARTS, np.arange(CELL_STARTS[-1] + 1), side="right") - 1
_POOL_WEIGHT = 2.0  # pseudo-observations a cell borrows from its drafter's position mean
_BASE_WEIGHT = 1.0  # and that mean from 1/2
_SPREAD_CAP = 50.0  # most pseudo-observations a between-request spread estimate may give a drafter's prior
_SPREAD_REQUESTS = 50  # earlier requests it is estimated from


def signal_levels(confidence: Sequence[float] | None, m: int) -> np.ndarray:
    """[m] the signal level of each token of an m-token draft: its confidence in [0, 1] binned into SIGNAL_LEVELS
    equal bins, or level SIGNAL_LEVELS for a token without one (no `confidence`, or NaN)."""
    if confidence is None:
        return np.full(m, SIGNAL_LEVELS, dtype=np.int64)
    c = np.asarray(confidence[:m], dtype=float)
    levels = np.minimum((np.clip(np.nan_to_num(c), 0.0, 1.0) * SIGNAL_LEVELS).astype(np.int64), SIGNAL_LEVELS - 1)
    return np.where(np.isnan(c), SIGNAL_LEVELS, levels)  # NaN: a token without a signal


def positions(m: int) -> np.ndarray:
    """[m] the position cell of each token of an m-token draft."""
    return _CELL_OF[np.minimum(np.arange(m), CELL_STARTS[-1])]


@dataclass(frozen=True)
class Tables:
    """The tables of one acceptance model, each a row per drafter: `main` (a drafter's own drafts), `continuation`
    (a free drafter's proposal continuing a model's draft: judged only where the model's tokens were accepted,
    easier text than a round's start) and `runner_up` (a model drafter's second choice where its token was
    rejected)."""

    n_arms: int

    @property
    def rows(self) -> int:
        """The acceptance model's rows: three tables of a row per drafter."""
        return 3 * self.n_arms

    def main(self, arm: int) -> int:
        """The row of drafter `arm`'s own drafts."""
        return arm

    def continuation(self, arm: int) -> int:
        """The row of free drafter `arm`'s proposals continuing a model's draft."""
        return self.n_arms + arm

    def runner_up(self, arm: int) -> int:
        """The row of model drafter `arm`'s second choices where its token was rejected."""
        return 2 * self.n_arms + arm

    def rows_of(self, arm: int) -> tuple[int, int, int]:
        """Every row of drafter `arm`: its own drafts, its continuations and its runners-up."""
        return self.main(arm), self.continuation(arm), self.runner_up(arm)


class AcceptanceModel:
    """Per-row (`Tables`) counts of accepted and tried drafted tokens by signal level and position, for this
    request and for the history across requests; `rates` turns them into conditional acceptance estimates,
    each shrunk toward its position mean (the module docstring says how and why)."""

    def __init__(self, n_arms: int, prior_weight: float = 20.0, gamma: float = 1.0, spread: bool = False):
        shape = (n_arms, SIGNAL_LEVELS + 1, POSITIONS)
        self.prior_weight = prior_weight
        self.gamma = gamma
        self.spread = spread
        self.history_accepted = np.zeros(shape)
        self.history_tried = np.zeros(shape)
        self.first_tokens: list[list[tuple[float, float]]] = [[] for _ in range(n_arms)]  # per earlier request
        self._first = np.zeros((n_arms, 2))  # this request's (accepted, tried) first drafted tokens per drafter
        self.reset()

    def reset(self) -> None:
        """A new request: start from the history, capped at prior_weight observations per cell; with `spread`,
        at as many observations per drafter as the spread of its acceptance between requests justifies."""
        for arm, (hits, tried) in enumerate(self._first):
            if tried > 0:
                self.first_tokens[arm] = (self.first_tokens[arm] + [(hits, tried)])[-_SPREAD_REQUESTS:]
        self._first[:] = 0.0
        if self.spread:
            weight = np.array([self.prior_strength(arm) for arm in range(len(self.first_tokens))])
            first = self.history_tried[:, :, 0].sum(1)
            scale = np.minimum(1.0, weight / np.maximum(first, 1e-12))[:, None, None]
        else:
            scale = np.minimum(1.0, self.prior_weight / np.maximum(self.history_tried, 1e-12))
        self.accepted = self.history_accepted * scale
        self.tried = self.history_tried * scale

    def forget_rows(self, rows: Sequence[int]) -> None:
        """Everything counted in these rows, this request's and the history's."""
        for row in rows:
            for counts in (self.accepted, self.tried, self.history_accepted, self.history_tried):
                counts[row] = 0.0
            self.first_tokens[row] = []
            self._first[row] = 0.0

    def prior_strength(self, arm: int) -> float:
        """Empirical Bayes: pseudo-observations worth of the drafter's history for a new request, from how much
        its first-token acceptance varied between earlier requests (a beta-binomial's concentration by the method
        of moments). A drafter that is equally poor on every request gets a strong prior and is not explored afresh
        each time; one whose acceptance depends on the text gets a weak one."""
        if len(self.first_tokens[arm]) < 3:
            return 0.0
        hits, tried = np.array(self.first_tokens[arm]).T
        mean = hits.sum() / tried.sum()
        if mean <= 0.0 or mean >= 1.0:
            return _SPREAD_CAP
        between = np.var(hits / tried) - mean * (1.0 - mean) * np.mean(1.0 / tried)
        if between <= 0.0:
            return _SPREAD_CAP
        return float(np.clip(mean * (1.0 - mean) / between - 1.0, 0.0, _SPREAD_CAP))

    def learn(self, arm: int, confidence: Sequence[float] | None, accepted: int, decided: int) -> None:
        """Tokens 0..accepted-1 were accepted; token `accepted` was rejected if accepted < decided (the number of
        positions whose fate is known: a draft's length, or fewer where the output ended)."""
        n = min(accepted + 1, decided)
        if n <= 0:
            return
        cells = (arm, signal_levels(confidence, n), positions(n))
        hits = (np.arange(n) < accepted).astype(float)
        self._first[arm] += (hits[0], 1.0)
        for acc, tried in ((self.accepted, self.tried), (self.history_accepted, self.history_tried)):
            np.add.at(acc, cells, hits)
            np.add.at(tried, cells, 1.0)

    def learn_at(self, arm: int, confidence: float | None, position: int, hit: bool) -> None:
        """One token at `position` was tried (everything before it accepted) and accepted or not."""
        cell = (
            arm,
            int(signal_levels(None if confidence is None else [confidence], 1)[0]),
            int(positions(position + 1)[-1]),
        )
        for acc, tried in ((self.accepted, self.tried), (self.history_accepted, self.history_tried)):
            acc[cell] += float(hit)
            tried[cell] += 1.0

    def forget(self) -> None:
        """One round passed: old evidence of this request weighs gamma times less (no-op at gamma 1)."""
        if self.gamma < 1.0:
            self.accepted *= self.gamma
            self.tried *= self.gamma

    def position_means(self, arm: int) -> np.ndarray:
        """[POSITIONS] acceptance per position with all signal levels pooled."""
        acc = self.accepted[arm].sum(0)
        tried = self.tried[arm].sum(0)
        return (acc + _BASE_WEIGHT * 0.5) / (tried + _BASE_WEIGHT)

    def rates(self, arm: int, confidence: Sequence[float] | None, m: int) -> np.ndarray:
        """[m] conditional acceptance of each token of an m-token draft with these signals."""
        if m <= 0:
            return np.zeros(0)
        levels, pos = signal_levels(confidence, m), positions(m)
        pooled = self.position_means(arm)[pos]
        return (self.accepted[arm, levels, pos] + _POOL_WEIGHT * pooled) / (self.tried[arm, levels, pos] + _POOL_WEIGHT)

    def rate_at(self, arm: int, confidence: float | None, position: int) -> float:
        """Conditional acceptance of one token at `position` with this signal."""
        level = int(signal_levels(None if confidence is None else [confidence], 1)[0])
        pos = int(_CELL_OF[min(position, CELL_STARTS[-1])])
        pooled = self.position_means(arm)[pos]
        hits, tried = self.accepted[arm, level, pos], self.tried[arm, level, pos]
        return float((hits + _POOL_WEIGHT * pooled) / (tried + _POOL_WEIGHT))

    def best_rates(self, arm: int, m: int) -> np.ndarray:
        """[m] the highest conditional acceptance any signal level of this drafter offers at each position: what
        no draft of it is expected to beat (`AdaptivePolicy.ceiling`)."""
        pos = positions(m)
        pooled = self.position_means(arm)[pos]
        cells = (self.accepted[arm][:, pos] + _POOL_WEIGHT * pooled) / (self.tried[arm][:, pos] + _POOL_WEIGHT)
        return cells.max(0)

    def plan_rates(self, arm: int, m: int) -> np.ndarray:
        """[m] conditional acceptance before the draft exists (its signals unknown): the position means."""
        return self.position_means(arm)[positions(m)]

    def explored_length(self, arm: int, k_max: int, min_tried: float = 3.0) -> int:
        """The longest draft worth planning for `arm`: one position past the last cell whose acceptance has been
        tried `min_tried` times, cell after cell from position 0 (all of k_max once the last cell has been).
        Optimism can then ask an unknown drafter for one token, not for k_max tokens priced at a guessed rate.

        Tries count across requests whenever a request starts from the history (spread, or a prior weight): how far
        a drafter has been sent is not what varies between texts, and counting only the request's scaled-down prior
        would restart a drafter at 1 token every request, so that in a short answer it never reached the draft
        length it is good for."""
        tried = (self.history_tried if self.spread or self.prior_weight > 0 else self.tried)[arm].sum(0)
        k = 1
        for cell in range(POSITIONS):
            if tried[cell] < min_tried:
                break
            k = CELL_STARTS[cell + 1] + 1 if cell < POSITIONS - 1 else k_max
        return min(k, k_max)

    def evidence(self, arm: int) -> float:
        """Observations behind arm's estimates in this request (prior included): what optimism shrinks with."""
        return float(self.tried[arm].sum())


def expected_tokens(rates: np.ndarray) -> np.ndarray:
    """[m + 1] expected tokens a round yields when the first k = 0..m drafted tokens are sent (1 = the target's own)."""
    return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(rates))])
