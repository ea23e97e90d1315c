"""metasd-adaptive: the (drafter, k) decision from costs and acceptance, its learning, and the cost model's cache."""

import json
import time
import warnings

import numpy as np
import pytest
import torch
from helpers import tiny_llama

from metasd import Decoder, Draft
from metasd.costs import CostModel, DrafterCost, TargetCost, cache_file, calibration_key, load_or_calibrate
from metasd.models.linear_kernels import KERNELS, install, installed, installed_beyond
from metasd.outcome import Extension, RoundOutcome
from metasd.policy import build_policy, canonical_policy
from metasd.policy.acceptance import SIGNAL_LEVELS, AcceptanceModel, expected_tokens, signal_levels
from metasd.policy.adaptive import AdaptivePolicy, parse_params
from metasd.policy.hindsight import Hindsight
from metasd.tree import DraftTree


def policy_with(table, accept=0.9, n_arms=2, free=(True, False), beta=0.0, signal=1.0, trials=200):
    """An adaptive policy whose acceptance model has seen `trials` tokens accepted at rate `accept` per cell."""
    policy = AdaptivePolicy(n_arms, beta=beta, prior=0)
    policy.attach(CostModel(TargetCost(table)), [f"d{i}" for i in range(n_arms)], list(free))
    policy.costs.target.observe(1, table[0])  # a plain step measured: no check round due
    hits = int(trials * accept)
    for acc, tried in (
        (policy.acceptance.accepted, policy.acceptance.tried),
        (policy.acceptance.history_accepted, policy.acceptance.history_tried),
    ):
        acc[:], tried[:] = hits, trials
    return policy


def proposal(m=8, confidence=1.0):
    return Draft(list(range(100, 100 + m)), confidence=[confidence] * m)


def test_free_verification_drafts_long():
    policy = policy_with([0.01] * 13)
    assert policy.choose(8, {0: proposal()}, [0, 0]) == (0, 8)


def test_expensive_multi_token_forwards_settle_on_a_plain_step():
    table = [0.01 * m for m in range(1, 14)]  # T(M) = M * T(1): drafting can never pay
    policy = policy_with(table, accept=0.6)
    assert policy.choose(8, {0: proposal()}, [0, 0]) == (None, 0)


def test_length_follows_the_cost_curve():
    # verifying 2 tokens is as dear as 3, so with a sure drafter k = 2 beats k = 1; past 3 tokens the cost jumps
    table = [0.010, 0.012, 0.012, 0.100, 0.100, 0.100, 0.100, 0.100, 0.100]
    arm, k = policy_with(table, accept=0.95).choose(8, {0: proposal()}, [0, 0])
    assert (arm, k) == (0, 2)


def test_weak_signals_shorten_the_draft():
    policy = policy_with([0.010 + 0.002 * m for m in range(13)], accept=0.9)
    policy.acceptance.accepted[0, :2] = 0  # the two lowest signal levels are never accepted
    sure = proposal(6, 1.0)
    mixed = Draft(sure.tokens, confidence=[1.0, 1.0, 1.0, 0.1, 0.1, 0.1])
    assert policy.choose(6, {0: sure}, [0, 0]) == (0, 6)
    assert policy.choose(6, {0: mixed}, [0, 0]) == (0, 3)


def test_model_drafter_pays_for_drafting_and_catch_up():
    table = [0.010] * 13
    policy = policy_with(table, accept=0.8, free=(False, False))
    policy.costs.drafter("d0").step.add(0.0005)  # cheap drafter
    policy.costs.drafter("d1").step.add(0.0100)  # as slow as the target
    assert policy.choose(6, {}, [0, 0])[0] == 0
    policy.costs.drafter("d0").catch_up.add(500, 1.0)
    arm, _ = policy.choose(6, {}, [500, 0])  # d0 missed 500 tokens: a 1 s catch-up
    assert arm != 0


def test_a_fresh_drafters_prompt_is_an_investment_in_the_rest_of_the_request():
    """A model drafter that has not drafted in this request must prefill the prompt first: worth it for a long
    answer, not for a few tokens."""
    policy = policy_with([0.010] * 13, accept=0.9, n_arms=1, free=(False,))
    policy.costs.drafter("d0").step.add(0.001)
    policy.costs.drafter("d0").catch_up.add(700, 0.300)  # thirty target steps
    assert policy.choose(6, {}, [700], remaining=16, fresh=[True]) == (None, 0)
    assert policy.choose(6, {}, [700], remaining=2000, fresh=[True])[0] == 0
    assert policy.choose(6, {}, [700], remaining=2000, fresh=[False]) == (None, 0)  # a real catch-up: paid now


