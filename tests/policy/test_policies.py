"""Bandit policies on synthetic arms: no models, a few seconds in all."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from metasd.policy import (
    EXP3,
    MAX_BUDGET,
    POLICY_NAMES,
    UCB,
    DiscountedUCB,
    Fixed,
    RandomPolicy,
    RoundRobin,
    SequentialHalving,
    SlidingWindowUCB,
    build_policy,
    canonical_policy,
)

DRAFTERS = ["tiny", "small", "medium"]


def bernoulli(means: list[float], rng: np.random.Generator) -> Callable[[int], float]:
    return lambda arm: float(rng.random() < means[arm])


def beta_arms(params: list[tuple[float, float]], rng: np.random.Generator) -> Callable[[int], float]:
    return lambda arm: float(rng.beta(*params[arm]))


def run(policy, reward_of: Callable[[int], float], rounds: int) -> list[int]:
    arms = []
    for _ in range(rounds):
        arm = policy.select()
        policy.update(arm, reward_of(arm))
        arms.append(arm)
    return arms


# --- UCB ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["bernoulli", "beta"])
def test_ucb_finds_best_arm(seed: int, kind: str) -> None:
    rng = np.random.default_rng(seed)
    if kind == "bernoulli":
        reward_of = bernoulli([0.2, 0.5, 0.8], rng)
    else:
        reward_of = beta_arms([(2, 5), (5, 5), (8, 2)], rng)  # means 0.29, 0.5, 0.8
    policy = UCB(3)
    arms = run(policy, reward_of, 2000)
    assert arms[:3] == [0, 1, 2]
    assert policy.pulls == [arms.count(a) for a in range(3)]
    assert int(np.argmax(policy.pulls)) == 2
    assert policy.pulls[2] > 0.8 * 2000
    assert policy.mean_rewards[2] == pytest.approx(0.8, abs=0.05)


def test_ucb_index_matches_formula() -> None:
    policy = UCB(2, beta=1.0)
    for _ in range(10):
        policy.update(0, 0.6)
    policy.update(1, 0.5)
    # t = 11. Bonus sqrt(2 ln t / n): 0.693 for arm 0, 2.190 for arm 1, so arm 1 wins while beta * 1.497 > 0.1.
    assert policy.select() == 1
    policy.beta = 0.08  # 0.655 vs 0.675: arm 1 (without the factor 2 in the bonus it would be arm 0)
    assert policy.select() == 1
    policy.beta = 0.05  # 0.635 vs 0.610: the mean wins
    assert policy.select() == 0


def test_ucb_beta_zero_is_greedy() -> None:
    rng = np.random.default_rng(3)
    reward_of = bernoulli([0.3, 0.6, 0.5, 0.55], rng)
    policy = UCB(4, beta=0.0)
    for step in range(500):
        arm = policy.select()
        if step < 4:
            assert arm == step
        else:
            assert arm == int(np.argmax(policy.mean_rewards))
        policy.update(arm, reward_of(arm))


def test_ucb_ties_go_to_lowest_index_and_reset_forgets() -> None:
    policy = UCB(3)
    run(policy, lambda arm: 0.5, 3)
    assert policy.select() == 0
    policy.reset()
    assert policy.pulls == [0, 0, 0] and policy.mean_rewards == [0.0, 0.0, 0.0]
    assert run(policy, lambda arm: 1.0, 3) == [0, 1, 2]


def test_update_validates_arm_and_reward() -> None:
    policy = UCB(2)
    with pytest.raises(ValueError):
        policy.update(2, 0.5)
    with pytest.raises(ValueError):
        policy.update(0, 1.5)
    with pytest.raises(ValueError):
        policy.update(0, float("nan"))
    policy.update(0, 1.0 + 1e-12)  # float round-off is clipped, not rejected
    assert policy.mean_rewards[0] == 1.0


# --- EXP3 --------------------------------------------------------------------------------------------------------


def test_exp3_update_is_importance_weighted() -> None:
    policy = EXP3(2, gamma=0.5)
    np.testing.assert_allclose(policy.probabilities(), [0.5, 0.5])
    policy.update(0, 1.0)  # r_hat = 1 / 0.5 = 2, log w_0 += 0.5 * 2 / 2 = 0.5
    w0 = math.exp(0.5)
    np.testing.assert_allclose(policy.probabilities(), [0.5 * w0 / (w0 + 1) + 0.25, 0.5 / (w0 + 1) + 0.25], rtol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_exp3_stays_normalised_and_prefers_best_arm(seed: int) -> None:
    gamma, k = 0.1, 3
    # The environment's stream must differ from the policy's: with equal seeds the reward draw would replay the
    # uniform that chose the arm, correlating reward with choice.
    reward_of = bernoulli([0.2, 0.5, 0.8], np.random.default_rng(1000 + seed))  # only the extremes 0 and 1
    policy = EXP3(k, gamma=gamma, seed=seed)
    for _ in range(5000):
        arm = policy.select()
        policy.update(arm, reward_of(arm))
        p = policy.probabilities()
        assert abs(p.sum() - 1.0) < 1e-9
        assert np.all(p >= gamma / k - 1e-12) and np.all(np.isfinite(p))
    assert int(np.argmax(policy.probabilities())) == 2
    assert int(np.argmax(policy.pulls)) == 2
    assert policy.probabilities()[2] > 0.85


def test_exp3_survives_one_sided_extreme_rewards() -> None:
    policy = EXP3(4, gamma=0.05, seed=1)
    for _ in range(5000):
        policy.update(1, 1.0)  # always-rewarded arm: log-weights would overflow without normalisation
        policy.update(3, 0.0)
    p = policy.probabilities()
    assert np.all(np.isfinite(p)) and abs(p.sum() - 1.0) < 1e-9
    assert p[1] == pytest.approx(1 - 0.05 + 0.05 / 4)


def test_exp3_reset_replays_same_sequence() -> None:
    policy = EXP3(3, seed=7)
    first = run(policy, lambda arm: arm / 2, 200)
    policy.reset()
    assert run(policy, lambda arm: arm / 2, 200) == first
    assert run(EXP3(3, seed=7), lambda arm: arm / 2, 200) == first


# --- Sequential halving ------------------------------------------------------------------------------------------


def test_sequential_halving_halves_each_phase_and_uses_budget() -> None:
    policy = SequentialHalving(8, budget=64)
    sizes = [len(policy.survivors())]
    rounds = 0
    while len(policy.survivors()) > 1:
        arm = policy.select()
        assert arm in policy.survivors()
        policy.update(arm, (arm + 1) / 10)  # deterministic, well separated: best is arm 7
        rounds += 1
        if len(policy.survivors()) != sizes[-1]:
            sizes.append(len(policy.survivors()))
    assert sizes == [8, 4, 2, 1]
    assert policy.survivors() == [7]
    assert rounds == 64  # 16 + 24 + 24: rounding leftovers of early phases carry over to later ones
    assert run(policy, lambda arm: 0.0, 50) == [7] * 50  # commits, even if the winner then does badly


def test_sequential_halving_splits_budget_evenly_within_phase() -> None:
    policy = SequentialHalving(4, budget=64)  # 2 phases of 32 rounds: 8 pulls each, then 16 pulls each
    run(policy, lambda arm: [0.1, 0.9, 0.3, 0.7][arm], 32)
    assert policy.pulls == [8, 8, 8, 8]
    assert policy.survivors() == [1, 3]
    run(policy, lambda arm: [0.1, 0.9, 0.3, 0.7][arm], 32)
    assert policy.pulls == [8, 24, 8, 24]
    assert policy.survivors() == [1]


def test_sequential_halving_noisy_arms() -> None:
    for seed in range(5):
        policy = SequentialHalving(4, budget=200)
        arms = run(policy, bernoulli([0.1, 0.3, 0.6, 0.9], np.random.default_rng(seed)), 400)
        assert policy.survivors() == [3]
        assert arms[-100:] == [3] * 100


def test_sequential_halving_ties_small_budget_and_reset() -> None:
    policy = SequentialHalving(4, budget=64)
    run(policy, lambda arm: 0.5, 64)
    assert policy.survivors() == [0]  # ties keep the lower index
    small = SequentialHalving(5, budget=1)  # budget below one pull per arm: one pull each, then commit to the best
    arms = run(small, lambda arm: [0.2, 0.1, 0.9, 0.4, 0.3][arm], 8)
    assert arms == [0, 1, 2, 3, 4, 2, 2, 2]
    small.reset()
    assert small.survivors() == [0, 1, 2, 3, 4] and small.pulls == [0] * 5
    single = SequentialHalving(1)
    assert run(single, lambda arm: 1.0, 3) == [0, 0, 0]


# --- Baselines ---------------------------------------------------------------------------------------------------


def test_round_robin_cycles() -> None:
    policy = RoundRobin(3)
    assert run(policy, lambda arm: 0.5, 7) == [0, 1, 2, 0, 1, 2, 0]
    policy.reset()
    assert policy.select() == 0


def test_fixed_always_returns_its_arm() -> None:
    policy = Fixed(3, 1)
    assert run(policy, lambda arm: 0.0, 20) == [1] * 20
    with pytest.raises(ValueError):
        Fixed(3, 3)


def test_random_is_reproducible_and_uniform() -> None:
    a, b = RandomPolicy(4, seed=11), RandomPolicy(4, seed=11)
    seq = run(a, lambda arm: 0.5, 4000)
    assert run(b, lambda arm: 0.5, 4000) == seq
    a.reset()
    assert run(a, lambda arm: 0.5, 4000) == seq
    assert run(RandomPolicy(4, seed=12), lambda arm: 0.5, 4000) != seq
    counts = np.bincount(seq, minlength=4)
    assert np.all(np.abs(counts - 1000) < 120)  # ~4 standard deviations


# --- build_policy ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_name_builds(name: str) -> None:
    policy = build_policy(name, DRAFTERS, seed=0)
    if name == "none":
        assert policy is None
        return
    assert policy is not None
    rewards = {
        "ucb-be": "be",
        "metasd-ucb-cost": "bd-cost",
        "metasd-fi": "be-cost",
        "ducb-cost": "bd-cost",
        "swucb-cost": "bd-cost",
        "metasd-adaptive": "rate",
    }
    assert policy.reward == rewards.get(name, "bd")
    if name == "metasd-adaptive":  # chooses through choose()/feedback() with measured costs: tests/test_adaptive.py
        return
    arms = run(policy, lambda arm: 0.5, 10)
    assert all(0 <= a < len(DRAFTERS) for a in arms)
    assert sum(policy.pulls) == 10 and len(policy.mean_rewards) == len(DRAFTERS)


def test_build_policy_parameters() -> None:
    ucb = build_policy("metasd-ucb", DRAFTERS)
    assert isinstance(ucb, UCB) and ucb.beta == 1.0 and ucb.reward == "bd"
    ucb = build_policy("ucb-be:0.25", DRAFTERS)
    assert isinstance(ucb, UCB) and ucb.beta == 0.25 and ucb.reward == "be"
    assert build_policy("metasd-ucb:0", DRAFTERS).beta == 0.0
    exp3 = build_policy("exp3", DRAFTERS)
    assert isinstance(exp3, EXP3) and exp3.gamma == 0.1
    assert build_policy("exp3:1", DRAFTERS).gamma == 1.0
    sh = build_policy("sequential-halving", DRAFTERS)
    assert isinstance(sh, SequentialHalving) and sh.budget == 32
    assert build_policy("sequential-halving:10", DRAFTERS).budget == 10
    fixed = build_policy("fixed:medium", DRAFTERS)
    assert isinstance(fixed, Fixed) and fixed.select() == 2 and fixed.reward == "bd"
    assert isinstance(build_policy("random", DRAFTERS), RandomPolicy)
    assert isinstance(build_policy("round-robin", DRAFTERS), RoundRobin)
    assert build_policy("none", []) is None


def test_build_policy_seed_makes_runs_reproducible() -> None:
    for name in ("exp3", "random"):
        first = run(build_policy(name, DRAFTERS, seed=5), lambda arm: arm / 2, 100)
        assert run(build_policy(name, DRAFTERS, seed=5), lambda arm: arm / 2, 100) == first


@pytest.mark.parametrize(
    "name",
    [
        "bogus",
        "ucb",
        "metasd-ucb:abc",
        "metasd-ucb:-1",
        "metasd-ucb:",
        "ucb-be:nan",
        "exp3:0",
        "exp3:1.5",
        "exp3:-0.1",
        "sequential-halving:0",
        "sequential-halving:2.5",
        "sequential-halving:x",
        "random:3",
        "round-robin:2",
        "none:1",
        "fixed",
        "fixed:",
        "fixed:huge",
    ],
)
def test_build_policy_rejects_bad_names(name: str) -> None:
    with pytest.raises(ValueError):
        build_policy(name, DRAFTERS)


def test_build_policy_errors_list_choices() -> None:
    with pytest.raises(ValueError, match="metasd-ucb.*sequential-halving.*fixed:<drafter>"):
        build_policy("bogus", DRAFTERS)
    with pytest.raises(ValueError, match="medium"):
        build_policy("fixed:huge", DRAFTERS)
    for name in POLICY_NAMES:
        if name != "none":
            with pytest.raises(ValueError, match="at least one drafter"):
                build_policy(name, [])


def test_hindsight_observations_do_not_inflate_exploration() -> None:
    """Free observations update means and counts but not t, so an unobserved arm's bonus does not grow with them."""
    policy = build_policy("metasd-fi", ["ngram", "suffix", "early-exit"], seed=0)
    assert policy is not None and policy.full_information
    policy.update(2, 0.1)  # the costly arm drafted once and did poorly
    for _ in range(200):  # the free arms are scored every round without drafting
        policy.observe(0, 0.3)
        policy.observe(1, 0.2)
    assert policy.rounds == 1 and policy.pulls == [200, 200, 1]
    assert policy.mean_rewards[0] == pytest.approx(0.3)
    assert policy.select() == 0  # t = 1: no bonus yet, the best observed mean wins


