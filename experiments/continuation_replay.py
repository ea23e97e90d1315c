"""Offline: how many tokens would a free drafter's continuation add after a model drafter's k-token draft?

    python experiments/continuation_replay.py [--preset qwen-coder] [--dtype bfloat16] [--per-category 2] [--tokens 48]

For each Spec-Bench question: the target's greedy output, the model drafter's greedy token at every position of it
(one teacher-forced forward: where its earlier tokens were right, its context is the true one), and the n-gram and
suffix proposals at every position. A k-token model draft from position i is fully accepted when the drafter is
right at i .. i+k-1; its continuation is then the better of the two free proposals at i+k, matched against the
output. Per group and k = 1, 2, 3: the model's mean accepted tokens, how often the whole draft is accepted, and
the continuation's mean accepted tokens (0 where the draft is not), relative to the round's tokens. An upper bound
for `metasd-adaptive`'s continuations: the better free proposal is picked in hindsight and verification is free.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from metasd.bench.presets import preset
from metasd.bench.questions import load_questions, select_questions
from metasd.bench.spec_bench import spec_bench_questions
from metasd.drafters import build_drafter
from metasd.engine import Decoder
from metasd.sampling import SamplingParams

GREEDY = SamplingParams()


def matched(draft: list[int], reference: list[int]) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(draft, reference, strict=False)) if a != b), min(len(draft), len(reference))
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen-coder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--questions", default=None, help="default: Spec-Bench (metasd.bench.spec_bench)")
    args = ap.parse_args()
    setup = preset(args.preset)
    model_spec = next(d for d in setup["drafters"].split(",") if d.startswith("lm:"))
    decoder = Decoder(setup["target"], drafters=["ngram"], policy="none", dtype=args.dtype)
    model = build_drafter(model_spec, decoder.target, args.dtype).model  # as loaded: one full-sequence forward
    # a suffix drafter of its own: the decoder's pool indexes each output at its end, before the replay reads it
    ngram, suffix = decoder.drafters["ngram"], build_drafter("suffix", decoder.target, args.dtype)
    rows: dict[str, list[tuple]] = {}
    for q in select_questions(load_questions(args.questions or spec_bench_questions()), per_category=args.per_category):
        prompt = decoder.encode(q.turns[0])
        out = decoder.generate(prompt, max_new_tokens=args.tokens).token_ids
        n = len(out)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + out]), logits_to_keep=n + 1).logits[0, :n]
        right = (logits.argmax(-1) == torch.tensor(out)).tolist()
        run = [0] * (n + 1)  # run[i]: the drafter's consecutive right tokens from position i
        for i in range(n - 1, -1, -1):
            run[i] = run[i + 1] + 1 if right[i] else 0
        suffix.begin(prompt)
        continuation = []
        for pos in range(n):
            context = prompt + out[:pos]
            continuation.append(
                max(matched(d.propose(context, 5, GREEDY, None).tokens, out[pos:]) for d in (ngram, suffix))
            )
        suffix.end(prompt + out)
        for i in range(n - 3):
            for k in (1, 2, 3):
                rows.setdefault(q.group, []).append(
                    (k, min(run[i], k), run[i] >= k, continuation[i + k] if run[i] >= k else 0)
                )
    for group, r in rows.items():
        r = np.array(r, dtype=float)
        cells = []
        for k in (1, 2, 3):
            s = r[r[:, 0] == k]
            cells.append(
                f"k={k}: model {s[:, 1].mean():.2f}, whole {s[:, 2].mean():.2f}, continuation "
                f"{s[:, 3].mean():.2f} (+{s[:, 3].mean() / (1 + s[:, 1].mean()):.0%})"
            )
        print(f"{group:15s} " + " | ".join(cells))


if __name__ == "__main__":
    main()
