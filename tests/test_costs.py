"""The cost model on its own: T(M) learned robustly from real rounds, drafter step and catch-up times, the per-round
overhead per decoding regime; and what the engine feeds it (forwards actually run, no prefills, true lags)."""

import pytest
import torch

from metasd import Decoder, Draft
from metasd.costs import CostModel, DrafterCost, TargetCost
from metasd.policy.adaptive import AdaptivePolicy
from metasd.tokens import common_prefix

COPY = "Repeat this list exactly, twice: apple, banana, cherry, dates, elderberry, figs, grapes, honeydew."
LONG = "Summarize: " + " ".join(f"item {i} is on the shelf." for i in range(60))


def test_the_overhead_moves_with_the_rounds_it_measures():
    """It follows a change of level (a running mean over all rounds would stay between the two) and one preempted
    round moves it by a bounded step."""
    costs = CostModel(TargetCost([0.01, 0.012]))
    overhead = costs.overhead["greedy"]
    for _ in range(20):
        overhead.add(0.01)
    assert overhead.value == pytest.approx(0.01)
    for _ in range(200):
        overhead.add(0.02)
    assert overhead.value == pytest.approx(0.02, rel=1e-3)  # a mean of all 220 rounds: 0.0191
    overhead.add(10.0)  # one round preempted by another process
    assert overhead.value < 0.02 + 0.05 * 3 * 0.02 + 1e-9  # counted as 4x the estimate at most, at weight 0.05
    assert costs.overhead["sampled"].value is None  # the other regime has measured nothing


def test_the_engine_measures_overhead_per_regime(embedded):
    decoder = Decoder(drafters=["ngram", "suffix"], policy="metasd-adaptive")
    decoder.generate(COPY, max_new_tokens=12)
    overhead = decoder.cost_model().overhead
    assert overhead["greedy"].value > 0 and overhead["sampled"].value is None
    decoder.generate(COPY, max_new_tokens=12, temperature=0.7, seed=1)
    assert overhead["sampled"].value > 0


def test_greedy_and_sampled_requests_learn_apart(embedded):
    decoder = Decoder(drafters=["ngram", "suffix"], policy="metasd-adaptive")
    decoder.generate(COPY, max_new_tokens=8)
    decoder.generate(COPY, max_new_tokens=8, temperature=0.7, seed=1)
    policies = [p for p in decoder.policies.values() if isinstance(p, AdaptivePolicy)]
    assert sorted(p.regime for p in policies) == ["greedy", "sampled"]
    assert policies[0] is not policies[1]


def test_a_step_is_priced_per_forward_run():
    cost = DrafterCost()
    cost.observe(forwards=2, missed=1, seconds=0.02)  # stopped before its second token: one token, two forwards
    assert cost.step.value == pytest.approx(0.01)
    cost.observe(forwards=3, missed=50, seconds=0.03 + 0.2)  # three steps after taking in 50 unseen tokens
    assert cost.catch_up(50) == pytest.approx(0.2, rel=0.05)


class StopBeforeSecond:
    """A stop rule that ends every draft before its second token is drawn (its q computed and paid for)."""

    def before(self, j, q):
        return j == 1

    def after(self, j, q, token):
        return False


def test_a_draft_stopped_before_a_token_counts_the_forward_it_paid(embedded):
    from metasd.drafters import build_drafter
    from metasd.models.loading import load_model
    from metasd.sampling import SamplingParams

    target = load_model()
    drafter = build_drafter("early-exit:4", target, "float32")
    context = target.tokenizer.encode("The capital of France is")
    draft = drafter.propose_until(context, 4, SamplingParams(), None, StopBeforeSecond())
    assert len(draft.tokens) == 1 and draft.forwards == 2
    assert len(drafter.lm.tokens) == len(context) + draft.forwards - 1  # what its cache holds
    full = drafter.propose(context, 3, SamplingParams(), None)
    assert full.forwards == 3 and len(drafter.lm.tokens) == len(context) + 2


