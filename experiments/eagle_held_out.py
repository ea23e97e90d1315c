"""Held-out agreement of trained EAGLE heads with their target, on the ~2 % of a corpus `train_head` keeps out:
a draft's first token (`top1`), its second from the head's own predicted feature (`top1_2`) and both in a row
(`both`), for heads trained with and without the training-time test on the same corpus.
python experiments/eagle_held_out.py --target SPEC [--dtype D] --corpus DIR [DIR ...] --heads HEAD_DIR [...]"""

import argparse
import json
from pathlib import Path

from metasd.models.eagle_head import load_head
from metasd.models.loading import load_model
from metasd.specialists.eagle_corpus import read_corpus
from metasd.specialists.eagle_train import TrainConfig, held_out_metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--corpus", nargs="+", required=True)
    parser.add_argument("--heads", nargs="+", required=True)
    args = parser.parse_args()
    target = load_model(args.target, args.dtype)
    seqs = [s for d in args.corpus for s in read_corpus(Path(d))]
    held = seqs[: len(seqs) // 50]  # what train_head kept out of training on the same corpus
    embed = target.model.get_input_embeddings()
    for path in args.heads:
        head = load_head(path, target.model).head.float()
        readout = target.model.get_output_embeddings().weight[head.draft_vocab].detach().float()
        metrics = held_out_metrics(head, embed, readout, held, TrainConfig())
        print(json.dumps({"head": path, "unroll": head_unroll(path), **metrics}))


def head_unroll(path: str) -> int:
    with open(f"{path}/config.json", encoding="utf-8") as f:
        return json.load(f)["training"]["train_config"].get("unroll", 1)


if __name__ == "__main__":
    main()
