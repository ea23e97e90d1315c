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
    """Rows of logits [n, V] -> rows of probabilities [n, V] under temperature, top-k and top-p (transformers'
    warpers in that order: every logit not below the k-th largest, then the smallest set of the likeliest whose mass
    reaches top_p).

    Greedy decoding gets the plain temperature-1 softmax: a model drafter's confidence and its argmax come from it,
    and top-k / top-p cannot change an argmax, so the filters are skipped. With top-k, the k likeliest are all that
    is computed on (`torch.topk` once, then softmax and nucleus over k values, scattered back), unless a tie at the
    k-th value keeps more than k in.
    """
    logits = logits.float()
    if params.greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        top, order = torch.topk(logits, params.top_k, dim=-1)  # descending
        kth = top[..., -1:]
        if not bool(((logits >= kth).sum(-1) > params.top_k).any()):
            top = torch.softmax(top, dim=-1)
            kept = _nucleus_of_sorted(top, params.top_p) if params.top_p < 1.0 else top
            return torch.zeros_like(logits).scatter_(-1, order, kept)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


NUCLEUS_FIRST = 64  # the likeliest tokens a top-p nucleus is first looked for among


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Each row kept to the smallest set of its likeliest tokens whose mass reaches top_p, renormalised
    (`_nucleus_of_sorted`).

    The nucleus is looked for among the `NUCLEUS_FIRST` likeliest tokens (`torch.topk`), four times as many while
    some row's mass falls short, instead of sorting the whole vocabulary (tens of milliseconds a round on CPU for a
    49k vocabulary): the prefix sums of that sorted prefix are those of the full sort, so it is the same nucleus."""
    if probs.numel() == 0:
        return probs
    support = int((probs > 0).sum(-1).max())  # a top-k filter before leaves about k
    width = min(NUCLEUS_FIRST, support)
    while True:
        whole = width == probs.shape[-1]
        top, order = torch.sort(probs, dim=-1, descending=True) if whole else torch.topk(probs, width, dim=-1)
        if width == support or bool((top.cumsum(-1)[..., -1] >= top_p).all()):
            break
        width = min(4 * width, support)
        if 8 * width > probs.shape[-1]:  # a flat row: one sort beats growing further
            width = support
    return torch.zeros_like(probs).scatter_(-1, order, _nucleus_of_sorted(top, top_p))


def _nucleus_of_sorted(top: torch.Tensor, top_p: float) -> torch.Tensor:
    """Rows of probabilities in descending order -> each row's shortest prefix whose mass reaches top_p,
    renormalised, zeros after it; the first token always stays, whatever top_p rounds to, so a row never becomes
    all zeros (NaN after normalising)."""
    keep = top.cumsum(-1) - top < top_p  # the mass before each token
    keep[..., 0] = True
    kept = top * keep
    return kept / kept.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a row of probabilities [V] (non-negative weights, their sum need not be exactly 1): the
    inverse of its cumulative distribution (float64) at one uniform draw. `torch.multinomial` draws an exponential
    per vocabulary entry for a single sample, about a millisecond over a 49k vocabulary on CPU."""
    row = probs.detach().to("cpu", torch.float64)
    cdf = row.cumsum(-1)
    if row.dim() != 1 or not 0 < float(cdf[-1]) < math.inf or float(row.min()) < 0:
        raise ValueError("draw takes one row of non-negative, finite weights with a positive sum")
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True))  # the first entry whose mass lies above u: never a zero
    return index if index < len(cdf) else int(torch.nonzero(row)[-1])  # u rounded up to the total


def pick(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token from a probability row: argmax when greedy."""
    if params.greedy:
        return int(torch.argmax(probs))
    return draw(probs, generator)
