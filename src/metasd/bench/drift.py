"""The drift workload of `metasd bench --drift`: requests that change task midway, and what the report shows of them.

MetaSD's case (arXiv 2604.05417) for a bandit over a router is drift within a request: a static choice commits to one
drafter for the whole request, a bandit can switch when the text changes character. Each drift request is one user
turn built from two Spec-Bench questions of different groups, "answer request 1, then request 2":

- `drift-copy-math`: 1 is a summarization or RAG question (its answer copies the context: prompt lookup shines),
  2 a math_reasoning question (no copying); `drift-copy-code`: 1 as above, 2 an MT-bench coding question (turn 1).
- `drift-translation`: German→English then English→German (the paper's two-language case). Spec-Bench only holds
  German→English questions, so the English→German source is the first sentence of a summarization article.

The model is asked to start its second answer with a marker line (`## Answer 2`); the boundary is the output token
where the marker starts in `ar`'s output (greedy outputs are identical across methods), None when the model never
wrote it (small models often ignore the format; the request still carries both tasks, but where it switches is unknown).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import metrics
from .questions import Question, load_questions

MARKER = "## Answer 2"
KINDS = ("drift-copy-math", "drift-copy-code", "drift-translation")
COPY = ("summarization", "rag")
_ID_BASE = 1_000_000  # drift request ids: KIND_INDEX * 10_000 + n + this, far from Spec-Bench's 1..480
# The drift methods when --methods is not given: the baselines and oracles the drift report compares with, the
# paper's UCB, UCB at the drifting policies' beta (the control that isolates forgetting), and the forgetting bandits.
METHODS = (
    "ar",
    "oracle-round",
    "oracle-category",
    "metasd-ucb",
    "metasd-ucb:0.1",
    "metasd-ucb-cost",
    "ducb",
    "swucb",
    "ducb-cost",
    "swucb-cost",
    "metasd-adaptive",
)


def template(first: str, second: str) -> str:
    """The one user turn that asks for both requests, the second answer to start with `MARKER`."""
    return (
        f"I have two requests. Answer them one after the other.\n\n## Request 1\n{first}\n\n## Request 2\n"
        f'{second}\n\nStart your reply with "## Answer 1" and answer request 1. Then write "{MARKER}" on a '
        "line of its own and answer request 2."
    )


@dataclass(frozen=True)
class DriftRequest:
    """One drift request: the question it is measured as, its kind, and the two Spec-Bench questions it joins."""

    question: Question  # category = the kind; turns = (the constructed prompt,)
    kind: str
    first: tuple[int, str]  # (Spec-Bench question id, category) of request 1
    second: tuple[int, str]  # of request 2 (for drift-translation: the article the English sentence comes from)

    def to_json(self) -> dict:
        """The request as a line of the prompts file: its id, kind, prompt, sources and marker."""
        return {
            "question_id": self.question.question_id,
            "kind": self.kind,
            "prompt": self.question.turns[0],
            "first": {"question_id": self.first[0], "category": self.first[1]},
            "second": {"question_id": self.second[0], "category": self.second[1]},
            "marker": MARKER,
        }


def _first_sentence(article: str) -> str:
    text = article.removeprefix("Summarize:").strip()
    match = re.match(r"(.{40,300}?[.!?])(\s|$)", text, flags=re.S)
    return (match.group(1) if match else text[:200]).strip()


def drift_requests(
    questions: list[Question], seed: int = 0, per_kind: int | None = 3, kinds: Sequence[str] | None = None
) -> list[DriftRequest]:
    """`per_kind` requests of each kind (None: 3), the same for the same seed and question file: Python's
    `random.Random` seeded with a string is stable across runs and platforms. An English→German request has no
    reference translation; none is needed to measure speed."""
    kinds = list(KINDS) if kinds is None else list(kinds)
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown drift kind {kind!r}; choose from {', '.join(KINDS)}")
    if per_kind is None:
        per_kind = 3
    if not isinstance(per_kind, int) or not 1 <= per_kind <= 1000:
        raise ValueError(f"per-category must be an integer in [1, 1000], got {per_kind!r}")
    pools = {
        c: [q for q in questions if q.category == c]
        for c in ("summarization", "rag", "math_reasoning", "coding", "translation")
    }
    for c, pool in pools.items():
        if not pool:
            raise ValueError(f"the questions file holds no {c} questions (the drift workload needs them)")
    out: list[DriftRequest] = []
    for kind in kinds:
        rng = random.Random(f"metasd-drift:{seed}:{kind}")
        for n in range(per_kind):
            qid = _ID_BASE + KINDS.index(kind) * 10_000 + n
            if kind == "drift-translation":
                a = rng.choice(pools["translation"])
                b = rng.choice(pools["summarization"])
                first, second = a.turns[0], f"Translate English to German: {_first_sentence(b.turns[0])}"
            else:
                a = rng.choice(pools[rng.choice(COPY)])
                b = rng.choice(pools["math_reasoning" if kind == "drift-copy-math" else "coding"])
                first, second = a.turns[0], b.turns[0]
            prompt = template(first.strip(), second.strip())
            out.append(
                DriftRequest(
                    Question(qid, kind, (prompt,)), kind, (a.question_id, a.category), (b.question_id, b.category)
                )
            )
    return out


def drift_questions(path: str | Path, seed: int, per_kind: int | None, kinds: Sequence[str] | None) -> list[Question]:
    """The drift requests (`drift_requests`) built from the questions file at `path`, as questions to measure."""
    return [r.question for r in drift_requests(load_questions(path), seed, per_kind, kinds)]


def write_prompts(path: Path, requests: list[DriftRequest]) -> None:
    """Write the requests to `path` as JSONL, one `to_json` line each."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")