def test_a_drafter_started_and_then_left_idle_pays_more_for_its_next_prompt():
    """The prefill is amortised over the share of the output the drafter's rounds yielded once started in earlier
    requests: a drafter tried once per request and then dropped (early exit on the Qwen pair) is not started on a
    long prompt any more, while one that drafts most rounds still is."""

    def run_request(policy, drafted_rounds, rounds=20):
        policy.reset()
        context = [1, 2, 3]
        for i in range(rounds):
            arm = 0 if i < drafted_rounds else None
            draft = Draft([7]) if arm is not None else Draft([])
            context = context + [7]
            policy.feedback(
                RoundOutcome(
                    arm, len(draft.tokens), draft, 0, len(context) - 1, context, None, [7], {}, 0.001, 0.01, 0.01
                )
            )
        policy.finish(context)

    chosen = {}
    for drafted in (1, 20):
        policy = policy_with([0.010] * 13, accept=0.9, n_arms=1, free=(False,))
        policy.costs.drafter("d0").step.add(0.001)
        policy.costs.drafter("d0").catch_up.add(700, 0.300)
        assert policy.choose(6, {}, [700], remaining=100, fresh=[True])[0] == 0  # unknown: priced as if used
        for _ in range(4):
            run_request(policy, drafted)
        policy.acceptance.accepted[:] = 180  # the same acceptance for both
        policy.acceptance.tried[:] = 200
        chosen[drafted] = policy.choose(6, {}, [700], remaining=100, fresh=[True])[0]
    assert chosen == {1: None, 20: 0}


def test_catch_up_time_is_a_line_through_small_and_large_intakes():
    cost = DrafterCost()
    assert cost.catch_up_time(10, 0.1) == pytest.approx(0.01)  # unmeasured: a guess of 1 % of a step per token
    for n, seconds in ((3, 0.021), (6, 0.024), (700, 0.72)):
        cost.catch_up.add(n, seconds)
    assert cost.catch_up_time(4, 0.1) == pytest.approx(0.022, abs=0.005)  # mostly the forward's fixed cost
    assert cost.catch_up_time(1400, 0.1) == pytest.approx(1.42, rel=0.05)  # per token for a prompt
    assert cost.catch_up_time(0, 0.1) == 0.0


def test_optimism_tries_an_unknown_model_drafter():
    policy = AdaptivePolicy(2, beta=0.3, prior=0)
    policy.attach(CostModel(TargetCost([0.010] * 13)), ["free", "model"], [True, False])
    assert policy.choose(4, {}, [0, 0]) == (None, 0)  # first a plain step: T(1) is every estimate's yardstick
    policy.costs.target.observe(1, 0.010)
    assert policy.choose(4, {0: Draft([])}, [0, 0]) == (1, 1)  # optimism buys a 1-token try, not 4 guesses
    for _ in range(3):  # three first tokens accepted: the plan may now reach position 1
        policy.acceptance.learn(1, None, accepted=1, decided=1)
    assert policy.choose(4, {0: Draft([])}, [0, 0]) == (1, 2)
    for j in (1, 2, 3):  # positions 1, 2 and 3+ seen too: the whole length is open
        for _ in range(3):
            policy.acceptance.learn(1, None, accepted=j + 1, decided=j + 1)
    assert policy.choose(4, {0: Draft([])}, [0, 0]) == (1, 4)


def test_stop_rule_ends_a_draft_whose_tokens_are_unlikely():
    policy = policy_with([0.010 + 0.004 * m for m in range(13)], accept=0.9, free=(False, False))
    policy.acceptance.accepted[0, :2] = 0  # low-confidence tokens are never accepted
    policy.costs.drafter("d0").step.add(0.0005)
    policy.choose(6, {}, [0, 0])
    stop = policy.stop_rule(0, 6)
    sure, unsure = torch.tensor([0.95, 0.05]), torch.tensor([0.2] * 5)
    assert stop.before(0, sure) is False and stop.before(1, sure) is False
    assert stop.before(2, unsure) is True


