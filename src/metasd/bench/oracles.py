"""Hindsight oracles, exact under greedy decoding.

Greedy decoding is lossless, so every method's context at output position `pos` is prompt + reference[:pos]
(the reference being `ar`'s output). That makes "how many tokens would drafter d have had accepted here" a
table, `accepted[pos, d]`: d drafts up to K tokens from the true context (drafters are walked through the positions
in order, from `begin(prompt)`, so model drafters catch up as they would) and its accepted length is its matching
prefix with the reference continuation. A draft of k <= K tokens is accepted for min(accepted, k) of them.

- `oracle-round`: the fastest walk through the reference that a per-round policy could take, in hindsight: at each
  round a drafter *and* a length k (k = 0: a plain target step), chosen by dynamic programming over the positions to
  minimise the total time under this machine's measured costs (T(k + 1) for the verification, the drafter's
  measured time per token or per proposal, the per-round overhead). In hindsight a drafter never drafts more than it
  gets accepted, so the plan is a schedule of fully accepted drafts; it is replayed through the engine and timed.
- regret of a run: per round, at the round's own draft length, best accepted length minus the chosen drafter's.
- `oracle-category`: per category, the single drafter with the best mean tokens/s in its fixed run (see metrics).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..sampling import SamplingParams
from ..stats import Round

Step = tuple[int | None, int]  # (drafter index or None, tokens to draft)


def draft_budget(pos: int, draft_len: int, max_new_tokens: int) -> int:
    """k at output position pos, as the engine computes it (0 on the last token: a plain target step)."""
    return max(0, min(draft_len, max_new_tokens - pos - 1))


def matching_prefix(draft: Sequence[int], reference: Sequence[int]) -> int:
    """How many leading tokens of `draft` equal the reference's: what greedy verification accepts of it."""
    n = 0
    for a, b in zip(draft, reference, strict=False):
        if a != b:
            break
        n += 1
    return n


@dataclass
class AcceptanceTable:
    """For one question's reference: what each drafter would have had accepted at each output position, how many
    tokens could be drafted there, and what each drafter's draft costs in seconds."""

    accepted: np.ndarray  # [len(reference), n_drafters] int: accepted tokens if drafter d drafts at position pos
    budgets: np.ndarray  # [len(reference)] int: most tokens draftable at each position (0 = no drafting there)
    draft_seconds: np.ndarray  # [n_drafters] measured seconds per drafted token (model) or per proposal (model-free)
    per_token: np.ndarray | None = None  # [n_drafters] bool: draft_seconds is per token (a drafter with a model)

    @property
    def positions(self) -> int:
        """The output positions the table covers: the reference's length."""
        return int(self.accepted.shape[0])

    def cost_order(self) -> list[int]:
        """The drafters' indices, cheapest draft first (ties in index order)."""
        return [int(i) for i in np.argsort(self.draft_seconds, kind="stable")]

    def draft_cost(self, arm: int, k: int) -> float:
        """Seconds drafter `arm` takes to draft `k` tokens: per token for a model drafter, per proposal otherwise."""
        per_token = self.per_token is not None and bool(self.per_token[arm])
        return float(self.draft_seconds[arm]) * (k if per_token else 1)


def acceptance_table(
    drafters: Sequence, prompt: list[int], reference: list[int], max_draft: int, max_new_tokens: int
) -> AcceptanceTable:
    """accepted[pos, d] for every position of the reference, for drafts of up to `max_draft` tokens.

    A model drafter (`runs_model`) drafts greedily one token at a time from context + its own tokens, so while its
    tokens match the reference, drafting k tokens equals probing one token at a time along the reference; the probe
    stops at the first mismatch, which costs accepted + 1 forwards instead of k. Model-free drafters (n-gram lookup,
    suffix index) may draft a block from one match, so they are asked for the whole block, as are EAGLE heads (they
    read the target's features of the context, which the target's cache holds after the reference's decoding).
    """
    params = SamplingParams()
    for d in drafters:
        d.begin(list(prompt))
    n = len(reference)
    accepted = np.zeros((n, len(drafters)), dtype=np.int64)
    budgets = np.array([draft_budget(p, max_draft, max_new_tokens) for p in range(n)], dtype=np.int64)
    # an EAGLE head drafts its later tokens from its own predicted features, not the target's: probing it along the
    # reference would feed it the true ones, so it is asked for whole blocks like the model-free drafters
    per_token = np.array(
        [d.runs_model and not d.reads_target_features for d in drafters],
        dtype=bool,
    )
    seconds = np.zeros(len(drafters))
    calls = np.zeros(len(drafters))
    for i, d in enumerate(drafters):  # untimed: a model drafter's first call prefills the prompt, no draft cost
        if per_token[i] and n and budgets[0] > 0:
            d.propose(list(prompt), 1, params, None)
    for pos in range(n):
        k = int(budgets[pos])
        if k == 0:
            continue
        context = list(prompt) + list(reference[:pos])
        target = list(reference[pos : pos + k])
        for i, d in enumerate(drafters):
            start = time.perf_counter()
            if per_token[i]:
                acc = 0
                while acc < len(target):
                    token = d.propose(context + target[:acc], 1, params, None).tokens
                    calls[i] += 1
                    if token[:1] != target[acc : acc + 1]:
                        break
                    acc += 1
            else:
                acc = matching_prefix(d.propose(context, k, params, None).tokens[:k], target)
                calls[i] += 1
            seconds[i] += time.perf_counter() - start
            accepted[pos, i] = acc
    return AcceptanceTable(accepted, budgets, seconds / np.maximum(calls, 1), per_token)


