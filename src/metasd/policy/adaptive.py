"""`metasd-adaptive`: each round, the (drafter, draft length) with the most expected tokens per second.

An extension of MetaSD's drafter bandit (Kim, Jung & Yun, arXiv 2604.05417), whose policies pick a drafter for a fixed
draft length. Here every option's expected tokens, 1 + sum_j prod_{i<=j} a_i (`acceptance.py`), are weighed against
its time, T_draft + T(k + 1) + overhead (`metasd.costs`, measured on the machine it runs on), and k = 0, a plain
target step, is always an option, so a pool that cannot pay for itself costs almost nothing. Free drafters (n-gram,
suffix, datastore) propose every round and are judged in hindsight whether they draft or not (`hindsight.py`); model
drafters are planned with a UCB-style optimism bonus (Auer et al. 2002) and end their own drafts by a stop rule, a
threshold policy as in SpecDec++ (Huang et al., arXiv 2405.19715) with the threshold derived from the measured costs.
`AdaptivePolicy` says how each part works and why; docs/policies.md lists the parameters, docs/decisions.md the
measurements behind the defaults.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..costs import CostModel
from ..drafters.base import Draft, StopRule
from ..outcome import RoundOutcome
from ..tree import DraftTree
from .acceptance import AcceptanceModel, expected_tokens
from .hindsight import Hindsight


@dataclass(frozen=True)
class Option:
    """A drafter's plan for one round: for k = 0 .. m drafted tokens, the expected tokens the round yields (`gain`,
    with the optimism bonus: what choices use; `honest_gain` without it: what bars use) and the seconds of drafting
    them (`draft`, `honest_draft`: a fresh drafter's prompt intake is charged by the share of the output it is
    expected to yield)."""

    arm: int
    gain: np.ndarray
    draft: np.ndarray
    honest_gain: np.ndarray
    honest_draft: np.ndarray


DEFAULTS = {"beta": 0.3, "prior": 0.0, "gamma": 1.0, "max": 12, "spread": 1, "extend": 0, "tree": 0}
_USAGE_PRIOR = 1.0  # pseudo-requests at full usage behind `AdaptivePolicy._usage`
_BOUNDS = {
    "beta": (0.0, 10.0),
    "prior": (0.0, 1e6),
    "gamma": (0.5, 1.0),
    "max": (1, 64),
    "spread": (0, 1),
    "extend": (0, 1),
    "tree": (0, 2),
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
        if key == "tree" and number not in (0, 1, 2):
            raise ValueError(f"metasd-adaptive: tree is 0 (chains), 1 (sized trees) or 2 (every proposal), got {value}")
        out[key] = number
    if out["spread"] and out["prior"]:
        # with spread the history weight is estimated per drafter, so a prior would be silently ignored
        raise ValueError(
            "metasd-adaptive: prior (a fixed history weight) applies only with spread=0; "
            f"write metasd-adaptive:spread=0,prior={out['prior']:g}"
        )
    out["max"] = int(out["max"])
    out["tree"] = int(out["tree"])
    return out


def canonical(params: dict[str, float]) -> str:
    return "metasd-adaptive:" + ",".join(f"{k}={params[k]:g}" for k in DEFAULTS)


class AdaptivePolicy:
    """Choose (drafter, k) by expected tokens per second, from an acceptance model and the machine's cost model.

    - Free drafters propose every round, up to the longest draft, before the choice: their proposals cost
      microseconds, and their per-token signals (match length, continuation share) feed the acceptance model, so
      each proposal is cut at the length its signals justify. Their tokens are deterministic, so cutting after seeing
      them keeps sampling exact, and each proposal is judged against the output whether it drafted or not
      (`Hindsight`): they need no exploration.
    - Model drafters are planned from position means before drafting, with an optimism bonus that shrinks as
      evidence accumulates (the bandit layer: a drafter is tried while it might be best). The plan reaches only one
      position past those already tried (`AcceptanceModel.explored_length`): optimism buys an unknown drafter a
      1-token try, then 2, ..., never a long draft priced at a guessed rate, which would cost several target steps
      and mostly be rejected. The plan only decides *whether* a model drafter drafts: one that takes a stop rule is
      sent out for the explored length and `_DraftStop` ends its draft token by token, before token j when q_j says
      it is not worth verifying, after it when the tokens still to come are worth less than their drafter forwards
      and verification. Position means alone cannot see that a particular draft is going well, so they would keep
      a good drafter's drafts short; the stop rule is a threshold policy (SpecDec++, and Hugging Face's assistant
      confidence threshold) whose threshold comes from the measured costs instead of being fixed.
    - A model drafter's first draft of a request prefills its prompt, which can cost several target steps: that
      investment is charged in proportion to the share of the request's remaining tokens its rounds are expected to
      yield (`_usage`), so a long prompt with a short answer, or a drafter rarely used once started, rules it out.
    - `extend=1`: a free drafter may continue a model drafter's draft (`extension`): the model's tokens lead the copy
      to a context it could not reach alone, and where T(M) is nearly flat the extra tokens cost little to verify.
      But they are verified at longer M and add proposals every round, so it is off by default (chosen by
      measurement: see docs/decisions.md).
    - `tree=1`: the other free drafters' proposals, and a model draft's runners-up, join the chosen draft as
      branches of one token tree verified in the same forward (`branches`; SpecInfer, arXiv 2305.09781; EAGLE-2's
      top-k siblings), each cut where its expected accepted tokens stop
      paying for the extra verification at the round's bar: where T(M) is flat a round can take a path no single
      drafter offered, where it is steep the tree stays a chain. `tree=2` adds every proposal whole (no sizing),
      the "verify everything" baseline.

    Parameters: `beta` scales the optimism bonus; `spread=1` starts each request from the pool's history weighted
    per drafter by how little its acceptance varied between earlier requests (empirical Bayes,
    `AcceptanceModel.prior_strength`), because a fixed history weight fails both ways: a strong one keeps a request
    on the last request's drafter although Spec-Bench-like tasks differ widely in acceptance, a weak one explores a
    drafter that is poor on every request afresh each time; `spread=0` uses `prior` instead, a cap on the
    observations per cell carried from earlier requests (0: each request starts afresh, as in the paper); `gamma`
    < 1 forgets within a request; `max_draft` (the name's `max`) is the longest draft considered.
    """

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
        tree: float = 0,
    ):
        if n_arms < 1:
            raise ValueError("a policy needs at least one drafter")
        self.n_arms = n_arms
        self.beta = beta
        self.max_draft = int(max_draft)
        self.extends = bool(extend)
        self.trees = int(tree)
        self.grows_trees = self.trees > 0
        # arms n_arms + a: drafter a as the continuation of a model's draft (`extension`), learned apart: its
        # proposals there are judged only where the model's tokens were accepted, easier text than a round's start
        # and arms 2 * n_arms + a: model drafter a's runners-up (`_runners_up`), tried where its token was rejected
        self.acceptance = AcceptanceModel(3 * n_arms, prior_weight=prior, gamma=gamma, spread=bool(spread))
        self.costs: CostModel | None = None
        self.regime = "greedy"
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
        self,
        costs: CostModel,
        names: Sequence[str],
        free: Sequence[bool],
        stoppable: Sequence[bool] | None = None,
        regime: str = "greedy",
    ) -> None:
        """The engine hands over the machine's cost model, which drafters propose for free, which model drafters
        take a stop rule (`StoppableDrafter`: they are sent out for the explored length and end their draft where
        it stops paying; the others draft the planned length), and the decoding regime the policy serves
        ("greedy" or "sampled": the engine keeps one policy per regime, whose rounds cost differently)."""
        if regime not in costs.overhead:
            raise ValueError(f"unknown decoding regime {regime!r}; use one of {', '.join(costs.overhead)}")
        self.regime = regime
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
        overhead = costs.overhead[self.regime].value or 0.0
        t = np.array([costs.target(m) for m in range(1, k_max + 2)]) + overhead  # t[k]: time to verify k drafted
        best: tuple[float, int | None, int] = (1.0 / t[0], None, 0)
        bar = best[0]  # the best rate any option offers on present evidence, optimism left out
        for option in self.options(k_max, proposals, lags, remaining=remaining, fresh=fresh, step=t[0]):
            m = len(option.gain) - 1
            rate = option.gain / (t[: m + 1] + option.draft)
            k = int(np.argmax(rate[1:])) + 1
            bar = max(bar, float((option.honest_gain / (t[: m + 1] + option.honest_draft))[1:].max()))
            if rate[k] > best[0]:  # a drafter that stops itself gets the explored length and ends where it pays
                best = (float(rate[k]), option.arm, m if self.stoppable[option.arm] else k)
        self._bar = bar
        return best[1], best[2]

    def options(
        self,
        k_max: int,
        proposals: Mapping[int, Draft],
        lags: Sequence[int],
        *,
        remaining: int | None = None,
        fresh: Sequence[bool] | None = None,
        step: float | None = None,
    ) -> list[Option]:
        """Every drafter that can draft this round, with its expected tokens and drafting time for each length.
        step: the seconds of a plain step, what unmeasured drafters are guessed from (default: T(1))."""
        step = self._costs().target(1) if step is None else step
        out = []
        for arm in range(self.n_arms):
            if self.free[arm]:
                draft = proposals.get(arm)
                if draft is None or not draft.tokens:
                    continue
                m = min(len(draft.tokens), k_max)
                gain = expected_tokens(self.acceptance.rates(arm, draft.confidence, m))
                free = np.zeros(m + 1)  # proposals are already paid for: only verification counts
                out.append(Option(arm, gain, free, gain, free))
            else:
                m = self.acceptance.explored_length(arm, k_max)
                fresh_arm = fresh is not None and fresh[arm] and bool(remaining)
                out.append(self._model_option(arm, m, step, lags[arm], fresh_arm, remaining))
        return out

    def ceiling(self, k_max: int) -> np.ndarray:
        """[k_max + 1] expected tokens of the best draft of k = 0..k_max tokens any drafter could offer now: each
        token at the highest acceptance any signal level of any drafter has shown, with a model drafter's optimism
        bonus, drafting free. No option of `options` exceeds it, so a batch that would not draft even at the
        ceiling can skip the proposals and options of the round."""
        if k_max <= 0:
            return np.ones(1)
        best = np.zeros(k_max)
        for arm in range(self.n_arms):
            rates = self.acceptance.best_rates(arm, k_max)
            if not self.free[arm]:
                rates = np.minimum(np.maximum(rates, self.acceptance.plan_rates(arm, k_max)) + self._bonus(arm), 1.0)
            best = np.maximum(best, rates)
        return expected_tokens(best)

    def use_bar(self, rate: float) -> None:
        """The rate, in tokens per second, that later choices this round (continuations, branches) must beat: set
        by a batch, whose rounds are shared (`metasd.batching`); `choose` sets its own."""
        self._bar = rate

    def _model_option(self, arm: int, m: int, step: float, lag: int, fresh: bool, remaining: int | None) -> Option:
        """Model drafter `arm` drafting k = 0..m tokens: expected tokens with the optimism bonus (what the choice
        uses) and without (what the stop rule's bar uses), and the drafting time of each."""
        price = self._costs().drafter(self.names[arm])
        catch_up = price.catch_up_time(lag, step)
        steps = np.arange(m + 1) * price.step_time(step)
        means = self.acceptance.plan_rates(arm, m)
        out = []
        for bonus in (self._bonus(arm), 0.0):
            gain = expected_tokens(np.minimum(means + bonus, 1.0))
            charge = catch_up
            if fresh:
                # its first draft prefills the prompt, which can cost several target steps on a long prompt: an
                # investment in the tokens it will yield, charged in proportion to this round's share of them:
                # of the request's remaining tokens, the share its rounds took in earlier requests once started. A
                # long prompt with a short answer, or a drafter that is started and then rarely drafts, rules it out.
                charge = catch_up * np.minimum(1.0, gain / (remaining * self._usage(arm)))
            out.append((gain, steps + charge))
        (gain, draft), (honest_gain, honest_draft) = out
        return Option(arm, gain, draft, honest_gain, honest_draft)

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

    def branches(self, tree: DraftTree, proposals: Mapping[int, Draft], max_nodes: int) -> list[tuple[int, Draft]]:
        """Branches to verify beside the chosen draft (the tree's one branch), as (drafter, draft): the other free
        drafters' proposals, each cut where it stops paying, and a model draft's runners-up (its second choice at
        token j, a sibling of token j). Greedy by net gain: a new node is worth the chance that its path is
        accepted, its parent's reach times its own acceptance (from the drafter's rate at its signal and depth,
        capped by what the parent's other children leave), against the extra verification T(M + e) - T(M) at the
        round's bar (`_net_gains`). `tree=2` adds every free proposal whole instead, runners-up left out."""
        main = tree.branches[0]
        offers = [(a, d, self._rates(a, d)) for a, d in proposals.items() if d.tokens and a != main.arm]
        if self.trees == 2:
            tree, out = tree.copy(), []
            for arm, draft, _ in offers:
                n = _fitting(tree, draft.tokens, max_nodes - tree.size)
                if n and tree.new_nodes(draft.tokens[:n]):
                    out.append((arm, draft.truncated(n)))
                    tree.add(*out[-1])
            return out
        offers += self._runners_up(main.arm, main.draft)
        costs = self._costs()
        reach: list[float] = []  # per node: the chance that its path is accepted
        taken: dict[int, float] = {}  # per node (-1: the root): the acceptance its children already claim
        self._claim(tree, main.draft.tokens, self._rates(main.arm, main.draft), reach, taken)
        tree, out = tree.copy(), []
        while offers:
            size, best = tree.size, (0.0, -1, 0)
            for i, (_, draft, rates) in enumerate(offers):
                start, own, shared = _new_nodes(tree, draft.tokens, rates, reach, taken, max_nodes - size)
                if len(own):
                    verify = np.array([costs.target(size + 1 + e) for e in range(len(own) + 1)])
                    net = _net_gains(start, own, verify[1:] - verify[0], self._bar)
                    e = int(np.argmax(net))
                    if net[e] > best[0]:
                        best = (float(net[e]), i, shared + e + 1)
            if best[1] < 0:
                break
            arm, draft, rates = offers.pop(best[1])
            out.append((arm, draft.truncated(best[2])))
            tree.add(arm, out[-1][1])
            self._claim(tree, out[-1][1].tokens, rates, reach, taken)
        return out

    def _rates(self, arm: int | None, draft: Draft) -> np.ndarray:
        if arm is None:
            return np.zeros(len(draft.tokens))
        return self.acceptance.rates(arm, draft.confidence, len(draft.tokens))

    def _runners_up(self, arm: int | None, draft: Draft) -> list[tuple[int, Draft, np.ndarray]]:
        """A model draft's runner-up at token j as a one-node offer: the draft's first j tokens then the runner-up,
        accepted after them with the chance the draft's token j is rejected times the runner-up's own rate there
        (learned in `feedback`, per level of its probability)."""
        if arm is None or self.free[arm] or not draft.runners_up:
            return []
        rates, out = self._rates(arm, draft), []
        for j, (token, prob) in enumerate(draft.runners_up[: len(draft.tokens)]):
            if prob > 0:
                own = (1.0 - rates[j]) * self.acceptance.rate_at(2 * self.n_arms + arm, prob, j)
                out.append((arm, Draft([*draft.tokens[:j], token]), np.append(rates[:j], own)))
        return out

    @staticmethod
    def _claim(tree: DraftTree, tokens: list[int], rates: np.ndarray, reach: list[float], taken: dict) -> None:
        """Record the reach of the nodes a branch with these tokens (already in the tree) added, in node order."""
        parent = -1
        for token, rate in zip(tokens, rates[: len(tokens)], strict=True):
            node = tree.child(parent, token)
            if node >= len(reach):
                own = min(float(rate), max(0.0, 1.0 - taken.get(parent, 0.0)))
                reach.append((reach[parent] if parent >= 0 else 1.0) * own)
                taken[parent] = taken.get(parent, 0.0) + own
            parent = node

    # --- learning --------------------------------------------------------------------------------------------------

    def feedback(self, outcome: RoundOutcome) -> float:
        self.rounds += 1
        arm = outcome.arm
        self.acceptance.forget()
        if arm is not None and not self.free[arm]:
            own = outcome.own
            self.acceptance.learn(arm, outcome.draft.truncated(own).confidence, min(outcome.accepted, own), own)
            # its runner-up where its token was rejected: in the tree or not, the output says whether it was right
            j, runners_up, at = outcome.accepted, outcome.draft.runners_up or [], outcome.start + outcome.accepted
            if j < min(own, len(runners_up)) and at < len(outcome.context):
                token, prob = runners_up[j]
                self.acceptance.learn_at(2 * self.n_arms + arm, prob, j, outcome.context[at] == token)
        for a, draft in outcome.proposals.items():
            self.hindsight.add(a, outcome.start, draft.tokens, draft.confidence)
        tail = outcome.extension  # appended or not, a continuation that followed the true context is evidence
        if tail is not None and outcome.accepted >= tail.start:
            for a, draft in tail.proposals.items():
                self.hindsight.add(self.n_arms + a, outcome.start + tail.start, draft.tokens, draft.confidence)
        self._resolve(outcome.context, final=False)
        spent = outcome.draft_time + outcome.verify_time
        score = (outcome.gained + 1) * outcome.plain_step_time / spent if spent > 0 else 0.0
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


def _new_nodes(
    tree: DraftTree, tokens: list[int], rates: np.ndarray, reach: list[float], taken: dict, room: int
) -> tuple[float, np.ndarray, int]:
    """What a branch with these tokens (conditional acceptance `rates`) would add: the reach of the node it leaves
    the tree from, the acceptance of each new node (at most `room`; the first capped by what its siblings claim),
    and how many of its tokens the tree already holds (a shared prefix)."""
    parent, shared = -1, 0
    while shared < len(tokens) and (node := tree.child(parent, tokens[shared])) is not None:
        parent, shared = node, shared + 1
    own = np.array(rates[shared : shared + max(room, 0)], dtype=float)
    if len(own):
        own[0] = min(own[0], max(0.0, 1.0 - taken.get(parent, 0.0)))
    return (reach[parent] if parent >= 0 else 1.0), own, shared


def _fitting(tree: DraftTree, tokens: list[int], room: int) -> int:
    """The most of `tokens` whose new nodes fit in `room` more nodes."""
    n = len(tokens)
    while n and tree.new_nodes(tokens[:n]) > room:
        n -= 1
    return n


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
