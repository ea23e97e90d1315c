"""Greedy outputs of the default configuration against transformers' own `generate` on an unrouted copy of the
target (the model as the user loaded it), float32, over Spec-Bench questions: the mismatch rate, and for each
mismatch the logit margin (top-1 minus top-2) of the unrouted model at the first differing token.

    python experiments/routing_mismatch.py [--per-category 3] [--max-new-tokens 128] [--out FILE.json]

Calibration routes each verified row count to the faster of two matmul layouts (`metasd.models.linear_kernels`);
both compute the same sums in another order, so a position can get other last bits than in a one-row step.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from metasd import Decoder
from metasd.bench.questions import load_questions, select_questions
from metasd.bench.spec_bench import spec_bench_questions
from metasd.bench.summary import first_difference
from metasd.models.linear_kernels import installed
from metasd.models.loading import load_model


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", default=None)
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = load_model()  # the process-wide instance the decoder routes (models are cached per process)
    plain = copy.deepcopy(target.model)  # as loaded: torch's F.linear everywhere
    decoder = Decoder()
    routing = installed(decoder.target.model)
    questions = select_questions(load_questions(args.questions or spec_bench_questions()), None, args.per_category)
    rows, started = [], time.perf_counter()
    for q in questions:
        ids = decoder.encode(q.turns[0])
        ours = decoder.generate(ids, max_new_tokens=args.max_new_tokens).token_ids
        x = torch.tensor([ids])
        reference = plain.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=len(ours))[
            0, len(ids) :
        ].tolist()
        at = first_difference(ours, reference)
        row = {"question_id": q.question_id, "category": q.category, "tokens": len(ours), "first_difference": at}
        if at is not None and at < min(len(ours), len(reference)):  # else one output ended early
            logits = plain(input_ids=torch.tensor([ids + reference[:at]])).logits[0, -1].float()
            top = torch.topk(logits, 2)
            row.update(
                margin=float(top.values[0] - top.values[1]),
                reference_token=reference[at],
                ours=ours[at],
                ours_logit_gap=float(logits[reference[at]] - logits[ours[at]]),
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    mismatched = [r for r in rows if r["first_difference"] is not None]
    summary = {
        "questions": len(rows),
        "mismatched": len(mismatched),
        "routing": routing,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    print(
        f"{len(mismatched)} of {len(rows)} outputs differ from transformers' generate on the unrouted model; "
        f"routing by row count: {routing}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
