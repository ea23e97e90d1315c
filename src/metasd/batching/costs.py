"""What a batch round costs: T(B, W), the target's forward over B rows of W tokens each (padded to the widest),
measured on the machine for batch sizes 1, 2, 4, ... and interpolated between them.

A forward over B x W tokens costs about what one over B x W tokens of a single request costs where the machine is
compute bound, and much less than B separate forwards where it is bound by reading the weights; which, and where the
turn comes, differs by machine and dtype, so it is measured (cached on disk like T(M), `metasd.costs`) and then
refined by every batch round, as T(M) is.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from collections.abc import Sequence

import torch

from ..costs import CONTEXT, CostModel, TargetCost, cache_file, calibration_key
from ..draft import Draft
from ..slots import BatchedTarget
from ..tree import DraftTree


def batch_sizes(max_batch: int) -> list[int]:
    """The sizes calibration measures: 2, 4, 8 ... and max_batch itself (1 is the single request's T(M))."""
    sizes, b = [], 2
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch] if max_batch > 1 else []


class BatchCost:
    """T(B, W) in seconds: B = 1 is the decoder's own T(M); every larger B has a `TargetCost` over W, from the
    calibrated table of its size or interpolated between the nearest calibrated sizes, corrected by real rounds."""

    def __init__(self, costs: CostModel, tables: dict[int, list[float]], max_batch: int):
        self.costs = costs  # the decoder's: its T(M) (`costs.target`, replaced when the decoder extends its range)
        self.max_batch = max_batch
        self.by_size: dict[int, TargetCost] = {}
        known = sorted(tables)
        for b in range(2, max_batch + 1):
            lower = max((s for s in known if s <= b), default=known[0])
            upper = min((s for s in known if s >= b), default=known[-1])
            share = 0.0 if upper == lower else (b - lower) / (upper - lower)
            table = [(1 - share) * lo + share * hi for lo, hi in zip(tables[lower], tables[upper], strict=True)]
            self.by_size[b] = TargetCost(table, plain_steps=False)  # no batch round is forced plain

    def __call__(self, size: int, width: int) -> float:
        return self.costs.target(width) if size <= 1 else self.by_size[min(size, self.max_batch)](width)

    def widths(self, size: int, max_width: int) -> list[float]:
        """[T(size, 1), ..., T(size, max_width)]: one round's lookups at once."""
        return [self(size, w) for w in range(1, max_width + 1)]

    def observe(self, size: int, width: int, seconds: float) -> None:
        if size <= 1:
            self.costs.target.observe(width, seconds)
        else:
            self.by_size[min(size, self.max_batch)].observe(width, seconds)


@torch.inference_mode()
def calibrate_batch(model: torch.nn.Module, sizes: Sequence[int], max_width: int, reps: int = 2) -> dict[int, list]:
    """Median seconds of a batch forward over B rows of W new tokens after CONTEXT cached tokens per row, for each
    B in sizes and W = 1 .. max_width (widths interleaved within each repetition, the first pass a warm-up)."""
    vocab = int(model.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    out = {}
    for size in sizes:
        target = BatchedTarget(model, rows=size, capacity=CONTEXT + max_width + 1)
        cached = max(min(CONTEXT, target.context - max_width - 1), 0)  # a model with a short context: what fits
        rows = [target.add_row() for _ in range(size)]
        contexts = [torch.randint(0, vocab, (cached + max_width,), generator=gen).tolist() for _ in rows]
        for row, context in zip(rows, contexts, strict=True):
            target.prefill(row, context[: cached + 1])
        times: list[list[float]] = [[] for _ in range(max_width)]
        for rep in range(reps + 1):
            for width in range(1, max_width + 1):
                items = [
                    (row, c[: cached + 1], DraftTree.chain(Draft(c[cached + 1 : cached + width])))
                    for row, c in zip(rows, contexts, strict=True)
                ]
                start = time.perf_counter()
                target.forward(items)
                elapsed = time.perf_counter() - start
                for row, c in zip(rows, contexts, strict=True):
                    target.settle(row, c[: cached + 1])
                if rep:
                    times[width - 1].append(elapsed)
        out[size] = [statistics.median(t) for t in times]
    return out


def load_or_calibrate_batch(spec: str, model: torch.nn.Module, max_batch: int, max_width: int) -> dict[int, list]:
    """The T(B, W) tables from the disk cache, else measured now and cached (beside the T(M) calibration)."""
    sizes = batch_sizes(max_batch)
    key = {**calibration_key(spec, model, max_width), "batch_sizes": sizes}
    path = cache_file(key).with_name(cache_file(key).stem + "-batch.json")
    try:
        data = json.loads(path.read_text())
        if data["key"] == key and all(len(data["tables"][str(b)]) == max_width for b in sizes):
            return {b: [float(t) for t in data["tables"][str(b)]] for b in sizes}
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"ignoring the batch calibration cache {path}: {err}", stacklevel=2)
    tables = calibrate_batch(model, sizes, max_width)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"key": key, "tables": {str(b): t for b, t in tables.items()}}, indent=1))
        partial.replace(path)
    except OSError as err:
        warnings.warn(f"cannot write the batch calibration cache {path}: {err}", stacklevel=2)
    return tables