def test_stop_rule_weighs_the_next_forward_against_what_it_may_earn():
    """After a token is drawn the rule asks whether another drafter forward pays: yes for a cheap drafter that is
    usually right, no once the chance that the whole draft survives has fallen below what a forward costs."""
    sure = torch.tensor([0.95, 0.05])
    table = [0.010] * 13
    cheap = policy_with(table, accept=0.9, free=(False, False))
    cheap.costs.drafter("d0").step.add(0.0005)
    cheap.choose(12, {}, [0, 0])
    stop = cheap.stop_rule(0, 12)
    assert not any(stop.before(j, sure) or stop.after(j, sure, 0) for j in range(8))
    dear = policy_with(table, accept=0.5, free=(False, False))
    dear.costs.drafter("d0").step.add(0.004)  # 40 % of a target step per token
    dear.costs.drafter("d1").step.add(0.050)
    assert dear.choose(12, {}, [0, 0])[0] == 0
    stop = dear.stop_rule(0, 12)
    ends = next(j for j in range(12) if stop.before(j, sure) or stop.after(j, sure, 0))
    assert 0 <= ends <= 3


def test_the_stop_rule_holds_a_draft_to_the_best_rate_without_optimism():
    """An unknown drafter picked on its bonus is not held to the bonus: going on must beat what the round's options
    offer on evidence, not the optimistic rate that picked it."""
    table = [0.010] * 13
    policy = AdaptivePolicy(1, beta=1.0, prior=0)
    policy.attach(CostModel(TargetCost(table)), ["d0"], [False], [True])
    policy.costs.target.observe(1, 0.010)
    policy.costs.drafter("d0").step.add(0.004)
    assert policy.choose(12, {}, [0]) == (0, 1)
    stop = policy.stop_rule(0, 1)
    # picked at 2 tokens / 14 ms (its first token sure, by the bonus); held to 1.5 tokens / 14 ms (the uninformed
    # 1/2), which beats a plain step (1 / 10 ms)
    assert stop.rate == pytest.approx(1.5 / 0.014)
    sure = policy_with(table, accept=0.9, n_arms=1, free=(False,), beta=0.0)
    sure.costs.drafter("d0").step.add(0.004)
    arm, _ = sure.choose(12, {}, [0])
    assert arm == 0 and sure.stop_rule(0, 12).rate > 1 / 0.010  # with evidence and no bonus: the plan's own rate


def test_a_stoppable_model_drafter_is_sent_for_the_explored_length():
    policy = policy_with([0.010] * 13, accept=0.7, free=(False, False))
    policy.costs.drafter("d0").step.add(0.003)
    policy.costs.drafter("d1").step.add(0.050)
    arm, planned = policy.choose(12, {}, [0, 0])
    assert arm == 0 and planned < 12  # the plan alone would stop early
    policy.stoppable = [True, True]
    assert policy.choose(12, {}, [0, 0]) == (0, 12)  # the stop rule decides where it ends


def test_a_model_draft_is_continued_where_verification_is_cheap_and_the_draft_likely_survives():
    """After a model drafter's tokens, a free proposal for the context they lead to is appended as far as its
    expected tokens beat the extra verification: all of a sure copy where T(M) is flat, none where each verified
    token costs a target step, none after model tokens that are rarely accepted."""
    model_draft = Draft([5, 6], confidence=[0.95, 0.95])
    flat = policy_with([0.010] * 13, accept=0.9, free=(True, False))
    flat.costs.drafter("d1").step.add(0.001)
    flat.choose(12, {}, [0, 0])
    assert flat.extension(1, model_draft, {0: proposal(4)}) == (0, 4)
    assert flat.extension(1, model_draft, {0: Draft([])}) is None
    steep = policy_with([0.010 * m for m in range(1, 14)], accept=0.9, free=(True, False))
    steep.costs.drafter("d1").step.add(0.001)
    steep.choose(12, {}, [0, 0])
    assert steep.extension(1, model_draft, {0: proposal(4)}) is None
    unlikely = policy_with([0.010 + 0.0005 * m for m in range(13)], accept=0.9, free=(True, False))
    unlikely.acceptance.accepted[1] = 10  # the model's tokens: 5 % accepted
    unlikely.costs.drafter("d1").step.add(0.001)
    unlikely.choose(12, {0: proposal(8)}, [0, 0])
    assert unlikely.extension(1, model_draft, {0: proposal(4)}) is None