# --- Drift: discounted and sliding-window UCB -------------------------------------------------------------------

SWITCH = 100  # the round at which the best arm changes


def drifting(seed: int) -> Callable[[int], float]:
    """Noisy rewards (Beta, like BD's spread) with a known switch: arm 0 best until SWITCH, then arm 2.
    Gaps of ~0.2-0.4, as between a copying drafter on copied text and on reasoning."""
    rng = np.random.default_rng(seed)
    before, after = [0.75, 0.5, 0.35], [0.35, 0.5, 0.75]
    calls = [0]

    def reward_of(arm: int) -> float:
        means = before if calls[0] < SWITCH else after
        calls[0] += 1
        m = means[arm]
        return float(rng.beta(20 * m, 20 * (1 - m)))

    return reward_of


def rounds_to_follow(arms: list[int], best: int = 2, run_len: int = 10) -> int | None:
    """Rounds after SWITCH until the new best arm has been picked in `run_len` consecutive rounds' majority:
    the first r such that rounds r..r+run_len-1 after the switch pick `best` at least 80 % of the time."""
    after = arms[SWITCH:]
    for r in range(len(after) - run_len + 1):
        if sum(a == best for a in after[r : r + run_len]) >= 0.8 * run_len:
            return r
    return None


@pytest.mark.parametrize("seed", range(5))
def test_forgetting_policies_follow_a_switch_and_plain_ucb_lags(seed: int) -> None:
    total = SWITCH + 150
    lags = {}
    for name, policy in [
        ("ducb", DiscountedUCB(3, gamma=0.95, beta=0.1)),
        ("swucb", SlidingWindowUCB(3, window=32, beta=0.1)),
        ("ucb", UCB(3, beta=0.1)),
    ]:
        arms = run(policy, drifting(seed), total)
        assert arms[SWITCH - 20 : SWITCH].count(0) >= 16, name  # all found the first best arm
        lags[name] = rounds_to_follow(arms)
    assert lags["ducb"] is not None and lags["ducb"] <= 40, lags
    assert lags["swucb"] is not None and lags["swucb"] <= 40, lags
    # the same beta without forgetting: 100 rounds of evidence for arm 0 keep it ahead far longer
    assert lags["ucb"] is None or lags["ucb"] > 2 * max(lags["ducb"], lags["swucb"]), lags


