"""`metasd bench`: arithmetic on known inputs, the oracles on synthetic tables, input errors, and one small
end-to-end run through the CLI on the embedded model (2 categories x 1 question, few tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from metasd.bench import metrics
from metasd.bench.answers import answer_line
from metasd.bench.history import DrafterHistory
from metasd.bench.methods import POLICIES, default_methods, file_stem, label, resolve_methods
from metasd.bench.oracles import AcceptanceTable, acceptance_table, oracle_path, oracle_plan, regret
from metasd.bench.questions import Question, load_questions, select_questions
from metasd.bench.runners import QuestionRecord, TurnRecord
from metasd.bench.summary import first_difference, mismatches
from metasd.cli import main
from metasd.cli.bench import _list
from metasd.drafters import Draft
from metasd.drafters.base import Drafter
from metasd.drafters.suffix import SuffixDrafter
from metasd.sampling import SamplingParams
from metasd.stats import Round

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
