"""`metasd bench`: arithmetic on known inputs, the drafters' shared history, and one small end-to-end run through
the CLI on the embedded model (2 categories x 1 question, few tokens). The oracles: test_oracles.py; questions,
methods and input errors: test_questions.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_oracles import Constant

from metasd.bench import metrics
from metasd.bench.history import DrafterHistory
from metasd.bench.methods import default_methods
from metasd.bench.questions import Question
from metasd.cli import main
from metasd.drafters.suffix import SuffixDrafter
from metasd.sampling import SamplingParams

# --- arithmetic -------------------------------------------------------------------------------------------------


def test_question_speed_sums_turns() -> None:
    assert metrics.question_speed([30, 10], [1.0, 1.0]) == pytest.approx(20.0)
    with pytest.raises(ValueError):
        metrics.question_speed([5], [0.0])


def test_speedup_is_a_ratio_of_mean_speeds() -> None:
    # method speeds 10 and 40 (mean 25) vs baseline 10 and 10: 2.5; the mean of per-question ratios would be 2.5 too,
    # so take unequal baselines where the two definitions differ: ratio of means 25 / 15 = 1.667, mean of ratios 2.5.
    assert metrics.speedup([10, 40], [10, 10]) == pytest.approx(2.5)
    assert metrics.speedup([10, 40], [10, 20]) == pytest.approx(25 / 15)
    with pytest.raises(ValueError):
        metrics.speedup([], [1.0])


def test_mean_accepted_tokens_pools_rounds() -> None:
    assert metrics.mean_accepted_tokens([1, 2, 3, 6]) == pytest.approx(3.0)
    assert metrics.mean_accepted_tokens([]) == 0.0
    with pytest.raises(ValueError):
        metrics.mean_accepted_tokens([1, 0])


def test_reward_stats() -> None:
    s = metrics.reward_stats([0.0, 0.5, 1.0, 0.0])
    assert s == {"n": 4, "mean": 0.375, "var": pytest.approx(0.171875), "zero_rate": 0.5}
    assert metrics.reward_stats([])["mean"] is None
    assert metrics.share(1.5, 2.0) == 0.75 and metrics.share(1.0, 0.0) is None


# --- history ----------------------------------------------------------------------------------------------------


def test_history_gives_every_method_the_same_suffix_index() -> None:
    suffix = SuffixDrafter(depth=4)
    history = DrafterHistory({"suffix": suffix, "model": Constant(runs_model=True), "free": Constant(runs_model=False)})
    assert list(history.stateful) == ["suffix"]  # only a drafter that learns across requests is snapshotted
    params = SamplingParams()
    answer = [11, 12, 13, 14, 15]
    history.advance([([1, 2], answer)])  # question 0 served: its answer joins the cross-request index
    history.restore()
    suffix.begin([3, 11])
    assert suffix.propose([3, 11], 4, params, None).tokens == [12, 13, 14, 15]
    suffix.begin([3, 21])  # a method's own run of question 1 (output 22 23 24) pollutes the index ...
    suffix.end([3, 21, 22, 23, 24])
    suffix.begin([5])
    assert suffix.propose([5, 22], 2, params, None).tokens == [23, 24]
    history.restore()  # ... and the next method starts from the same snapshot again
    suffix.begin([5])
    assert suffix.propose([5, 22], 2, params, None).tokens == []
    assert suffix.propose([5, 13], 2, params, None).tokens == [14, 15]


# --- end to end -------------------------------------------------------------------------------------------------


def speed_py(path: Path) -> tuple[list[float], list[int]]:
    """What Spec-Bench's evaluation/speed.py reads from an answer file: per-question speeds and accept lengths."""
    speeds, lengths = [], []
    for line in path.read_text().splitlines():
        choice = json.loads(line)["choices"][0]
        speeds.append(sum(choice["new_tokens"]) / sum(choice["wall_time"]))
        lengths.extend(choice["accept_lengths"])
    return speeds, lengths


