"""Time `metasd.sampling.probabilities` against another version of the module, on the embedded model's own logits:
six rows at the end of its greedy answer to one everyday request (what one verification of a 5-token draft
processes), per call, for a few settings of temperature, top-k and top-p; and whether both give the same support.
Usage: git show REV:src/metasd/sampling.py > /tmp/sampling_before.py
       python experiments/sampling_filters.py /tmp/sampling_before.py"""

import importlib.util
import sys
import time

import torch

from metasd import sampling as current
from metasd.models.loading import load_model

SETTINGS = [(0.7, 0, 0.9), (0.7, 50, 0.9), (0.7, 50, 1.0), (1.0, 0, 0.95)]


def module_from(path: str):
    spec = importlib.util.spec_from_file_location("sampling_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def per_call(module, logits: torch.Tensor, params, calls: int = 300) -> float:
    for _ in range(30):
        module.probabilities(logits, params)
    started = time.perf_counter()
    for _ in range(calls):
        module.probabilities(logits, params)
    return (time.perf_counter() - started) / calls


def main() -> None:
    before = module_from(sys.argv[1])
    model = load_model()
    chat = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    ids = model.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        answer = model.model.generate(ids["input_ids"], max_new_tokens=40, do_sample=False)
        logits = model.model(answer).logits[0, -6:].float()
    for temperature, top_k, top_p in SETTINGS:
        old = per_call(before, logits, before.SamplingParams(temperature, top_k, top_p))
        new = per_call(current, logits, current.SamplingParams(temperature, top_k, top_p))
        a = current.probabilities(logits, current.SamplingParams(temperature, top_k, top_p))
        b = before.probabilities(logits, before.SamplingParams(temperature, top_k, top_p))
        print(
            f"temperature {temperature}, top-k {top_k}, top-p {top_p}: before {old * 1e6:.0f} us, now {new * 1e6:.0f} "
            f"us ({old / new:.2f}x); same support: {torch.equal(a > 0, b > 0)}, largest difference "
            f"{float((a - b).abs().max()):.1e}"
        )


if __name__ == "__main__":
    main()
