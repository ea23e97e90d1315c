"""A long prompt joins three running requests: how long the running ones wait between their rounds, and how long
the joiner waits for its first token, with its prompt entering whole (prefill_share 1) or in chunks.

The batch is driven directly (`metasd.batching.Batch`, what `metasd serve` runs; no HTTP): three everyday requests
decode (greedy, embedded model, float32, default pool and policy; past any end-of-sequence token, cut once the
joiner is answered); after ten steps a prompt of about 1,500 tokens (this project's own docs/design.md, to be
summarised) joins. A running request's gap is the time between two steps that gave it tokens; the joiner's time
to first token is from its join to its first token, against the same prompt joining an empty batch (its prefill
alone, then its first round).
Usage: python experiments/long_prompt_join.py [SHARE ...]   (default 1.0 0.67 0.6 0.5)
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from metasd import Decoder
from metasd.batching.batch import Batch

HERE = Path(__file__).parent
SHARES = [float(a) for a in sys.argv[1:]] or [1.0, 0.67, 0.6, 0.5]
RUNNING = [json.loads(line)["prompt"] for line in (HERE / "data/everyday_requests.jsonl").open()][:3]


def endless(decoder: Decoder, prompt: str):
    """A running request: up to 1,500 tokens past any end-of-sequence token, so that all three decode through the
    join (they are cut once the joiner has its answer)."""
    request = decoder.stream(prompt, max_new_tokens=1500)
    request.eos_token_ids = frozenset()
    return request


def long_prompt(decoder: Decoder, tokens: int = 1500) -> str:
    words = (HERE.parent / "docs/design.md").read_text().split()
    text = " ".join(words)
    ids = decoder.tokenizer(text)["input_ids"][:tokens]
    return "Summarize the following design notes in three sentences.\n\n" + decoder.tokenizer.decode(ids)


def time_to_first_token(decoder: Decoder, batch: Batch, request) -> float:
    start = time.perf_counter()
    batch.join(request)
    while not request.token_ids:
        batch.step()
    return time.perf_counter() - start


def join_while_running(decoder: Decoder, share: float, prompt: str) -> dict:
    batch = Batch(decoder, max_batch=4, prefill_share=share)
    running = [endless(decoder, p) for p in RUNNING]
    for request in running:
        batch.join(request)
    emitted = {id(r): [] for r in running}
    before_join: list[float] = []
    joiner, joined, first, steps, chunk_steps = None, None, None, 0, 0
    while joiner is None or not joiner.done:
        if steps == 10:
            joiner = decoder.stream(prompt, max_new_tokens=32)
            batch.join(joiner)
            joined = time.perf_counter()
            before_join = [b - a for times in emitted.values() for a, b in zip(times, times[1:], strict=False)]
        if joiner is not None and joiner in batch.joining:
            chunk_steps += 1
            assert all(r in batch.requests for r in running), "a running request ended during the join"
        out = batch.step()
        now = time.perf_counter()
        for request, tokens in out:
            if id(request) in emitted and tokens:
                emitted[id(request)].append(now)
            if request is joiner and tokens and first is None:
                first = now - joined
        steps += 1
    for request in running:
        batch.leave(request)
    gaps = [b - a for times in emitted.values() for a, b in zip(times, times[1:], strict=False)]
    return {
        "share": share,
        "median_gap": statistics.median(gaps),
        "median_before": statistics.median(before_join),
        "max_gap": max(gaps),
        "ttft": first,
        "steps_prefilling": chunk_steps,
        "prompt_tokens": len(joiner.prompt),
        "outputs": [r.token_ids for r in running] + [joiner.token_ids],
    }


def main() -> None:
    torch.set_num_threads(2)
    decoder = Decoder()
    prompt = long_prompt(decoder)
    warm = Batch(decoder, max_batch=4)
    time_to_first_token(decoder, warm, decoder.stream(RUNNING[0], max_new_tokens=1))
    alone = [
        time_to_first_token(decoder, Batch(decoder, max_batch=4), decoder.stream(prompt, max_new_tokens=1))
        for _ in range(2)
    ]
    reference = []
    for prompt_text in RUNNING:
        request = endless(decoder, prompt_text)
        for _ in request:
            pass
        reference.append(request.token_ids)
    reference.append(decoder.generate(prompt, max_new_tokens=32).token_ids)
    print(f"joiner alone: time to first token {min(alone):.3f} s (of {alone})")
    for share in SHARES:
        r = join_while_running(decoder, share, prompt)
        same = sum(a == b[: len(a)] for a, b in zip(r.pop("outputs"), reference, strict=True))
        print(
            f"share {share}: prompt {r['prompt_tokens']} tokens; running requests' median gap {r['median_gap']:.3f} s "
            f"({r['median_before']:.3f} s before the join), max {r['max_gap']:.3f} s "
            f"({r['max_gap'] / r['median_gap']:.1f}x the median, {r['max_gap'] / r['median_before']:.1f}x the median "
            f"before); joiner's time to first token "
            f"{r['ttft']:.3f} s ({r['ttft'] / min(alone):.2f}x alone) over {r['steps_prefilling']} steps; "
            f"outputs equal to decoding alone: {same} of 4",
            flush=True,
        )


if __name__ == "__main__":
    main()
