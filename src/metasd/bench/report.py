"""`report.md`: the tables a reader needs, all taken from summary.json."""

from __future__ import annotations

from .methods import is_policy, label
from .summary import CONTINUED


def _fmt(x, digits: int = 2, pct: bool = False) -> str:
    if x is None:
        return "–"
    if pct:
        return f"{100 * x:.{digits}f}%"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"
    lines = ["| " + " | ".join(header) + " |", rule]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines + [""]


def _per_group(summary: dict, key: str, digits: int = 2) -> list[str]:
    groups = summary["groups"]
    rows = []
    for method, entry in summary["methods"].items():
        cells = [_fmt(entry["groups"][g][key], digits) for g in groups] + [_fmt(entry["overall"][key], digits)]
        rows.append([f"`{label(method)}`", *cells])
    return _table(["method", *groups, "overall"], rows)


def render(summary: dict, plots: list[str]) -> str:
    """report.md: the run's header, then one section per table, from summary.json's content and the plot files."""
    out = [
        *_header(summary),
        *_correctness(summary),
        *_per_group_section(
            summary,
            "Speedup over `ar`",
            "speedup",
            intro="Spec-Bench's definition: mean tokens/s of the method over `ar`'s on the same questions.",
        ),
        *_per_group_section(
            summary,
            "Mean accepted tokens",
            "mean_accepted_tokens",
            intro="Tokens per target forward (accepted draft tokens + 1), pooled over rounds.",
        ),
        *_per_group_section(summary, "Tokens per second", "tokens_per_second", 1),
        *_oracles(summary),
        *_oracle_shares(summary),
        *_engine(summary),
        *_rewards(summary),
        *_target_cost(summary),
        *_draft_lengths(summary),
    ]
    if summary.get("drift"):
        out += _drift(summary)
    if plots:
        out += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(line for line in out) + "\n"


def _header(summary: dict) -> list[str]:
    """The title and what was run: command, models, questions, software, machine and where the time went."""
    c = summary["config"]
    out = ["# metasd bench", ""]
    weights = c.get("drafter_weights", {})
    pool = ", ".join(f"`{label(d)}`" + (f" (weights: {weights[d]})" if d in weights else "") for d in c["drafters"])
    out += [
        f"- command: `{c['command']}`" if c.get("command") else "",
        f"- target `{c['target']}`, dtype {c['dtype']}, device {c.get('device', 'cpu')}, drafters {pool}, "
        f"draft length k = {c['draft_len']}, max new tokens {c['max_new_tokens']}, greedy",
        f"- {len(summary['questions'])} questions ({c['turns']} turns) from `{c['questions_file']}`: "
        + ", ".join(f"{g} {sum(q['group'] == g for q in summary['questions'])}" for g in summary["groups"]),
        f"- {c['threads']} torch threads on {c['cpus']} CPUs; torch {c['torch']}, "
        f"transformers {c['transformers']}; seed {c['seed']}; policy scope {c['policy_scope']}"
        + (f"; fastest of {c['repeat']} passes per question and method" if c.get("repeat", 1) > 1 else ""),
        f"- run wall time {c['wall_time_s']:.0f} s (model load {c['load_s']:.0f} s, warm-up {c['warmup_s']:.0f} s, "
        f"measured runs and oracle tables {c['measure_s']:.0f} s); load average at start / end "
        f"{c['loadavg_start']} / {c['loadavg_end']} (other processes on the machine skew absolute speeds)",
        "",
    ]
    return out


def _correctness(summary: dict) -> list[str]:
    """Every method's outputs against `ar`'s: the mismatch count, and where each mismatch starts."""
    corr = summary["correctness"]
    out = [
        "## Correctness",
        "",
        f"Greedy outputs of every method compared token for token with `ar`: {corr['compared_turns']} turns, "
        f"**{corr['mismatches']} mismatches**.",
        "",
    ]
    if corr["details"]:
        out += _table(
            ["method", "question", "turn", "first differing token", "tokens", "ar tokens"],
            [
                [
                    f"`{label(d['method'])}`",
                    str(d["question_id"]),
                    str(d["turn"]),
                    str(d["first_difference"]),
                    str(d["tokens"]),
                    str(d["reference_tokens"]),
                ]
                for d in corr["details"]
            ],
        )
    return out