def test_the_lag_the_policy_sees_is_what_the_drafter_takes_in(embedded):
    """Each round, a model drafter's lag is the tokens its cache will be fed before it drafts: the context minus
    what its cache shares with it (its own accepted tokens, but not the last one it drew and never fed)."""
    decoder = Decoder(drafters=["ngram", "suffix", "early-exit:4"], policy="round-robin", draft_len=3)
    drafter = decoder.drafters["early-exit:4"]
    seen = []
    original = Decoder._policy

    def watched(self, name, names, regime="greedy"):
        policy = original(self, name, names, regime)
        choose = policy.choose

        def choose_and_check(k, proposals, lags, **kw):
            context = generation.prompt + generation.token_ids
            if drafter.name in generation._drafted:
                seen.append((lags[2], len(context) - common_prefix(drafter.lm.tokens, context)))
            return choose(k, proposals, lags, **kw)

        policy.choose = choose_and_check
        return policy

    decoder._policy = watched.__get__(decoder)
    generation = decoder.stream(COPY, max_new_tokens=40)
    for _ in generation:
        pass
    assert len(seen) >= 5
    assert all(lag == true for lag, true in seen), seen


@pytest.mark.parametrize("policy", ["fixed:eagle", "round-robin"])
def test_an_eagle_heads_lag_is_every_token_since_the_context_it_drafted_from(embedded, policy):
    """An EAGLE head drops its draft's entries (they came from predicted features) and its next catch-up reruns
    every entry after the context it last drafted from: the lag the policy sees when it sends the head out is the
    number of entries that catch-up feeds it, whether the head drafted the round before (accepted tokens
    included) or sat rounds out."""
    decoder = Decoder(drafters=["ngram", "suffix", "eagle"], policy=policy, draft_len=3)
    drafter = decoder.drafters["eagle"]
    pending, seen = [], []  # the lag of the round the head was sent out in; (lag, entries its catch-up fed)
    original = Decoder._policy

    def watched(self, name, names, regime="greedy"):
        policy = original(self, name, names, regime)
        choose = policy.choose

        def choose_and_record(k, proposals, lags, **kw):
            arm, length = choose(k, proposals, lags, **kw)
            if arm == 2 and length and drafter.name in generation._drafted:
                pending.append(lags[2])
            return arm, length

        policy.choose = choose_and_record
        return policy

    fuse = drafter.exact_head.fuse

    def fuse_and_count(features):
        if pending:
            seen.append((pending.pop(), features.shape[1]))
        return fuse(features)

    drafter.exact_head.fuse = fuse_and_count
    decoder._policy = watched.__get__(decoder)
    generation = decoder.stream(COPY, max_new_tokens=40)
    for _ in generation:
        pass
    assert len(seen) >= 3 and max(lag for lag, _ in seen) > 1
    assert all(lag == fed for lag, fed in seen), seen


def test_prefills_stay_out_of_the_rewards(embedded):
    """The first round of a request prefills the prompt (hundreds of tokens) and a fresh model drafter takes its
    own copy of it in: the round's statistics keep that time, the reward's times do not."""
    decoder = Decoder(drafters=["ngram", "early-exit:4"], policy="fixed:early-exit:4", draft_len=2)
    decoder.generate(LONG, max_new_tokens=6)  # costs measured once
    outcomes = []
    policy = decoder._policy("fixed:early-exit:4", decoder.drafter_names)
    feedback = policy.feedback
    policy.feedback = lambda outcome: outcomes.append(outcome) or feedback(outcome)
    decoder._policy = lambda *args: policy
    result = decoder.generate(LONG, max_new_tokens=8)
    first, later = outcomes[0], outcomes[1:]
    stats = result.stats.rounds
    assert first.verify_time < 0.5 * stats[0].verify_time  # no prompt prefill in the reward's verification
    assert first.draft_time < 0.5 * stats[0].draft_time  # nor in the fresh drafter's first draft
    assert all(o.verify_time == r.verify_time for o, r in zip(later, stats[1:], strict=True))


# --- T(M) under load ---------------------------------------------------------------------------------------------


