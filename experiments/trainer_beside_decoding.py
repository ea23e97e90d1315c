"""Decoding beside a trainer that never pauses: does the trainer's form matter when serving keeps every core busy?

One batch of 8 short chat requests (192 new tokens each, greedy, embedded model, float32, default pool and policy,
`metasd.batching.Batch` as the server runs it) decodes beside, in turn: no trainer; a loop of optimiser steps in a
thread at nice 19 (as `metasd.learning` trains with `when_busy`); the same loop in a thread at Linux's SCHED_IDLE;
the same loop in a spawned process at SCHED_IDLE (its own interpreter and OpenMP team). A step is `head_loss` on a
copy of the shipped head over 512 positions of random tokens and features of the head's shapes, one torch thread,
no pause between steps. Reports tokens/s and the trainer's steps per pass, `--repeats` passes interleaved.
Linux only (SCHED_IDLE). Usage: python experiments/trainer_beside_decoding.py [--repeats 3]
"""

import argparse
import copy
import multiprocessing
import os
import statistics
import threading
import time

import torch

from metasd import Decoder
from metasd.batching.batch import Batch
from metasd.drafters.eagle import EagleDrafter
from metasd.specialists.eagle_loss import head_loss
from metasd.specialists.eagle_train import TrainConfig

PROMPTS = [
    "Write a haiku about rivers.",
    "List three prime numbers and explain why.",
    "Name two rivers in Europe.",
    "Explain what a hash table is.",
    "Write a short poem about autumn.",
    "How do I sort a list in Python?",
    "Describe the water cycle briefly.",
    "Give three tips for better sleep.",
]
MODES = ("none", "thread, nice 19", "thread, SCHED_IDLE", "process, SCHED_IDLE")
POSITIONS = 512


def train(head, embed, readout, width, stop, steps, idle: bool) -> None:
    """Optimiser steps until `stop`, counted in `steps` (a shared integer)."""
    torch.set_num_threads(1)
    thread = threading.get_native_id()
    if idle:
        os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.setpriority(os.PRIO_PROCESS, thread, 19)
    config = TrainConfig(noise=0.1, unroll=2, feature_layers=head.config.feature_layers, max_length=768)
    optimiser = torch.optim.AdamW(head.train().parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    while not stop.is_set():
        tokens = torch.randint(0, len(head.draft_vocab), (1, POSITIONS), generator=generator)
        features = torch.randn(1, POSITIONS, width, generator=generator)
        real = torch.ones(1, POSITIONS, dtype=torch.bool)
        loss, _ = head_loss(
            head, lambda ids: torch.nn.functional.embedding(ids, embed), readout, tokens, features, real, config
        )
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        with steps.get_lock():
            steps.value += 1


def decode(decoder: Decoder, max_new_tokens: int) -> float:
    """Tokens/s of the batch, joined at once and decoded to the end."""
    batch = Batch(decoder, max_batch=len(PROMPTS))
    requests = [decoder.stream(p, max_new_tokens=max_new_tokens) for p in PROMPTS]
    started = time.perf_counter()
    for request in requests:
        batch.join(request)
    while len(batch):
        batch.step()
    return sum(len(r.token_ids) for r in requests) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    args = parser.parse_args()
    decoder = Decoder()
    eagle = next(d for d in decoder.drafters.values() if isinstance(d, EagleDrafter))
    head = copy.deepcopy(eagle.loaded_head).float()
    width = next(m for m in head.modules() if isinstance(m, torch.nn.Linear)).in_features
    embed = decoder.target.model.get_input_embeddings().weight.detach().float()
    readout = decoder.target.model.get_output_embeddings().weight.detach()[head.draft_vocab].float().contiguous()
    spawn = multiprocessing.get_context("spawn")
    decode(decoder, args.max_new_tokens)  # warm-up: the first batch measures its costs
    results = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            stop, steps = spawn.Event(), spawn.Value("i", 0)
            job = (copy.deepcopy(head), embed, readout, width, stop, steps, mode.endswith("SCHED_IDLE"))
            worker = None
            if mode.startswith("thread"):
                worker = threading.Thread(target=train, args=job, daemon=True)
            elif mode.startswith("process"):
                worker = spawn.Process(target=train, args=job, daemon=True)
            if worker is not None:
                worker.start()
                time.sleep(8 if mode.startswith("process") else 1)  # the process imports torch and metasd first
            started = steps.value
            speed = decode(decoder, args.max_new_tokens)
            trained = steps.value - started
            stop.set()
            if worker is not None:
                worker.join(60)
            results[mode].append((speed, trained))
            print(
                f"pass {repeat + 1}, {mode}: {speed:.1f} tokens/s, trainer steps during the decode {trained}",
                flush=True,
            )
    base = statistics.mean(s for s, _ in results["none"])
    for mode, runs in results.items():
        speeds = [s for s, _ in runs]
        print(
            f"{mode}: mean {statistics.mean(speeds):.1f} tokens/s ({statistics.mean(speeds) / base:.2f}x none), "
            f"range {min(speeds):.1f}-{max(speeds):.1f}, trainer steps {[t for _, t in runs]}"
        )


if __name__ == "__main__":
    main()
