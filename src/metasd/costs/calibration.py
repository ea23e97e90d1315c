"""Measuring the target's forward on this machine: T(M) for one request (`calibrate`: M = 1 .. max new tokens under
each linear kernel of `metasd.models.linear_kernels`, the faster kept per M) and T(B, W) for batches of B rows of W
tokens (`calibrate_batch`, B = 2, 4, ... max batch), both cached on disk per model, dtype, thread count, machine and
linear kernels (`metasd calibrate` prints them). A table measured while other processes kept the CPUs busy serves
the run that measured it but is not cached (`quiet_since`): every later run would inherit its contention. A forward
over B x W tokens costs about what one over B x W tokens of a single request costs where the machine is compute
bound, and much less than B separate forwards where it is bound by reading the weights; which, and where the turn
comes, differs by machine and dtype, so it is measured."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from transformers import DynamicCache

from ..draft import Draft
from ..files import written_aside
from ..machine import cpu_name
from ..models.attention import ATTENTION
from ..models.embedded import cache_dir
from ..models.linear_kernels import KERNELS, install
from ..models.timing import interleaved_medians, seconds
from ..slots import BatchedTarget
from ..tree import DraftTree
from .model import CostModel, TargetCost

T = TypeVar("T")
CONTEXT = 256  # tokens already in the cache when timing: a typical prompt, so attention is not free
CONTENDED = 0.25  # other processes' share of the machine's CPU time above which a measured table is not cached
PREFILL_REPS = 2  # timed prefills of CONTEXT tokens per kernel: each costs as much as tens of short forwards
MIN_WINDOW = 50  # ticks per CPU (half a second at Linux's usual 100 a second) a contention reading needs


@dataclass(frozen=True)
class Calibration:
    """T(M) in seconds for M = 1 .. len(table), the linear kernel (`linear_kernels`) each M was fastest under, and
    the one a prefill of CONTEXT tokens was fastest under (`beyond`: every longer input's)."""

    table: list[float]
    kernels: list[str]
    beyond: str


@torch.inference_mode()
def calibrate(
    model: torch.nn.Module, max_tokens: int, context: int = CONTEXT, reps: int = 5, candidates: Sequence[str] = KERNELS
) -> Calibration:
    """Median seconds of a cached forward over M new tokens after `context` cached tokens, M = 1 .. max_tokens,
    under each candidate linear kernel; the faster kernel per M is installed on `model` and its time kept, and
    the kernel under which the prefill of the `context` tokens was fastest routes every input past max_tokens.

    The (M, kernel) pairs are interleaved within each repetition, so a slow spell of the machine hits all alike.
    """
    vocab = int(model.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    if device.type != "cpu":  # oneDNN's kernel is a CPU's: elsewhere it would time torch's own under another name
        candidates = [kernel for kernel in candidates if kernel != "onednn"]
    ids = torch.randint(0, vocab, (1, context + max_tokens), generator=gen).to(device)
    cache = DynamicCache(config=model.config)

    def prefill(kernel: str) -> float:  # leaves `cache` holding the context for the timings of M after it
        nonlocal cache
        install(model, [kernel] * max_tokens, beyond=kernel, keep=True)
        cache = DynamicCache(config=model.config)
        return seconds(lambda: model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1), device)

    prefills = interleaved_medians(prefill, candidates, PREFILL_REPS)
    beyond = min(candidates, key=prefills.__getitem__)

    def step(key: tuple[int, str]) -> float:
        m, kernel = key
        install(model, [kernel] * max_tokens, beyond=beyond, keep=True)
        new = ids[:, context : context + m]
        elapsed = seconds(lambda: model(input_ids=new, cache=cache, use_cache=True, logits_to_keep=m), device)
        cache.crop(-m)
        return elapsed

    medians = interleaved_medians(step, [(m, k) for m in range(1, max_tokens + 1) for k in candidates], reps)
    kernels = [min(candidates, key=lambda k, m=m: medians[m, k]) for m in range(1, max_tokens + 1)]
    install(model, kernels, beyond)
    return Calibration([medians[m, k] for m, k in enumerate(kernels, 1)], kernels, beyond)


def calibration_key(spec: str, model: torch.nn.Module, max_tokens: int, candidates: Sequence[str] = KERNELS) -> dict:
    """Everything T(M) depends on: a table measured under another key is foreign."""
    import transformers

    device = next(model.parameters()).device
    return {
        "model": spec,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type}:{cpu_name()}",
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "context": CONTEXT,
        "max_tokens": max_tokens,
        "kernels": list(candidates),
        "attention": ATTENTION,
    }


