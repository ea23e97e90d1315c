"""Does drafting cost a full batch anything? `metasd-adaptive` against `--policy none` through the server at 8
clients (16 Spec-Bench first turns, 128 new tokens, `--max-batch 16`), the two settings alternating, twice each, so
that the machine's drift over minutes weighs on both alike.

Usage: METASD_SPEC_BENCH=question.jsonl python experiments/batch_policy_alternating.py
"""

from metasd.bench.load import Setting, first_turns, run_load
from metasd.bench.questions import load_questions
from metasd.bench.spec_bench import spec_bench_questions
from metasd.engine import Decoder

prompts = first_turns(load_questions(spec_bench_questions()), 16)
for policy in ["metasd-adaptive", "none", "metasd-adaptive", "none"]:
    result = run_load(Decoder(policy=policy), Setting(policy, 16, policy), prompts, 8, 128)
    print(f"{policy:>16}: {result.throughput:.1f} tokens/s ({result.wall_s:.1f} s)", flush=True)
