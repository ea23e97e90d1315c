"""A transformers user's own model object through `metasd.generate`: greedy output against `model.generate` on four
left-padded prompts at once, sampling reproduced by `torch.manual_seed`, and the process's memory before and after
the decoder is built (one copy of the target's weights, not two).

Usage: python experiments/hf_model_object.py [TARGET.gguf [DRAFTER.gguf]]
  no argument: the embedded model (float32); with a drafter, its object joins the pool as (model, tokenizer).
"""

import resource
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import metasd
from metasd.models.embedded import embedded_path

PROMPTS = [
    "Write a python function that reverses a list.",
    "Say only the word yes.",
    "Explain what a hash map is in two sentences.",
    "Write a bash one-liner that counts the lines of every .py file.",
]
NEW = 48


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load(path: Path):
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, tokenizer


def batch(tokenizer):
    rows = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer(rows, return_tensors="pt", padding=True, add_special_tokens=False)


def main() -> None:
    target_path = Path(sys.argv[1]) if len(sys.argv) > 1 else embedded_path()
    model, tokenizer = load(target_path)
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    # the default pool for the embedded model (its shipped EAGLE head included); the copy drafters for another
    drafters: list = list(metasd.drafters.DEFAULT_POOL) if len(sys.argv) == 1 else ["ngram", "suffix"]
    if len(sys.argv) > 2:
        drafters.append(load(Path(sys.argv[2])))
    inputs = batch(tokenizer)
    pad = tokenizer.pad_token_id
    print(f"target {target_path.name}: weights {weights_mb:.0f} MB, torch threads {torch.get_num_threads()}")

    start = time.perf_counter()
    want = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=pad)
    hf_seconds = time.perf_counter() - start

    before = rss_mb()
    decoder = metasd.hf.decoder_for(model, tokenizer, drafters, metasd.engine.DEFAULT_POLICY)
    after = rss_mb()
    print(f"RSS before the decoder {before:.0f} MB, after {after:.0f} MB: +{after - before:.0f} MB "
          f"({100 * (after - before) / weights_mb:.1f} % of the weights); pool {decoder.drafter_names}")  # fmt: skip

    metasd.generate(model, **inputs, max_new_tokens=4, tokenizer=tokenizer, drafters=drafters)  # warm-up
    start = time.perf_counter()
    got = metasd.generate(model, **inputs, max_new_tokens=NEW, tokenizer=tokenizer, drafters=drafters)
    metasd_seconds = time.perf_counter() - start
    same = [bool(torch.equal(g, w)) for g, w in zip(got, want, strict=True)]
    print(f"greedy, {len(PROMPTS)} left-padded prompts, {NEW} new tokens: rows equal to model.generate {same}")
    print(f"wall: model.generate {hf_seconds:.2f} s, metasd.generate {metasd_seconds:.2f} s "
          f"({hf_seconds / metasd_seconds:.2f}x)")  # fmt: skip

    options = {"max_new_tokens": 16, "do_sample": True, "temperature": 0.8, "tokenizer": tokenizer}
    for pool, policy in ((drafters, metasd.engine.DEFAULT_POLICY), (["ngram"], "metasd-ucb")):
        torch.manual_seed(0)
        first = metasd.generate(model, **inputs, drafters=pool, policy=policy, **options)
        torch.manual_seed(0)
        again = metasd.generate(model, **inputs, drafters=pool, policy=policy, **options)
        print(f"sampling, {policy} over {[d if isinstance(d, str) else 'lm' for d in pool]}, torch.manual_seed(0) "
              f"twice: identical {bool(torch.equal(first, again))}")  # fmt: skip


if __name__ == "__main__":
    main()
