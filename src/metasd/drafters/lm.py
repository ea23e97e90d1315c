"""A drafter that runs a causal LM autoregressively with its own KV cache (a small LM, or a truncated target)."""

from __future__ import annotations

import torch

from ..cached_model import CachedModel
from ..sampling import SamplingParams, pick, probabilities
from .base import Draft


class ModelDrafter:
    has_cache = True

    def __init__(self, model: torch.nn.Module, name: str, vocab_size: int):
        self.name = name
        self.lm = CachedModel(model, vocab_size=vocab_size)

    def begin(self, prompt: list[int]) -> None:
        self.lm.reset()

    def end(self, context: list[int]) -> None:
        pass

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        # logits_for() first catches the cache up on whatever context it has not seen (missed rounds, rejections)
        seq = list(context)
        rows = []
        for _ in range(k):
            q = probabilities(self.lm.logits_for(seq), params)[0]
            seq.append(pick(q, params, generator))
            rows.append(q)
        return Draft(seq[len(context) :], torch.stack(rows) if rows else None)