def boundary_token(decode: Callable[[list[int]], str], token_ids: Sequence[int], marker: str = MARKER) -> int | None:
    """Index of the output token where `marker` starts (the first token whose decoded prefix reaches into the
    marker), None when the output does not contain it."""
    ids = list(token_ids)
    at = decode(ids).find(marker)
    if at < 0:
        return None
    lo, hi = 0, len(ids) - 1  # smallest i with len(decode(ids[: i + 1])) > at; prefix lengths grow with i
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[: mid + 1])) > at:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _picks(rounds, boundary: int | None) -> dict[str, dict[str, int]]:
    """Drafting rounds per drafter, before the boundary (segment 1) and from it on (segment 2)."""
    out: dict[str, dict[str, int]] = {"1": {}, "2": {}}
    pos = 0
    for r in rounds or []:
        seg = "1" if boundary is None or pos < boundary else "2"
        if r.drafter is not None:
            out[seg][r.drafter] = out[seg].get(r.drafter, 0) + 1
        pos += r.emitted
    return out


def summarize_drift(
    requests: list[DriftRequest], results: dict, methods: Sequence[str], decode: Callable[[list[int]], str]
) -> dict:
    """Per drift request: its boundary, each method's tokens/s and its ratio to `ar`, to the static router (the
    best fixed drafter for this request, in hindsight) and to `oracle-round`; drafter picks per segment."""
    timed = [m for m in methods if m in results]
    fixed = [m for m in timed if m.startswith("fixed:")]
    rows, speeds = [], {m: [] for m in timed}
    static_speeds: list[float] = []
    for req in requests:
        qid = req.question.question_id
        if qid not in results.get("ar", {}):
            continue
        ar = results["ar"][qid].turns[0]
        boundary = boundary_token(decode, ar.token_ids)
        speed = {m: metrics.question_speed([results[m][qid].new_tokens], [results[m][qid].wall_time]) for m in timed}
        for m in timed:
            speeds[m].append(speed[m])
        static = max(fixed, key=lambda m: speed[m]) if fixed else None
        if static:
            static_speeds.append(speed[static])
        orr = speed.get("oracle-round")
        rows.append(
            {
                **req.to_json(),
                "boundary_token": boundary,
                "new_tokens": ar.new_tokens,
                "tokens_per_second": {m: round(v, 3) for m, v in speed.items()},
                "static_router": static,
                "vs_ar": {m: round(v / speed["ar"], 4) for m, v in speed.items()},
                "vs_static_router": {m: round(v / speed[static], 4) for m, v in speed.items()} if static else None,
                "vs_oracle_round": {m: round(v / orr, 4) for m, v in speed.items()} if orr else None,
                "picks": {
                    m: _picks(results[m][qid].turns[0].rounds, boundary)
                    for m in timed
                    if results[m][qid].turns[0].rounds is not None and m != "ar"
                },
            }
        )
    overall = {}
    if rows:
        for m in timed:
            overall[m] = {
                "vs_ar": round(metrics.speedup(speeds[m], speeds["ar"]), 4),
                "vs_static_router": round(metrics.speedup(speeds[m], static_speeds), 4) if static_speeds else None,
                "vs_oracle_round": (
                    round(metrics.speedup(speeds[m], speeds["oracle-round"]), 4) if "oracle-round" in speeds else None
                ),
            }
    return {
        "marker": MARKER,
        "requests": rows,
        "overall": overall,
        "with_boundary": sum(r["boundary_token"] is not None for r in rows),
    }


def add_drift(cfg, summary: dict, results: dict, out: Path) -> None:
    """For a --drift run: write drift_prompts.jsonl into `out` and the drift section into the summary. The
    boundary needs the tokenizer: the target's, loaded once per process (already loaded in the measuring one)."""
    from ..models.loading import load_tokenizer

    requests = drift_requests(load_questions(cfg.questions), cfg.seed, cfg.per_category, cfg.categories)
    write_prompts(out / "drift_prompts.jsonl", requests)
    tokenizer = load_tokenizer(summary["config"]["target"])
    summary["drift"] = summarize_drift(
        requests, results, summary["config"]["methods"], lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    )
    summary["drift"]["prompts_file"] = "drift_prompts.jsonl"
