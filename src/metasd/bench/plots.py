"""PNG plots of a run (matplotlib's object API, no pyplot: no display and no global backend needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import ListedColormap, TwoSlopeNorm, to_hex
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .methods import is_policy, label
from .oracles import AcceptanceTable, regret
from .runners import QuestionRecord

if TYPE_CHECKING:
    from .load import LoadResult

STYLES = ["-", "--", "-.", ":"]  # lines often coincide (same picks): dashes keep each one visible
# matplotlib's tab20, its ten dark shades first: 20 distinct colours, enough for the specialists pool (10 drafters)
# and more; past 20 they repeat rather than fail
PALETTE = [to_hex(c) for c in (*colormaps["tab20"].colors[::2], *colormaps["tab20"].colors[1::2])]


def color(i: int) -> str:
    """The `i`-th line's colour, repeating after the palette's 20."""
    return PALETTE[i % len(PALETTE)]


def speedup_heatmap(summary: dict, path: Path) -> None:
    """Speedup over `ar` per Spec-Bench group (columns) and method (rows), numbers written in the cells."""
    methods = list(summary["methods"])
    cols = [*summary["groups"], "overall"]
    data = np.array(
        [
            [
                summary["methods"][m]["groups"][g]["speedup"]
                if g != "overall"
                else summary["methods"][m]["overall"]["speedup"]
                for g in cols
            ]
            for m in methods
        ]
    )
    fig = Figure(figsize=(1.1 * len(cols) + 3.2, 0.42 * len(methods) + 1.6), layout="constrained")
    ax = fig.add_subplot()
    lo, hi = min(float(data.min()), 0.99), max(float(data.max()), 1.01)
    image = ax.imshow(data, cmap="RdYlGn", norm=TwoSlopeNorm(vmin=lo, vcenter=1.0, vmax=hi), aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right")
    ax.set_yticks(range(len(methods)), [label(m) for m in methods])
    for i in range(len(methods)):
        for j in range(len(cols)):
            ax.text(j, i, f"{data[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.axvline(len(cols) - 1.5, color="black", linewidth=0.8)
    ax.set_title("Speedup over ar (ratio of mean tokens/s)")
    fig.colorbar(image, ax=ax, shrink=0.8, label="speedup")
    fig.savefig(path, dpi=110)


def showcase(results: dict[str, dict[int, QuestionRecord]], summary: dict, limit: int = 4) -> list[tuple[int, str]]:
    """The first question of up to `limit` different groups: (question id, group)."""
    picked, seen = [], set()
    known = drift_boundaries(summary)  # drift requests: prefer those whose boundary is known
    for q in sorted(summary["questions"], key=lambda q: q["question_id"] not in known):
        if q["group"] not in seen:
            seen.add(q["group"])
            picked.append((q["question_id"], q["group"]))
    return picked[:limit]


def _pickers(summary: dict) -> list[str]:
    return [m for m in summary["methods"] if is_policy(m) or m == "oracle-round"]


def drafter_picks(results, summary: dict, drafters: list[str], path: Path) -> bool:
    """Which drafter each policy picked, round by round (turn 1 of a few questions of different groups)."""
    cases = showcase(results, summary)
    methods = _pickers(summary)
    if not cases or not methods:
        return False
    colors = ListedColormap(["#dddddd", *(color(i) for i in range(len(drafters)))])
    fig = Figure(figsize=(11, 1.2 + 0.32 * len(methods) * len(cases) + 0.6 * len(cases)), layout="constrained")
    axes = fig.subplots(len(cases), 1, squeeze=False)[:, 0]
    for ax, (qid, group) in zip(axes, cases, strict=False):
        rows = []
        for m in methods:
            rounds = results[m][qid].turns[0].rounds or []
            rows.append([0 if r.drafter is None else drafters.index(r.drafter) + 1 for r in rounds])
        width = max(len(r) for r in rows)
        grid = np.ma.masked_all((len(rows), width))
        for i, r in enumerate(rows):
            grid[i, : len(r)] = r
        ax.imshow(grid, cmap=colors, vmin=-0.5, vmax=len(drafters) + 0.5, aspect="auto", interpolation="nearest")
        ax.set_yticks(range(len(methods)), [label(m) for m in methods], fontsize=8)
        title = f"question {qid} ({group}), turn 1"
        boundary = drift_boundaries(summary).get(qid)
        if boundary is not None:
            mark_boundary(ax, [results[m][qid].turns[0].rounds or [] for m in methods], boundary)
            title += f"; black bars: the round holding output token {boundary}, where the task changes"
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_xlabel("round")
    handles = [Patch(color=color(i), label=label(d)) for i, d in enumerate(drafters)]
    handles.append(Patch(color="#dddddd", label="no draft (a plain target step)"))
    fig.legend(handles=handles, loc="outside upper center", ncol=min(len(handles), 5), fontsize=8)
    fig.savefig(path, dpi=110)
    return True


def drift_boundaries(summary: dict) -> dict[int, int]:
    """Question id -> the output token where a drift request's second task starts (bench/drift.py), where known."""
    rows = (summary.get("drift") or {}).get("requests", [])
    return {r["question_id"]: r["boundary_token"] for r in rows if r["boundary_token"] is not None}