def cache_file(key: dict) -> Path:
    """Where the calibration measured under `key` (`calibration_key`) is cached on disk."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "calibration" / f"{digest}.json"


def batch_cache_file(key: dict) -> Path:
    """Where the T(B, W) tables measured under `key` are cached: beside T(M)'s file."""
    beside = cache_file(key)
    return beside.with_name(beside.stem + "-batch.json")


def _read(path: Path, key: dict, parse: Callable[[dict, dict], T]) -> T | None:
    """What `parse` makes of the calibration cached at `path` under `key` (from the file's data and the key), or
    None, with a warning when a file is there but unusable: corrupt, foreign, or malformed (`parse` raises)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            raise ValueError("it was measured for another model, dtype or machine")
        return parse(data, key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        warnings.warn(f"ignoring the calibration cache {path}: {err}", stacklevel=3)
        return None


def _times(table: Sequence, width: int) -> list[float]:
    """A cached table of `width` times in seconds, each positive and finite, else ValueError."""
    times = [float(t) for t in table]
    if len(times) != width or not all(0 < t < math.inf for t in times):
        raise ValueError("a table is malformed")
    return times


def _calibration(data: dict, key: dict) -> Calibration:
    """A cached T(M) calibration: its table and the kernel chosen per M."""
    table, kernels = _times(data["table"], key["max_tokens"]), [str(k) for k in data["kernels"]]
    beyond = str(data.get("beyond", KERNELS[0]))  # tables cached before it was measured routed them to torch's own
    if len(kernels) != len(table) or not {*kernels, beyond} <= set(key["kernels"]):
        raise ValueError("its kernels are malformed")
    return Calibration(table, kernels, beyond)


def _batch_tables(data: dict, key: dict) -> dict[int, list[float]]:
    """Cached T(B, W) tables, per batch size."""
    return {int(b): _times(table, key["max_tokens"]) for b, table in data["tables"].items()}


def cpu_ticks() -> tuple[int, int, int] | None:
    """(ticks of the CPUs this process may run on, the busy ones among them, this process's own), counted since boot
    and since the process started, from Linux's /proc (steal counts as busy: another machine's work); None where
    they cannot be read. Only differences between two readings mean anything."""
    try:
        allowed = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        total = busy = 0
        for line in Path("/proc/stat").read_text().splitlines()[1:]:
            name, *fields = line.split()
            if name in allowed:  # user nice system idle iowait irq softirq steal (guest time is within user)
                values = [int(v) for v in fields[:8]]
                total, busy = total + sum(values), busy + sum(values) - values[3] - values[4]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # the fields after the command's name
        return (total, busy, int(own[11]) + int(own[12])) if total else None  # utime, stime: fields 14 and 15
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, or no sched_getaffinity (not Linux)
        return None


def quiet_since(before: tuple[int, int, int] | None, what: str) -> bool:
    """Whether other processes left this one's CPUs to it since `before` (`cpu_ticks`): at most `CONTENDED` of
    their time was others'. If not, a warning: the table just measured serves this run and is not cached. A window
    of under `MIN_WINDOW` ticks per CPU (a tiny model's calibration) says nothing either way: cached."""
    after = cpu_ticks()
    if before is None or after is None:
        return True  # unknown: cached, as on a machine without /proc
    total, busy, own = (a - b for a, b in zip(after, before, strict=True))
    if total < MIN_WINDOW * len(os.sched_getaffinity(0)):
        return True
    others = max(busy - own, 0) / total
    if others <= CONTENDED:
        return True
    warnings.warn(
        f"other processes used {others:.0%} of the CPUs while {what} was measured: it serves this run and is not "
        "cached; measure it on a quiet machine (metasd calibrate --refresh)",
        stacklevel=3,
    )
    return False


def _watch(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """`cpu_ticks` now, where the model computes on the CPU (another process's CPU time says nothing of a GPU's)."""
    return cpu_ticks() if next(model.parameters()).device.type == "cpu" else None


def _write(path: Path, data: dict) -> None:
    """A calibration cached whole or not at all; a read-only home still decodes, it only calibrates again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with written_aside(path) as aside:
            aside.write_text(json.dumps(data, indent=1))
    except OSError as err:
        warnings.warn(f"cannot write the calibration cache {path}: {err}", stacklevel=3)


def load_or_calibrate(
    spec: str, model: torch.nn.Module, max_tokens: int, refresh: bool = False, candidates: Sequence[str] = KERNELS
) -> Calibration:
    """T(M) for M = 1 .. max_tokens from the disk cache, else measured now (seconds) and cached; either way the
    model's linear layers are routed to the kernels the calibration chose among `candidates`."""
    key = calibration_key(spec, model, max_tokens, candidates)
    path = cache_file(key)
    found = None if refresh else _read(path, key, _calibration)
    if found is not None:
        install(model, found.kernels, found.beyond)
        return found
    before = _watch(model)
    found = calibrate(model, max_tokens, candidates=candidates)
    if quiet_since(before, "T(M)"):
        _write(path, {"key": key, "table": found.table, "kernels": found.kernels, "beyond": found.beyond})
    return found


def batch_sizes(max_batch: int) -> list[int]:
    """The sizes calibration measures: 2, 4, 8 ... and max_batch itself (1 is the single request's T(M))."""
    sizes, b = [], 2
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch] if max_batch > 1 else []


@torch.inference_mode()
def calibrate_batch(model: torch.nn.Module, sizes: Sequence[int], max_width: int, reps: int = 2) -> dict[int, list]:
    """Median seconds of a batch forward over B rows of W new tokens after CONTEXT cached tokens per row, for each
    B in sizes and W = 1 .. max_width (widths interleaved within each repetition, the first pass a warm-up)."""
    vocab = int(model.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    out = {}
    for size in sizes:
        target = BatchedTarget(model, rows=size, capacity=CONTEXT + max_width + 1)
        cached = max(min(CONTEXT, target.context - max_width - 1), 0)  # a model with a short context: what fits
        rows = [target.add_row() for _ in range(size)]
        contexts = [torch.randint(0, vocab, (cached + max_width,), generator=gen).tolist() for _ in rows]
        for row, context in zip(rows, contexts, strict=True):
            target.prefill(row, context[: cached + 1])

        def forward(width: int, rows=rows, contexts=contexts, target=target, cached=cached) -> float:
            items = [
                (row, c[: cached + 1], DraftTree.chain(Draft(c[cached + 1 : cached + width])))
                for row, c in zip(rows, contexts, strict=True)
            ]
            elapsed = seconds(lambda: target.forward(items), device)
            for row, c in zip(rows, contexts, strict=True):
                target.settle(row, c[: cached + 1])
            return elapsed

        widths = range(1, max_width + 1)
        medians = interleaved_medians(forward, widths, reps)
        out[size] = [medians[width] for width in widths]
    return out


def load_or_calibrate_batch(
    spec: str,
    model: torch.nn.Module,
    max_batch: int,
    max_width: int,
    candidates: Sequence[str] = KERNELS,
    refresh: bool = False,
) -> dict[int, list]:
    """The T(B, W) tables for `batch_sizes(max_batch)`, W = 1 .. max_width: from the disk cache (one file per model,
    machine, width range and kernel candidates, beside the T(M) calibration, a table per size), and measured now
    for the sizes it lacks (a later, larger batch measures only its new sizes), which are then added to it.
    refresh: measure every size again (the sizes cached beyond them are kept)."""
    key, sizes = calibration_key(spec, model, max_width, candidates), batch_sizes(max_batch)
    path = batch_cache_file(key)
    cached = _read(path, key, _batch_tables) or {}
    if refresh:
        cached = {b: t for b, t in cached.items() if b not in sizes}
    missing = [b for b in sizes if b not in cached]
    if missing:
        before = _watch(model)
        cached.update(calibrate_batch(model, missing, max_width))
        if quiet_since(before, "T(B, W)"):
            _write(path, {"key": key, "tables": {str(b): t for b, t in sorted(cached.items())}})
    return {b: cached[b] for b in sizes}


def calibrated(
    costs: CostModel | None,
    spec: str,
    model: torch.nn.Module,
    max_tokens: int,
    max_batch: int = 1,
    candidates: Sequence[str] = KERNELS,
) -> CostModel:
    """`costs` (a new model when None) covering T(M) for M = 1 .. max_tokens and T(B, W) for B up to max_batch and
    every batch size it already holds, over the same widths, so that widening T(M) widens the tables a running
    batch reads: what it lacks is read from the disk cache or measured, both tables before either is kept (a
    calibration that raises leaves `costs` as it was)."""
    widths = max_tokens if costs is None else max(max_tokens, costs.target.max_tokens)
    table = None
    if costs is None or costs.target.max_tokens < max_tokens:
        table = load_or_calibrate(spec, model, max_tokens, candidates=candidates).table
    batch = max([max_batch, *(costs.rows if costs is not None else ())])
    tables = None
    if batch > 1 and (costs is None or not costs.covers(batch, widths)):
        tables = load_or_calibrate_batch(spec, model, batch, widths, candidates)
    if costs is None:
        costs = CostModel(TargetCost(table))
    elif table is not None:
        costs.target = TargetCost(table)
    if tables is not None:
        costs.add_batch_tables(tables, batch)
    return costs
