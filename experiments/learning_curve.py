"""A head learning from the traffic it drafts for: its acceptance over 200 code requests, then the learned head
against the head as loaded on the last 50, interleaved.

Requests: complete a function of the `click` package's source (its signature, docstring and first lines, shuffled
with a fixed seed; no benchmark set), greedy, 64 new tokens, embedded model, float32, default pool. Phase 1: the
200 requests under `fixed:eagle` (the head drafts every round, so its acceptance is measured on every request)
while the learner (`metasd.learning`, defaults but `LEARN_EVERY`, half a core at serving's priority) trains in
the background. Phase 2:
the learner stopped, each of the last 50 prompts four times in turn: fixed:eagle and the default policy, each
with the learned head and with the head as loaded (the drafter's history key set to None).
Usage: python experiments/learning_curve.py [REQUESTS] [LEARN_EVERY]   (default 200 2048)
"""

import ast
import json
import random
import statistics
import sys
import time
from pathlib import Path

import click

from metasd import Decoder
from metasd.learning import LearningConfig, learn_heads

REQUESTS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
LEARN_EVERY = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
TAIL = 50
NEW_TOKENS = 64


def prompts(n: int) -> list[str]:
    """Function openings from click's source: up to 12 lines of each function of 8 or more lines."""
    out = []
    for path in sorted(Path(click.__file__).parent.glob("*.py")):
        source = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(source))):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 8:
                lines = source[node.lineno - 1 : node.lineno - 1 + 12]
                indent = len(lines[0]) - len(lines[0].lstrip())
                body = "\n".join(line[indent:] for line in lines)
                out.append(f"Complete this Python function from the click library:\n\n```python\n{body}\n```")
    random.Random(0).shuffle(out)
    if len(out) < n:
        raise SystemExit(f"only {len(out)} functions")
    return out[:n]


def head_stats(result, name: str) -> tuple[int, int, int]:
    """(rounds the head drafted, tokens it drafted, tokens accepted)."""
    d = result.stats.drafters().get(name)
    return (0, 0, 0) if d is None else (d.pulls, d.drafted, d.accepted)


def main() -> None:
    decoder = Decoder()
    eagle = next(name for name in decoder.drafter_names if name.startswith("eagle"))
    drafter = decoder.drafters[eagle]
    # the requests run back to back on every core, so a trainer at the lowest priority would get nothing: it runs
    # at serving's priority with half a core (phase 1's timings are not compared; phase 2 runs without it)
    (learner,) = learn_heads(decoder, LearningConfig(train_every=LEARN_EVERY, share=0.5, nice=0))
    learner.start()
    ps = prompts(REQUESTS)
    started = time.perf_counter()
    curve = []
    for i, prompt in enumerate(ps):
        result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS, policy=f"fixed:{eagle}")
        rounds, drafted, accepted = head_stats(result, eagle)
        curve.append(
            {
                "request": i,
                "version": drafter.version[1],
                "rounds": rounds,
                "accepted": accepted,
                "drafted": drafted,
                "tokens": len(result.token_ids),
            }
        )
        if i % 25 == 24:
            print(
                json.dumps(
                    {
                        "done": i + 1,
                        "version": drafter.version[1],
                        "s": round(time.perf_counter() - started),
                        **learner.stats(),
                    }
                ),
                flush=True,
            )
    learner.close()
    phase1 = time.perf_counter() - started

    def mean_accepted(rows):  # accepted draft tokens + the target's own token, per round the head drafted
        return (sum(r["accepted"] for r in rows) + sum(r["rounds"] for r in rows)) / max(
            1, sum(r["rounds"] for r in rows)
        )

    runs = {(policy, head): [] for policy in ("fixed", "default") for head in ("learned", "loaded")}
    for prompt in ps[-TAIL:]:
        for policy in ("fixed", "default"):
            for head in ("learned", "loaded"):
                drafter.use_history("" if head == "learned" else None)
                result = decoder.generate(
                    prompt, max_new_tokens=NEW_TOKENS, policy=f"fixed:{eagle}" if policy == "fixed" else None
                )
                rounds, drafted, accepted = head_stats(result, eagle)
                runs[policy, head].append(
                    {
                        "rounds": rounds,
                        "accepted": accepted,
                        "tokens": len(result.token_ids),
                        "seconds": result.stats.wall_time,
                        "all_rounds": len(result.stats.rounds),
                    }
                )
    drafter.use_history("")
    summary = {
        "requests": REQUESTS,
        "learn_every": LEARN_EVERY,
        "phase1_seconds": round(phase1, 1),
        "versions": drafter.version[1],
        "learner": learner.stats(),
        "first50_mean_accepted": round(mean_accepted(curve[:TAIL]), 3),
        "last50_mean_accepted": round(mean_accepted(curve[-TAIL:]), 3),
        "tail": {
            f"{policy}/{head}": {
                "mean_accepted": round(mean_accepted(rows), 3),
                "tokens_per_second": round(sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows), 2),
                "median_request_tps": round(statistics.median(r["tokens"] / r["seconds"] for r in rows), 2),
            }
            for (policy, head), rows in runs.items()
        },
        "curve_by_25": [
            {
                "requests": f"{i}-{i + 24}",
                "mean_accepted": round(mean_accepted(curve[i : i + 25]), 3),
                "version": curve[min(i + 24, len(curve) - 1)]["version"],
            }
            for i in range(0, len(curve), 25)
        ],
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
