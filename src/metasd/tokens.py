"""Token lists: how far two agree (every cache compares the context it holds with the one asked for, every round)
and a generation setting's token ids as a list."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix, by bisection on slice equality.

    List comparison runs in C, so this costs O(n log n) machine steps instead of n Python steps: contexts grow
    to thousands of tokens and it is called for every cache every round.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def token_ids(ids: int | Sequence[int] | torch.Tensor | None) -> list[int]:
    """A generation setting naming tokens (`eos_token_id`: None, an id, a list or a tensor of ids) as a list."""
    if ids is None:
        return []
    if isinstance(ids, torch.Tensor):
        return [int(i) for i in ids.flatten().tolist()]
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
