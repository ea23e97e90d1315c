"""What drafting together saves a batch: B requests decoding side by side with one model drafter (the shipped
EAGLE head by default, or an `lm:`/`early-exit:` drafter) drafting k tokens for every row every round
(`fixed:DRAFTER`), its forks drafting together (one forward per drafted token for all rows, the drafter's
`draft_batch`) against one request after another (the same code with the forks' batch key withheld), alternating,
the same Spec-Bench first turns each time. Reports the batch's wall time, its drafting seconds (every request's
share summed) and tokens per second, and checks the outputs are the same either way.

Usage: METASD_SPEC_BENCH=question.jsonl python experiments/batched_drafting.py [--drafter eagle] [--rows 8]
    [--tokens 64] [--k 4] [--repeat 2] [--target SPEC] [--dtype DTYPE]
"""

import argparse
import time

from metasd.batching.batch import Batch
from metasd.bench.load import first_turns
from metasd.bench.questions import load_questions
from metasd.bench.spec_bench import spec_bench_questions
from metasd.engine import Decoder


def run(decoder: Decoder, prompts: list[str], tokens: int, together: bool) -> tuple[float, float, int, list]:
    """(wall seconds, drafting seconds, tokens, outputs) of one batch decoding every prompt."""
    kind.batch_key = original if together else (lambda self: None)
    batch = Batch(decoder, max_batch=len(prompts))
    requests = [decoder.stream(p, max_new_tokens=tokens) for p in prompts]
    for request in requests:
        batch.join(request)
    started = time.perf_counter()
    while len(batch):
        batch.step()
    wall = time.perf_counter() - started
    drafting = sum(r.draft_time for request in requests for r in request.stats.rounds)
    return wall, drafting, sum(len(r.token_ids) for r in requests), [r.token_ids for r in requests]


parser = argparse.ArgumentParser()
parser.add_argument("--drafter", default="eagle")
parser.add_argument("--target", default=None)
parser.add_argument("--dtype", default="float32")
parser.add_argument("--rows", type=int, default=8)
parser.add_argument("--tokens", type=int, default=64)
parser.add_argument("--k", type=int, default=4)
parser.add_argument("--repeat", type=int, default=2)
args = parser.parse_args()
prompts = first_turns(load_questions(spec_bench_questions()), args.rows)
decoder = Decoder(
    target=args.target, dtype=args.dtype, drafters=[args.drafter], policy=f"fixed:{args.drafter}", draft_len=args.k
)
kind = type(decoder.drafters[args.drafter])
original = kind.batch_key
run(decoder, prompts[:2], 8, True)  # warm-up
outputs = {}
for _ in range(args.repeat):
    for together in (False, True):
        wall, drafting, made, outputs[together] = run(decoder, prompts, args.tokens, together)
        label = "together" if together else "one after another"
        print(
            f"{label:>18}: {made / wall:6.1f} tokens/s, wall {wall:6.2f} s, drafting {drafting:6.2f} s "
            f"({drafting / wall:.0%} of the wall time)",
            flush=True,
        )
print("outputs equal:", outputs[False] == outputs[True])
