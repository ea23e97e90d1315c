"""Assemble `summary.json` from the records of a run: per method, overall and per Spec-Bench group."""

from __future__ import annotations

from collections.abc import Sequence

from ..stats import GenerationStats
from . import metrics
from .methods import DERIVED, is_engine_method, is_policy, label, uses_drafters
from .oracles import AcceptanceTable, OraclePath, Regret, draft_budget, regret
from .questions import GROUPS, Question
from .runners import QuestionRecord

Results = dict[str, dict[int, QuestionRecord]]  # method -> question id -> record


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def mismatches(results: Results, reference: str = "ar") -> list[dict]:
    """Every (method, question, turn) whose output ids differ from the reference method's."""
    out = []
    ref = results[reference]
    for method, records in results.items():
        if method == reference:
            continue
        for qid, record in records.items():
            for t, (turn, ref_turn) in enumerate(zip(record.turns, ref[qid].turns, strict=True)):
                at = first_difference(turn.token_ids, ref_turn.token_ids)
                if at is not None:
                    out.append(
                        {
                            "method": method,
                            "question_id": qid,
                            "turn": t + 1,
                            "first_difference": at,
                            "tokens": turn.new_tokens,
                            "reference_tokens": ref_turn.new_tokens,
                        }
                    )
    return out


def _group_metrics(records: list[QuestionRecord], base: list[QuestionRecord], mismatched: int, engine: bool) -> dict:
    speeds = [metrics.question_speed([t.new_tokens for t in r.turns], [t.wall_time for t in r.turns]) for r in records]
    base_speeds = [
        metrics.question_speed([t.new_tokens for t in r.turns], [t.wall_time for t in r.turns]) for r in base
    ]
    turns = [t for r in records for t in r.turns]
    wall = sum(t.wall_time for t in turns)
    out = {
        "questions": len(records),
        "turns": len(turns),
        "new_tokens": sum(t.new_tokens for t in turns),
        "wall_time": round(wall, 4),
        "tokens_per_second": round(metrics.mean_speed(speeds), 3),
        "speedup": round(metrics.speedup(speeds, base_speeds), 4),
        "mean_accepted_tokens": round(metrics.mean_accepted_tokens(a for t in turns for a in t.accept_lengths), 4),
        "rounds": sum(len(t.accept_lengths) for t in turns),
        "mismatches": mismatched,
        "switches": None,
        "catch_up_tokens": None,
        "policy_overhead": None,
    }
    if engine:
        stats = [GenerationStats(rounds=t.rounds or []) for t in turns]
        out["switches"] = sum(s.switches for s in stats)
        out["catch_up_tokens"] = sum(s.catch_up_tokens for s in stats)
        rounds = [r for t in turns for r in t.rounds or []]
        policy_time = sum(r.policy_time for r in rounds)
        out["policy_overhead"] = round(policy_time / wall, 6) if wall > 0 else None
        out["draft_time_share"] = round(sum(r.draft_time for r in rounds) / wall, 4) if wall > 0 else None
        out["verify_time_share"] = round(sum(r.verify_time for r in rounds) / wall, 4) if wall > 0 else None
        picks: dict[str, int] = {}
        for r in rounds:
            if r.drafter is not None:
                picks[r.drafter] = picks.get(r.drafter, 0) + 1
        out["drafter_rounds"] = picks
        # draft trees: rounds that verified other drafters' branches beside the chosen draft, their nodes, and the
        # tokens the accepted paths took from them
        trees = [r for r in rounds if r.branch_nodes > 0]
        out["tree_rounds"] = len(trees)
        out["mean_tree_nodes"] = (
            round(sum(r.drafted + r.branch_nodes for r in trees) / len(trees), 3) if trees else None
        )
        out["branch_accepted"] = sum(r.branch_accepted for r in rounds)
    return out


