"""The batch decision: every request's (drafter, k) for one round, chosen to maximise the batch's tokens per second.

A batch round yields sum_i E_i tokens (E_i = 1 + the expected accepted tokens of request i's draft) in T(B, W) +
sum_i D_i seconds: one target forward over B rows padded to the widest row W = 1 + max_i k_i (`CostModel.forward`,
measured), plus every request's drafting (forks of one EAGLE head draft together, each charged its own catch-up and
its share of the steps: `round.drafts_together`). Each request's policy offers its options
(`AdaptivePolicy.options`: expected tokens and drafting time per drafter and length). The forward's cost depends on
the choices only through W, so for each width W the best choices with every k < W are found exactly: the rate
sum E / (T(B, W) + sum D) is a ratio of sums, which Dinkelbach's method maximises by letting each request maximise
E_i - rate x D_i on its own, the rate updated until it stops growing (a few passes). The best width wins. Searching
widths rather than improving one request at a time matters: the first request to draft pays the whole widening of
every row, so from "nobody drafts" no single request's change pays even where everyone drafting does. With a flat T
every request drafts as it would alone; with T growing in B x W drafting fades as the batch fills, then returns as
it empties, without thresholds. Ties go to the plain step and the shorter draft, so equal options do not flip round
after round. Policies without options (the paper's bandits) keep their own (drafter, k), which only bounds W."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..costs import CostModel
from ..policy.adaptive import Option
from ..round import RoundRequest, RoundState

_PASSES = 16  # Dinkelbach passes per width at most; each raises the rate, and three or four settle it in practice


@dataclass(frozen=True)
class Plan:
    """One request's choices this round: a policy's options, or a choice it fixed itself (`fixed`)."""

    options: Sequence[Option] = ()
    fixed: tuple[int | None, int] | None = None


@dataclass(frozen=True)
class Decision:
    """One round's decision for a batch: each request's (drafter, k) and the shared forward's expected width."""

    choices: list[tuple[int | None, int]]  # per request (drafter, k)
    width: int  # tokens per row of the round's forward: 1 + the longest draft
    rate: float  # the batch's expected tokens per second, optimism left out (the bar later choices must beat)


def decide(plans: Sequence[Plan], round_seconds: Sequence[float]) -> Decision:
    """round_seconds[w - 1]: T(B, w) for this batch's size B, w = 1 .. the widest row allowed."""
    times = np.asarray(round_seconds, dtype=float)
    table = _Candidates(plans)
    fixed_width = min(max((p.fixed[1] + 1 for p in plans if p.fixed is not None), default=1), len(times))
    rows = np.arange(len(plans))
    best, best_rate = table.plain, -np.inf
    for width in range(fixed_width, len(times) + 1):
        pick = table.best_within(width - 1, times[width - 1])
        # priced at the width it needs, which may be narrower than the one searched (T need not grow with W)
        needed = max(int(table.k[rows, pick].max(initial=0)) + 1, fixed_width)
        rate = table.gain[rows, pick].sum() / (times[needed - 1] + table.draft[rows, pick].sum())
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = pick, rate
    choices = [plan.fixed if plan.fixed is not None else table.choice(i, best[i]) for i, plan in enumerate(plans)]
    width = min(max((k for _, k in choices), default=0) + 1, len(times))
    rate = float(table.expected_gain[rows, best].sum() / (times[width - 1] + table.expected_draft[rows, best].sum()))
    return Decision(choices, width, rate)