def test_discounted_statistics_decay_each_round() -> None:
    policy = DiscountedUCB(2, gamma=0.5, beta=0.0)
    assert [policy.select()] == [0]
    policy.update(0, 1.0)
    assert policy.select() == 1  # every arm once first
    policy.update(1, 0.5)
    counts, means = policy.discounted()
    assert counts == pytest.approx([0.5, 1.0]) and means == pytest.approx([1.0, 0.5])
    policy.update(1, 0.5)
    policy.update(1, 0.5)
    counts, _ = policy.discounted()
    assert counts == pytest.approx([0.125, 1.75])
    # undiscounted totals for reporting
    assert policy.pulls == [1, 3] and policy.mean_rewards == pytest.approx([1.0, 0.5])
    policy.reset()
    assert policy.discounted() == ([0.0, 0.0], [0.0, 0.0]) and policy.pulls == [0, 0]


def test_discounted_ucb_index_matches_formula() -> None:
    policy = DiscountedUCB(2, gamma=0.9, beta=0.3)
    rewards = [(0, 0.8), (1, 0.4), (0, 0.7), (0, 0.9), (1, 0.5)]
    n, s = np.zeros(2), np.zeros(2)
    for arm, r in rewards:
        policy.update(arm, r)
        n, s = 0.9 * n, 0.9 * s
        n[arm] += 1
        s[arm] += r
    index = s / n + 0.3 * np.sqrt(2 * math.log(n.sum()) / n)
    assert policy.select() == int(np.argmax(index))
    assert policy.discounted()[0] == pytest.approx(n.tolist())


