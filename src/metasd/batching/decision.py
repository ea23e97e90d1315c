"""The batch decision: every request's (drafter, k) for one round, chosen to maximise the batch's tokens per second.

A batch round yields sum_i E_i tokens (E_i = 1 + the expected accepted tokens of request i's draft) in T(B, W) +
sum_i D_i seconds: one target forward over B rows padded to the widest row W = 1 + max_i k_i (`CostModel.forward`,
measured), plus every request's drafting (forks of one EAGLE head draft together, each charged its own catch-up and
its share of the steps: `round.drafts_together`). Each request's policy offers its options
(`AdaptivePolicy.options`: expected tokens and drafting time per drafter and length); coordinate ascent then gives
each request in turn its best option given the others' (k = 0 always among them) until no request changes, which
maximises the batch's rate locally and ends because the rate only grows. With a flat T every request drafts as it
would alone; with T growing in B x W, one request's longer draft widens every row, and drafting fades as the batch
fills, then returns as it empties, without thresholds. A request changes its choice only for a strictly better batch
rate, so the decision does not flip between equal options round after round. Policies without options (the paper's
bandits) keep their own (drafter, k), which only sets the width they need."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..costs import CostModel
from ..policy.adaptive import Option
from ..round import RoundRequest, RoundState

_SWEEPS = 8  # coordinate-ascent passes at most; two or three settle it in practice


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
    n = len(plans)
    arm: list[int | None] = [None] * n
    k = [0] * n
    gain, draft = np.ones(n), np.zeros(n)
    expected_gain, expected_draft = np.ones(n), np.zeros(n)
    for i, plan in enumerate(plans):
        if plan.fixed is not None:
            arm[i], k[i] = plan.fixed
    for _ in range(_SWEEPS):
        changed = False
        for i, plan in enumerate(plans):
            if plan.fixed is not None:
                continue
            width = max((k[j] + 1 for j in range(n) if j != i), default=1)
            others_gain, others_draft = gain.sum() - gain[i], draft.sum() - draft[i]
            current = (others_gain + gain[i]) / (times[max(width, k[i] + 1) - 1] + others_draft + draft[i])
            best = (current, arm[i], k[i], None)
            plain = (others_gain + 1.0) / (times[width - 1] + others_draft)
            if plain > best[0] * (1 + 1e-9):
                best = (plain, None, 0, None)
            for option in plan.options:
                m = min(len(option.gain) - 1, len(times) - 1)
                if m < 1:
                    continue
                ks = np.arange(1, m + 1)
                rates = (others_gain + option.gain[1 : m + 1]) / (
                    times[np.maximum(width, ks + 1) - 1] + others_draft + option.draft[1 : m + 1]
                )
                j = int(np.argmax(rates))
                if rates[j] > best[0] * (1 + 1e-9):
                    best = (float(rates[j]), option.arm, j + 1, option)
            if (best[1], best[2]) != (arm[i], k[i]):
                changed = True
                arm[i], k[i] = best[1], best[2]
                option = best[3]
                if option is None:
                    gain[i], draft[i], expected_gain[i], expected_draft[i] = 1.0, 0.0, 1.0, 0.0
                else:
                    gain[i], draft[i] = option.gain[k[i]], option.draft[k[i]]
                    expected_gain[i], expected_draft[i] = option.expected_gain[k[i]], option.expected_draft[k[i]]
        if not changed:
            break
    width = min(max(k, default=0) + 1, len(times))
    rate = float(expected_gain.sum() / (times[width - 1] + expected_draft.sum()))
    return Decision(list(zip(arm, k, strict=True)), width, rate)


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