def oracle_plan(table: AcceptanceTable, step_seconds: Sequence[float], overhead: float = 0.0) -> list[Step]:
    """The fastest schedule in hindsight: plan[pos] = (drafter, k) for a round starting at pos.

    f(pos) = min(T(1) + f(pos + 1), min over d and 1 <= k <= accepted[pos, d] of cost_d(k) + T(k + 1) + f(pos+k+1)),
    every round also paying `overhead`. step_seconds[m - 1] = T(m); k is capped where the table has no T(k + 1).
    Ties go to the shorter draft, then the cheaper drafter.
    """
    n = table.positions
    step = list(step_seconds)
    if not step:
        raise ValueError("oracle_plan needs T(1) at least")
    order = table.cost_order()
    best = np.zeros(n + 1)
    plan: list[Step] = [(None, 0)] * n
    for pos in range(n - 1, -1, -1):
        best[pos] = step[0] + overhead + best[pos + 1]
        for k in range(1, min(int(table.budgets[pos]), len(step) - 1) + 1):
            for arm in order:
                if table.accepted[pos, arm] < k:
                    continue
                t = table.draft_cost(arm, k) + step[k] + overhead + best[min(pos + k + 1, n)]
                if t < best[pos] - 1e-12:
                    best[pos], plan[pos] = t, (arm, k)
    return plan


@dataclass
class OraclePath:
    """The oracle's walk through the reference: each round's start position, drafter and accepted tokens."""

    positions: list[int]
    arms: list[int | None]  # None: a round without drafting (k = 0)
    accepted: list[int]

    @property
    def rounds(self) -> int:
        """The rounds (target forwards) the walk takes."""
        return len(self.arms)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per target forward along the walk (accepted + 1)."""
        return float(np.mean([a + 1 for a in self.accepted])) if self.accepted else 0.0


def oracle_path(plan: Sequence[Step]) -> OraclePath:
    """Walk the reference along the plan; each round advances by its (fully accepted) k + 1."""
    path = OraclePath([], [], [])
    pos = 0
    while pos < len(plan):
        arm, k = plan[pos]
        path.positions.append(pos)
        path.arms.append(arm if k > 0 else None)
        path.accepted.append(k)
        pos += k + 1
    return path


@dataclass
class Regret:
    """A run's regret in accepted tokens, round by round, and the rounds where the engine and the table disagree."""

    per_round: list[int]  # best accepted length at the round's position minus the chosen drafter's
    disagreements: int  # rounds where the engine's logged acceptance differs from the table's (float numerics)

    @property
    def total(self) -> int:
        """The run's regret: accepted tokens lost to its choices over all rounds."""
        return int(sum(self.per_round))

    @property
    def cumulative(self) -> list[int]:
        """The regret after each round, summed from the first."""
        return [int(x) for x in np.cumsum(self.per_round)] if self.per_round else []


def regret(table: AcceptanceTable, rounds: Sequence[Round], drafter_names: Sequence[str]) -> Regret:
    """Regret of a run's drafter choices: per round, at the draft length the policy chose, the best accepted length
    minus the chosen drafter's (an n-gram lookup that finds nothing still had its chance: rounds without a drafter
    count 0)."""
    index = {name: i for i, name in enumerate(drafter_names)}
    pos = 0
    per_round: list[int] = []
    disagreements = 0
    for r in rounds:
        if pos >= table.positions:
            break
        if r.drafter is None or r.drafter not in index:
            per_round.append(0)
        else:
            row = np.minimum(table.accepted[pos], r.chosen_k if r.chosen_k is not None else r.drafted)
            arm = index[r.drafter]
            per_round.append(int(row.max()) - int(row[arm]))
            # the drafter's own tokens only: a free continuation may follow them
            disagreements += min(int(table.accepted[pos, arm]), r.own) != min(r.accepted, r.own)
        pos += r.emitted
    return Regret(per_round, disagreements)


@dataclass
class TurnOracle:
    """Everything the bench keeps of one turn's hindsight: the table, the plan replayed as `oracle-round`, its walk."""

    table: AcceptanceTable
    plan: list[Step]
    path: OraclePath


def turn_oracle(
    drafters: Sequence, prompt: list[int], reference: list[int], max_draft: int, max_new_tokens: int, costs
) -> TurnOracle:
    """The table (drafts up to max_draft), and the plan under `costs` (the decoder's CostModel: T(M) as calibrated
    and refined so far, and the per-round overhead)."""
    table = acceptance_table(drafters, prompt, reference, max_draft, max_new_tokens)
    steps = [costs.target(m) for m in range(1, max_draft + 2)]
    plan = oracle_plan(table, steps, costs.overhead["greedy"].value or 0.0)  # the benchmark decodes greedily
    return TurnOracle(table, plan, oracle_path(plan))


def question_oracle(
    drafters: Sequence, reference, max_draft: int, max_new_tokens: int, costs
) -> tuple[list[AcceptanceTable], list[OraclePath], list[list[Step]]]:
    """`turn_oracle` for every turn of a question's reference record (`ar`'s): the tables, the walks, the plans."""
    turns = [
        turn_oracle(drafters, t.prompt_ids, t.token_ids, max_draft, max_new_tokens, costs) for t in reference.turns
    ]
    return [t.table for t in turns], [t.path for t in turns], [t.plan for t in turns]
