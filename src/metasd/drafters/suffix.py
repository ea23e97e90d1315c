"""Suffix drafting after SuffixDecoding (Oliaro et al., arXiv 2411.04975): a frequency index of continuations.

SuffixDecoding keeps suffix trees over the prompt and earlier outputs and drafts a tree of frequent continuations;
here a dictionary over every suffix up to `depth` tokens stands in for the trees, and a draft is one path. Two
indexes: one over this request's context (prompt + generated so far), one over the outputs of earlier
requests of this process, which is what lets the drafter learn across requests. Each draft step follows the longest
suffix of (context + tokens drafted so far) found in either index and proposes its most frequent continuation.
Both indexes are updated incrementally: each new token costs `depth` dictionary updates, and so does each token of
an output evicted from the history (the oldest outputs leave once a history holds more than `history_requests`
outputs, or all histories together more than `history_tokens` tokens), so a request never costs more than its own
tokens plus the ones it evicts.

Privacy: the history is shared by every request unless the caller picks another one with `use_history` (the
server does this per API key, or turns it off): a draft reveals what earlier outputs in the same history contained.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict, deque

import torch

from ..draft import Draft
from ..sampling import SamplingParams
from ..tokens import common_prefix
from .base import Drafter

SHARED = ""  # the key of the default, process-wide history


class SuffixIndex:
    """Counts of the token that follows each run of up to `depth` tokens: the frequency index SuffixDecoding's
    suffix trees stand for (Oliaro et al., arXiv 2411.04975)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.next: defaultdict[tuple[int, ...], Counter[int]] = defaultdict(Counter)

    def add(self, tokens: list[int], start: int) -> None:
        """Index the continuations tokens[i] for every i >= start, keyed by the up-to-depth tokens before it."""
        for i in range(max(start, 1), len(tokens)):
            for n in range(1, min(self.depth, i) + 1):
                self.next[tuple(tokens[i - n : i])][tokens[i]] += 1

    def remove(self, tokens: list[int], start: int = 0) -> None:
        """Undo `add(tokens, start)`: entries whose count drops to zero are deleted, so memory follows what is held."""
        for i in range(max(start, 1), len(tokens)):
            for n in range(1, min(self.depth, i) + 1):
                key = tuple(tokens[i - n : i])
                counts = self.next[key]
                counts[tokens[i]] -= 1
                if counts[tokens[i]] <= 0:
                    del counts[tokens[i]]
                    if not counts:
                        del self.next[key]

    def lookup(self, tokens: list[int]) -> tuple[int, int, float] | None:
        """(match length, most frequent next token, its share of the continuations) for the longest indexed
        suffix of tokens."""
        for n in range(min(self.depth, len(tokens)), 0, -1):
            counts = self.next.get(tuple(tokens[-n:]))
            if counts:
                token, count = counts.most_common(1)[0]
                return n, token, count / counts.total()
        return None


class _History:
    """Earlier outputs (oldest first) and their index, bounded in outputs and in tokens."""

    def __init__(self, depth: int):
        self.index = SuffixIndex(depth)
        self.outputs: deque[list[int]] = deque()
        self.tokens = 0

    def add(self, output: list[int]) -> None:
        self.outputs.append(output)
        self.tokens += len(output)
        self.index.add(output, 0)

    def evict(self) -> int:
        """Forget the oldest output; returns its length."""
        old = self.outputs.popleft()
        self.tokens -= len(old)
        self.index.remove(old)
        return len(old)


class SuffixDrafter(Drafter):
    """SuffixDecoding's drafter (Oliaro et al., arXiv 2411.04975) as one path: token by token, the most frequent
    continuation of the longest suffix found in this request's index or in the history of earlier outputs."""

    learns_across_requests = True  # `end` indexes the output into the history

    def __init__(
        self,
        depth: int = 8,
        min_match: int = 1,
        history_requests: int = 256,
        name: str = "suffix",
        history_tokens: int = 1 << 16,
        max_histories: int = 64,
    ):
        """history_requests: outputs each history keeps; history_tokens: tokens all histories keep together (each
        costs about `depth` dictionary entries, so this bounds the index's memory)."""
        if depth < 1 or min_match < 1:
            raise ValueError("suffix depth and min_match must be >= 1")
        if history_requests < 0 or history_tokens < 0 or max_histories < 1:
            raise ValueError("suffix history bounds must be >= 0 (max_histories >= 1)")
        self.name = name
        self.depth = depth
        self.min_match = min_match
        self.history_requests = history_requests
        self.history_tokens = history_tokens
        self.max_histories = max_histories
        self.local = SuffixIndex(depth)
        self._histories: OrderedDict[str, _History] = OrderedDict()
        self._key: str | None = SHARED
        self._context: list[int] = []
        self._prompt_len = 0

    def use_history(self, key: str | None) -> None:
        """Which history the next requests read and extend: SHARED (the default), any other key (its own,
        created on first use; the least recently used of more than `max_histories` is dropped), or None (none:
        nothing learned across requests)."""
        self._key = key

    @property
    def history(self) -> SuffixIndex | None:
        """The index of the history in use (None when off); created on first use."""
        if self._key is None:
            return None
        if self._key not in self._histories:
            self._histories[self._key] = _History(self.depth)
            while len(self._histories) > self.max_histories:
                self._histories.popitem(last=False)
        self._histories.move_to_end(self._key)
        return self._histories[self._key].index

    @property
    def outputs(self) -> list[list[int]]:
        """The outputs the history in use holds, oldest first."""
        held = self._histories.get(self._key) if self._key is not None else None
        return list(held.outputs) if held else []

    _outputs = outputs  # an alias the tests read

    def begin(self, prompt: list[int]) -> None:
        self.local = SuffixIndex(self.depth)
        self._context = []
        self._prompt_len = len(prompt)

    def end(self, context: list[int]) -> None:
        """The request's whole output joins the cross-request history, including rounds this drafter sat out."""
        generated = list(context[self._prompt_len :])
        if not generated or self.history is None:
            return
        current = self._histories[self._key]
        current.add(generated)
        while len(current.outputs) > self.history_requests:
            current.evict()
        total = sum(h.tokens for h in self._histories.values())
        for key in list(self._histories):  # least recently used first: the current history is last
            held = self._histories[key]
            while held.outputs and total > self.history_tokens:
                total -= held.evict()
            if not held.outputs and key != self._key:
                del self._histories[key]

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        # The local index follows the context it was last asked about. A context is usually that one plus the
        # tokens generated since; one that is not (a continuation of a model's draft, asked before verification)
        # first takes out what the new context no longer has.
        keep = common_prefix(self._context, context)
        if keep < len(self._context):
            self.local.remove(self._context, keep)
        self.local.add(context, keep)
        self._context = list(context)
        history = self.history
        seq = list(context[-self.depth :])
        draft: list[int] = []
        confidence: list[float] = []
        while len(draft) < k:
            hits = (self.local.lookup(seq), history.lookup(seq) if history is not None else None)
            best = max((hit for hit in hits if hit), default=None, key=lambda hit: hit[0])
            if best is None or best[0] < self.min_match:
                break
            draft.append(best[1])
            seq.append(best[1])
            # a long match whose continuation is (nearly) always the same is a safe copy; a 1-token match is a guess
            confidence.append(best[2] * min(1.0, best[0] / 4))
        return Draft(draft, confidence=confidence)
