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
from ..draft import Draft
from ..drafters.base import StopRule
from ..outcome import RoundOutcome
from ..tree import DraftTree
from . import branching
from .acceptance import AcceptanceModel, Tables, expected_tokens
from .base import Learned
from .hindsight import Hindsight
from .stop_rule import DraftStop, net_gains
from .usage import PrefillUsage


@dataclass(frozen=True)
class Option:
    """A drafter's plan for one round: for k = 0 .. m drafted tokens, the tokens the round is expected to yield
    (`gain`, with the optimism bonus: what choices use; `expected_gain` without it: what the bar uses) and the
    seconds of drafting them (`draft`, `expected_draft`; a fresh drafter's prompt intake is charged by the share
    of the output it is expected to yield)."""

    arm: int
    gain: np.ndarray
    draft: np.ndarray
    expected_gain: np.ndarray
    expected_draft: np.ndarray


DEFAULTS = {"beta": 0.3, "prior": 0.0, "gamma": 1.0, "max": 12, "spread": 1, "extend": 0, "tree": 0}
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
    """The policy's name with every parameter spelled out, in `DEFAULTS` order: one name per configuration."""
    return "metasd-adaptive:" + ",".join(f"{k}={params[k]:g}" for k in DEFAULTS)


class AdaptivePolicy(Learned):
    """Choose (drafter, k) by expected tokens per second, from an acceptance model and the machine's cost model.

    Free drafters propose every round and are judged in hindsight (no exploration); model drafters are planned from
    position means with an optimism bonus, reach one position past those tried (`explored_length`), and are ended
    token by token by `DraftStop`; a model drafter's prompt intake is charged by the share of the output it is
    expected to yield (`usage.PrefillUsage`). `extend=1` lets a free drafter continue a model's draft
    (`extension`); `tree=1` verifies other proposals and runners-up as branches of one tree (`branches`), `tree=2`
    every proposal whole.
    Parameters: `beta` (optimism bonus), `spread` (history weighted per drafter by its spread across requests) or
    `prior` (a cap on history), `gamma` (forgetting within a request), `max` (longest draft). Why each piece is as
    it is: docs/decisions.md ("metasd-adaptive, piece by piece").
    """

    reward = "rate"  # reported reward: the round's tokens per second relative to a plain target step
    full_information = True
    wants_proposals = True
    uses_costs = True
    carries_over = True  # reset() starts a request from what earlier ones learned

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
        self.tables = Tables(n_arms)  # rows of the acceptance model: own drafts, continuations, runners-up
        self.acceptance = AcceptanceModel(self.tables.rows, prior_weight=prior, gamma=gamma, spread=bool(spread))
        self.costs: CostModel | None = None
        self.regime = "greedy"
        self.names: list[str] = []
        self.free: list[bool] = []
        self.stoppable: list[bool] = []
        self.hindsight = Hindsight()
        self.pulls = [0] * n_arms
        self.mean_rewards = [0.0] * n_arms
        self.rounds = 0
        self.bar = 0.0
        self.usage = PrefillUsage(n_arms)  # what a model drafter's prompt prefill is amortised over

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

    def forget_drafters(self, arms: Sequence[int]) -> None:
        """Forget the acceptance these drafters' drafts, continuations and runners-up had, this request's and
        the history's, and the share of output they yielded: a revised drafter (an EAGLE head learned from
        traffic) is judged by its own rounds."""
        self.acceptance.forget_rows([row for arm in arms for row in self.tables.rows_of(arm)])
        for arm in arms:
            self.pulls[arm], self.mean_rewards[arm] = 0, 0.0
            self.usage.forget(arm)

    def reset(self) -> None:
        self.acceptance.reset()
        self.hindsight.clear()
        self.pulls = [0] * self.n_arms
        self.mean_rewards = [0.0] * self.n_arms
        self.rounds = 0

    # --- choosing --------------------------------------------------------------------------------------------------

    def bonus(self, arm: int) -> float:
        """The optimism bonus added to drafter `arm`'s acceptance rates: UCB-style (Auer et al. 2002), scaled by
        `beta`, shrinking as the request's evidence on the drafter grows."""
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
        costs = self.cost_model()
        if costs.target.plain_step_due():  # keep T(1) measured: every other estimate is scaled by it
            self.bar = 0.0
            return None, 0
        overhead = costs.overhead[self.regime].value or 0.0
        t = np.array([costs.target(m) for m in range(1, k_max + 2)]) + overhead  # t[k]: time to verify k drafted
        best: tuple[float, int | None, int] = (1.0 / t[0], None, 0)
        bar = best[0]  # the best rate any option offers on present evidence, optimism left out
        for option in self.options(k_max, proposals, lags, remaining=remaining, fresh=fresh, step=t[0]):
            m = len(option.gain) - 1
            rate = option.gain / (t[: m + 1] + option.draft)
            k = int(np.argmax(rate[1:])) + 1
            bar = max(bar, float((option.expected_gain / (t[: m + 1] + option.expected_draft))[1:].max()))
            if rate[k] > best[0]:  # a drafter that stops itself gets the explored length and ends where it pays
                best = (float(rate[k]), option.arm, m if self.stoppable[option.arm] else k)
        self.bar = bar
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
        step = self.cost_model().target(1) if step is None else step
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
                rates = np.minimum(np.maximum(rates, self.acceptance.plan_rates(arm, k_max)) + self.bonus(arm), 1.0)
            best = np.maximum(best, rates)
        return expected_tokens(best)

    def set_bar(self, rate: float) -> None:
        """The rate, in tokens per second, that later choices this round (continuations, branches) must beat: set
        by a batch, whose rounds are shared (`metasd.batching`); `choose` sets its own."""
        self.bar = rate

    def _model_option(self, arm: int, m: int, step: float, lag: int, fresh: bool, remaining: int | None) -> Option:
        """Model drafter `arm` drafting k = 0..m tokens: expected tokens with the optimism bonus (what the choice
        uses) and without (what the stop rule's bar uses), and the drafting time of each."""
        price = self.cost_model().drafter(self.names[arm])
        catch_up = price.catch_up_time(lag, step)
        steps = np.arange(m + 1) * price.step_time(step)
        means = self.acceptance.plan_rates(arm, m)
        out = []
        for bonus in (self.bonus(arm), 0.0):
            gain = expected_tokens(np.minimum(means + bonus, 1.0))
            charge = catch_up
            if fresh:
                # its first draft prefills the prompt, which can cost several target steps on a long prompt: an
                # investment in the tokens it will yield, charged in proportion to this round's share of them:
                # of the request's remaining tokens, the share its rounds took in earlier requests once started. A
                # long prompt with a short answer, or a drafter that is started and then rarely drafts, rules it out.
                charge = catch_up * np.minimum(1.0, gain / (remaining * self.usage.share(arm)))
            out.append((gain, steps + charge))
        (gain, draft), (expected_gain, expected_draft) = out
        return Option(arm, gain, draft, expected_gain, expected_draft)

    def stop_rule(self, arm: int, k: int) -> StopRule | None:
        """For a model drafter: the rule that ends its draft once more tokens are worth less than their time."""
        return (
            None
            if self.free[arm]
            else DraftStop(self.acceptance, arm, k, self.bar, self.bonus(arm), self.cost_model(), self.names[arm])
        )

    def extension(self, arm: int, draft: Draft, proposals: Mapping[int, Draft]) -> tuple[int, int] | None:
        """Continue a model drafter's draft with the free proposal for the context it leads to, as far as the
        tokens' expected gain beats their extra verification at the round's bar (`DraftStop`). A continuation
        token counts only if every model token before it is accepted: its gain is scaled by that chance, the
        model tokens' acceptance at their own signals, optimism left out (the continuation is no exploration)."""
        costs = self.cost_model()
        n = len(draft.tokens)
        reach = float(np.prod(self.acceptance.rates(arm, draft.confidence, n)))
        best, choice = 0.0, None
        for free, tail in proposals.items():
            m = len(tail.tokens)
            if m == 0:
                continue
            extra = np.array([costs.target(n + 1 + e) for e in range(1, m + 1)]) - costs.target(n + 1)
            net = net_gains(
                reach, self.acceptance.rates(self.tables.continuation(free), tail.confidence, m), extra, self.bar
            )
            e = int(np.argmax(net))
            if net[e] > best:
                best, choice = float(net[e]), (free, e + 1)
        return choice

    def branches(self, tree: DraftTree, proposals: Mapping[int, Draft], max_nodes: int) -> list[tuple[int, Draft]]:
        """Branches to verify beside the chosen draft (the tree's one branch), as (drafter, draft): the other free
        drafters' proposals and a model draft's runners-up (its second choice at token j, a sibling of token j),
        each cut where it stops paying at the round's bar (`branching.grow`); `tree=2` adds every free proposal
        whole instead, runners-up left out (`branching.whole`)."""
        main = tree.branches[0]
        others = [(a, d) for a, d in proposals.items() if d.tokens and a != main.arm]
        if self.trees == 2:
            return branching.whole(tree, others, max_nodes)
        offers = [(a, d, self._rates(a, d)) for a, d in others] + self._runners_up(main.arm, main.draft)
        return branching.grow(tree, self._rates(main.arm, main.draft), offers, self.cost_model(), self.bar, max_nodes)

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
                own = (1.0 - rates[j]) * self.acceptance.rate_at(self.tables.runner_up(arm), prob, j)
                out.append((arm, Draft([*draft.tokens[:j], token]), np.append(rates[:j], own)))
        return out

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
                self.acceptance.learn_at(self.tables.runner_up(arm), prob, j, outcome.context[at] == token)
        for a, draft in outcome.proposals.items():
            self.hindsight.add(a, outcome.start, draft.tokens, draft.confidence)
        tail = outcome.extension  # appended or not, a continuation that followed the true context is evidence
        if tail is not None and outcome.accepted >= tail.start:
            for a, draft in tail.proposals.items():
                self.hindsight.add(
                    self.tables.continuation(a), outcome.start + tail.start, draft.tokens, draft.confidence
                )
        self._resolve(outcome.context, final=False)
        spent = outcome.draft_time + outcome.verify_time
        score = (outcome.gained + 1) * outcome.plain_step_time / spent if spent > 0 else 0.0
        if arm is not None:
            self.pulls[arm] += 1
            self.mean_rewards[arm] += (score - self.mean_rewards[arm]) / self.pulls[arm]
        self.usage.count(arm, len(outcome.context) - outcome.start, model=arm is not None and not self.free[arm])
        return score

    def finish(self, context: list[int]) -> None:
        """The request ended: judge the proposals still waiting on as much output as there is, and record the
        share of its output each started model drafter's rounds yielded."""
        self._resolve(context, final=True)
        self.usage.finish()

    def _resolve(self, context: list[int], final: bool) -> None:
        for d in self.hindsight.resolve(context, final):
            self.acceptance.learn(d.pending.arm, d.pending.info, d.matched, d.decided)

    def cost_model(self) -> CostModel:
        """The machine's cost model that `attach` handed over (an error before it has)."""
        if self.costs is None:
            raise RuntimeError("metasd-adaptive needs the engine's cost model: call attach() first")
        return self.costs
