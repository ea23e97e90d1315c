"""`metasd-adaptive`: each round, the (drafter, draft length) with the most expected tokens per second.

For every option the policy knows E[tokens] = 1 + sum_j prod_{i<=j} a_i (acceptance model) and the time,
T_draft + T(k + 1) + overhead (cost model, measured on this machine), and takes the best ratio; k = 0, a plain target
step at rate 1 / (T(1) + overhead), is always an option, so a pool that cannot pay for itself costs almost nothing
(one round in 100 is a plain step regardless, to keep T(1), the yardstick of every estimate, measured).

- Drafters without a model (n-gram, suffix, datastore) propose every round, up to the longest draft, before the
  choice: their proposals cost microseconds and their per-token signals (match length, continuation share) feed the
  acceptance model, so the policy cuts each proposal at the length its signals justify. Their tokens are
  deterministic, so cutting after seeing them keeps sampling exact. Each proposal is judged in hindsight against
  the output (`hindsight.py`), whether it drafted or not: they need no exploration.
- Drafters with a model are planned from position means before drafting, with an optimism bonus that shrinks as
  evidence accumulates (the MetaSD bandit layer: a drafter is tried while it might be best). The plan reaches only
  one position past those already seen tried (`AcceptanceModel.explored_length`): optimism on an unknown drafter
  buys a 1-token try, then 2, ..., not 12 tokens at a guessed rate (measured on the Qwen pair: untried drafters sent
  7-12 tokens at 3x the cost of a plain step and lost most of them). The plan only decides
  *whether* the drafter drafts: a drafter that takes a stop rule is sent out for that explored length and a stop
  rule ends its draft token by token, before token j when q_j says it is not worth verifying, and after it when
  the tokens still to come are worth less than the drafter forwards and verification they would add at the best
  rate any option offers this round without optimism (HF's confidence threshold and SpecDec++, with the threshold
  derived from the measured costs instead of fixed). Measured on the Qwen pair (bfloat16): planning k from
  position means alone held the 0.5B drafter at k = 2 in 56 of its 59 rounds, while at a fixed k = 5 it averaged
  3.11 tokens a round.
- A model drafter's draft may be continued by a free drafter (`extension`, `extend=1`): the free drafters propose
  for the context the model's tokens lead to, and the best proposal is appended as far as its tokens, each worth
  its acceptance times the chance that every model token before it is accepted, beat the extra verification at
  the round's bar. Where T(M) is flat (the Qwen pair in bfloat16: T(6) = T(1)) that costs nothing, and the model
  hands the copy a context it could not have reached alone: offline, over two Spec-Bench questions per group,
  appending n-gram or suffix continuations after the 0.5B drafter's 2-token drafts added 4-24 % to its rounds'
  tokens outside summarization (98 % there). Measured side by side on that pair the gain did not survive: +1 and
  +2 % in runs of two earlier versions, -2 % for this one (mean accepted tokens +3 %, but continuations of 6-12
  tokens are verified at T(7..13) = 1.07-1.20 T(1), and the extra proposals took policy time from 0.3 to 0.8 %),
  so it is off by default.

Parameters (`metasd-adaptive[:beta=B,gamma=G,max=K,spread=S,prior=W,extend=E]`): beta (0.3) scales the optimism
bonus; spread (1) starts each request from the pool's history weighted per drafter by how little its acceptance
varied between earlier requests (empirical Bayes, `AcceptanceModel.prior_strength`); spread=0 uses prior (0)
instead, a cap on the observations per cell carried from earlier requests (prior > 0 with spread=1 is refused);
gamma (1) forgets within a request; max (12) is the longest draft considered; extend (0) lets free drafters continue
a model drafter's draft. A fixed history weight fails both ways: Spec-Bench's groups differ so much (at k = 5 the
0.5B Qwen drafter gets 4.3 tokens a round accepted on math and 1.25 on translation) that prior 20 kept a request on
the last request's drafter (prior 0 against 20: 1.11 vs 1.09x `ar` on the embedded quick bench, 1.25 / 1.18 / 1.20
vs 1.21 / 1.14 / 1.17x in three runs on the Qwen pair), while prior 0 explored early exit, poor on every request,
afresh each time. Side by side on the Qwen pair (bfloat16, two questions per group): spread 1.32x against 1.18x for
prior 0 (README, Speed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..costs import CostModel
from ..drafters.base import Draft, StopRule
from ..outcome import RoundOutcome
from .acceptance import AcceptanceModel, expected_tokens
from .hindsight import Hindsight

DEFAULTS = {"beta": 0.3, "prior": 0.0, "gamma": 1.0, "max": 12, "spread": 1, "extend": 0}
_USAGE_PRIOR = 1.0  # pseudo-requests at full usage behind `AdaptivePolicy._usage`
_BOUNDS = {
    "beta": (0.0, 10.0),
    "prior": (0.0, 1e6),
    "gamma": (0.5, 1.0),
    "max": (1, 64),
    "spread": (0, 1),
    "extend": (0, 1),
}


def from_params(n_arms: int, param: str) -> AdaptivePolicy:
    """The policy a `metasd-adaptive:...` name asks for (its `max` is the constructor's `max_draft`)."""
    params = parse_params(param)
    return AdaptivePolicy(n_arms, max_draft=params.pop("max"), **params)


def parse_params(param: str) -> dict[str, float]:
    """'beta=0.5,max=8' (or a bare number: beta) -> validated parameters, defaults filled in."""
    out = dict(DEFAULTS)
    for item in filter(None, (s.strip() for s in param.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            key, value = "beta", item
        key = key.strip()
        if key not in DEFAULTS:
            raise ValueError(f"metasd-adaptive: unknown parameter {key!r}; use {', '.join(DEFAULTS)}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"metasd-adaptive: {key}={value!r} is not a number") from None
        lo, hi = _BOUNDS[key]
        if not (math.isfinite(number) and lo <= number <= hi):
            raise ValueError(f"metasd-adaptive: {key} must be in [{lo}, {hi}], got {value}")
        if key == "max" and number != int(number):
            raise ValueError(f"metasd-adaptive: max must be an integer, got {value}")
        if key in ("spread", "extend") and number not in (0, 1):
            raise ValueError(f"metasd-adaptive: {key} is 0 (off) or 1 (on), got {value}")
        out[key] = number
    if out["spread"] and out["prior"]:
        # with spread the history weight is estimated per drafter, so a prior would be silently ignored
        raise ValueError(
            "metasd-adaptive: prior (a fixed history weight) applies only with spread=0; "
            f"write metasd-adaptive:spread=0,prior={out['prior']:g}"
        )
    out["max"] = int(out["max"])
    return out


def canonical(params: dict[str, float]) -> str:
    return "metasd-adaptive:" + ",".join(f"{k}={params[k]:g}" for k in DEFAULTS)


class AdaptivePolicy:
    reward = "rate"  # reported reward: the round's tokens per second relative to a plain target step
    full_information = True
    wants_proposals = True

    def __init__(
        self,
        n_arms: int,
        beta: float = 0.3,
        prior: float = 0.0,
        gamma: float = 1.0,
        max_draft: int = 12,
        spread: float = 1,
        extend: float = 0,
    ):
        if n_arms < 1:
            raise ValueError("a policy needs at least one drafter")
        self.n_arms = n_arms
        self.beta = beta
        self.max_draft = int(max_draft)
        self.extends = bool(extend)
        # arms n_arms + a: drafter a as the continuation of a model's draft (`extension`), learned apart: its
        # proposals there are judged only where the model's tokens were accepted, easier text than a round's start
        self.acceptance = AcceptanceModel(2 * n_arms, prior_weight=prior, gamma=gamma, spread=bool(spread))
        self.costs: CostModel | None = None
        self.names: list[str] = []
        self.free: list[bool] = []
        self.stoppable: list[bool] = []
        self.hindsight = Hindsight()
        self.pulls = [0] * n_arms
        self.mean_rewards = [0.0] * n_arms
        self.rounds = 0
        self._bar = 0.0
        # per model drafter, across requests: the share of a request's output, from its first draft on, that came
        # from its rounds (what its prompt prefill is amortised over), as a mean shrunk toward 1 (`_usage`)
        self.usage_sum = [0.0] * n_arms
        self.usage_count = [0] * n_arms
        self._since_start: list[float | None] = [None] * n_arms  # this request: tokens since its first draft
        self._yielded = [0.0] * n_arms  # and tokens its own rounds emitted

    def attach(
        self, costs: CostModel, names: Sequence[str], free: Sequence[bool], stoppable: Sequence[bool] | None = None
    ) -> None:
        """The engine hands over the machine's cost model, which drafters propose for free, and which model
        drafters take a stop rule (`StoppableDrafter`: they are sent out for the explored length and end their
        draft where it stops paying; the others draft the planned length)."""
        stoppable = [False] * self.n_arms if stoppable is None else list(stoppable)
        if not len(names) == len(free) == len(stoppable) == self.n_arms:
            raise ValueError("attach() needs one name, one free flag and one stoppable flag per drafter")
        self.costs, self.names, self.free, self.stoppable = costs, list(names), list(free), stoppable

    def reset(self) -> None:
        self.acceptance.reset()
        self.hindsight.clear()
        self.pulls = [0] * self.n_arms
        self.mean_rewards = [0.0] * self.n_arms
        self.rounds = 0

    # --- choosing --------------------------------------------------------------------------------------------------

    def _bonus(self, arm: int) -> float:
        return self.beta * math.sqrt(2.0 * math.log(self.rounds + 2) / (1.0 + self.acceptance.evidence(arm)))

    def choose(
        self,
        k_max: int,
        proposals: Mapping[int, Draft],
        lags: Sequence[int],
        *,
        remaining: int | None = None,
        fresh: Sequence[bool] | None = None,
    ) -> tuple[int | None, int]:
        costs = self._costs()
        if costs.target.plain_step_due():  # keep T(1) measured: every other estimate is scaled by it
            self._bar = 0.0
            return None, 0
        overhead = costs.overhead.value or 0.0
        t = np.array([costs.target(m) for m in range(1, k_max + 2)]) + overhead  # t[k]: time to verify k drafted
        best: tuple[float, int | None, int] = (1.0 / t[0], None, 0)
        bar = best[0]  # the best rate any option offers on present evidence, optimism left out
        for arm in range(self.n_arms):
            if self.free[arm]:
                draft = proposals.get(arm)
                if draft is None or not draft.tokens:
                    continue
                m = min(len(draft.tokens), k_max)
                rate = expected_tokens(self.acceptance.rates(arm, draft.confidence, m)) / t[: m + 1]
                honest = rate  # proposals are already paid for: only verification counts
            else:
                m = self.acceptance.explored_length(arm, k_max)
                fresh_arm = fresh is not None and fresh[arm] and bool(remaining)
                rate, honest = self._model_rates(arm, m, t, lags[arm], fresh_arm, remaining)
            k = int(np.argmax(rate[1:])) + 1
            bar = max(bar, float(honest[1:].max()))
            if rate[k] > best[0]:  # a drafter that stops itself gets the explored length and ends where it pays
                best = (float(rate[k]), arm, m if self.stoppable[arm] else k)
        self._bar = bar
        return best[1], best[2]

    def _model_rates(
        self, arm: int, m: int, t: np.ndarray, lag: int, fresh: bool, remaining: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """[m + 1] expected tokens per second of drafting k = 0..m tokens with model drafter `arm`: with the
        optimism bonus (what the choice uses) and without (what the stop rule's bar uses)."""
        price = self._costs().drafter(self.names[arm])
        catch_up = price.catch_up_time(lag, t[0])
        base = t[: m + 1] + np.arange(m + 1) * price.step_time(t[0])
        means = self.acceptance.plan_rates(arm, m)
        out = []
        for bonus in (self._bonus(arm), 0.0):
            gain = expected_tokens(np.minimum(means + bonus, 1.0))
            charge = catch_up
            if fresh:
                # its first draft prefills the prompt (0.9 s for 709 tokens on the Qwen pair, six target steps):
                # an investment in the tokens it will yield, charged in proportion to this round's share of them:
                # of the request's remaining tokens, the share its rounds took in earlier requests once started. A
                # long prompt with a short answer, or a drafter that is started and then rarely drafts, rules it out.
                charge = catch_up * np.minimum(1.0, gain / (remaining * self._usage(arm)))
            out.append(gain / (base + charge))
        return out[0], out[1]

    def stop_rule(self, arm: int, k: int) -> StopRule | None:
        """For a model drafter: the rule that ends its draft once more tokens are worth less than their time."""
        return None if self.free[arm] else _DraftStop(self, arm, k)

    def extension(self, arm: int, draft: Draft, proposals: Mapping[int, Draft]) -> tuple[int, int] | None:
        """Continue a model drafter's draft with the free proposal for the context it leads to, as far as the
        tokens' expected gain beats their extra verification at the round's bar (`_DraftStop`). A continuation
        token counts only if every model token before it is accepted: its gain is scaled by that chance, the
        model tokens' acceptance at their own signals, optimism left out (the continuation is no exploration)."""
        costs = self._costs()
        n = len(draft.tokens)
        reach = float(np.prod(self.acceptance.rates(arm, draft.confidence, n)))
        best, choice = 0.0, None
        for free, tail in proposals.items():
            m = len(tail.tokens)
            if m == 0:
                continue
            extra = np.array([costs.target(n + 1 + e) for e in range(1, m + 1)]) - costs.target(n + 1)
            net = _net_gains(reach, self.acceptance.rates(self.n_arms + free, tail.confidence, m), extra, self._bar)
            e = int(np.argmax(net))
            if net[e] > best:
                best, choice = float(net[e]), (free, e + 1)
        return choice

    # --- learning --------------------------------------------------------------------------------------------------

    def feedback(self, outcome: RoundOutcome) -> float:
        self.rounds += 1
        arm = outcome.arm
        self.acceptance.forget()
        if arm is not None and not self.free[arm]:
            own = outcome.own
            self.acceptance.learn(arm, outcome.draft.truncated(own).confidence, min(outcome.accepted, own), own)
        for a, draft in outcome.proposals.items():
            self.hindsight.add(a, outcome.start, draft.tokens, draft.confidence)
        tail = outcome.extension  # appended or not, a continuation that followed the true context is evidence
        if tail is not None and outcome.accepted >= tail.start:
            for a, draft in tail.proposals.items():
                self.hindsight.add(self.n_arms + a, outcome.start + tail.start, draft.tokens, draft.confidence)
        self._resolve(outcome.context, final=False)
        spent = outcome.draft_time + outcome.verify_time
        score = (outcome.accepted + 1) * outcome.plain_step_time / spent if spent > 0 else 0.0
        if arm is not None:
            self.pulls[arm] += 1
            self.mean_rewards[arm] += (score - self.mean_rewards[arm]) / self.pulls[arm]
        self._count_usage(arm, len(outcome.context) - outcome.start)
        return score

    def finish(self, context: list[int]) -> None:
        """The request ended: judge the proposals still waiting on as much output as there is, and record the
        share of its output each started model drafter's rounds yielded."""
        self._resolve(context, final=True)
        for arm, since in enumerate(self._since_start):
            if since:
                self.usage_sum[arm] += self._yielded[arm] / since
                self.usage_count[arm] += 1
        self._since_start = [None] * self.n_arms
        self._yielded = [0.0] * self.n_arms

    def _count_usage(self, arm: int | None, tokens: int) -> None:
        for a, since in enumerate(self._since_start):
            if since is not None:
                self._since_start[a] = since + tokens
        if arm is not None and not self.free[arm]:
            if self._since_start[arm] is None:
                self._since_start[arm] = tokens
            self._yielded[arm] += tokens

    def _usage(self, arm: int) -> float:
        """The expected share of a request's output a model drafter yields once started: the mean over earlier
        requests with one pseudo-request at 1 (so an unknown drafter is priced as if it would yield everything,
        and a single poor request does not shut it out of the next)."""
        return (self.usage_sum[arm] + _USAGE_PRIOR) / (self.usage_count[arm] + _USAGE_PRIOR)

    def _resolve(self, context: list[int], final: bool) -> None:
        for d in self.hindsight.resolve(context, final):
            self.acceptance.learn(d.pending.arm, d.pending.info, d.matched, d.decided)

    def _costs(self) -> CostModel:
        if self.costs is None:
            raise RuntimeError("metasd-adaptive needs the engine's cost model: call attach() first")
        return self.costs


def _net_gains(reach: float, rates: np.ndarray, times: np.ndarray, bar: float) -> np.ndarray:
    """[n] what sending 1..n more tokens earns: their expected accepted tokens (each counts only if every token
    before it, `reach` for those already sent, is accepted) minus what their extra time would earn at `bar`."""
    return reach * np.cumsum(np.cumprod(rates)) - bar * times


class _DraftStop:
    """A model drafter's draft, token by token: go on while the tokens still to come are worth their time at the
    bar: the best rate any option offered this round on present evidence, optimism left out (what the time could
    earn in the next round). The plan's own rate would be the wrong bar: it includes the bonus that got an unknown
    drafter picked, and the drafter would be held to it.

    Token j is worth its acceptance chance given everything before it was accepted (from q_j's confidence once
    known, the position mean before); the time of going on is the drafter forwards not yet paid for plus the
    extra verification. Both are optimistic like the plan, or a drafter planned on its bonus would be stopped
    before it could be learned from.
    """

    def __init__(self, policy: AdaptivePolicy, arm: int, k: int):
        costs = policy._costs()
        self.acceptance, self.arm, self.rate = policy.acceptance, arm, policy._bar
        self.bonus = policy._bonus(arm)
        self.later = np.minimum(self.acceptance.plan_rates(arm, k) + self.bonus, 1.0)
        self.step = costs.drafter(policy.names[arm]).step_time(costs.target(1))
        self.verify = np.array([costs.target(m) for m in range(1, k + 2)])  # [n]: verifying n drafted tokens
        self.reach = 1.0  # probability that every token drafted so far is accepted

    def _worth_going_on(self, sent: int, rates: np.ndarray, first_paid: bool) -> bool:
        """Is sending some of the next len(rates) tokens (after `sent`) worth more than its time?"""
        if len(rates) == 0:
            return False
        more = np.arange(1, len(rates) + 1)
        forwards = more - 1 if first_paid else more
        times = self.verify[sent + more] - self.verify[sent] + self.step * forwards
        return bool(np.max(_net_gains(self.reach, rates, times, self.rate)) > 0)

    def before(self, j: int, q) -> bool:
        a_j = min(self.acceptance.rate_at(self.arm, float(q.max()), j) + self.bonus, 1.0)
        # token 0: the plan paid for its forward, and sending it is also how the drafter is learned
        stop = j > 0 and not self._worth_going_on(j, np.concatenate([[a_j], self.later[j + 1 :]]), True)
        if not stop:
            self.reach *= a_j
        return stop

    def after(self, j: int, q, token: int) -> bool:
        return not self._worth_going_on(j + 1, self.later[j + 1 :], False)