def test_a_continued_round_teaches_each_drafter_only_its_own_tokens():
    """The model drafter learns from its own tokens; the free drafter's continuation is judged in hindsight, and
    only where the model's tokens were accepted (otherwise it continued a context that never happened)."""
    policy = AdaptivePolicy(2, beta=0.0, prior=0)
    policy.attach(CostModel(TargetCost([0.01] * 13)), ["free", "model"], [True, False])
    context = [1, 2, 3]
    model_draft = Draft([5, 6], confidence=[0.9, 0.9])
    continued = model_draft.followed_by(Draft([7, 8], confidence=[0.9, 0.9]))
    after = {0: Draft([7, 8], confidence=[0.9, 0.9])}
    out = context + [5, 6, 7, 4]  # both model tokens and the first continuation token accepted, then the target's 4
    policy.feedback(
        RoundOutcome(
            1, 2, continued, 3, len(context), out, None, [5, 6, 7, 4, 0], {}, 0.0, 0.01, 0.01, Extension(2, 0, after)
        )
    )
    tried, accepted = policy.acceptance.tried, policy.acceptance.accepted
    assert tried[1].sum() == 2 and accepted[1].sum() == 2
    # the free drafter as a continuation (arm 2 + 0) is learned apart from its own rounds' proposals (arm 0)
    assert tried[2].sum() == 2 and accepted[2].sum() == 1 and tried[0].sum() == 0
    rejected = context + [9]  # the model's first token rejected: the continuation is not evidence
    policy.feedback(
        RoundOutcome(1, 2, continued, 0, len(context), rejected, None, [9], {}, 0.0, 0.01, 0.01, Extension(2, 0, after))
    )
    assert tried[2].sum() == 2 and tried[1].sum() == 3
    # a continuation offered but not appended is evidence all the same, once the model's tokens are accepted
    declined = context + [5, 6, 7, 8, 1]
    policy.feedback(
        RoundOutcome(
            1,
            2,
            model_draft,
            2,
            len(context),
            declined,
            None,
            [5, 6, 7],
            {},
            0.0,
            0.01,
            0.01,
            Extension(2, None, after),
        )
    )
    assert tried[2].sum() == 4 and accepted[2].sum() == 3 and tried[1].sum() == 5


def test_a_continued_draft_carries_one_hot_rows_after_the_models():
    q = torch.softmax(torch.randn(2, 10), -1)
    draft = Draft([3, 4], q, [0.5, 0.6]).followed_by(Draft([7], confidence=[0.9]))
    assert draft.tokens == [3, 4, 7] and draft.confidence == [0.5, 0.6, 0.9]
    assert torch.equal(draft.q[:2], q) and draft.q[2, 7] == 1.0 and draft.q[2].sum() == 1.0
    assert Draft([3]).followed_by(Draft([7])).q is None
    assert Draft([3]).followed_by(Draft([7])).confidence is None
    mixed = Draft([3], confidence=[0.95]).followed_by(Draft([7, 8]))  # a continuation without a signal
    assert mixed.confidence[0] == 0.95 and np.isnan(mixed.confidence[1:]).all()
    assert signal_levels(mixed.confidence, 3).tolist() == [4, SIGNAL_LEVELS, SIGNAL_LEVELS]
    with pytest.raises(ValueError, match="one-hot"):
        Draft([3]).followed_by(Draft([7], q[:1]))


def tree_policy(table, accept=0.6, tree=1):
    """Three free drafters (0-2) and a model drafter (3), every cell at `accept`; `choose` sets the round's bar."""
    policy = policy_with(table, accept=accept, n_arms=4, free=(True, True, True, False))
    policy.trees, policy.grows_trees = tree, True
    return policy


def siblings():
    """Three free proposals: 0 and 1 share their first two tokens, 2 starts apart."""
    return {
        0: Draft([5, 6, 7, 8], confidence=[1.0] * 4),
        1: Draft([5, 6, 9], confidence=[1.0] * 3),
        2: Draft([11, 12, 13], confidence=[1.0] * 3),
    }


def test_where_verification_is_flat_the_tree_takes_every_branch_that_may_be_accepted():
    policy = tree_policy([0.010] * 13)
    proposals = siblings()
    arm, k = policy.choose(4, proposals, [0] * 4)
    tree = DraftTree.chain(proposals[arm].truncated(k), arm)
    added = policy.branches(tree, proposals, 12)
    assert {a for a, _ in added} == {0, 1, 2} - {arm}
    assert tree.size == k  # the policy sizes on a copy: the engine adds what it returns


def test_where_verification_is_steep_the_tree_stays_a_chain():
    policy = tree_policy([0.010 * (1 + 0.5 * (m - 1)) for m in range(1, 14)])
    proposals = siblings()
    arm, k = policy.choose(4, proposals, [0] * 4)
    assert arm is not None
    assert policy.branches(DraftTree.chain(proposals[arm].truncated(k), arm), proposals, 12) == []