def mark_boundary(ax, round_logs: list, boundary: int) -> None:
    """On each row, a bar at the round whose output span holds token `boundary` (rows advance at their own pace)."""
    for row, rounds in enumerate(round_logs):
        pos = 0
        for index, r in enumerate(rounds):
            if pos + r.emitted > boundary:
                ax.plot([index, index], [row - 0.45, row + 0.45], color="black", linewidth=2.2)
                break
            pos += r.emitted


def cumulative_regret(
    results, summary: dict, drafters: list[str], tables: dict[int, list[AcceptanceTable]], path: Path
) -> bool:
    """Cumulative regret (tokens) against oracle-round, per policy, for the same showcase questions."""
    cases = [c for c in showcase(results, summary) if c[0] in tables]
    methods = [m for m in _pickers(summary) if m != "oracle-round"]
    if not cases or not methods:
        return False
    fig = Figure(figsize=(5.2 * min(len(cases), 2), 3.6 * ((len(cases) + 1) // 2) + 0.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots((len(cases) + 1) // 2, min(len(cases), 2), squeeze=False)).ravel()
    for ax, (qid, group) in zip(axes, cases, strict=False):
        for i, m in enumerate(methods):
            rounds = results[m][qid].turns[0].rounds or []
            curve = regret(tables[qid][0], rounds, drafters).cumulative
            ax.plot(
                range(1, len(curve) + 1),
                curve,
                label=label(m),
                color=color(i),
                linestyle=STYLES[i % len(STYLES)],
                linewidth=1.6,
            )
        ax.set_title(f"question {qid} ({group}), turn 1", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("cumulative regret (tokens)")
        ax.grid(alpha=0.3)
    for ax in axes[len(cases) :]:
        ax.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncol=min(len(labels), 6), fontsize=8)
    fig.savefig(path, dpi=110)
    return True


def acceptance_over_requests(results: Sequence[LoadResult], path: Path, window: int = 8) -> bool:
    """`serve-bench`'s mean accepted tokens per round of each response, in the order the responses arrived, as a
    moving mean over `window` responses: one line per setting and load (a head learning from the traffic should
    climb, a frozen one stay level). False where no response reported any."""
    curves = [r for r in results if r.acceptance]
    if not curves:
        return False
    fig = Figure(figsize=(7.0, 4.0), layout="constrained")
    ax = fig.subplots()
    for i, result in enumerate(curves):
        accepted = np.asarray(result.acceptance_in_order())
        width = max(1, min(window, len(accepted)))
        moving = np.convolve(accepted, np.ones(width) / width, mode="valid")
        ax.plot(
            range(width, len(accepted) + 1),
            moving,
            label=f"{result.setting}, {result.clients} clients",
            color=color(i),
            linestyle=STYLES[i % len(STYLES)],
            linewidth=1.6,
        )
    ax.set_xlabel("response, in the order answered")
    ax.set_ylabel(f"mean accepted tokens per round\n(moving mean over up to {window} responses)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return True


def write_plots(out: Path, results, summary: dict, drafters: list[str], tables) -> list[str]:
    """Write every plot into `out`; returns their file names."""
    speedup_heatmap(summary, out / "speedup.png")
    names = ["speedup.png"]
    if drafter_picks(results, summary, drafters, out / "drafter_picks.png"):
        names.append("drafter_picks.png")
    if cumulative_regret(results, summary, drafters, tables, out / "regret.png"):
        names.append("regret.png")
    return names