def _per_group_section(summary: dict, title: str, key: str, digits: int = 2, intro: str | None = None) -> list[str]:
    """A section of one metric per method and Spec-Bench group (speedup, mean accepted tokens, tokens/s)."""
    out = [f"## {title}", ""]
    if intro is not None:
        out += [intro, ""]
    return out + _per_group(summary, key, digits)


def _oracles(summary: dict) -> list[str]:
    """What `oracle-category` chose per group and how `oracle-round`'s hindsight plan is made."""
    out: list[str] = []
    choice = summary["oracle_category"]["choice"]
    if choice:
        out += [
            "## Oracles",
            "",
            "`oracle-category` takes, per group, the fixed drafter with the best tokens/s there: "
            + ", ".join(f"{g} → `{label(m)}`" for g, m in choice.items())
            + ".",
            "",
        ]
    hind = summary["oracle_round"]["hindsight"].get("overall")
    if hind and "oracle-round" in summary["methods"]:
        out += [
            "`oracle-round` is the fastest per-round schedule in hindsight: every round a drafter and a draft "
            "length (0: a plain step), chosen by dynamic programming over the true context to minimise the time "
            "under this machine's measured T(M), drafter and per-round costs; each draft is one that is fully "
            f"accepted (hindsight walk: {hind['rounds']} rounds, mean accepted tokens "
            f"{hind['mean_accepted_tokens']:.2f}). Its row above is the replay of that plan through the engine, "
            "timed. It may draft as long as the longest draft of any method in this run.",
            "",
        ]
    return out


def _oracle_shares(summary: dict) -> list[str]:
    """How much of each oracle's speedup and accepted length each method reaches, overall and (policies) per group."""
    shares = summary["shares"]
    if not shares:
        return []
    methods = summary["methods"]
    header = [
        "method",
        "speedup",
        "of oracle-category",
        "of oracle-round",
        "mean acc. tokens",
        "of oracle-round MAT",
        "regret / round",
        "extra rounds vs oracle",
    ]
    rows = []
    for method, row in shares.items():
        o = methods[method]["overall"]
        oc = row.get("oracle-category", {}).get("overall", {})
        orr = row.get("oracle-round", {}).get("overall", {})
        rows.append(
            [
                f"`{label(method)}`",
                _fmt(o["speedup"]),
                _fmt(oc.get("speedup"), 1, True),
                _fmt(orr.get("speedup"), 1, True),
                _fmt(o["mean_accepted_tokens"]),
                _fmt(orr.get("mean_accepted_tokens"), 1, True),
                _fmt(o.get("regret_per_round")),
                _fmt(o.get("extra_rounds_vs_oracle")),
            ]
        )
    out = [
        "## Share of the oracles each policy reaches (overall)",
        "",
        "Regret per round: the best drafter's accepted length at that round's position minus the chosen "
        "drafter's (tokens). Extra rounds: target forwards beyond the oracle's hindsight walk.",
        "",
    ]
    out += _table(header, rows)
    groups = summary["groups"]
    for oracle in ("oracle-category", "oracle-round"):
        policy_rows = [
            [
                f"`{label(m)}`",
                *(_fmt(r[oracle][g]["speedup"], 1, True) for g in groups),
                _fmt(r[oracle]["overall"]["speedup"], 1, True),
            ]
            for m, r in shares.items()
            if is_policy(m) and oracle in r
        ]
        if policy_rows:
            out += [f"Share of `{oracle}`'s speedup per group:", ""]
            out += _table(["policy", *groups, "overall"], policy_rows)
    return out