@pytest.fixture(scope="module")
def small_run(embedded, questions_path: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    code = main(
        [
            "bench",
            "--questions",
            str(questions_path),
            "--categories",
            "writing,qa",
            "--per-category",
            "1",
            "--max-new-tokens",
            "10",
            "--drafters",
            "ngram,suffix",
            "--out",
            str(out),
            "--no-warmup",
            "--no-progress",
        ]
    )
    assert code == 0
    return out


def test_small_run_outputs(small_run: Path) -> None:
    summary = json.loads((small_run / "summary.json").read_text())
    expected = default_methods(["ngram", "suffix"])
    assert list(summary["methods"]) == expected
    assert summary["groups"] == ["mt_bench", "qa"]
    assert [q["category"] for q in summary["questions"]] == ["writing", "qa"]
    assert summary["correctness"]["mismatches"] == 0
    assert summary["correctness"]["compared_turns"] == 3 * (len(expected) - 2)  # every timed method but ar, 3 turns
    for method, entry in summary["methods"].items():
        assert entry["overall"]["mismatches"] == 0, method
        assert entry["overall"]["questions"] == 2 and entry["overall"]["turns"] == 3
        assert set(entry["groups"]) == {"mt_bench", "qa"}
        assert entry["overall"]["tokens_per_second"] > 0
    assert summary["methods"]["ar"]["overall"]["speedup"] == 1.0
    assert summary["methods"]["ar"]["overall"]["mean_accepted_tokens"] == 1.0
    assert summary["methods"]["hf-ar"]["overall"]["mean_accepted_tokens"] == 1.0
    for method in expected[3:-1]:  # the engine's drafter methods: regret against the oracle table is defined
        assert summary["methods"][method]["overall"]["oracle_table_disagreements"] == 0, method
    assert summary["methods"]["oracle-round"]["overall"]["regret_tokens"] == 0  # the replay follows the table
    hindsight = summary["oracle_round"]["hindsight"]["overall"]
    assert hindsight["mean_accepted_tokens"] == summary["methods"]["oracle-round"]["overall"]["mean_accepted_tokens"]
    assert set(summary["oracle_category"]["choice"]) == {"mt_bench", "qa"}
    assert set(summary["reward_stats"]) == {"ngram", "suffix"}
    assert set(summary["shares"]["metasd-ucb"]) == {"oracle-category", "oracle-round"}


def test_small_run_answer_files_read_like_spec_bench(small_run: Path) -> None:
    summary = json.loads((small_run / "summary.json").read_text())
    files = summary["answer_files"]
    assert set(files) == set(summary["methods"]) - {"oracle-category"}
    base, _ = speed_py(small_run / files["ar"])
    for method, name in files.items():
        lines = [json.loads(line) for line in (small_run / name).read_text().splitlines()]
        assert [x["question_id"] for x in lines] == [q["question_id"] for q in summary["questions"]]
        assert [len(x["choices"][0]["turns"]) for x in lines] == [2, 1]
        speeds, lengths = speed_py(small_run / name)
        overall = summary["methods"][method]["overall"]
        assert overall["speedup"] == pytest.approx(np.mean(speeds) / np.mean(base), abs=1e-4)
        assert overall["mean_accepted_tokens"] == pytest.approx(np.mean(lengths), abs=1e-4)


def test_small_run_report_and_plots(small_run: Path) -> None:
    report = (small_run / "report.md").read_text()
    assert "**0 mismatches**" in report
    for heading in (
        "## Speedup over `ar`",
        "## Mean accepted tokens",
        "## Share of the oracles",
        "## Reward statistics per drafter",
    ):
        assert heading in report
    for method in default_methods(["ngram", "suffix"]):
        assert f"| `{method}` |" in report
    for name in ("speedup.png", "drafter_picks.png", "regret.png"):
        data = (small_run / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


@pytest.mark.slow
def test_model_drafters_and_hf_assisted(embedded, questions_path: Path, tmp_path: Path) -> None:
    """early-exit and an lm: drafter (the target itself, unquantized) in the pool, so hf-assisted runs; a few
    minutes."""
    code = main(
        [
            "bench",
            "--questions",
            str(questions_path),
            "--categories",
            "summarization,coding",
            "--per-category",
            "1",
            "--max-new-tokens",
            "24",
            "--drafters",
            "ngram,early-exit:8,lm:embedded:unquantized",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    exact = "fixed:lm:embedded:unquantized"
    assert "hf-assisted" in summary["methods"] and exact in summary["methods"]
    assert summary["config"]["drafter_weights"] == {
        "early-exit:8": "unquantized",
        "lm:embedded:unquantized": "unquantized",
    }
    assert summary["correctness"]["mismatches"] == 0, summary["correctness"]["details"]
    # the target drafting for itself is always right: k + 1 tokens a round except at the end
    assert summary["methods"][exact]["overall"]["mean_accepted_tokens"] > 4
    assert summary["methods"]["hf-assisted"]["overall"]["mean_accepted_tokens"] > 4


def test_specialists_preset_pools_every_datastore_the_ofa_and_distilled_drafters(tmp_path: Path) -> None:
    from metasd.bench.presets import SPECIALIST_METHODS, preset

    for name in ("code", "chat", "math", "translation", "mixed"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "header.json").write_text("{}")
    (tmp_path / "distill-code").mkdir()
    (tmp_path / "distill-code" / "config.json").write_text("{}")
    (tmp_path / "distill-math").mkdir()  # no model saved yet: not in the pool
    settings = preset("specialists", tmp_path)
    assert settings["drafters"].split(",") == [
        "ngram",
        *(f"datastore:{tmp_path / n}" for n in ("code", "chat", "math", "translation", "mixed")),
        f"lm:{tmp_path / 'distill-code'}",
    ]
    assert settings["methods"] == SPECIALIST_METHODS
    assert "oracle-category" in settings["methods"]  # it brings every drafter's fixed run: each specialist alone
    (tmp_path / "math" / "header.json").unlink()
    with pytest.raises(ValueError, match="math"):
        preset("specialists", tmp_path)


def test_eagle_specialists_preset_pools_a_head_per_domain_and_the_ofa_head(tmp_path: Path) -> None:
    from metasd.bench.presets import SPECIALIST_METHODS, preset

    names = ("code", "chat", "math", "translation", "mixed")
    for name in names:
        (tmp_path / f"eagle-{name}").mkdir()
        (tmp_path / f"eagle-{name}" / "config.json").write_text("{}")
    settings = preset("eagle-specialists", tmp_path)
    assert settings["drafters"].split(",") == [f"eagle:{tmp_path / f'eagle-{n}'}" for n in names]
    assert settings["methods"] == SPECIALIST_METHODS
    (tmp_path / "eagle-chat" / "config.json").unlink()
    with pytest.raises(ValueError, match="eagle-chat.*train_domain_heads"):
        preset("eagle-specialists", tmp_path)


def test_repeats_start_from_one_state_and_keep_the_fastest(embedded) -> None:
    """--repeat: passes over a question's methods, each pass from what the policies knew before the first (a
    repeat must not learn from the question it is measured on); each method keeps its fastest run, and the
    reference is handed over once, after its first run."""
    from metasd import Decoder
    from metasd.bench.runners import engine_turn, measure_question

    decoder = Decoder(drafters="ngram,suffix")
    question = Question(1, "qa", ("Name three colours of the rainbow.",))
    decoder.generate("Count from one to five.", max_new_tokens=6)  # the policy exists and has learned something
    (policy,) = [p for p in decoder.policies.values() if p is not None]
    seen, walls, runs, references = [], {"ar": [], "metasd-adaptive": []}, [], []

    def runner(method):
        inner = engine_turn(decoder, "none" if method == "ar" else method, 8, 0)

        def turn(ids, index):
            if method != "ar":
                seen.append(policy.acceptance.history_tried.sum())
            record = inner(ids, index)
            walls[method].append(record.wall_time)
            return record

        return turn

    best = measure_question(
        decoder, question, ["ar", "metasd-adaptive"], runner, 3, lambda: None, references.append, runs.append
    )
    assert runs == ["ar", "metasd-adaptive"] * 3 and len(references) == 1
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]
    assert policy.acceptance.history_tried.sum() > seen[0]  # the last pass's learning is kept
    assert {m: r.wall_time for m, r in best.items()} == {m: min(w) for m, w in walls.items()}
