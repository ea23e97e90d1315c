"""A drafter that runs a causal LM autoregressively with its own KV cache (a small LM, or a truncated target)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from ..cached_model import CachedModel
from ..models.int8_weights import drafting_weights
from ..sampling import SamplingParams, probabilities
from .base import AutoregressiveDrafter


class ModelDrafter(AutoregressiveDrafter):
    """`model` is kept as loaded (`self.model`); drafting runs `self.lm`, on an int8 twin of it where `weights`
    asks for one (`int8_weights`: `auto` = where measured faster). `self.weights` says which it got."""

    def __init__(self, model: torch.nn.Module, name: str, vocab_size: int, weights: str = "unquantized"):
        self.name = name
        self.model = model
        drafting, self.weights = drafting_weights(model, weights)
        self.lm = CachedModel(drafting, vocab_size=vocab_size)

    def begin(self, prompt: list[int]) -> None:
        self.lm.reset()

    def fork(self) -> ModelDrafter:
        """The same weights with a KV cache of its own (a batch gives each request one)."""
        twin = copy.copy(self)
        twin.lm = CachedModel(self.lm.model, vocab_size=self.lm.vocab_size)
        return twin

    def next_q(self, context: list[int], params: SamplingParams) -> Callable[[list[int]], torch.Tensor]:
        """logits_for() first catches the cache up on whatever context it has not seen (missed rounds, rejections)."""
        return lambda seq: probabilities(self.lm.logits_for(seq), params)[0]