def _engine(summary: dict) -> list[str]:
    """The engine's rounds per method: drafter shares, switches, catch-up, where the time went, table agreement."""
    drafters = summary["config"]["drafters"]
    engine_rows = []
    for m, e in summary["methods"].items():
        o = e["overall"]
        if o["switches"] is None or m == "oracle-category":
            continue
        picked = sum(o["drafter_rounds"].values())
        shares = [_fmt(o["drafter_rounds"].get(d, 0) / picked, 0, True) if picked else "–" for d in drafters]
        engine_rows.append(
            [
                f"`{label(m)}`",
                _fmt(o["rounds"]),
                *shares,
                _fmt(o["switches"]),
                _fmt(o["catch_up_tokens"]),
                _fmt(o["draft_time_share"], 1, True),
                _fmt(o["verify_time_share"], 1, True),
                _fmt(o["policy_overhead"], 3, True),
                _fmt(o.get("oracle_table_disagreements")),
            ]
        )
    out = [
        "## Engine bookkeeping (overall)",
        "",
        "Drafter columns: share of drafting rounds given to each drafter. Draft / verify / policy: share of wall "
        "time spent drafting (catch-up included), in the target's forward, and in select/update/reward. Table "
        "disagreements: rounds where the engine's acceptance differs from the oracle table's (float numerics of "
        "a drafter's cache), expected 0.",
        "",
    ]
    out += _table(
        [
            "method",
            "rounds",
            *(f"{label(d)}" for d in drafters),
            "switches",
            "catch-up tokens",
            "draft",
            "verify",
            "policy",
            "table disagreements",
        ],
        engine_rows,
    )
    return out


def _rewards(summary: dict) -> list[str]:
    """The BD and BE reward statistics of each drafter's fixed run (the paper's Table 2)."""
    rewards = summary["reward_stats"]
    if not rewards:
        return []
    rows = [
        [
            f"`{label(d)}`",
            _fmt(s["bd"]["n"]),
            _fmt(s["bd"]["mean"], 3),
            _fmt(s["bd"]["var"], 4),
            _fmt(s["bd"]["zero_rate"], 1, True),
            _fmt(s["be"]["mean"], 3),
            _fmt(s["be"]["var"], 4),
            _fmt(s["be"]["zero_rate"], 1, True),
        ]
        for d, s in rewards.items()
    ]
    out = [
        "## Reward statistics per drafter (the paper's Table 2)",
        "",
        "From each drafter's fixed run: BD (block divergence, the mean of 1 − TV over the k drafted positions) "
        "and BE (block efficiency, accepted / k) of the same rounds. Zero: reward ≤ 1e-6.",
        "",
    ]
    out += _table(["drafter", "rounds", "BD mean", "BD var", "BD zero", "BE mean", "BE var", "BE zero"], rows)
    return out


