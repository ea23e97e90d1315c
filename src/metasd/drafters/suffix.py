"""Suffix drafting (SuffixDecoding-like): a frequency index of continuations over every suffix up to `depth`.

Two indexes: one over this request's context (prompt + generated so far), one over the outputs of earlier
requests of this process, which is what lets the drafter learn across requests. Each draft step follows the longest
suffix of (context + tokens drafted so far) found in either index and proposes its most frequent continuation.
Both indexes are updated incrementally: each new token costs `depth` dictionary updates.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from ..sampling import SamplingParams
from .base import Draft


class SuffixIndex:
    def __init__(self, depth: int):
        self.depth = depth
        self.next: defaultdict[tuple[int, ...], Counter[int]] = defaultdict(Counter)

    def add(self, tokens: list[int], start: int) -> None:
        """Index the continuations tokens[i] for every i >= start, keyed by the up-to-depth tokens before it."""
        for i in range(max(start, 1), len(tokens)):
            for n in range(1, min(self.depth, i) + 1):
                self.next[tuple(tokens[i - n : i])][tokens[i]] += 1

    def lookup(self, tokens: list[int]) -> tuple[int, int] | None:
        """(match length, most frequent next token) for the longest indexed suffix of tokens."""
        for n in range(min(self.depth, len(tokens)), 0, -1):
            counts = self.next.get(tuple(tokens[-n:]))
            if counts:
                return n, counts.most_common(1)[0][0]
        return None


class SuffixDrafter:
    has_cache = False  # indexing the missed tokens costs microseconds, not a forward pass

    def __init__(self, depth: int = 8, min_match: int = 1, history_requests: int = 256, name: str = "suffix"):
        if depth < 1 or min_match < 1:
            raise ValueError("suffix depth and min_match must be >= 1")
        self.name = name
        self.depth = depth
        self.min_match = min_match
        self.history_requests = history_requests
        self.local = SuffixIndex(depth)
        self.history = SuffixIndex(depth)
        self._outputs: list[list[int]] = []
        self._context: list[int] = []
        self._prompt_len = 0

    def begin(self, prompt: list[int]) -> None:
        self.local = SuffixIndex(self.depth)
        self._context = []
        self._prompt_len = len(prompt)

    def end(self, context: list[int]) -> None:
        """The request's whole output joins the cross-request history, including rounds this drafter sat out."""
        generated = list(context[self._prompt_len :])
        if not generated:
            return
        self._outputs.append(generated)
        if len(self._outputs) > self.history_requests:  # rebuild rather than grow without bound
            self._outputs = self._outputs[-self.history_requests :]
            self.history = SuffixIndex(self.depth)
            for out in self._outputs:
                self.history.add(out, 0)
        else:
            self.history.add(generated, 0)

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        self.local.add(context, len(self._context))
        self._context = list(context)
        seq = list(context[-self.depth :])
        draft: list[int] = []
        while len(draft) < k:
            best = max(
                (hit for hit in (self.local.lookup(seq), self.history.lookup(seq)) if hit), default=None,
                key=lambda hit: hit[0],
            )
            if best is None or best[0] < self.min_match:
                break
            draft.append(best[1])
            seq.append(best[1])
        return Draft(draft)
