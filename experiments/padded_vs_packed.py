"""A batch forward over rows of slots padded to the widest row against the same forward packed (`ragged`), for
mixes of row widths (a row's new token plus its draft; `-` a row fed nothing between fed ones): the embedded model,
8 rows of 200-270 cached tokens, padded and packed forwards alternating, medians of 20 of each after 5
(python experiments/padded_vs_packed.py). What `BatchedTarget.PACK_WHEN_PADDED` is set from."""

import statistics
import time

import torch

from metasd.draft import Draft
from metasd.models.loading import load_model
from metasd.slots import BatchedTarget
from metasd.tree import DraftTree

MIXES = [
    "11111111",
    "2222-222",
    "43333333",
    "1-1-1111",
    "1-1-1-11",
    "1------1",
    "33333333",
    "63333333",
    "62315114",
    "61111111",
    "4------2",
    "66666666",
]
model = load_model(None, "float32").model
gen = torch.Generator().manual_seed(0)


def medians_ms(mix: str) -> tuple[float, float]:
    """(padded, packed): forwards of the two kinds alternating on one batch, so that drift hits both alike."""
    target = BatchedTarget(model, rows=8, capacity=512)
    rows = [target.add_row() for _ in mix]
    contexts = [torch.randint(0, 40000, (200 + 10 * i,), generator=gen).tolist() for i in range(len(mix))]
    for row, context in zip(rows, contexts, strict=True):
        target.prefill(row, context)
    times = {0.0: [], float("inf"): []}
    for n in range(50):
        target.PACK_WHEN_PADDED = float("inf") if n % 2 else 0.0
        items = []
        for row, context, width in zip(rows, contexts, mix, strict=True):
            if width != "-":
                context.append(int(torch.randint(0, 40000, (1,), generator=gen)))
                draft = torch.randint(0, 40000, (int(width) - 1,), generator=gen).tolist()
                items.append((row, context, DraftTree.chain(Draft(draft))))
        started = time.perf_counter()
        target.forward(items)
        times[target.PACK_WHEN_PADDED].append(time.perf_counter() - started)
    return tuple(statistics.median(times[key][5:]) * 1e3 for key in (float("inf"), 0.0))


print("| widths | padded / fed positions | padded ms | packed ms | packed / padded |")
print("|---|---|---|---|---|")
for mix in MIXES:
    fed = sum(int(w) for w in mix if w != "-")
    padded, packed = medians_ms(mix)
    print(
        f"| {mix} | {len(mix) * max(int(w) for w in mix if w != '-') / fed:.2f} | {padded:.1f} | {packed:.1f} | "
        f"{packed / padded:.2f} |",
        flush=True,
    )