def _reward_stats(results: Results, drafters: Sequence[str], draft_len: int, max_new_tokens: int) -> dict:
    """Paper's Table 2: BD and BE of each drafter's rounds in its fixed run (both computable for every round)."""
    out = {}
    for name in drafters:
        records = results.get(f"fixed:{name}")
        if not records:
            continue
        bd, be = [], []
        for record in records.values():
            for turn in record.turns:
                pos = 0
                for r in turn.rounds or []:
                    k = draft_budget(pos, draft_len, max_new_tokens)
                    if r.drafter is not None and k > 0:
                        if r.reward is not None:
                            bd.append(r.reward)
                        be.append(r.accepted / k)
                    pos += r.emitted
        out[name] = {"bd": metrics.reward_stats(bd), "be": metrics.reward_stats(be)}
    return out


def summarize(
    results: Results,
    questions: list[Question],
    methods: list[str],
    drafters: list[str],
    tables: dict[int, list[AcceptanceTable]],
    paths: dict[int, list[OraclePath]],
    config: dict,
) -> dict:
    """The run's `summary.json`: per method its speed, speedup over `ar` and acceptance overall and per group, its
    regret against the oracles' tables and paths, and every output that differs from `ar`'s."""
    groups = [g for g in GROUPS if any(q.group == g for q in questions)]
    groups += [g for g in dict.fromkeys(q.group for q in questions) if g not in GROUPS]  # e.g. the drift kinds
    by_group = {g: [q for q in questions if q.group == g] for g in groups}
    diffs = mismatches(results)
    bad_turns = {(d["method"], d["question_id"], d["turn"]) for d in diffs}

    def count(method: str, qs: list[Question]) -> int:
        ids = {q.question_id for q in qs}
        return sum(1 for (m, qid, _) in bad_turns if m == method and qid in ids)

    summary_methods: dict[str, dict] = {}
    for method in methods:
        if method in DERIVED:
            continue
        records = results[method]
        entry = {
            "label": label(method),
            "overall": _group_metrics(
                [records[q.question_id] for q in questions],
                [results["ar"][q.question_id] for q in questions],
                count(method, questions),
                is_engine_method(method),
            ),
            "groups": {
                g: _group_metrics(
                    [records[q.question_id] for q in qs],
                    [results["ar"][q.question_id] for q in qs],
                    count(method, qs),
                    is_engine_method(method),
                )
                for g, qs in by_group.items()
            },
        }
        summary_methods[method] = entry

    regrets = _regrets(results, methods, drafters, tables, paths, by_group, questions, bad_turns)
    for method, entry in regrets.items():
        for scope, values in entry.items():
            target = summary_methods[method]["overall" if scope == "overall" else "groups"]
            (target if scope == "overall" else target[scope]).update(values)

    oracle_choice: dict[str, str] = {}
    if "oracle-category" in methods:
        oracle_choice = _oracle_category(results, summary_methods, drafters, questions, by_group, count)

    summary = {
        "config": config,
        "groups": groups,
        "questions": [
            {"question_id": q.question_id, "category": q.category, "group": q.group, "turns": len(q.turns)}
            for q in questions
        ],
        "methods": summary_methods,
        "oracle_category": {"choice": oracle_choice},
        "oracle_round": _hindsight(paths, by_group, questions),
        "reward_stats": _reward_stats(results, drafters, config["draft_len"], config["max_new_tokens"]),
        "correctness": {
            "mismatches": len(diffs),
            "compared_turns": sum(len(r.turns) for m, rs in results.items() if m != "ar" for r in rs.values()),
            "details": diffs,
        },
    }
    summary["shares"] = _shares(summary_methods, methods)
    summary["draft_lengths"] = _draft_lengths(results, methods)
    return summary


CONTINUED = " + continuation"  # the draft-length row of a model drafter's continued rounds


def _draft_lengths(results: Results, methods: list[str]) -> dict:
    """Per policy and drafter: how many rounds sent k = 0, 1, 2, ... drafted tokens ("-" = plain target steps;
    a model drafter's rounds continued by a free drafter count apart, under CONTINUED after its name)."""
    out: dict[str, dict[str, dict[int, int]]] = {}
    for method in methods:
        if not is_policy(method) or method not in results:
            continue
        counts: dict[str, dict[int, int]] = {}
        for record in results[method].values():
            for turn in record.turns:
                for r in turn.rounds or []:
                    row = counts.setdefault((r.drafter or "-") + (CONTINUED if r.extended else ""), {})
                    row[r.drafted] = row.get(r.drafted, 0) + 1
        out[method] = {d: dict(sorted(row.items())) for d, row in counts.items()}
    return out


