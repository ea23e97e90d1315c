"""Timing alternatives on a noisy machine (linear kernels, int8 or float weights, batch shapes): each one's median
seconds over some passes after a warm-up pass, the alternatives taking turns within every pass so that a slow spell
of the machine (another process, a clock change) hits them all alike; and a wall-clock time that covers the device's
queued work."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

K = TypeVar("K")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock time covers it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def seconds(run: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of `run()`, the device's work it queued included."""
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def interleaved_medians(run: Callable[[K], float], keys: Iterable[K], reps: int) -> dict[K, float]:
    """Median of `run(key)`'s seconds for each key over `reps` passes after a warm-up pass, the keys in turn within
    each pass (in their order). `run` returns the seconds it measured, so that its own setup stays out of them."""
    times: dict[K, list[float]] = {key: [] for key in keys}
    for rep in range(reps + 1):
        for key, spent in times.items():
            elapsed = run(key)
            if rep:  # the first pass warms up
                spent.append(elapsed)
    return {key: statistics.median(t) for key, t in times.items()}
