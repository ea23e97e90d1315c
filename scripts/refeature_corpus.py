"""Give an EAGLE corpus written without fused features (or with others) the features a fused head reads: the same
sequences, shard by shard, with the outputs of --feature-layers and the final norm from one prefill per shard, so
the held-out split stays the same sequences. Resumable.
Usage: python scripts/refeature_corpus.py --source eagle-data/general --out eagle-data/general-fused
       [--feature-layers auto] [--target SPEC] [--dtype float32]"""

import argparse
import json
from pathlib import Path

from metasd.cli.train_eagle import feature_layers
from metasd.models.loading import load_model
from metasd.specialists.eagle_corpus import refeature_corpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--feature-layers", default="auto")
    parser.add_argument("--target", default=None)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    target = load_model(args.target, args.dtype)
    layers = feature_layers(args.feature_layers, target.model.config.num_hidden_layers)
    print(json.dumps(refeature_corpus(target, Path(args.source), Path(args.out), layers), indent=1))


if __name__ == "__main__":
    main()