def test_target_cost_refines_online():
    cost = TargetCost([0.01, 0.01, 0.01])
    assert cost.plain_step_due()
    for _ in range(5):
        cost.observe(2, 0.05)
    assert cost(2) == pytest.approx(0.05, rel=0.3)
    assert cost(3) == pytest.approx(0.01)  # a dear M = 2 says nothing of the machine's speed
    cost.observe(1, 0.02)
    assert cost(3) == pytest.approx(0.02) and not cost.plain_step_due()  # a slower plain step does
    with pytest.raises(ValueError):
        TargetCost([0.01, 0.0])


def test_a_burst_of_slow_rounds_leaves_no_lasting_mark():
    calibrated = [0.010, 0.0105, 0.011, 0.0115, 0.012, 0.013]
    cost = TargetCost(calibrated)
    for m in [1, 3, 5, 2, 4, 6] * 4:  # a quiet machine: rounds as calibrated
        cost.observe(m, calibrated[m - 1])
    quiet = cost.table()
    for m in [3, 5, 1, 6]:  # another process competes for the CPU for a few rounds
        cost.observe(m, 4 * calibrated[m - 1])
    assert cost.table() == pytest.approx(quiet, rel=0.01)  # one slow round per M moves no median
    for m in [2, 4, 6, 3, 5, 1] * 6:  # a long burst does move the estimates ...
        cost.observe(m, 4 * calibrated[m - 1])
    assert min(b / a for a, b in zip(quiet, cost.table(), strict=True)) > 3
    for m in [1, 2] * 6:  # ... and once the machine is quiet, rounds at any M bring them back
        cost.observe(m, calibrated[m - 1])
    assert cost(1) == pytest.approx(quiet[0], rel=0.01) and cost(2) == pytest.approx(quiet[1], rel=0.01)
    for _ in range(TargetCost.MAX_AGE):  # an M the policy avoided since falls back to the scaled calibration
        cost.observe(1, calibrated[0])
    assert cost.table() == pytest.approx(quiet, rel=0.01)


class FakeClock:
    """The engine's clock, advanced only by the target's forwards: every timing the cost model sees is exact."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def forward_time(m: int) -> float:
    return 0.010 + 0.0005 * m  # nearly flat: drafting pays


class Timed(torch.nn.Module):
    """The target, its forwards taking `forward_time(M)` on the fake clock, ten times that for the calls in `slow`."""

    def __init__(self, model, clock, slow=range(0)):
        super().__init__()
        self.inner, self.config, self.clock, self.slow, self.calls = model, model.config, clock, slow, 0

    def forward(self, input_ids, **kwargs):
        self.calls += 1
        self.clock.now += forward_time(input_ids.shape[1]) * (10 if self.calls in self.slow else 1)
        return self.inner(input_ids=input_ids, **kwargs)


def test_after_a_burst_of_slow_forwards_the_policy_chooses_as_before(embedded, monkeypatch):
    """Two decoders see the same requests; in one, another process takes the CPU for a few forwards of the second
    request. Once the machine is quiet again, both choose the same drafts and believe the same T(M)."""
    import metasd.generation
    import metasd.round

    clock = FakeClock()
    monkeypatch.setattr(metasd.generation, "time", clock)
    monkeypatch.setattr(metasd.round, "time", clock)  # a round's forward is timed there
    decoders = []
    for slow in (range(0), range(30, 38)):
        decoder = Decoder(drafters=["ngram"], policy="metasd-adaptive:max=4")
        decoder.cost_model().target = TargetCost([forward_time(m) for m in range(1, 14)])
        decoder.target_cache.model = Timed(decoder.target_cache.model, clock, slow)
        decoders.append(decoder)
    calm, burst = decoders
    for request in range(8):
        runs = [d.generate(COPY, max_new_tokens=40) for d in decoders]
        assert runs[0].token_ids == runs[1].token_ids
        if request == 1:
            assert burst.target_cache.model.calls > 38  # the slow forwards happened in this request
    assert [r.drafted for r in runs[1].stats.rounds] == [r.drafted for r in runs[0].stats.rounds]
    assert burst.cost_model().target.table() == pytest.approx(calm.cost_model().target.table())


def test_draft_keeps_its_forwards_through_cuts_and_continuations():
    draft = Draft([1, 2, 3], forwards=4)
    assert draft.truncated(2).forwards == 4 and draft.followed_by(Draft([7])).forwards == 4
