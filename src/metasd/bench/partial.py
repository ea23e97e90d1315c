"""`OUT/partial/`: each finished question's result, kept as it finishes so that `--resume` skips it, and the run's
fingerprint, so that a folder of another run's results is refused rather than mixed in."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

from ..files import written_aside
from .config import BenchConfig
from .questions import Question
from .worker import QuestionResult

PARTIAL = "partial"


def fingerprint(cfg: BenchConfig, questions: list[Question]) -> dict:
    """What must match for a partial result to be reused by --resume."""
    ids = [q.question_id for q in questions]
    return {
        "questions_file": str(cfg.questions),
        "target": cfg.target,
        "drafters": cfg.drafters,
        "methods": cfg.methods,
        "max_new_tokens": cfg.max_new_tokens,
        "draft_len": cfg.draft_len,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "seed": cfg.seed,
        "policy_scope": cfg.policy_scope,
        "drift": getattr(cfg, "drift", False),
        "kernels": cfg.kernels,
        "repeat": cfg.repeat,
        "questions": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
    }


class PartialStore:
    """`OUT/partial/`: one pickle per finished question, written atomically as it finishes."""

    def __init__(self, out: Path, fingerprint: dict, resume: bool):
        self.dir = out / PARTIAL
        meta = self.dir / "run.json"
        if resume and meta.is_file():
            old = json.loads(meta.read_text(encoding="utf-8"))
            if old != fingerprint:
                changed = sorted(k for k in fingerprint if old.get(k) != fingerprint[k])
                raise ValueError(
                    f"--resume: {self.dir} holds results of a different run (differs in "
                    f"{', '.join(changed)}); use another --out or drop --resume"
                )
        elif self.dir.is_dir():
            for stale in self.dir.glob("q*.pkl"):
                stale.unlink()
        self.dir.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps(fingerprint, indent=2) + "\n", encoding="utf-8")

    def load(self) -> dict[int, QuestionResult]:
        """The stored results by question id; a torn or foreign file is skipped (that question is measured again)."""
        out = {}
        for path in self.dir.glob("q*.pkl"):
            try:
                result = pickle.loads(path.read_bytes())
            except Exception:  # a torn or foreign file: measure that question again
                continue
            if isinstance(result, QuestionResult):
                out[result.question.question_id] = result
        return out

    def save_info(self, info: dict) -> None:
        """Store the run's record of its workers (workers.json)."""
        (self.dir / "workers.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")

    def load_info(self) -> dict | None:
        """The stored record of the workers, or None when there is none."""
        path = self.dir / "workers.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def save(self, result: QuestionResult) -> None:
        """Store a finished question's result, atomically (a temporary file renamed into place)."""
        path = self.dir / f"q{result.question.question_id}.pkl"
        with written_aside(path) as aside:
            aside.write_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
