import pytest
import torch

from metasd.policy.rewards import block_divergence, block_efficiency, reward


def test_block_divergence_is_mean_overlap_over_k_positions():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])
    # position 0 identical (overlap 1), position 1 disjoint (overlap 0); k=2
    assert block_divergence(p, q, [0, 1], 2) == pytest.approx(0.5)
    # one-hot drafter: overlap = p(drafted token)
    assert block_divergence(p, None, [1, 0], 2) == pytest.approx((0.5 + 1.0) / 2)
    # a short draft earns nothing for the positions it left empty
    assert block_divergence(p, None, [1], 4) == pytest.approx(0.5 / 4)
    assert block_divergence(p, None, [], 4) == 0.0


def test_block_efficiency_and_dispatch():
    assert block_efficiency(3, 4) == 0.75
    assert block_efficiency(0, 0) == 0.0
    p = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert reward("be", p, None, [0], 1, 1) == 1.0
    assert reward("bd", p, None, [1], 0, 1) == 0.0
    with pytest.raises(ValueError):
        reward("nope", p, None, [0], 1, 1)


def test_cost_aware_reward_discounts_slow_drafters():
    # a perfect free draft: all k + 1 tokens, no time lost
    assert reward("bd-cost", torch.tensor([[1.0, 0.0]] * 3), None, [0, 0], 2, 2, 0.0, 1.0) == pytest.approx(1.0)
    # the same alignment bought with a draft as slow as the verification is worth half
    assert reward("bd-cost", torch.tensor([[1.0, 0.0]] * 3), None, [0, 0], 2, 2, 1.0, 1.0) == pytest.approx(0.5)
    # an empty draft still yields the target's own token: 1 / (k + 1)
    assert reward("bd-cost", torch.tensor([[1.0, 0.0]]), None, [], 0, 4, 0.0, 1.0) == pytest.approx(0.2)
