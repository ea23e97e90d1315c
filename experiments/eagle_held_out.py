"""Held-out agreement of trained EAGLE heads with their target, on the ~2 % of a corpus `train_head` keeps out:
a draft's first token (`top1`), its second from the head's own predicted feature (`top1_2`) and both in a row
(`both`), for heads trained on the same corpus with and without the training-time test or fused features.
python experiments/eagle_held_out.py [--target SPEC] [--dtype D] --corpus DIR [DIR ...] --heads HEAD_DIR [...]"""

import argparse
import json
from pathlib import Path

from metasd.models.eagle_head import load_head
from metasd.models.loading import load_model
from metasd.specialists.eagle_corpus import read_corpus
from metasd.specialists.eagle_train import TrainConfig, held_out_metrics, held_out_split


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--corpus", nargs="+", required=True)
    parser.add_argument("--heads", nargs="+", required=True)
    args = parser.parse_args()
    target = load_model(args.target, args.dtype)
    embed = target.model.get_input_embeddings()
    for path in args.heads:
        saved = load_head(path, target.model)
        layers = saved.head.config.feature_layers  # the corpus's features as this head reads them
        held, _ = held_out_split([s for d in args.corpus for s in read_corpus(Path(d), layers)])
        head = saved.head.float()
        cfg = TrainConfig(**saved.training.get("train_config", {}))
        readout = target.model.get_output_embeddings().weight[head.draft_vocab].detach().float()
        metrics = held_out_metrics(head, embed, readout, held, cfg)
        print(json.dumps({"head": path, "unroll": cfg.unroll, "layers": list(layers), **metrics}))


if __name__ == "__main__":
    main()
