"""What the training-time test costs by depth: seconds per training step of an EAGLE head for the embedded target
with `unroll` = 1, 2, 4, 8, on one batch size, from a small corpus of prefilled text (Python standard-library
sources: what a prefill corpus is made of; the content does not change a step's cost).

Usage: python experiments/eagle_unroll_cost.py [STEPS]   (default 6 steps per depth, the first one a warm-up)
"""

import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from metasd.models.loading import load_model
from metasd.specialists.eagle_corpus import read_corpus, write_corpus
from metasd.specialists.eagle_sequences import StoredSequences
from metasd.specialists.eagle_train import TrainConfig, train_head

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 6
BATCH_TOKENS = 4096


def main() -> None:
    target = load_model()
    text = "".join(p.read_text() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-c]*.py"))[:12])
    ids = target.tokenizer(text)["input_ids"]
    sequences = [ids[i : i + 512] for i in range(0, 512 * 24, 512)]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        write_corpus(target, sequences, corpus, max_new_tokens=0, batch_size=8)
        seqs = read_corpus(corpus)
        print(f"corpus: {len(seqs)} sequences, {sum(len(s.tokens) for s in seqs)} tokens; batch {BATCH_TOKENS} tokens")
        base = None
        for unroll in (1, 2, 4, 8):
            times: list[float] = []
            last = [time.perf_counter()]

            def tick(step: int, steps: int, metrics: dict, times=times, last=last) -> None:
                now = time.perf_counter()
                times.append(now - last[0])
                last[0] = now

            epochs = STEPS / (len(sequences) * 512 // BATCH_TOKENS)
            cfg = TrainConfig(epochs=epochs, batch_tokens=BATCH_TOKENS, draft_vocab=8192, unroll=unroll)
            last[0] = time.perf_counter()
            train_head(target, StoredSequences(seqs), Path(tmp) / f"head{unroll}", cfg, progress=tick)
            per_step = sorted(times[1:])[len(times[1:]) // 2]  # median, the first step a warm-up
            base = base or per_step
            print(f"unroll {unroll}: {per_step:.2f} s a step (median of {len(times) - 1}), {per_step / base:.2f}x")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
