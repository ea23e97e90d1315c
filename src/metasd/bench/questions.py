"""Spec-Bench questions: load `question.jsonl`, validate it, and pick the questions a run measures.

Spec-Bench reports six task groups: `mt_bench` (its eight MT-bench categories, two turns each) and the single-turn
categories translation, summarization, qa, math_reasoning and rag. `--categories` takes group names or MT-bench
category names; results are always reported per group, as Spec-Bench's `speed.py` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUPS: dict[str, tuple[str, ...]] = {
    "mt_bench": MT_BENCH,
    "translation": ("translation",),
    "summarization": ("summarization",),
    "qa": ("qa",),
    "math_reasoning": ("math_reasoning",),
    "rag": ("rag",),
}


@dataclass(frozen=True)
class Question:
    """A benchmark question: its id, its category and its user turns, asked in order."""

    question_id: int
    category: str
    turns: tuple[str, ...]

    @property
    def group(self) -> str:
        """The Spec-Bench task group the question is reported under."""
        return group_of(self.category)


def group_of(category: str) -> str:
    """The Spec-Bench task group a category is reported under."""
    return "mt_bench" if category in MT_BENCH else category


def load_questions(path: str | Path) -> list[Question]:
    """Read a Spec-Bench question file; raises ValueError naming the file (and line) for anything malformed."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"questions file not found: {path} (give the Spec-Bench question.jsonl with --questions)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read questions file {path}: {err}") from err
    questions: list[Question] = []
    seen: set[int] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err})") from err
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a JSON object with question_id, category and turns")
        qid, category, turns = item.get("question_id"), item.get("category"), item.get("turns")
        if not isinstance(qid, int) or isinstance(qid, bool):
            raise ValueError(f"{where}: 'question_id' must be an integer, got {qid!r}")
        if not isinstance(category, str) or not category:
            raise ValueError(f"{where}: 'category' must be a non-empty string, got {category!r}")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        if qid in seen:
            raise ValueError(f"{where}: question_id {qid} appears twice")
        seen.add(qid)
        questions.append(Question(qid, category, tuple(turns)))
    if not questions:
        raise ValueError(f"questions file {path} holds no questions")
    return questions


def expand_categories(names: list[str] | None) -> list[tuple[str, tuple[str, ...]]]:
    """Each requested name (a group or an MT-bench category) with the categories it covers; None = all groups."""
    if names is None:
        return list(GROUPS.items())
    out = []
    for name in names:
        if name in GROUPS:
            out.append((name, GROUPS[name]))
        elif name in MT_BENCH:
            out.append((name, (name,)))
        else:
            raise ValueError(
                f"unknown category {name!r}; choose groups {', '.join(GROUPS)} or MT-bench categories "
                f"{', '.join(MT_BENCH)}"
            )
    if not out:
        raise ValueError("no categories given")
    return out


def select_questions(
    questions: list[Question], categories: list[str] | None = None, per_category: int | None = None
) -> list[Question]:
    """The first `per_category` questions of each requested name (a group takes its categories in turn, so
    `mt_bench` with 2 gives one writing and one roleplay question), in file order, without duplicates."""
    if per_category is not None and (not isinstance(per_category, int) or per_category < 1):
        raise ValueError(f"per-category must be an integer >= 1, got {per_category!r}")
    chosen: list[Question] = []
    seen: set[int] = set()
    for name, cats in expand_categories(categories):
        lanes = [[q for q in questions if q.category == c] for c in cats]
        if not any(lanes):
            raise ValueError(f"the questions file holds no questions of category {name!r}")
        interleaved = [
            q for rank in range(max(map(len, lanes))) for lane in lanes if rank < len(lane) for q in [lane[rank]]
        ]
        picked = interleaved if per_category is None else interleaved[:per_category]
        for q in picked:
            if q.question_id not in seen:
                seen.add(q.question_id)
                chosen.append(q)
    return chosen
