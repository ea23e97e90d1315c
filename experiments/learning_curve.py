"""A head learning from the traffic it drafts for: its acceptance over 200 requests of one domain, then the learned
head against the head as loaded on the last 50, interleaved.

Requests (shuffled with a fixed seed; no benchmark set), greedy, 64 new tokens, embedded model, float32, default
pool. `code`: complete a function of the `click` package's source (its signature, docstring and first lines).
`translation`: translate into English one message of Django's own catalogs (its compiled gettext files, German,
French, Spanish, Italian, Portuguese or Dutch, 5 words or more; `pip install django` first): little of an answer
can be copied from its prompt, so the free drafters propose little. Phase 1: the 200 requests under `fixed:eagle`
(the head drafts every round, so its acceptance is measured on every request) while the learner
(`metasd.learning`, defaults but `--learn-every`, half a core at serving's priority) trains in the background.
Phase 2: the learner stopped, each of the last 50 prompts (`--tail`) four times in turn: fixed:eagle and the
default policy (`--policies`), each with the learned head and with the head as loaded (the drafter's history key
set to None), each head with its own policy state across requests. Every arm starts from the server as it stood
before the tail: the learned head is the one in service then (phase 1 went on to learn from the tail's answers,
which a fair comparison must not have seen), and each arm has its own copy of the free drafters' cross-request
history of that moment, which it extends with its own outputs only (one history for all four would hold each
prompt's greedy answer after its first arm, for the suffix drafter to copy whole).
Usage: python experiments/learning_curve.py [--domain code|translation] [--requests 200] [--learn-every 2048]
  [--tail 50] [--new-tokens 64] [--target SPEC --drafters A,B,... --dtype bfloat16]   (another pair: its head among
  the drafters, named eagle:...)
"""

import argparse
import ast
import copy
import gettext
import json
import random
import statistics
import time
from pathlib import Path

import click

from metasd import Decoder
from metasd.learning import LearningConfig, learn_heads


def code_prompts(n: int) -> list[str]:
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


LANGUAGES = {"de": "German", "fr": "French", "es": "Spanish", "it": "Italian", "pt": "Portuguese", "nl": "Dutch"}


def translation_prompts(n: int) -> list[str]:
    """Messages of Django's compiled catalogs (every app's, each language above), one request per distinct message."""
    import django

    seen, out = set(), []
    for mo in sorted(Path(django.__file__).parent.rglob("locale/*/LC_MESSAGES/django.mo")):
        lang = mo.parts[-3]
        if lang not in LANGUAGES:
            continue
        with mo.open("rb") as f:
            catalog = gettext.GNUTranslations(f)._catalog
        for english, other in sorted(catalog.items(), key=str):
            if isinstance(english, str) and english and len(other.split()) >= 5 and other not in seen:
                seen.add(other)
                out.append(f"Translate {LANGUAGES[lang]} to English: {other}")
    random.Random(0).shuffle(out)
    if len(out) < n:
        raise SystemExit(f"only {len(out)} messages")
    return out[:n]


class FrozenLearning:
    """`HeadLearning` serving one head, fixed, to the shared history key, and collecting nothing: the learned
    head as it stood before the tail."""

    def __init__(self, version: int, head):
        self.version, self.head = version, head

    def current(self, key: str):
        return (self.version, self.head) if key == "" and self.head is not None else (0, None)

    def collect(self, key, tokens, features, prompt) -> None:
        pass


def head_stats(result, name: str) -> tuple[int, int, int]:
    """(rounds the head drafted, tokens it drafted, tokens accepted)."""
    d = result.stats.drafters().get(name)
    return (0, 0, 0) if d is None else (d.pulls, d.drafted, d.accepted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domain", choices=("code", "translation"), default="code")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--learn-every", type=int, default=2048, help="new tokens between rounds of learning")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--tail", type=int, default=50, help="requests compared at each end of the curve")
    parser.add_argument("--target", default=None, help="default: the embedded model")
    parser.add_argument("--drafters", default=None, help="the pool, comma-separated (default: the default pool)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--policies", default="fixed,default", help="phase 2's policies: fixed (the head), default")
    args = parser.parse_args()
    if not 0 < args.tail <= args.requests:
        parser.error("--tail must be 1 .. --requests")
    pool = {"drafters": args.drafters.split(",")} if args.drafters else {}
    decoder = Decoder(target=args.target, dtype=args.dtype, **pool)
    eagle = next(name for name in decoder.drafter_names if name.startswith("eagle"))
    drafter = decoder.drafters[eagle]
    # the requests run back to back on every core, so a trainer at the lowest priority would get nothing: it runs
    # at serving's priority with half a core (phase 1's timings are not compared; phase 2 runs without it)
    (learner,) = learn_heads(decoder, LearningConfig(train_every=args.learn_every, share=0.5, nice=0))
    learner.start()
    ps = (code_prompts if args.domain == "code" else translation_prompts)(args.requests)
    started = time.perf_counter()
    curve = []
    learns_across = [name for name, d in decoder.drafters.items() if d.learns_across_requests and name != eagle]
    for i, prompt in enumerate(ps):
        if i == len(ps) - args.tail:  # the server as it stood before the tail, for phase 2's arms to start from
            tail_version, tail_head = learner.current("")
            tail_head = copy.deepcopy(tail_head)
            tail_history = {name: copy.deepcopy(decoder.drafters[name]) for name in learns_across}
        result = decoder.generate(prompt, max_new_tokens=args.new_tokens, policy=f"fixed:{eagle}")
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
    final_version = learner.current("")[0]

    def mean_accepted(rows):  # accepted draft tokens + the target's own token, per round the head drafted
        return (sum(r["accepted"] for r in rows) + sum(r["rounds"] for r in rows)) / max(
            1, sum(r["rounds"] for r in rows)
        )

    policies = args.policies.split(",")
    runs = {(policy, head): [] for policy in policies for head in ("learned", "loaded")}
    # what the policies learn across requests (the default's acceptance record of each drafter) is kept per head,
    # as on a server that serves only that head: interleaved in one state, each head would be judged by the other's
    states = dict.fromkeys(("learned", "loaded"), decoder.snapshot_policies())
    drafter.learn_from(FrozenLearning(tail_version, tail_head))
    histories = {arm: copy.deepcopy(tail_history) for arm in runs}
    for prompt in ps[-args.tail :]:
        for policy in policies:
            for head in ("learned", "loaded"):
                drafter.use_history("" if head == "learned" else None)
                decoder.restore_policies(states[head])
                decoder.drafters.update(histories[policy, head])
                result = decoder.generate(
                    prompt, max_new_tokens=args.new_tokens, policy=f"fixed:{eagle}" if policy == "fixed" else None
                )
                states[head] = decoder.snapshot_policies()
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
        "domain": args.domain,
        "requests": args.requests,
        "learn_every": args.learn_every,
        "phase1_seconds": round(phase1, 1),
        "versions": final_version,
        "tail_version": tail_version,
        "learner": learner.stats(),
        "first_tail_mean_accepted": round(mean_accepted(curve[: args.tail]), 3),
        "last_tail_mean_accepted": round(mean_accepted(curve[-args.tail :]), 3),
        "tail": {
            f"{policy}/{head}": {
                "mean_accepted": round(mean_accepted(rows), 3),
                "tokens_per_second": round(sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows), 2),
                "median_request_tps": round(statistics.median(r["tokens"] / r["seconds"] for r in rows), 2),
                "head_round_share": round(sum(r["rounds"] for r in rows) / sum(r["all_rounds"] for r in rows), 3),
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
