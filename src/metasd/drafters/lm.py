"""A drafter that runs a causal LM autoregressively with its own KV cache (a small LM, or a truncated target)."""

from __future__ import annotations

import torch

from ..cached_model import CachedModel
from ..models.int8_weights import drafting_weights
from ..sampling import SamplingParams, probabilities
from .base import Draft, StopRule, draft_autoregressively


class ModelDrafter:
    """`model` is kept as loaded (`self.model`); drafting runs `self.lm`, on an int8 twin of it where `weights`
    asks for one (`int8_weights`: `auto` = where measured faster). `self.weights` says which it got."""

    has_cache = True

    def __init__(self, model: torch.nn.Module, name: str, vocab_size: int, weights: str = "unquantized"):
        self.name = name
        self.model = model
        drafting, self.weights = drafting_weights(model, weights)
        self.lm = CachedModel(drafting, vocab_size=vocab_size)

    def begin(self, prompt: list[int]) -> None:
        self.lm.reset()

    def end(self, context: list[int]) -> None:
        pass

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        return self.propose_until(context, k, params, generator, None)

    def propose_until(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        stop: StopRule | None,
    ) -> Draft:
        """Up to k tokens (`draft_autoregressively`). logits_for() first catches the cache up on whatever context
        it has not seen (missed rounds, rejections)."""
        return draft_autoregressively(
            lambda seq: probabilities(self.lm.logits_for(seq), params)[0], context, k, params, generator, stop
        )
