"""A batch forward with transformers' own SDPA attention against metasd's (`metasd.models.attention`: grouped-query
keys and values handed to torch's kernel instead of repeated), alternating on one batch: the embedded model, 8 rows
whose cached contexts are alike (250 tokens each) or mixed (50-800), each row's width its new token plus a chain
draft, padded and packed forwards; medians of 10 of each after 2, in milliseconds, and whether the logits were
bitwise equal. Usage: python experiments/gqa_attention.py
"""

import statistics
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from metasd.draft import Draft
from metasd.models.attention import sdpa_attention
from metasd.models.loading import load_model
from metasd.slots import BatchedTarget
from metasd.tree import DraftTree

CONTEXTS = {"alike": [250] * 8, "mixed": [60, 70, 800, 50, 100, 700, 70, 100]}
WIDTHS = ["11111111", "33333333", "21212121"]
ATTENTION = {"transformers": sdpa_attention_forward, "metasd": sdpa_attention}
model = load_model(None, "float32").model
gen = torch.Generator().manual_seed(0)


def run(lengths: list[int], widths: str, pack: bool) -> tuple[dict[str, float], bool]:
    """Median ms per attention, and whether both gave the same logits on every forward."""
    target = BatchedTarget(model, rows=8, capacity=1024)
    target.PACK_WHEN_PADDED = 0.0 if pack else float("inf")
    rows = [target.add_row() for _ in widths]
    contexts = [torch.randint(0, 40000, (n,), generator=gen).tolist() for n in lengths]
    for row, context in zip(rows, contexts, strict=True):
        target.prefill(row, context)
    times, same = {name: [] for name in ATTENTION}, True
    for _ in range(12):
        items = []
        for row, context, width in zip(rows, contexts, widths, strict=True):
            draft = torch.randint(0, 40000, (int(width) - 1,), generator=gen).tolist()
            items.append((row, context, DraftTree.chain(Draft(draft))))
        logits = {}
        for name, attention in ATTENTION.items():  # the same forward twice: the rows' slots are rewritten alike
            ALL_ATTENTION_FUNCTIONS.register("sdpa", attention)
            started = time.perf_counter()
            logits[name] = target.forward(items)
            times[name].append(time.perf_counter() - started)
        same &= all(torch.equal(a, b) for a, b in zip(*logits.values(), strict=True))
        for context in contexts:
            context.append(int(torch.randint(0, 40000, (1,), generator=gen)))
    ALL_ATTENTION_FUNCTIONS.register("sdpa", sdpa_attention)
    return {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}, same


print("| contexts | widths | forward | transformers' (ms) | metasd's (ms) | ratio | same logits |")
print("|---|---|---|---:|---:|---:|---|")
for label, lengths in CONTEXTS.items():
    for widths in WIDTHS:
        for pack in (False, True):
            ms, same = run(lengths, widths, pack)
            ratio = ms["metasd"] / ms["transformers"]
            kind = "packed" if pack else "padded"
            cells = [label, widths, kind, f"{ms['transformers']:.1f}", f"{ms['metasd']:.1f}", f"{ratio:.2f}", str(same)]
            print("| " + " | ".join(cells) + " |", flush=True)
