"""Logits -> processed next-token probabilities, shared by the target and every drafter.

The Leviathan/Chen rule is lossless only when p and q are processed identically (same temperature, top-k, top-p),
so both sides go through `probabilities` with the same `SamplingParams`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (as vLLM): dividing logits by less overflows to inf/NaN
TOP_P_FLOOR = 1e-8  # smaller top_p is raised to it: the same tokens (the top one only, for any vocabulary under 1e8)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or anything below GREEDY_BELOW = 1e-5) means greedy; top_k 0 and top_p 1 disable those
    filters. From 1e-5 up, logits / temperature stays finite in float32 for any logit a model produces, and a top_p
    below TOP_P_FLOOR (which float32 would round to 0, dropping every token) is raised to it, so every accepted
    value gives finite probabilities."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.top_p < TOP_P_FLOOR:
            object.__setattr__(self, "top_p", TOP_P_FLOOR)

    @property
    def greedy(self) -> bool:
        """Whether these parameters mean greedy decoding (temperature below `GREEDY_BELOW`)."""
        return self.temperature < GREEDY_BELOW


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of logits [n, V] -> rows of probabilities [n, V] under temperature, top-k and top-p.

    Greedy decoding gets the plain temperature-1 softmax: a model drafter's confidence and its argmax come from it,
    and top-k / top-p cannot change an argmax, so the filters (a sort of the whole vocabulary) are skipped.
    """
    logits = logits.float()
    if params.greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p; the most likely token always stays, whatever top_p
        # rounds to, so a row can never become all zeros (NaN after normalising)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def pick(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token from a probability row: argmax when greedy."""
    if params.greedy:
        return int(torch.argmax(probs))
    return int(torch.multinomial(probs, 1, generator=generator))