class _Candidates:
    """Every request's candidates in one table, [request, candidate]: column 0 the plain step (gain 1, no drafting),
    then every option's k = 1 .. m, shorter drafts first (argmax takes the first of equals); a request with a fixed
    choice has only column 0 (it yields 1 token as far as the others' choices go, and its k bounds the width from
    below). Padding never wins (gain -inf)."""

    def __init__(self, plans: Sequence[Plan]):
        rows = [[(None, 0, 1.0, 0.0, 1.0, 0.0)] for _ in plans]
        for row, plan in zip(rows, plans, strict=True):
            for option in plan.options if plan.fixed is None else ():
                row += [
                    (option.arm, k, option.gain[k], option.draft[k], option.expected_gain[k], option.expected_draft[k])
                    for k in range(1, len(option.gain))
                ]
            row[1:] = sorted(row[1:], key=lambda candidate: candidate[1])  # stable: options in order within a k
        width = max(map(len, rows), default=1)
        padded = [row + [(None, 0, -np.inf, 0.0, 0.0, 0.0)] * (width - len(row)) for row in rows]
        self.arms = [[c[0] for c in row] for row in padded]
        columns = np.array([[c[1:] for c in row] for row in padded], dtype=float).reshape(len(plans), width, 5)
        self.k, self.gain, self.draft, self.expected_gain, self.expected_draft = np.moveaxis(columns, 2, 0)
        self.plain = np.zeros(len(plans), dtype=int)

    def best_within(self, k_max: int, forward: float) -> np.ndarray:
        """The column per request maximising sum gain / (forward + sum draft) with every k <= k_max (Dinkelbach:
        each pass picks argmax gain - rate x draft per request, then prices the picks)."""
        allowed = np.where(self.k <= k_max, self.gain, -np.inf)
        rows = np.arange(len(self.arms))
        pick, rate = self.plain, len(rows) / forward
        for _ in range(_PASSES):
            again = np.argmax(allowed - rate * self.draft, axis=1)
            new_rate = self.gain[rows, again].sum() / (forward + self.draft[rows, again].sum())
            if new_rate <= rate * (1 + 1e-12):
                break
            pick, rate = again, new_rate
        return pick

    def choice(self, request: int, column: int) -> tuple[int | None, int]:
        return self.arms[request][column], int(self.k[request, column])


class BatchDecision:
    """The `round.RoundDecision` of a batch round: `decide` over every request's plan, priced by the batch's
    measured T(B, W), which every round's forward refines."""

    def __init__(self, costs: CostModel):
        self.costs = costs
        self._times: list[float] = []  # this round's T(B, w), w = 1 .. the widest row
        self._drafts = False  # whether this round decides at all (`may_draft`), from `start` to `choose`

    def start(self, requests: Sequence[RoundRequest]) -> list[RoundState]:
        self._times = self.costs.forward_widths(len(requests), max(r.room for r in requests) + 1)
        self._drafts = self.may_draft(requests, self._times)
        return [request.start_round(propose=self._drafts) for request in requests]

    def choose(self, requests: Sequence[RoundRequest], states: Sequence[RoundState]) -> None:
        if not self._drafts:
            return
        times = self._times
        decision = decide([_plan(request, state) for request, state in zip(requests, states, strict=True)], times)
        for request, state, (arm, k) in zip(requests, states, decision.choices, strict=True):
            state.arm, state.k = arm, min(k, state.room)
            if request.policy is not None:
                request.policy.set_bar(decision.rate)

    def observe(self, size: int, width: int, seconds: float) -> None:
        self.costs.observe_forward(size, width, seconds)

    @staticmethod
    def may_draft(requests: Sequence[RoundRequest], times: Sequence[float]) -> bool:
        """Whether any drafting could pay this round: False when every request drafting k tokens at its policy's
        ceiling (`Policy.ceiling`: the best acceptance it has seen, drafting free) still yields fewer tokens
        per second than a plain batch step, for every k. The round then skips every request's proposals and
        options, work it would pay for nothing. Policies without a ceiling (the bandits) always decide."""
        ceilings = []
        for request in requests:
            if request.policy is None or request.room <= 0:
                ceilings.append(np.ones(len(times)))
            elif (ceiling := request.policy.ceiling(request.room)) is not None:
                ceilings.append(np.concatenate([ceiling, np.full(len(times) - len(ceiling), ceiling[-1])]))
            else:
                return True
        rates = np.sum(ceilings, axis=0) / np.asarray(times)
        return bool(rates[1:].max(initial=0.0) > rates[0])


def _plan(request: RoundRequest, state: RoundState) -> Plan:
    policy = request.policy
    if policy is None or state.room <= 0:
        return Plan(fixed=(None, 0))
    options = policy.options(state.room, state.proposals, state.lags, remaining=state.remaining, fresh=state.fresh)
    if options is not None:
        return Plan(options)
    return Plan(
        fixed=policy.choose(state.room, state.proposals, state.lags, remaining=state.remaining, fresh=state.fresh)
    )
