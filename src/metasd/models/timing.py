"""Timing alternatives on a noisy machine (linear kernels, int8 or float weights, batch shapes): each one's median
seconds over some passes after a warm-up pass, the alternatives taking turns within every pass so that a slow spell
of the machine (another process, a clock change) hits them all alike; and a wall-clock time that covers the device's
queued work."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
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


def interleaved_medians(runs: Mapping[K, Callable[[], float]], reps: int) -> dict[K, float]:
    """Median of each run's seconds over `reps` passes after a warm-up pass, the runs in turn within each pass (in
    the mapping's order). A run returns the seconds it measured, so that its own setup stays out of them."""
    times: dict[K, list[float]] = {key: [] for key in runs}
    for rep in range(reps + 1):
        for key, run in runs.items():
            elapsed = run()
            if rep:  # the first pass warms up
                times[key].append(elapsed)
    return {key: statistics.median(t) for key, t in times.items()}
