"""Hindsight oracles, exact under greedy decoding.

Greedy decoding is lossless, so every method's context at output position `pos` is prompt + reference[:pos]
(the reference being `ar`'s output). That makes "how many tokens would drafter d have had accepted here" a
table, `accepted[pos, d]`: d drafts k tokens from the true context (drafters are walked through the positions in
order, from `begin(prompt)`, so model drafters catch up as they would) and its accepted length is its matching
prefix with the reference continuation.

- `oracle-round`: at each round, the drafter with the longest accepted prefix (ties: the cheaper drafter).
- regret of a run: per round, best accepted length at that position minus the chosen drafter's.
- `oracle-category`: per category, the single drafter with the best mean tokens/s in its fixed run (see metrics).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..sampling import SamplingParams
from ..stats import Round


def draft_budget(pos: int, draft_len: int, max_new_tokens: int) -> int:
    """k at output position pos, as the engine computes it (0 on the last token: a plain target step)."""
    return max(0, min(draft_len, max_new_tokens - pos - 1))


def matching_prefix(draft: Sequence[int], reference: Sequence[int]) -> int:
    n = 0
    for a, b in zip(draft, reference, strict=False):
        if a != b:
            break
        n += 1
    return n


@dataclass
class AcceptanceTable:
    accepted: np.ndarray  # [len(reference), n_drafters] int: accepted tokens if drafter d drafts at position pos
    budgets: np.ndarray  # [len(reference)] int: k at each position (0 = no drafting there)
    draft_seconds: np.ndarray  # [n_drafters] estimated seconds per k-token proposal, for tie-breaking by cost

    @property
    def positions(self) -> int:
        return int(self.accepted.shape[0])

    def cost_order(self) -> list[int]:
        return [int(i) for i in np.argsort(self.draft_seconds, kind="stable")]


def acceptance_table(drafters: Sequence, prompt: list[int], reference: list[int], draft_len: int,
                     max_new_tokens: int) -> AcceptanceTable:
    """accepted[pos, d] for every position of the reference.

    A model drafter (`has_cache`) drafts greedily one token at a time from context + its own tokens, so while its
    tokens match the reference, drafting k tokens equals probing one token at a time along the reference; the probe
    stops at the first mismatch, which costs accepted + 1 forwards instead of k. Model-free drafters (n-gram lookup,
    suffix index) may draft a block from one match, so they are asked for the whole block.
    """
    params = SamplingParams()
    for d in drafters:
        d.begin(list(prompt))
    n = len(reference)
    accepted = np.zeros((n, len(drafters)), dtype=np.int64)
    budgets = np.array([draft_budget(p, draft_len, max_new_tokens) for p in range(n)], dtype=np.int64)
    seconds = np.zeros(len(drafters))
    calls = np.zeros(len(drafters))
    for pos in range(n):
        k = int(budgets[pos])
        if k == 0:
            continue
        context = list(prompt) + list(reference[:pos])
        target = list(reference[pos : pos + k])
        for i, d in enumerate(drafters):
            start = time.perf_counter()
            if getattr(d, "has_cache", False):
                acc = 0
                while acc < len(target):
                    token = d.propose(context + target[:acc], 1, params, None).tokens
                    calls[i] += 1 / k  # a full proposal is k of these single-token calls
                    if token[:1] != target[acc : acc + 1]:
                        break
                    acc += 1
            else:
                acc = matching_prefix(d.propose(context, k, params, None).tokens[:k], target)
                calls[i] += 1
            seconds[i] += time.perf_counter() - start
            accepted[pos, i] = acc
    return AcceptanceTable(accepted, budgets, seconds / np.maximum(calls, 1e-12))


def best_choices(table: AcceptanceTable) -> list[int]:
    """The oracle's drafter at every position: longest accepted prefix, ties to the cheapest drafter."""
    order = table.cost_order()
    out = []
    for row in table.accepted:
        best = int(row.max()) if row.size else 0
        out.append(next(i for i in order if row[i] == best) if row.size else 0)
    return out


@dataclass
class OraclePath:
    positions: list[int]
    arms: list[int | None]  # None: a round without drafting (k = 0)
    accepted: list[int]

    @property
    def rounds(self) -> int:
        return len(self.arms)

    @property
    def mean_accepted_tokens(self) -> float:
        return float(np.mean([a + 1 for a in self.accepted])) if self.accepted else 0.0


def oracle_path(table: AcceptanceTable) -> OraclePath:
    """Walk the reference taking the best drafter every round; each round advances by accepted + 1."""
    choices = best_choices(table)
    path = OraclePath([], [], [])
    pos = 0
    while pos < table.positions:
        arm = choices[pos] if table.budgets[pos] > 0 else None
        acc = int(table.accepted[pos, arm]) if arm is not None else 0
        path.positions.append(pos)
        path.arms.append(arm)
        path.accepted.append(acc)
        pos += acc + 1
    return path


@dataclass
class Regret:
    per_round: list[int]  # best accepted length at the round's position minus the chosen drafter's
    disagreements: int  # rounds where the engine's logged acceptance differs from the table's (float numerics)

    @property
    def total(self) -> int:
        return int(sum(self.per_round))

    @property
    def cumulative(self) -> list[int]:
        return [int(x) for x in np.cumsum(self.per_round)] if self.per_round else []


def regret(table: AcceptanceTable, rounds: Sequence[Round], drafter_names: Sequence[str]) -> Regret:
    """Regret of a run's round log against the per-round oracle (rounds without a drafter count 0)."""
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
            row = table.accepted[pos]
            chosen = int(row[index[r.drafter]])
            per_round.append(int(row.max()) - chosen)
            disagreements += chosen != r.accepted
        pos += r.emitted
    return Regret(per_round, disagreements)
