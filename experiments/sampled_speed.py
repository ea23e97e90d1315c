"""Sampled decoding (temperature 0.7, top-p 0.9, a seed per request) over the first N everyday requests: tokens/s of
the default pool and policy and of plain decoding, one request after another on one decoder. Run it on two commits
(the other's `src` on PYTHONPATH) to compare:
python experiments/sampled_speed.py [--requests 20] [--max-new-tokens 64] [--label NAME]"""

import argparse
import json
import time
from pathlib import Path

from metasd import Decoder

REQUESTS = Path(__file__).resolve().parent / "data" / "everyday_requests.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    lines = REQUESTS.read_text(encoding="utf-8").splitlines()[: args.requests]
    prompts = [json.loads(line)["prompt"] for line in lines]
    options = {"temperature": 0.7, "top_p": 0.9}
    decoder = Decoder()
    for policy in ("metasd-adaptive", "none"):
        decoder.generate(prompts[0], max_new_tokens=8, seed=0, policy=policy, **options)  # warm-up
        tokens, seconds = 0, 0.0
        for i, prompt in enumerate(prompts):
            started = time.perf_counter()
            result = decoder.generate(prompt, max_new_tokens=args.max_new_tokens, seed=i, policy=policy, **options)
            seconds += time.perf_counter() - started
            tokens += len(result.token_ids)
        print(f"{args.label} {policy}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.2f} tokens/s")


if __name__ == "__main__":
    main()