def test_branches_are_cut_where_their_tokens_stop_paying_and_the_tree_within_its_room():
    """T(M) flat up to 5 nodes, then steep: the tree fills to 4 nodes (M = 5) and no further; `tree=2` takes
    every proposal whole, as far as the room allows."""
    table = [0.010] * 5 + [0.030 + 0.01 * m for m in range(8)]
    policy = tree_policy(table, accept=0.5)
    proposals = siblings()
    tree = DraftTree.chain(proposals[2].truncated(2), 2)
    policy.bar = 1.0 / 0.010
    for arm, branch in policy.branches(tree, proposals, 12):
        tree.add(arm, branch)
    assert tree.size == 4
    policy.trees = 2
    tree = DraftTree.chain(proposals[2], 2)
    added = policy.branches(tree, proposals, 8)
    assert [(a, b.tokens) for a, b in added] == [(0, [5, 6, 7, 8]), (1, [5, 6, 9])]  # 3 + 4 + 1: 5, 6 shared
    added = policy.branches(tree, proposals, 6)
    assert [(a, b.tokens) for a, b in added] == [(0, [5, 6, 7])]  # then 1's new node has no room


def test_a_model_drafts_runner_up_is_a_sibling_where_its_token_is_likely_rejected():
    """A model draft whose first token is accepted half the time: its runner-up there, right 80 % of the times
    the token is not, joins the tree as one node; where the model's token is never rejected it does not."""
    policy = tree_policy([0.010] * 13, accept=0.5)
    runner = policy.tables.runner_up(3)
    policy.acceptance.accepted[runner], policy.acceptance.tried[runner] = 160, 200
    draft = Draft([40, 41], confidence=[0.5, 0.5], runners_up=[(50, 0.3), (51, 0.3)])
    policy.bar = 1.0 / 0.010
    added = policy.branches(DraftTree.chain(draft, 3), {}, 12)
    assert [(a, b.tokens) for a, b in added] == [(3, [50]), (3, [40, 51])]
    policy.acceptance.accepted[3], policy.acceptance.tried[3] = 200, 200
    policy.costs.target = TargetCost([0.010 * m for m in range(1, 14)])  # and each node costs a whole step
    assert policy.branches(DraftTree.chain(draft, 3), {}, 12) == []


def test_a_model_drafts_runner_up_is_learned_from_every_round_it_could_have_been_tried():
    policy = tree_policy([0.010] * 13)
    runner = policy.tables.runner_up(3)
    before = policy.acceptance.tried[runner].sum()
    draft = Draft([40, 41], confidence=[0.9, 0.9], runners_up=[(50, 0.3), (51, 0.3)], forwards=2)
    for emitted, hit in (([40, 51], 1.0), ([40, 52], 0.0), ([40, 41, 7], None)):
        accepted_before = policy.acceptance.accepted[runner].sum()
        context = [1, 2, 3, *emitted]
        outcome = RoundOutcome(
            arm=3,
            k=2,
            draft=draft,
            accepted=len(emitted) - 1,
            start=3,
            context=context,
            p=None,
            target_tokens=None,
            proposals={},
            draft_time=0.01,
            verify_time=0.01,
            plain_step_time=0.01,
        )
        policy.feedback(outcome)
        if hit is not None:
            assert policy.acceptance.accepted[runner].sum() - accepted_before == hit
    assert policy.acceptance.tried[runner].sum() - before == 2  # the fully accepted draft tried no runner-up


def test_acceptance_model_learns_per_signal_and_position_and_starts_from_history():
    model = AcceptanceModel(1, prior_weight=10)
    for _ in range(100):
        model.learn(0, [1.0, 1.0, 1.0], accepted=3, decided=3)
        model.learn(0, [0.1, 0.1], accepted=0, decided=2)  # rejected at position 0: position 1 never tried
    assert model.rates(0, [1.0, 1.0, 1.0], 3).min() > 0.9
    assert model.rates(0, [0.1], 1)[0] < 0.1
    model.reset()
    assert model.tried.max() <= 10 + 1e-9 and model.rates(0, [1.0], 1)[0] > 0.8  # history as a bounded prior
    assert AcceptanceModel(1).rates(0, None, 2).tolist() == [0.5, 0.5]  # uninformed
    assert expected_tokens(np.array([1.0, 0.5])).tolist() == [1.0, 2.0, 2.5]


