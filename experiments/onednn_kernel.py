"""The three linear kernels of `metasd.models.linear_kernels` on this machine: each distinct weight shape of the
embedded model multiplied by M rows (torch's F.linear, the weight-major layout, oneDNN on a reordered copy), then
a whole cached forward over M new tokens after 256 cached ones under each kernel (the product of every M and of
the 256-token prefill on one kernel), kernels interleaved within each repetition; medians in milliseconds, and
whether oneDNN's first row is bitwise the same whatever M is. Usage: python experiments/onednn_kernel.py
"""

import statistics
import time

import torch
from transformers import DynamicCache

from metasd.models.linear_kernels import KERNELS, install
from metasd.models.loading import load_model

ROWS = (1, 2, 4, 8, 13, 64, 256)
FORWARD_ROWS = (1, 2, 3, 4, 6, 8, 13)
model = load_model(None, "float32").model
gen = torch.Generator().manual_seed(0)


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def products() -> None:
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    print("| weight (out x in) | M | " + " | ".join(f"{k} ms" for k in KERNELS) + " | linear / onednn | row 0 same |")
    print("|---|---:|" + "---:|" * (len(KERNELS) + 1) + "---|")
    for out_f, in_f in shapes:
        layer = torch.nn.Linear(in_f, out_f, bias=False)
        holder = torch.nn.Sequential(layer)
        x = torch.randn(max(ROWS), in_f, generator=gen)
        install(holder, ["onednn"], beyond="onednn", keep=True)
        first = layer(x[:1])
        for m in ROWS:
            rows, ms = x[:m], {}
            for kernel in KERNELS:
                install(holder, [kernel] * max(ROWS), beyond=kernel, keep=True)
                ms[kernel] = median_ms(lambda rows=rows, layer=layer: layer(rows), 20 if m <= 13 else 5)
            same = torch.equal(layer(rows)[:1], first)  # the last kernel timed is oneDNN
            cells = " | ".join(f"{ms[k]:.3f}" for k in KERNELS)
            print(f"| {out_f} x {in_f} | {m} | {cells} | {ms['linear'] / ms['onednn']:.2f} | {same} |")


@torch.inference_mode()
def forwards(reps: int = 6, context: int = 256) -> None:
    ids = torch.randint(0, 40000, (1, context + max(FORWARD_ROWS)), generator=gen)
    times = {(k, m): [] for k in KERNELS for m in (*FORWARD_ROWS, context)}
    for rep in range(reps + 1):
        for kernel in KERNELS:
            install(model, [kernel] * max(FORWARD_ROWS), beyond=kernel, keep=True)
            cache = DynamicCache(config=model.config)
            start = time.perf_counter()
            model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
            if rep:
                times[kernel, context].append(time.perf_counter() - start)
            for m in FORWARD_ROWS:
                start = time.perf_counter()
                model(input_ids=ids[:, context : context + m], cache=cache, use_cache=True, logits_to_keep=m)
                if rep:
                    times[kernel, m].append(time.perf_counter() - start)
                cache.crop(-m)
    print("\n| kernel | " + " | ".join(f"T({m})" for m in FORWARD_ROWS) + f" | prefill of {context} |")
    print("|---|" + "---:|" * (len(FORWARD_ROWS) + 1))
    for kernel in KERNELS:
        cells = [f"{statistics.median(times[kernel, m]) * 1e3:.1f}" for m in (*FORWARD_ROWS, context)]
        print(f"| {kernel} | " + " | ".join(cells) + " |")


products()
forwards()