def _drift(summary: dict) -> list[str]:
    """The drift workload (bench/drift.py): per request, each method against ar, the static router and oracle-round."""
    d = summary["drift"]
    rows = d["requests"]
    if not rows:
        return []
    out = [
        "## Drift within a request",
        "",
        f"Each request asks two tasks in one turn (prompts in `{d.get('prompts_file', 'drift_prompts.jsonl')}`); "
        f"the boundary is the output token where `{d['marker']}` starts in `ar`'s output ({d['with_boundary']} of "
        f"{len(rows)} requests have one; – where the model never wrote the marker). Static router: the fixed "
        "drafter with the best tokens/s on that request, in hindsight (a per-request `oracle-category`).",
        "",
    ]
    out += _table(
        ["request", "kind", "request 1", "request 2", "boundary / tokens", "static router"],
        [
            [
                str(r["question_id"]),
                r["kind"],
                f"{r['first']['category']} {r['first']['question_id']}",
                f"{r['second']['category']} {r['second']['question_id']}",
                f"{_fmt(r['boundary_token'])} / {r['new_tokens']}",
                f"`{label(r['static_router'] or '–')}`",
            ]
            for r in rows
        ],
    )
    methods = [m for m in d["overall"] if m != "ar"]
    for key, title in (
        ("vs_ar", "Speedup over `ar`"),
        ("vs_static_router", "Speed relative to the static router"),
        ("vs_oracle_round", "Speed relative to `oracle-round`"),
    ):
        if all(r[key] is None for r in rows):
            continue
        table = [
            [f"`{label(m)}`", *(_fmt((r[key] or {}).get(m)) for r in rows), _fmt(d["overall"][m][key])] for m in methods
        ]
        out += [f"{title} per drift request (overall: ratio of mean tokens/s):", ""]
        out += _table(["method", *(str(r["question_id"]) for r in rows), "overall"], table)
    drafters = summary["config"]["drafters"]
    split = [r for r in rows if r["boundary_token"] is not None]
    if split:
        table = []
        for m in [m for m in methods if m in split[0]["picks"]]:
            cells = []
            for seg in ("1", "2"):
                counts = {dr: sum(r["picks"][m][seg].get(dr, 0) for r in split) for dr in drafters}
                total = sum(counts.values())
                cells += [_fmt(counts[dr] / total, 0, True) if total else "–" for dr in drafters]
            table.append([f"`{label(m)}`", *cells])
        out += ["Share of drafting rounds per drafter before (1) and after (2) the boundary, requests with one:", ""]
        out += _table(
            ["method", *(f"1: {label(dr)}" for dr in drafters), *(f"2: {label(dr)}" for dr in drafters)], table
        )
    return out


def _target_cost(summary: dict) -> list[str]:
    """The T(M) table the run decided with: as calibrated, at the end of the run, and the kernel chosen per M."""
    out: list[str] = []
    cost = summary["config"].get("target_cost_ms")
    if cost:
        cal, end = cost["calibrated"], cost["end_of_run"]
        out += [
            "## Target cost T(M)",
            "",
            "A cached target forward over M new tokens: calibrated at load (`metasd calibrate`), and as refined "
            "online from the run's rounds (these include the acceptance rule); the linear kernel calibration chose "
            "for each M (`linear_kernels.py`: `linear` is torch's own).",
            "",
        ]
        rows = [
            ["calibrated ms", *(_fmt(t, 1) for t in cal)],
            ["T(M)/T(1)", *(_fmt(t / cal[0]) for t in cal)],
            ["end of run ms", *(_fmt(t, 1) for t in end)],
            ["T(M)/T(1)", *(_fmt(t / end[0]) for t in end)],
        ]
        if cost.get("linear_kernels"):
            rows.append(["kernel", *cost["linear_kernels"][: len(cal)]])
        out += _table(["M", *map(str, range(1, len(cal) + 1))], rows)
        if cost.get("prefill_kernel"):
            out += ["", f"Longer inputs (prefills, wide batches) on `{cost['prefill_kernel']}`."]
    return out


def _draft_lengths(summary: dict) -> list[str]:
    """The draft lengths each policy chose per drafter: rounds, mean k and the distribution."""
    out: list[str] = []
    lengths = summary.get("draft_lengths") or {}
    rows = []
    for method, per_drafter in lengths.items():
        for drafter, hist in per_drafter.items():
            total = sum(hist.values())
            mean = sum(k * n for k, n in hist.items()) / total if total else 0.0
            name = drafter.removesuffix(CONTINUED)
            shown = "plain step" if drafter == "-" else f"`{label(name)}`" + drafter[len(name) :]
            rows.append(
                [f"`{label(method)}`", shown, str(total), _fmt(mean), ", ".join(f"{k}: {n}" for k, n in hist.items())]
            )
    if rows:
        out += [
            "## Draft lengths chosen",
            "",
            "Rounds per policy and drafter, the mean number of tokens sent for verification, and the "
            "distribution (k: rounds). A model drafter's rounds whose draft a free drafter continued "
            "(`+ continuation`) count apart, with the continuation in k.",
            "",
        ]
        out += _table(["policy", "drafter", "rounds", "mean k", "k: rounds"], rows)
    return out
