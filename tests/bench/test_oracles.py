"""The hindsight oracles on synthetic acceptance tables and synthetic drafters, and the regret of a round log."""

from __future__ import annotations

import numpy as np
import pytest

from metasd.bench.oracles import AcceptanceTable, acceptance_table, oracle_path, oracle_plan, regret
from metasd.drafters import Draft
from metasd.drafters.base import Drafter
from metasd.stats import Round

# --- oracles ----------------------------------------------------------------------------------------------------


def synthetic_table() -> AcceptanceTable:
    # 3 drafters; positions 0..7; drafter 2 is the most expensive, drafter 1 the cheapest
    accepted = np.array([[2, 0, 2], [0, 0, 0], [1, 3, 0], [0, 0, 0], [0, 0, 4], [0, 1, 0], [3, 3, 1], [0, 0, 0]])
    budgets = np.array([5, 5, 5, 5, 5, 5, 5, 0])  # no drafting on the last token
    return AcceptanceTable(accepted, budgets, np.array([0.002, 0.001, 0.5]))


FLAT = [1.0] * 6  # T(M) = 1 for M = 1..6: verification costs the same for any draft length


def test_oracle_with_free_verification_takes_the_longest_accepted_draft() -> None:
    table = synthetic_table()
    table.draft_seconds = np.zeros(3)  # drafting is free too
    path = oracle_path(oracle_plan(table, FLAT))
    # every round costs the same, so the fewest rounds win: 3 (e.g. 2 at pos 0, a plain step, 3 of 4 at pos 4)
    assert path.rounds == 3 and sum(a + 1 for a in path.accepted) == table.positions
    for pos, arm, k in zip(path.positions, path.arms, path.accepted, strict=True):
        assert (arm is None and k == 0) or 1 <= k <= table.accepted[pos, arm]  # only drafts that are accepted
    assert path.mean_accepted_tokens == pytest.approx(8 / 3)


def test_oracle_weighs_drafter_cost_and_verification_cost() -> None:
    table = synthetic_table()  # drafter 2 costs 0.5 s per proposal; 1 and 0 a few ms
    # at pos 4 only drafter 2 accepts: 0.5 + T(4) = 1.5 s for the last 4 tokens beats 4 plain steps (4 s)
    assert oracle_plan(table, FLAT)[4] == (2, 3)
    table.draft_seconds[2] = 3.5  # ...but not at 3.5 s a proposal
    assert oracle_plan(table, FLAT)[4] == (None, 0)
    # verification linear in M: T(k + 1) = k + 1, so no draft can pay for itself and every round is a plain step
    linear = [float(m) for m in range(1, 7)]
    assert all(arm is None for arm, _ in oracle_plan(table, linear))
    # one free drafter with 3 accepted at pos 0 of 10: with T(3) dear and T(4) cheap it drafts 3 (1 + 6 plain
    # steps after = 7 s, against 9 s for k = 1 and 12 s for k = 2); with T(4) dear instead, 2 (8 s, against 11 s)
    accepted = np.zeros((10, 1), dtype=np.int64)
    accepted[0, 0] = 3
    one = AcceptanceTable(accepted, np.full(10, 5), np.zeros(1))
    assert oracle_plan(one, [1.0, 1.0, 5.0, 1.0, 1.0, 1.0])[0] == (0, 3)
    assert oracle_plan(one, [1.0, 1.0, 1.0, 5.0, 1.0, 1.0])[0] == (0, 2)


def test_oracle_round_last_token_is_a_plain_step() -> None:
    table = AcceptanceTable(np.array([[1, 0], [0, 0]]), np.array([1, 0]), np.array([0.0, 0.0]))
    path = oracle_path(oracle_plan(table, FLAT))
    assert path.arms == [0] and path.accepted == [1] and path.rounds == 1
    table = AcceptanceTable(np.array([[0, 0], [0, 0]]), np.array([1, 0]), np.array([0.0, 0.0]))
    path = oracle_path(oracle_plan(table, FLAT))
    assert path.arms == [None, None] and path.accepted == [0, 0] and path.rounds == 2


def test_regret_of_a_round_log() -> None:
    table = synthetic_table()
    names = ["a", "b", "c"]

    def rnd(drafter, accepted):
        return Round(drafter, 5, accepted, 0.0, 0, 0.0, 0.0, 0.0, accepted + 1)

    # pos 0: 'b' accepts 0 (best 2) -> pos 1: 'a' 0 (best 0) -> pos 2: 'a' 1 (best 3) -> pos 4: 'c' 4 (best 4)
    # -> pos 9: stop. The last round's logged 3 disagrees with the table's 4.
    rounds = [rnd("b", 0), rnd("a", 0), rnd("a", 1), rnd("c", 3)]
    reg = regret(table, rounds, names)
    assert reg.per_round == [2, 0, 2, 0]
    assert reg.cumulative == [2, 2, 4, 4]
    assert reg.total == 4 and reg.disagreements == 1
    assert regret(table, [rnd(None, 0)], names).per_round == [0]
    # judged at the round's own draft length: drafting 2 at pos 4, 'c' could not have had more than 2
    short = Round("c", 2, 2, 0.0, 0, 0.0, 0.0, 0.0, 3)
    assert regret(table, [rnd("a", 2), rnd("b", 0), short], names).per_round == [0, 0, 0]
    # a proposal that ran out (nothing drafted) is judged at the length the policy asked for
    empty = Round("b", 0, 0, 0.0, 0, 0.0, 0.0, 0.0, 1, 5)
    assert regret(table, [empty], names).per_round == [2]


class Copier(Drafter):
    """A model-free drafter that knows the reference: drafts it exactly from any position."""

    def __init__(self, reference: list[int], prompt_len: int, name: str = "copier"):
        self.reference, self.prompt_len, self.name = reference, prompt_len, name

    def propose(self, context, k, params, generator) -> Draft:
        pos = len(context) - self.prompt_len
        return Draft(self.reference[pos : pos + k])


class Constant(Drafter):
    """Always drafts token 0 (wrong here); `runs_model` makes the table probe it one token at a time."""

    name = "zero"

    def __init__(self, runs_model: bool):
        self.runs_model = runs_model
        self.calls = 0

    def propose(self, context, k, params, generator) -> Draft:
        self.calls += 1
        return Draft([0] * k)


def test_acceptance_table_on_synthetic_drafters() -> None:
    prompt, reference = [9, 9, 9], [5, 6, 7, 8, 0, 0]
    model_like = Constant(runs_model=True)
    table = acceptance_table(
        [Copier(reference, len(prompt)), model_like, Constant(False)], prompt, reference, max_draft=3, max_new_tokens=6
    )
    assert table.budgets.tolist() == [3, 3, 3, 2, 1, 0]
    assert table.accepted[:, 0].tolist() == [3, 3, 3, 2, 1, 0]
    # token 0 matches the reference's 0 at positions 4 and 5 only (budget 1 at pos 4, none at pos 5)
    assert table.accepted[:, 1].tolist() == [0, 0, 0, 0, 1, 0]
    assert table.accepted[:, 2].tolist() == table.accepted[:, 1].tolist()
    assert model_like.calls == 1 + 5  # a prefill, then one probe per drafting position: each stops at the first
    # token (pos 4 matches 1)
    assert table.per_token.tolist() == [False, True, False]  # the model-like drafter's cost is per drafted token
