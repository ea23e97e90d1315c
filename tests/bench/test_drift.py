"""The drift workload of `metasd bench --drift`: construction from the seed, the boundary, the per-request summary and
its report section on synthetic records (no model), and the CLI's checks (which fail before any model loads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metasd.bench.drift import (
    KINDS,
    MARKER,
    boundary_token,
    drift_requests,
    summarize_drift,
    write_prompts,
)
from metasd.bench.plots import drafter_picks, drift_boundaries, mark_boundary
from metasd.bench.questions import Question, load_questions
from metasd.bench.report import _drift
from metasd.bench.runners import QuestionRecord, TurnRecord
from metasd.cli import main
from metasd.stats import Round


@pytest.fixture(scope="module")
def spec_bench(questions_path: Path) -> list[Question]:
    return load_questions(questions_path)


def test_drift_prompts_are_reproducible_from_the_seed(spec_bench, tmp_path: Path) -> None:
    first = drift_requests(spec_bench, seed=0, per_kind=4)
    assert drift_requests(spec_bench, seed=0, per_kind=4) == first
    assert [r.question.turns for r in drift_requests(spec_bench, seed=1, per_kind=4)] != [
        r.question.turns for r in first
    ]
    assert [r.kind for r in first] == [k for k in KINDS for _ in range(4)]
    ids = [r.question.question_id for r in first]
    assert len(set(ids)) == len(ids) and min(ids) > max(q.question_id for q in spec_bench)
    # a subset of kinds draws the same requests for those kinds
    only = drift_requests(spec_bench, seed=0, per_kind=4, kinds=["drift-translation"])
    assert only == [r for r in first if r.kind == "drift-translation"]
    write_prompts(tmp_path / "p.jsonl", first)
    lines = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [x["prompt"] for x in lines] == [r.question.turns[0] for r in first]
    assert lines[0]["marker"] == MARKER and set(lines[0]["first"]) == {"question_id", "category"}


def test_drift_prompts_contain_both_tasks(spec_bench) -> None:
    by_id = {q.question_id: q for q in spec_bench}
    for r in drift_requests(spec_bench, seed=3, per_kind=5):
        prompt = r.question.turns[0]
        a, b = by_id[r.first[0]], by_id[r.second[0]]
        assert r.question.category == r.kind and r.question.group == r.kind
        assert MARKER in prompt and prompt.index("## Request 1") < prompt.index("## Request 2")
        assert a.turns[0].strip() in prompt
        if r.kind == "drift-translation":
            assert a.category == "translation" and b.category == "summarization"
            assert "Translate German to English:" in prompt and "Translate English to German:" in prompt
            english = prompt.split("Translate English to German:")[1].split("\n")[0].strip()
            assert 20 < len(english) <= 300 and english in b.turns[0]
        else:
            assert a.category in ("summarization", "rag")
            assert b.category == ("math_reasoning" if r.kind == "drift-copy-math" else "coding")
            assert b.turns[0].strip() in prompt


def test_drift_requests_reject_bad_input(spec_bench) -> None:
    with pytest.raises(ValueError, match="unknown drift kind"):
        drift_requests(spec_bench, kinds=["mt_bench"])
    with pytest.raises(ValueError, match="per-category"):
        drift_requests(spec_bench, per_kind=0)
    with pytest.raises(ValueError, match="no coding questions"):
        drift_requests([q for q in spec_bench if q.category != "coding"])


def _decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_boundary_token_finds_the_marker() -> None:
    text = "## Answer 1\nsummary here\n## Answer 2\n42"
    ids = [ord(c) for c in text]
    assert boundary_token(_decode, ids) == text.index(MARKER)
    assert boundary_token(_decode, ids[: text.index(MARKER) + 3]) is None  # marker cut off
    assert boundary_token(_decode, []) is None
    # multi-character tokens: the marker starts inside token 2
    pieces = ["abc", "de#", "# Answer 2", "x"]
    assert boundary_token(lambda ids: "".join(pieces[i] for i in ids), [0, 1, 2, 3], "## Answer 2") == 1


def _turn(tokens: int, wall: float, rounds: list[Round] | None) -> TurnRecord:
    return TurnRecord([1, 2], list(range(tokens)), "", wall, [r.emitted for r in rounds or []] or [1] * tokens, rounds)


def _rounds(plan: list[tuple[str, int]]) -> list[Round]:
    return [Round(d, 5, n - 1, 0.5, 0, 0.0, 0.0, 0.0, n) for d, n in plan]


def test_summarize_drift_report_and_plot_on_synthetic_records(tmp_path: Path) -> None:
    q = Question(1_000_000, "drift-copy-math", ("prompt",))
    from metasd.bench.drift import DriftRequest

    req = DriftRequest(q, "drift-copy-math", (5, "summarization"), (7, "math_reasoning"))
    text = "aaaa" + MARKER + "bbbb"
    ar = TurnRecord([1], [ord(c) for c in text], text, 2.0, [1] * len(text), _rounds([(None, 1)] * len(text)))
    n = len(text)
    results = {
        "ar": {q.question_id: QuestionRecord(q, [ar])},
        "fixed:ngram": {q.question_id: QuestionRecord(q, [_turn(n, 1.0, _rounds([("ngram", 1)] * n))])},
        "fixed:suffix": {q.question_id: QuestionRecord(q, [_turn(n, 1.6, _rounds([("suffix", 1)] * n))])},
        "oracle-round": {q.question_id: QuestionRecord(q, [_turn(n, 0.8, _rounds([("ngram", 4), ("suffix", 15)]))])},
        # picks ngram for the first 4 tokens, then suffix from the boundary (token 4) on
        "ducb": {
            q.question_id: QuestionRecord(q, [_turn(n, 0.9, _rounds([("ngram", 2), ("ngram", 2), ("suffix", 15)]))])
        },
    }
    methods = ["ar", "fixed:ngram", "fixed:suffix", "oracle-round", "ducb"]
    d = summarize_drift([req], results, methods, _decode)
    row = d["requests"][0]
    assert row["boundary_token"] == 4 and d["with_boundary"] == 1
    assert row["static_router"] == "fixed:ngram"
    assert row["vs_ar"]["ducb"] == pytest.approx(2.0 / 0.9, abs=1e-3)
    assert row["vs_static_router"]["ducb"] == pytest.approx(1.0 / 0.9, abs=1e-3)
    assert row["vs_oracle_round"]["ducb"] == pytest.approx(0.8 / 0.9, abs=1e-3)
    assert row["picks"]["ducb"] == {"1": {"ngram": 2}, "2": {"suffix": 1}}
    assert d["overall"]["ducb"]["vs_static_router"] == pytest.approx(1.0 / 0.9, abs=1e-3)
    summary = {
        "drift": d,
        "config": {"drafters": ["ngram", "suffix"]},
        "questions": [{"question_id": q.question_id, "group": q.group}],
        "methods": dict.fromkeys(methods),
    }
    report = "\n".join(_drift(summary))
    assert "## Drift within a request" in report and "Speed relative to the static router" in report
    assert "| `ducb` | 1.11 | 1.11 |" in report  # one request, so overall equals it
    assert "| `ducb` | 100% | 0% | 0% | 100% |" in report  # picks before / after the boundary
    # the drafter-picks plot marks the boundary on each picker's row, at the round holding token 4
    marks = []

    class Axes:
        def plot(self, xs, ys, **kwargs):
            marks.append((xs[0], round(sum(ys) / 2)))

    mark_boundary(Axes(), [results[m][q.question_id].turns[0].rounds for m in ("ducb", "oracle-round")], 4)
    assert marks == [(2, 0), (1, 1)]
    assert drift_boundaries(summary) == {q.question_id: 4}
    path = tmp_path / "picks.png"
    assert drafter_picks(results, summary, ["ngram", "suffix"], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a pool as large as the specialists preset's (10 drafters) once overran the plot's 8 colours
    many = ["ngram", "suffix", *(f"datastore:d{i}" for i in range(10))]
    assert drafter_picks(results, summary, many, tmp_path / "many.png")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--categories", "mt_bench"], "unknown drift kind"),
        (["--per-category", "0"], "per-category"),
        (["--methods", "ar,ducb:2"], "gamma must be in"),
    ],
)
def test_drift_cli_errors(args: list[str], message: str, questions_path: Path, tmp_path: Path, capsys) -> None:
    code = main(["bench", "--drift", "--questions", str(questions_path), "--out", str(tmp_path), *args])
    assert code == 2
    assert message in capsys.readouterr().err
