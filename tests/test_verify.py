"""The acceptance rule: greedy prefix matching, and the sampling rule's output distribution equals p."""

import pytest
import torch

from metasd.verify import Verdict, verify_greedy, verify_sampling

V = 6
P = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.10, 0.10], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
Q = torch.tensor([[0.50, 0.05, 0.25, 0.05, 0.10, 0.05]])  # a drafter that is badly wrong about p


def first_token_histogram(rule, trials: int, seed: int) -> torch.Tensor:
    """Distribution of the first emitted token when the drafter samples x ~ q and the rule verifies it."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V)
    for _ in range(trials):
        x = int(torch.multinomial(Q[0], 1, generator=g))
        verdict = rule(P, Q, [x], g)
        counts[x if verdict.accepted else verdict.next_token] += 1
    return counts / trials


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def accept_always(p, q, draft, g):
    return Verdict(len(draft), int(torch.multinomial(p[len(draft)], 1, generator=g)))


def resample_from_p(p, q, draft, g):  # a common bug: on rejection sample p instead of the residual max(0, p - q)
    u = float(torch.rand((), generator=g))
    if u < min(1.0, float(p[0, draft[0]] / q[0, draft[0]])):
        return Verdict(1, int(torch.multinomial(p[1], 1, generator=g)))
    return Verdict(0, int(torch.multinomial(p[0], 1, generator=g)))


# 20k trials: the sampling error of a 6-way histogram is about 0.01 in TV; the wrong rules are off by >= 0.08.
THRESHOLD = 0.03


def test_sampling_rule_output_matches_target_distribution():
    hist = first_token_histogram(verify_sampling, 20_000, seed=0)
    assert total_variation(hist, P[0]) < THRESHOLD
    assert total_variation(hist, Q[0]) > 0.3  # it is p we converge to, not q


@pytest.mark.parametrize("wrong_rule", [accept_always, resample_from_p])
def test_threshold_rejects_wrong_rules(wrong_rule):
    hist = first_token_histogram(wrong_rule, 20_000, seed=0)
    assert total_variation(hist, P[0]) > THRESHOLD


def test_one_hot_drafter_matches_target_distribution():
    """q=None: the drafter proposes a fixed token; accept with p(x), else sample p with x removed."""
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(V)
    trials = 20_000
    for _ in range(trials):
        verdict = verify_sampling(P, None, [2], g)
        counts[2 if verdict.accepted else verdict.next_token] += 1
    assert total_variation(counts / trials, P[0]) < THRESHOLD


def test_bonus_token_is_drawn_from_the_last_row():
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.1, 0.5]])
    counts = torch.zeros(V)
    for _ in range(10_000):
        verdict = verify_sampling(p, None, [1], g)
        assert verdict.accepted == 1  # p(x) = 1: always accepted
        counts[verdict.next_token] += 1
    assert total_variation(counts / 10_000, p[1]) < THRESHOLD


def test_sampling_never_accepts_a_token_the_target_excludes():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0]] * 2)
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        verdict = verify_sampling(p, None, [0], g)
        assert verdict.accepted == 0 and verdict.next_token in (1, 2)


def test_greedy_accepts_longest_matching_prefix_then_target_token():
    logits = torch.full((4, V), -1.0)
    for row, best in enumerate([3, 1, 4, 5]):
        logits[row, best] = 1.0
    assert verify_greedy(logits, [3, 1, 4]) == Verdict(3, 5)  # all accepted + bonus
    assert verify_greedy(logits, [3, 2, 4]) == Verdict(1, 1)  # rejected at position 1: target's token there
    assert verify_greedy(logits, [0, 1, 4]) == Verdict(0, 3)
    assert verify_greedy(logits[:1], []) == Verdict(0, 3)  # empty draft: one plain target step
