"""What the engine tells the cost model after a round, and what it tells a policy's reward about the round's times
(prefills replaced by the steady-state estimate)."""

from __future__ import annotations

from ..round import RoundClock
from .model import CostModel


def reward_times(
    costs: CostModel | None,
    clock: RoundClock,
    proposal_time: float,
    forward: tuple[int, int],
    prefilled: bool,
    fresh_drafter: str | None,
    forwards: int,
) -> dict[str, float]:
    """The times a policy's reward sees: what the round costs in steady state. A prompt prefill (the target's, or a
    fresh model drafter's first draft taking in its own copy: `fresh_drafter`, its name, drafting in `forwards`
    forwards) is replaced by the cost model's estimate of the same round without it, as T(B, W) and the step costs
    leave prefills out: `forward`, the forward's (B, W), is priced as a batch round, or T(M) alone."""
    draft_time, verify_time = proposal_time + clock.draft_seconds, clock.verify_seconds
    if costs is None:
        return {"draft_time": draft_time, "verify_time": verify_time, "plain_step_time": 0.0}
    if prefilled:
        verify_time = costs.forward(*forward) + clock.accept_seconds
    if fresh_drafter is not None:
        draft_time = forwards * costs.drafter(fresh_drafter).step_time(costs.target(1))
    return {"draft_time": draft_time, "verify_time": verify_time, "plain_step_time": costs.target(1)}


def observe_round(
    costs: CostModel | None,
    clock: RoundClock,
    regime: str,
    verified: int,
    unmeasured: bool,
    drafter: str | None = None,
    forwards: int = 0,
    taken_in: int = 0,
) -> None:
    """The machine's costs, whatever the policy: every round is a measurement (but prefills and batch rounds,
    which measure other shapes: `unmeasured`). T(M) is the forward alone; the acceptance rule, processing and
    bookkeeping go to the regime's per-round overhead; the drafter that drafted after the choice (`drafter`, in
    `forwards` forwards after taking in `taken_in` tokens; not a proposal made before it) adds to its costs."""
    if costs is None:
        return
    if drafter is not None:
        costs.drafter(drafter).observe(forwards, taken_in, clock.draft_seconds)
    if not unmeasured:
        costs.target.observe(verified + 1, clock.forward_seconds)
        costs.overhead[regime].add(max(clock.total_seconds - clock.draft_seconds - clock.forward_seconds, 0.0))
