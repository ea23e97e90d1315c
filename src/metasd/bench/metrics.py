"""The arithmetic of the benchmark, as Spec-Bench defines it.

- A question's speed: its new tokens over its wall time, all turns together (tokens/s).
- A method's tokens/s on a set of questions: the mean of its question speeds.
- Speedup: that mean over the baseline's (`ar`) mean on the same questions (a ratio of means, not a mean of ratios).
- Mean accepted tokens: the mean, over every round of every question pooled, of the tokens that round's target
  forward produced (accepted draft tokens + 1); `ar` is exactly 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def question_speed(new_tokens: Sequence[int], wall_times: Sequence[float]) -> float:
    """Tokens per second of one question over all its turns."""
    total_time = float(sum(wall_times))
    if total_time <= 0:
        raise ValueError(f"wall time must be positive, got {total_time}")
    return float(sum(new_tokens)) / total_time


def mean_speed(speeds: Sequence[float]) -> float:
    """A method's tokens per second on a set of questions: the mean of its question speeds."""
    if not len(speeds):
        raise ValueError("no question speeds to average")
    return float(np.mean(speeds))


def speedup(speeds: Sequence[float], baseline_speeds: Sequence[float]) -> float:
    """Spec-Bench's speedup: mean tokens/s of a method over the baseline's mean on the same questions."""
    base = mean_speed(baseline_speeds)
    if base <= 0:
        raise ValueError("baseline speed must be positive")
    return mean_speed(speeds) / base


def mean_accepted_tokens(accept_lengths: Iterable[int]) -> float:
    """Mean of per-round accept lengths (accepted + 1), pooled over all rounds given."""
    values = list(accept_lengths)
    if not values:
        return 0.0
    if any(v < 1 for v in values):
        raise ValueError("accept lengths count the target's own token, so each is >= 1")
    return float(np.mean(values))


def reward_stats(values: Sequence[float], zero_tol: float = 1e-6) -> dict:
    """Mean, population variance and the share of rounds whose reward is (numerically) zero."""
    if not len(values):
        return {"n": 0, "mean": None, "var": None, "zero_rate": None}
    arr = np.asarray(values, dtype=float)
    return {
        "n": int(arr.size),
        "mean": float(arr.mean()),
        "var": float(arr.var()),
        "zero_rate": float(np.mean(arr <= zero_tol)),
    }


def share(value: float | None, reference: float | None) -> float | None:
    """value / reference, or None when either is missing or the reference is zero."""
    if value is None or not reference:
        return None
    return value / reference
