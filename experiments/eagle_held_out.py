"""Held-out agreement of trained EAGLE heads with their target, on the ~2 % of a corpus `train_head` keeps out:
a draft's first token (`top1`), its second from the head's own predicted feature (`top1_2`) and both in a row
(`both`), for heads trained on the same corpus with and without the training-time test or fused features; with
--whole, on every sequence of a corpus no head trained on (e.g. the target's answers to requests of one's own);
with --answer-tokens N, on each answer's first N tokens only (what a generation of N tokens drafts: an answer's
opening is harder to draft than its middle, so it compares with the engine's `--max-new-tokens N`).
Agreement is with the target's argmax over its whole vocabulary (a token outside the draft vocabulary is a miss).
python experiments/eagle_held_out.py [--target SPEC] [--dtype D] --corpus DIR [DIR ...] --heads HEAD_DIR [...]
    [--whole] [--unroll S] [--answers-only] [--answer-tokens N]"""

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from metasd.models.eagle_head import load_head
from metasd.models.loading import load_model
from metasd.specialists.eagle_corpus import read_corpus
from metasd.specialists.eagle_sequences import StoredSequences, TokenFeatures
from metasd.specialists.eagle_train import TrainConfig, held_out_metrics, held_out_split


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--corpus", nargs="+", required=True)
    parser.add_argument("--heads", nargs="+", required=True)
    parser.add_argument("--whole", action="store_true", help="every sequence, not the ~2 %% train_head held out")
    parser.add_argument("--unroll", type=int, default=None, help="report draft tokens 1..S (default: as trained)")
    parser.add_argument(
        "--answers-only", action="store_true", help="count the answers' tokens only (drafting never drafts a prompt)"
    )
    parser.add_argument("--answer-tokens", type=int, default=None, help="each answer's first N tokens only")
    args = parser.parse_args()
    target = load_model(args.target, args.dtype)
    embed = target.model.get_input_embeddings()
    for path in args.heads:
        saved = load_head(path, target.model)
        layers = saved.head.config.feature_layers  # the corpus's features as this head reads them
        read = [s for d in args.corpus for s in read_corpus(Path(d), layers)]
        if args.answer_tokens is not None:
            n = args.answer_tokens
            read = [TokenFeatures(s.tokens[: s.prompt + n], s.features[: s.prompt + n], s.prompt) for s in read]
        seqs = StoredSequences(read, args.answers_only)
        held = seqs if args.whole else held_out_split(seqs)[0]
        head = saved.head.float()
        cfg = TrainConfig(**saved.training.get("train_config", {}))
        cfg = TrainConfig(**{**asdict(cfg), "unroll": args.unroll or cfg.unroll})
        whole = target.model.get_output_embeddings().weight.detach()
        metrics = held_out_metrics(head, embed, whole[head.draft_vocab].float(), held, cfg, whole)
        scope = {"answer_tokens": args.answer_tokens} if args.answer_tokens is not None else {}
        print(json.dumps({"head": path, "unroll": cfg.unroll, "layers": list(layers), **scope, **metrics}))


if __name__ == "__main__":
    main()