def test_discount_one_is_plain_ucb() -> None:
    a, b = DiscountedUCB(3, gamma=1.0, beta=0.5), UCB(3, beta=0.5)
    rng = np.random.default_rng(4)
    for _ in range(300):
        arm = a.select()
        assert arm == b.select()
        r = float(rng.random() < [0.3, 0.5, 0.6][arm])
        a.update(arm, r)
        b.update(arm, r)


def test_sliding_window_forgets_exactly() -> None:
    policy = SlidingWindowUCB(2, window=3, beta=0.0)
    for arm, r in [(0, 1.0), (1, 0.2), (0, 0.9)]:
        policy.update(arm, r)
    assert policy.select() == 0
    policy.update(1, 0.3)  # (0, 1.0) leaves the window: arm 0 has (0.9), arm 1 (0.2, 0.3)
    assert policy.select() == 0
    policy.update(1, 0.3)  # (1, 0.2) leaves: window (0, 0.9), (1, 0.3), (1, 0.3)
    policy.update(1, 0.3)  # (0, 0.9) leaves: arm 0 is out of the window, so it is tried again
    assert policy.select() == 0
    assert policy.pulls == [2, 4] and policy.mean_rewards[0] == pytest.approx(0.95)  # totals, not the window
    policy.reset()
    assert run(policy, lambda arm: 0.5, 2) == [0, 1]


