"""Prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding): copy what followed the most
recent earlier occurrence of the context's last n tokens (n from `max_ngram` down to `min_ngram`). Ours adds a
confidence per draft from how far the match extends backwards (`match_signal`), for the adaptive policy."""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from ..draft import Draft
from ..sampling import SamplingParams
from .base import Drafter


class NgramDrafter(Drafter):
    """Prompt lookup decoding (Saxena 2023): copies what followed the latest earlier occurrence of the context's
    last n tokens, the longest n from `max_ngram` down to `min_ngram` that occurs; a free drafter."""

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
                signal = match_signal(_match_length(ids, int(hits[-1]), n))
                return Draft(tokens, confidence=[signal] * len(tokens))
        return Draft([])


MATCH_LEVELS = ((1, 0.1), (2, 0.3), (3, 0.5), (7, 0.7))  # match length up to L -> signal; longer: 0.9
LONGEST_MATCH = 16


def match_signal(length: int) -> float:
    """The confidence a copy gets from how long its match is: one signal level each for 1, 2, 3, 4-7 and 8+
    matched tokens (`acceptance.py` bins it in fifths). A 1-token match is a guess; an 8-token match is a copy."""
    return next((signal for most, signal in MATCH_LEVELS if length <= most), 0.9)


def _match_length(ids: np.ndarray, hit: int, n: int) -> int:
    """How far the match of the last n tokens at `hit` extends backwards (at most LONGEST_MATCH): the lookup only
    needs max_ngram tokens to find a copy, but the full length says how sure the copy is."""
    length, end = n, len(ids) - n
    while (
        length < LONGEST_MATCH
        and hit - (length - n) - 1 >= 0
        and ids[hit - (length - n) - 1] == ids[end - (length - n) - 1]
    ):
        length += 1
    return length
