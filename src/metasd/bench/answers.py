"""Answer files in Spec-Bench's format (`answers/<method>.jsonl`), readable by Spec-Bench's `evaluation/speed.py`.

One line per question: question_id, category, answer_id, model_id, tstamp and one choice holding per-turn text,
decoding_steps, new_tokens and wall_time, and the flat list of accept_lengths (tokens per target forward).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .questions import Question
from .runners import QuestionRecord


def answer_line(method: str, record: QuestionRecord) -> dict:
    """One question's answer line as Spec-Bench writes it, for `method` (its model_id); wall times in seconds."""
    q = record.question
    return {
        "question_id": q.question_id,
        "category": q.category,
        "answer_id": f"{method}-{q.question_id}",
        "model_id": method,
        "choices": [
            {
                "index": 0,
                "turns": [t.text for t in record.turns],
                "decoding_steps": [len(t.accept_lengths) for t in record.turns],
                "new_tokens": [t.new_tokens for t in record.turns],
                "wall_time": [t.wall_time for t in record.turns],
                "accept_lengths": [a for t in record.turns for a in t.accept_lengths],
            }
        ],
        "tstamp": time.time(),
    }


def write_answers(path: Path, method: str, records: dict[int, QuestionRecord], questions: list[Question]) -> None:
    """Write `method`'s answer file to `path`: a line per question, in the order of `questions`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for q in questions:
            f.write(json.dumps(answer_line(method, records[q.question_id]), ensure_ascii=False) + "\n")