def test_a_drafter_equally_poor_on_every_request_gets_a_strong_prior_a_variable_one_a_weak_one():
    """spread: the history's weight in a new request follows how much a drafter's first-token acceptance varied
    between earlier requests (beta-binomial concentration by moments)."""
    model = AcceptanceModel(2, prior_weight=0, spread=True)
    for request in range(8):
        steady = [1] + [0] * 9  # 1 in 10 on every request
        varying = [1] * 9 + [0] if request % 2 else [1] * 3 + [0] * 7  # 90 % on some requests, 30 % on others
        for a, b in zip(steady, varying, strict=True):
            model.learn(0, None, a, 1)
            model.learn(1, None, b, 1)
        if request == 1:
            model.reset()
            assert model.tried.sum() == 0  # two requests are too few to tell: a fresh start, as prior 0
            continue
        model.reset()
    assert model.prior_strength(0) == 50.0 and model.prior_strength(1) < 5
    assert model.tried[0, :, 0].sum() == pytest.approx(50.0) and model.position_means(0)[0] < 0.15
    assert model.tried[1, :, 0].sum() == pytest.approx(model.prior_strength(1))
    per_cell = AcceptanceModel(2, prior_weight=0)  # spread off: prior 0 is the paper's per-query reset
    per_cell.learn(0, None, 0, 1)
    per_cell.reset()
    assert per_cell.tried.sum() == 0


def test_a_revised_drafter_is_judged_by_its_own_rounds_not_by_what_it_replaced():
    """A drafter whose revision changed between requests (an EAGLE head learned from traffic swapped in) starts
    without the acceptance carried across requests of what drafted before; the other drafters keep theirs."""
    policy = policy_with([0.01] * 13, accept=0.2, n_arms=2, free=(True, False))
    policy.acceptance.spread, policy.acceptance.prior_weight = False, 20.0  # requests start from the history
    t = policy.tables
    kept = policy.acceptance.history_tried[t.main(0)].copy()
    policy.usage.sums[1], policy.usage.counts[1] = 0.1, 4  # the head before yielded little of its requests
    policy.revise([None, 0])  # the first request seen: nothing to compare with
    policy.revise([None, 0])
    assert policy.acceptance.history_tried[t.main(1)].sum() > 0
    policy.revise([None, ("", 1)])
    for row in t.rows_of(1):
        assert policy.acceptance.history_tried[row].sum() == 0 and policy.acceptance.tried[row].sum() == 0
    assert np.array_equal(policy.acceptance.history_tried[t.main(0)], kept)
    assert policy.usage.share(1) == 1.0
    policy.reset()
    assert policy.acceptance.rates(t.main(1), None, 2).tolist() == [0.5, 0.5]  # uninformed again
    assert policy.acceptance.rates(t.main(0), None, 1)[0] < 0.3  # the other drafter starts from its record
    assert policy.snapshot()["revisions"] == (None, ("", 1))  # what it learned describes this revision


def test_deep_positions_have_their_own_cells():
    """A drafter whose spans always run out after 6 tokens: tokens 3-5 are sure, token 6 never; one rate from
    token 3 on would price both alike."""
    model = AcceptanceModel(1, prior_weight=0)
    assert model.explored_length(0, 12) == 1
    for _ in range(50):
        model.learn(0, None, accepted=6, decided=12)
    rates = model.rates(0, None, 12)
    assert rates[3:6].min() > 0.9 and rates[6:9].max() < 0.1 and rates[9] == 0.5  # 9+ never tried
    assert model.explored_length(0, 12) == 10  # cells up to 6-8 seen, the plan may reach position 9
    for _ in range(3):
        model.learn(0, None, accepted=12, decided=12)
    assert model.explored_length(0, 12) == 12


def test_the_explored_length_carries_across_requests_unless_each_request_starts_afresh():
    """Spread gives a drafter whose acceptance varies between requests a weak prior; the lengths it has been sent
    for still count, so the next request does not restart it at one token. The paper's per-query reset does."""
    carried, afresh = AcceptanceModel(1, spread=True), AcceptanceModel(1, prior_weight=0)
    for model in (carried, afresh):
        for request in range(4):  # first tokens accepted on half the requests: a weak prior
            for _ in range(4):
                model.learn(0, None, accepted=12 if request % 2 else 0, decided=12)
            model.reset()
    assert carried.tried[0].sum() < 12  # little of the history weighs in the estimates
    assert carried.explored_length(0, 12) == 12
    assert afresh.tried.sum() == 0 and afresh.explored_length(0, 12) == 1


