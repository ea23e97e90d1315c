"""How much of what the target writes a draft vocabulary can draft at all: the share of the answer tokens of a
corpus (`write_corpus`'s output, e.g. the target's answers to the everyday requests) inside each head's draft
vocabulary, and inside the N most frequent tokens of ShareGPT conversations (the first --count of a JSONL file of
`{"conversations": [...]}` records, tokenized whole) for each N of --sizes. A token outside the draft vocabulary is
one no draft gets right, so the share bounds a head's first-token agreement.

Usage: python experiments/draft_vocab_coverage.py --corpus DIR [--heads HEAD_DIR ...] [--texts FILE] [--count 1500]
    [--sizes 8192,16384,32768] [--target SPEC]
"""

import argparse
import json
from pathlib import Path

import torch

from metasd.models.eagle_head import load_head
from metasd.models.loading import load_model
from metasd.specialists.eagle_corpus import read_corpus


def text_counts(tokenizer, path: str, count: int, vocab: int) -> torch.Tensor:
    """Token counts over the first `count` conversations of `path`, their turns joined by spaces."""
    counts = torch.zeros(vocab)
    with open(path) as f:
        for line, _ in zip(f, range(count), strict=False):
            text = " ".join(turn.get("value", "") for turn in json.loads(line)["conversations"])
            ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
            counts += torch.bincount(ids[ids < vocab], minlength=vocab).float()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--heads", nargs="*", default=[])
    parser.add_argument("--texts", default=None)
    parser.add_argument("--count", type=int, default=1500)
    parser.add_argument("--sizes", default="8192,16384,32768")
    parser.add_argument("--target", default=None)
    args = parser.parse_args()
    target = load_model(args.target, "float32")
    vocab = target.model.get_output_embeddings().weight.shape[0]
    answers = torch.cat([s.tokens[s.prompt :] for s in read_corpus(Path(args.corpus))]).long()
    print(json.dumps({"corpus": args.corpus, "answer_tokens": len(answers)}))
    for path in args.heads:
        inside = torch.zeros(vocab, dtype=torch.bool)
        inside[load_head(path, target.model).head.draft_vocab] = True
        print(
            json.dumps(
                {"head": path, "size": int(inside.sum()), "coverage": round(inside[answers].float().mean().item(), 4)}
            )
        )
    if args.texts:
        order = text_counts(target.tokenizer, args.texts, args.count, vocab).argsort(descending=True)
        for size in (int(n) for n in args.sizes.split(",")):
            inside = torch.zeros(vocab, dtype=torch.bool)
            inside[order[:size]] = True
            print(json.dumps({"texts_top": size, "coverage": round(inside[answers].float().mean().item(), 4)}))


if __name__ == "__main__":
    main()