def test_sliding_window_sums_do_not_drift() -> None:
    policy = SlidingWindowUCB(3, window=5, beta=0.1)
    rng = np.random.default_rng(0)
    run(policy, lambda arm: float(rng.random()), 20_000)
    window = list(policy._recent)
    for arm in range(3):
        assert policy._s[arm] == pytest.approx(sum(r for a, r in window if a == arm), abs=1e-9)


# --- Parameter bounds, schedules, canonical names -----------------------------------------------------------------


def test_drifting_policies_build_with_defaults_and_parameters() -> None:
    d = build_policy("ducb", DRAFTERS)
    assert isinstance(d, DiscountedUCB) and (d.gamma, d.beta, d.reward) == (0.95, 0.1, "bd")
    d = build_policy("ducb-cost:0.9:0.5", DRAFTERS)
    assert isinstance(d, DiscountedUCB) and (d.gamma, d.beta, d.reward) == (0.9, 0.5, "bd-cost")
    w = build_policy("swucb", DRAFTERS)
    assert isinstance(w, SlidingWindowUCB) and (w.window, w.beta, w.reward) == (32, 0.1, "bd")
    w = build_policy("swucb-cost:64:0", DRAFTERS)
    assert isinstance(w, SlidingWindowUCB) and (w.window, w.beta, w.reward) == (64, 0.0, "bd-cost")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("metasd-ucb:100.5", "beta must be in"),
        ("metasd-ucb-cost:1e300", "beta must be in"),
        ("ucb-be:-0.1", "beta must be in"),
        ("metasd-ucb:inf", "finite"),
        ("sequential-halving:4000000000", "budget must be an integer in"),
        (f"sequential-halving:{MAX_BUDGET + 1}", "budget"),
        ("sequential-halving:" + "9" * 5000, "not a valid int"),
        ("exp3:1e-400", "gamma"),
        ("ducb:0", "gamma must be in"),
        ("ducb:1.01", "gamma must be in"),
        ("ducb:nan", "finite"),
        ("ducb:0.9:101", "beta must be in"),
        ("ducb:0.9:-1", "beta must be in"),
        ("ducb:0.9:", "bad parameter"),
        ("ducb::0.1", "bad parameter"),
        ("ducb:0.9:0.1:3", "not a valid float"),
        ("swucb:0", "window must be an integer in"),
        ("swucb:100001", "window must be an integer in"),
        ("swucb:2.5", "not a valid int"),
        ("swucb-cost:-3", "window"),
    ],
)
def test_client_chosen_parameters_are_bounded(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_policy(name, DRAFTERS)
    with pytest.raises(ValueError, match=message):
        canonical_policy(name, DRAFTERS)


def test_sequential_halving_huge_budget_builds_instantly_in_constant_memory() -> None:
    import time
    import tracemalloc

    tracemalloc.start()
    start = time.perf_counter()
    policy = build_policy(f"sequential-halving:{MAX_BUDGET}", DRAFTERS)
    arms = run(policy, lambda arm: arm / 3, 30)
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 0.5 and peak < 200_000  # a schedule list would be 1e6 entries (8 MB)
    assert arms == [0, 1, 2] * 10  # survivors in turn
    with pytest.raises(ValueError):
        build_policy("sequential-halving:4000000000", DRAFTERS)


@pytest.mark.parametrize(
    ("spellings", "canonical"),
    [
        (["metasd-ucb", "metasd-ucb:1", "metasd-ucb:1.0", " metasd-ucb : 1.00 ", "metasd-ucb:1e0"], "metasd-ucb:1.0"),
        (["metasd-ucb-cost", "metasd-ucb-cost:0.1", "metasd-ucb-cost:.1"], "metasd-ucb-cost:0.1"),
        (["exp3", "exp3:0.10"], "exp3:0.1"),
        (["sequential-halving", "sequential-halving:32", "sequential-halving: 32"], "sequential-halving:32"),
        (["ducb", "ducb:0.95", "ducb:0.950:0.1", "ducb : 0.95:1e-1"], "ducb:0.95:0.1"),
        (["swucb", "swucb:32", "swucb:32:0.1"], "swucb:32:0.1"),
        (["swucb-cost:8:1"], "swucb-cost:8:1.0"),
        (["fixed:small", " fixed:small "], "fixed:small"),
        (["random", " random"], "random"),
        (["none"], "none"),
    ],
)
def test_canonical_policy_merges_spellings(spellings: list[str], canonical: str) -> None:
    assert {canonical_policy(s, DRAFTERS) for s in spellings} == {canonical}
    assert canonical_policy(canonical, DRAFTERS) == canonical  # a fixed point
    assert canonical_policy(canonical, DRAFTERS) != canonical_policy("metasd-ucb:0.1234567", DRAFTERS)


def test_canonical_policy_keeps_distinct_values_apart() -> None:
    assert canonical_policy("metasd-ucb:0.1234567", DRAFTERS) != canonical_policy("metasd-ucb:0.1234568", DRAFTERS)
    assert canonical_policy("ducb:0.95", DRAFTERS) != canonical_policy("ducb:0.95:1", DRAFTERS)
    assert canonical_policy("ducb", DRAFTERS) != canonical_policy("ducb-cost", DRAFTERS)
    with pytest.raises(ValueError, match="unknown policy"):
        canonical_policy("bogus", DRAFTERS)


def test_a_bandit_kept_across_requests_starts_over_when_a_drafter_is_revised():
    """Its statistics compare the drafters with one another: one of them drafting with something new (a learned
    head swapped in) makes them stale."""
    policy = UCB(2)
    policy.revise([0, 0])
    for arm, r in ((0, 0.9), (1, 0.1), (0, 0.8)):
        policy.update(arm, r)
    policy.revise([0, 0])
    assert policy.pulls == [2, 1]
    policy.revise([0, 1])
    assert policy.pulls == [0, 0] and policy.rounds == 0


def test_a_copy_that_learned_of_a_drafter_since_revised_is_not_merged_back():
    """Batched requests learn in copies of the shared policy (`for_request`, `take_back`); a copy that started
    before a drafter was revised compared it with the others as it was."""
    shared = UCB(2)
    shared.revise([0, 0])
    shared.update(0, 1.0)
    before, start = shared.for_request(), shared.copy_start()
    before.update(1, 0.5)
    shared.revise([0, 1])  # the next request to join sees the new revision
    after, start_after = shared.for_request(), shared.copy_start()
    after.update(1, 0.9)
    shared.take_back(before, start)
    shared.take_back(after, start_after)
    assert shared.pulls == [0, 1] and shared.mean_rewards[1] == pytest.approx(0.9)
    adaptive = build_policy("metasd-adaptive", ["a", "b"])
    adaptive.revise([0, 0])
    stale = adaptive.for_request()
    stale.rounds = 7
    adaptive.revise([0, 1])
    adaptive.take_back(stale, adaptive.copy_start())
    assert adaptive.rounds == 0
