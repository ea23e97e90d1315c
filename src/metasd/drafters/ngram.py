"""Prompt lookup (Saxena 2023): copy what followed the most recent earlier occurrence of the context's tail."""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from ..sampling import SamplingParams
from .base import Draft


class NgramDrafter:
    has_cache = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "ngram"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes need 1 <= min <= max, got min={min_ngram} max={max_ngram}")
        self.name = name
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def begin(self, prompt: list[int]) -> None:
        pass

    def end(self, context: list[int]) -> None:
        pass

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        ids = np.asarray(context, dtype=np.int64)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            tail = ids[-n:]
            windows = sliding_window_view(ids[:-1], n)  # every earlier n-gram, excluding the tail itself
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                tokens = ids[start : start + k].tolist()
                return Draft(tokens, confidence=[n / self.max_ngram] * len(tokens))  # longer match, surer copy
        return Draft([])
