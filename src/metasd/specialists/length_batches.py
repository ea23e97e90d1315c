"""Batches of similar lengths, so that padding wastes little: how distillation, EAGLE training and a served head's
learner group their sequences."""

from __future__ import annotations


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length so that a batch pads little and holds about batch_tokens (padded) tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current, width = [], [], 0
    for i in order:
        n = lengths[i]
        if current and max(width, n) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, n)
    if current:
        batches.append(current)
    return batches