def test_hindsight_waits_for_the_output_that_decides_a_proposal():
    h = Hindsight()
    h.add(0, 2, [5, 6, 7])
    assert h.resolve([1, 2, 5]) == []  # one token out, it matched: undecided
    (d,) = h.resolve([1, 2, 5, 6, 9])
    assert (d.matched, d.decided) == (2, 3)  # rejected at its third token
    h.add(1, 0, [1, 2, 3])
    (d,) = h.resolve([1, 2], final=True)  # the request ended: the rest stays unknown
    assert (d.matched, d.decided) == (2, 2)


def test_parameters_are_validated_and_canonical():
    assert parse_params("beta=0.5, max=8")["max"] == 8
    assert parse_params("0.2")["beta"] == 0.2
    assert parse_params("spread=0,prior=20")["prior"] == 20
    for bad in (
        "max=0",
        "max=1e9",
        "gamma=2",
        "beta=nan",
        "speed=3",
        "max=2.5",
        "spread=0.5",
        "prior=20",
        "tree=3",
        "tree=0.5",
    ):  # prior is the history weight of spread=0 only: never silently ignored
        with pytest.raises(ValueError):
            build_policy(f"metasd-adaptive:{bad}", ["ngram"])
    assert canonical_policy("metasd-adaptive", ["ngram"]) == canonical_policy("metasd-adaptive:beta=0.3", ["ngram"])


class SlowMultiToken(torch.nn.Module):
    """The target with a delay that grows with the tokens of a forward: multi-token verification made expensive."""

    def __init__(self, model, per_token):
        super().__init__()
        self.inner, self.per_token, self.config = model, per_token, model.config

    def forward(self, input_ids, **kwargs):
        time.sleep(self.per_token * (input_ids.shape[1] - 1) if input_ids.shape[1] <= 16 else 0.0)
        return self.inner(input_ids=input_ids, **kwargs)


COPY = "Repeat this list exactly, twice: apple, banana, cherry, dates, elderberry, figs, grapes, honeydew."


def test_engine_learns_expensive_verification_online_and_stops_drafting(embedded):
    decoder = Decoder(drafters=["ngram", "suffix"], policy="metasd-adaptive:max=3")
    reference = decoder.generate(COPY, max_new_tokens=40, policy="none").token_ids
    decoder.target_cache.model = SlowMultiToken(decoder.target_cache.model, per_token=0.3)
    for _ in range(2):  # the calibration said drafting is cheap; rounds measure otherwise
        result = decoder.generate(COPY, max_new_tokens=40)
        assert result.token_ids == reference
    drafted = [r.drafted for r in result.stats.rounds]
    assert sum(d == 0 for d in drafted) >= 0.8 * len(drafted)


def test_engine_drafts_long_when_verification_is_free(embedded):
    decoder = Decoder(drafters=["ngram", "suffix"], policy="metasd-adaptive:max=8")
    decoder.cost_model().target = TargetCost([decoder.cost_model().target(1)] * 9)  # pretend T(M) = T(1)
    reference = decoder.generate(COPY, max_new_tokens=48, policy="none")
    result = decoder.generate(COPY, max_new_tokens=48)
    assert result.token_ids == reference.token_ids
    assert result.stats.mean_accepted_tokens > 2.0
    assert max(r.drafted for r in result.stats.rounds) == 8


def test_statistics_count_what_is_emitted(embedded):
    exact = "lm:embedded:unquantized"  # the target itself: it drafts the target's own tokens
    decoder = Decoder(drafters=["ngram", "suffix", exact], policy=f"fixed:{exact}", draft_len=5)
    result = decoder.generate("Reply with only the word: yes", max_new_tokens=64)
    assert result.finish_reason == "stop"
    rounds = result.stats.rounds
    assert sum(r.emitted for r in rounds) == len(result.token_ids)
    assert all(r.accepted <= r.emitted <= r.accepted + 1 for r in rounds)
    last = rounds[-1]  # the drafter drafts the target's own tokens: the EOS cut is what limits the last round
    assert last.accepted < last.drafted or last.emitted == last.accepted + 1
    assert sum(s.accepted for s in result.stats.drafters().values()) <= len(result.token_ids)


