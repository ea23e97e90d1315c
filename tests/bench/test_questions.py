"""`metasd bench`'s inputs: questions, methods, answer files, and the CLI's errors before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from metasd.bench.answers import answer_line
from metasd.bench.methods import POLICIES, default_methods, file_stem, label, resolve_methods
from metasd.bench.questions import Question, load_questions, select_questions
from metasd.bench.runners import QuestionRecord, TurnRecord
from metasd.bench.summary import first_difference, mismatches
from metasd.cli import main
from metasd.cli.bench import _list

# --- questions, methods, answers --------------------------------------------------------------------------------


def test_load_and_select_questions(questions_path: Path) -> None:
    questions = load_questions(questions_path)
    assert len(questions) == 39  # tests/data/questions.jsonl: 13 categories x 3
    picked = select_questions(questions, ["mt_bench", "qa"], 2)
    assert [q.category for q in picked] == ["writing", "roleplay", "qa", "qa"]
    assert [q.group for q in picked] == ["mt_bench", "mt_bench", "qa", "qa"]
    assert len(picked[0].turns) == 2
    everything = select_questions(questions)
    assert len(everything) == 39
    with pytest.raises(ValueError, match="unknown category 'poetry'"):
        select_questions(questions, ["poetry"])
    with pytest.raises(ValueError, match="per-category"):
        select_questions(questions, ["qa"], 0)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "holds no questions"),
        ('{"question_id": 1, "category": "qa", "turns": ["hi"]}\nnot json\n', ":2: not JSON"),
        ("[1, 2]\n", "expected a JSON object"),
        ('{"question_id": "1", "category": "qa", "turns": ["hi"]}\n', "'question_id' must be an integer"),
        ('{"question_id": 1, "turns": ["hi"]}\n', "'category'"),
        ('{"question_id": 1, "category": "qa", "turns": []}\n', "'turns'"),
        (
            '{"question_id": 1, "category": "qa", "turns": ["a"]}\n'
            '{"question_id": 1, "category": "qa", "turns": ["b"]}\n',
            "appears twice",
        ),
    ],
)
def test_malformed_questions_file(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_questions(path)


def test_missing_questions_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="questions file not found"):
        load_questions(tmp_path / "nope.jsonl")


def test_resolve_methods() -> None:
    pool = ["ngram", "suffix"]
    assert default_methods(pool) == [
        "ar",
        "hf-ar",
        "hf-pld",
        "fixed:ngram",
        "fixed:suffix",
        *POLICIES,
        "oracle-round",
        "oracle-category",
    ]
    assert POLICIES[:6] == ("metasd-ucb", "ucb-be", "exp3", "sequential-halving", "random", "round-robin")
    assert "hf-assisted" in default_methods(["ngram", "lm:/m/small.gguf"])
    assert resolve_methods(["metasd-ucb", "hf-pld"], pool) == ["ar", "metasd-ucb", "hf-pld"]
    # oracle-category brings the fixed runs it is made of; specs map to pool names
    assert resolve_methods(["oracle-category"], ["ngram", "early-exit:7"], {"early-exit": "early-exit:7"}) == [
        "ar",
        "fixed:ngram",
        "fixed:early-exit:7",
        "oracle-category",
    ]
    assert resolve_methods(["fixed:early-exit"], ["early-exit:7"], {"early-exit": "early-exit:7"}) == [
        "ar",
        "fixed:early-exit:7",
    ]
    with pytest.raises(ValueError, match="unknown method 'turbo'"):
        resolve_methods(["turbo"], pool)
    with pytest.raises(ValueError, match="hf-assisted"):
        resolve_methods(["hf-assisted"], pool)
    with pytest.raises(ValueError, match="not in the pool"):
        resolve_methods(["fixed:lm:x"], pool)
    with pytest.raises(ValueError, match="beta"):
        resolve_methods(["metasd-ucb:-1"], pool)
    with pytest.raises(ValueError, match="at least one drafter"):
        resolve_methods(None, [])
    assert label("fixed:lm:/a/b/qwen-0.5b.gguf") == "fixed:lm:qwen-0.5b"
    assert label("fixed:lm:/a/b/qwen-0.5b.gguf:unquantized") == "fixed:lm:qwen-0.5b:unquantized"
    assert label("lm:Qwen/Qwen2.5-0.5B:int8") == "lm:Qwen2.5-0.5B:int8"
    # --methods: a method with several parameters keeps its commas
    assert _list("ar, metasd-adaptive:spread=0,prior=5,beta=0.1,fixed:ngram,") == [
        "ar",
        "metasd-adaptive:spread=0,prior=5,beta=0.1",
        "fixed:ngram",
    ]
    assert resolve_methods(_list("metasd-adaptive:spread=0,prior=5,beta=0.1"), pool) == [
        "ar",
        "metasd-adaptive:spread=0,prior=5,beta=0.1",
    ]
    assert file_stem("fixed:lm:/a/b/qwen-0.5b.gguf") == "fixed-lm-qwen-0.5b"


def test_answer_line_and_mismatches() -> None:
    q = Question(7, "writing", ("a", "b"))
    turns = [TurnRecord([1], [5, 6, 2], "x", 0.5, [2, 1]), TurnRecord([1], [7], "y", 0.25, [1])]
    line = answer_line("fixed:ngram", QuestionRecord(q, turns))
    assert line["question_id"] == 7 and line["category"] == "writing"
    choice = line["choices"][0]
    assert choice["turns"] == ["x", "y"] and choice["new_tokens"] == [3, 1] and choice["wall_time"] == [0.5, 0.25]
    assert choice["accept_lengths"] == [2, 1, 1] and choice["decoding_steps"] == [2, 1]
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    other = QuestionRecord(q, [TurnRecord([1], [5, 6, 2], "x", 0.4, [3]), TurnRecord([1], [8], "z", 0.1, [1])])
    diffs = mismatches({"ar": {7: QuestionRecord(q, turns)}, "m": {7: other}})
    assert diffs == [
        {"method": "m", "question_id": 7, "turn": 2, "first_difference": 0, "tokens": 1, "reference_tokens": 1}
    ]


# --- the CLI: errors before any model loads ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--questions", "/nonexistent/question.jsonl"], "questions file not found"),
        (["--categories", "poetry"], "unknown category 'poetry'"),
        (["--methods", "ar,turbo"], "unknown method 'turbo'"),
        (["--methods", "hf-assisted"], "needs an lm:"),
        (["--max-new-tokens", "0"], "max-new-tokens must be an integer >= 1"),
        (["--preset", "qwen-coder", "--models-dir", "/nonexistent"], "Qwen/Qwen2.5-Coder-1.5B-Instruct"),
        (["--preset", "specialists", "--models-dir", "/nonexistent"], "scripts/build_specialists.py"),
    ],
)
def test_cli_errors(args: list[str], message: str, questions_path: Path, tmp_path: Path, capsys) -> None:
    if "--questions" not in args:
        args = ["--questions", str(questions_path), *args]
    assert main(["bench", *args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
