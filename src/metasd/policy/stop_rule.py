"""metasd-adaptive's stop rule: a model drafter's draft ends, token by token, where the tokens still to come are
worth less than their time at the round's bar (a threshold policy as in SpecDec++, arXiv 2405.19715, whose threshold
comes from the measured costs)."""

from __future__ import annotations

import numpy as np

from ..costs import CostModel
from .acceptance import AcceptanceModel


def net_gains(reach: float, rates: np.ndarray, times: np.ndarray, bar: float) -> np.ndarray:
    """[n] what sending 1..n more tokens earns: their expected accepted tokens (each counts only if every token
    before it, `reach` for those already sent, is accepted) minus what their extra time would earn at `bar`."""
    return reach * np.cumsum(np.cumprod(rates)) - bar * times


class DraftStop:
    """A model drafter's draft, token by token: go on while the tokens still to come are worth their time at the
    bar: the best rate any option offered this round on present evidence, optimism left out (what the time could
    earn in the next round). The plan's own rate would be the wrong bar: it includes the bonus that got an unknown
    drafter picked, and the drafter would be held to it.

    Token j is worth its acceptance chance given everything before it was accepted (from q_j's confidence once
    known, the position mean before); the time of going on is the drafter forwards not yet paid for plus the
    extra verification. Both are optimistic like the plan, or a drafter planned on its bonus would be stopped
    before it could be learned from.
    """

    def __init__(
        self, acceptance: AcceptanceModel, arm: int, k: int, bar: float, bonus: float, costs: CostModel, name: str
    ):
        """Drafter `arm` (`name` in the cost model) sent out for up to k tokens; bar: the round's bar; bonus: the
        optimism bonus its plan had."""
        self.acceptance, self.arm, self.rate, self.bonus = acceptance, arm, bar, bonus
        self.later = np.minimum(self.acceptance.plan_rates(arm, k) + self.bonus, 1.0)
        self.step = costs.drafter(name).step_time(costs.target(1))
        self.verify = np.array([costs.target(m) for m in range(1, k + 2)])  # [n]: verifying n drafted tokens
        self.reach = 1.0  # probability that every token drafted so far is accepted

    def _worth_going_on(self, sent: int, rates: np.ndarray, first_paid: bool) -> bool:
        """Is sending some of the next len(rates) tokens (after `sent`) worth more than its time?"""
        if len(rates) == 0:
            return False
        more = np.arange(1, len(rates) + 1)
        forwards = more - 1 if first_paid else more
        times = self.verify[sent + more] - self.verify[sent] + self.step * forwards
        return bool(np.max(net_gains(self.reach, rates, times, self.rate)) > 0)

    def before(self, j: int, q) -> bool:
        """Stop before drawing token j? Its rate is read from q_j's confidence; token 0 is always sent."""
        a_j = min(self.acceptance.rate_at(self.arm, float(q.max()), j) + self.bonus, 1.0)
        # token 0: the plan paid for its forward, and sending it is also how the drafter is learned
        stop = j > 0 and not self._worth_going_on(j, np.concatenate([[a_j], self.later[j + 1 :]]), True)
        if not stop:
            self.reach *= a_j
        return stop

    def after(self, j: int, q, token: int) -> bool:
        """Stop after token j? Yes when no further tokens, priced at the plan's rates, are worth their time."""
        return not self._worth_going_on(j + 1, self.later[j + 1 :], False)