def test_greedy_block_divergence_is_one_scale_for_every_kind(embedded):
    """The target itself as drafter scores 1 whether it sends q (lm:) or only tokens (fixed:ngram-like one-hot)."""
    decoder = Decoder(drafters=["lm:embedded:unquantized"], policy="metasd-ucb", draft_len=4)
    rewards = [
        r.reward
        for r in decoder.generate("Name three colours.", max_new_tokens=24).stats.rounds
        if r.drafter and r.drafted == 4
    ]
    assert rewards and all(r == pytest.approx(1.0) for r in rewards)


@pytest.fixture()
def tiny_model():

    return tiny_llama(64, layers=1, positions=512)


def test_calibration_cache_round_trip_and_corrupt_or_foreign_files(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("METASD_CACHE_DIR", str(tmp_path))
    found = load_or_calibrate("tiny", tiny_model, 4)
    assert len(found.table) == 4 and all(t > 0 for t in found.table)
    assert len(found.kernels) == 4 and set(found.kernels) <= set(KERNELS)
    assert installed(tiny_model) == found.kernels  # the calibration routed the layers to the kernels it chose
    key = calibration_key("tiny", tiny_model, 4)
    path = cache_file(key)
    assert json.loads(path.read_text())["table"] == found.table
    install(tiny_model, ["linear"] * 4)
    assert load_or_calibrate("tiny", tiny_model, 4) == found  # read back, not measured again
    assert installed(tiny_model) == found.kernels  # and its kernels installed again
    assert found.beyond in KERNELS and installed_beyond(tiny_model) == found.beyond
    good = {"key": key, "table": found.table, "kernels": found.kernels, "beyond": found.beyond}
    for content in (
        "{not json",
        json.dumps({**good, "key": {**key, "threads": 999}}),
        json.dumps({**good, "table": [1.0, -2.0, 3.0, 4.0]}),
        json.dumps({**good, "kernels": ["linear", "fancy", "linear", "linear"]}),
        json.dumps({**good, "beyond": "fancy"}),
        json.dumps({"key": key, "table": found.table}),
    ):
        path.write_text(content)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again = load_or_calibrate("tiny", tiny_model, 4)
        assert len(again.table) == 4 and all(t > 0 for t in again.table)
        assert any("ignoring the calibration cache" in str(w.message) for w in caught)


def test_prefills_are_not_taken_for_forward_costs(embedded):
    """The first round of a request also prefills the prompt (and a model drafter's first draft its own copy of
    it): hundreds of tokens. Counted as T(M) or as a drafter's step time, they made drafting look several times
    dearer than it is."""
    decoder = Decoder(drafters=["ngram", "early-exit:4"], policy="fixed:early-exit:4", draft_len=2)
    costs = decoder.cost_model()
    before = costs.target.observations()
    prompt = "Summarize: " + " ".join(f"item {i} is on the shelf." for i in range(60))
    result = decoder.generate(prompt, max_new_tokens=12)
    observed = costs.target.observations() - before
    assert observed == len(result.stats.rounds) - 1  # every round but the one that prefilled the prompt
    step = costs.drafter("early-exit:4").step
    assert step.n == sum(r.drafter is not None for r in result.stats.rounds) - 1
    assert step.value < 10 * costs.target(1)  # per drafted token: four layers, not a prompt's prefill
    # once a step is known, the next request's first draft measures what taking in a prompt costs
    assert not costs.drafter("early-exit:4").catch_up.measured
    again = decoder.generate(prompt, max_new_tokens=4)
    assert again.stats.rounds[0].catch_up == 0  # the prompt is not counted as missed tokens
    intake = costs.drafter("early-exit:4").catch_up
    assert intake.measured and intake(400) > intake(4)


def test_the_ceiling_bounds_every_option():
    """`ceiling` is what a batch compares with a plain step before asking for options: no option may exceed it."""
    policy = policy_with([0.01] * 13, accept=0.5, beta=0.3)
    rng = np.random.default_rng(0)
    policy.acceptance.accepted[:] = rng.uniform(0, 50, policy.acceptance.accepted.shape)  # cells differ by level
    ceiling = policy.ceiling(8)
    for confidence in (0.05, 0.5, 0.95, None):
        draft = Draft(list(range(8)), confidence=None if confidence is None else [confidence] * 8)
        for option in policy.options(8, {0: draft}, [0, 0]):
            assert np.all(option.gain <= ceiling[: len(option.gain)] + 1e-12)
    assert ceiling[0] == 1.0 and np.all(np.diff(ceiling) >= 0)