def _regrets(results, methods, drafters, tables, paths, by_group, questions, bad_turns) -> dict:
    out: dict[str, dict] = {}
    for method in methods:
        if not uses_drafters(method) or method not in results:
            continue
        per_scope: dict[str, dict] = {}
        for scope, qs in [("overall", questions), *by_group.items()]:
            total, rounds, extra, disagree, turns = 0, 0, 0, 0, 0
            for q in qs:
                for t, turn in enumerate(results[method][q.question_id].turns):
                    if (method, q.question_id, t + 1) in bad_turns or q.question_id not in tables:
                        continue  # another context than the reference: regret is undefined there
                    reg: Regret = regret(tables[q.question_id][t], turn.rounds or [], drafters)
                    total += reg.total
                    rounds += len(reg.per_round)
                    disagree += reg.disagreements
                    extra += len(turn.rounds or []) - paths[q.question_id][t].rounds
                    turns += 1
            per_scope[scope] = {
                "regret_tokens": total,
                "regret_per_round": round(total / rounds, 4) if rounds else None,
                "extra_rounds_vs_oracle": extra if turns else None,
                "oracle_table_disagreements": disagree,
            }
        out[method] = per_scope
    return out


def _oracle_category(results, summary_methods, drafters, questions, by_group, count) -> dict[str, str]:
    """Per group, the fixed drafter with the best tokens/s there; its records stand in for that group."""
    choice: dict[str, str] = {}
    chosen: dict[int, QuestionRecord] = {}
    for g, qs in by_group.items():
        best = max((f"fixed:{d}" for d in drafters), key=lambda m: summary_methods[m]["groups"][g]["tokens_per_second"])
        choice[g] = best
        for q in qs:
            chosen[q.question_id] = results[best][q.question_id]

    def bad(qs: list[Question]) -> int:
        return sum(count(choice[q.group], [q]) for q in qs)

    entry = {
        "label": "oracle-category",
        "overall": _group_metrics(
            [chosen[q.question_id] for q in questions],
            [results["ar"][q.question_id] for q in questions],
            bad(questions),
            True,
        ),
        "groups": {
            g: _group_metrics(
                [chosen[q.question_id] for q in qs], [results["ar"][q.question_id] for q in qs], bad(qs), True
            )
            for g, qs in by_group.items()
        },
    }
    entry["overall"]["choice"] = choice
    for g in by_group:
        entry["groups"][g]["choice"] = choice[g]
    summary_methods["oracle-category"] = entry
    return choice


def _hindsight(paths: dict[int, list[OraclePath]], by_group, questions) -> dict:
    """The oracle's own walk: rounds and mean accepted tokens in hindsight (the replay measures its time)."""

    def scope(qs):
        walks = [p for q in qs for p in paths.get(q.question_id, [])]
        if not walks:
            return None
        accepted = [a + 1 for p in walks for a in p.accepted]
        return {"rounds": len(accepted), "mean_accepted_tokens": round(metrics.mean_accepted_tokens(accepted), 4)}

    return {"hindsight": {"overall": scope(questions), **{g: scope(qs) for g, qs in by_group.items()}}}


def _shares(summary_methods: dict, methods: list[str]) -> dict:
    """How much of each oracle's speedup and mean accepted tokens every policy and fixed drafter reaches."""
    out = {}
    oracles = {o: summary_methods[o] for o in ("oracle-category", "oracle-round") if o in summary_methods}
    for method in methods:
        if not (is_policy(method) or method.startswith("fixed:")) or method not in summary_methods:
            continue
        row = {}
        for oracle, entry in oracles.items():
            scopes = {"overall": (summary_methods[method]["overall"], entry["overall"])}
            scopes.update({g: (summary_methods[method]["groups"][g], entry["groups"][g]) for g in entry["groups"]})
            row[oracle] = {
                s: {
                    "speedup": _r(metrics.share(m["speedup"], o["speedup"])),
                    "mean_accepted_tokens": _r(metrics.share(m["mean_accepted_tokens"], o["mean_accepted_tokens"])),
                }
                for s, (m, o) in scopes.items()
            }
        out[method] = row
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
