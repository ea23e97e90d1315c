"""A drafter that runs a causal LM autoregressively with its own KV cache (a small LM, or a truncated target)."""

from __future__ import annotations

import torch

from ..cached_model import CachedModel
from ..models.int8_weights import drafting_weights
from ..sampling import SamplingParams, pick, probabilities
from .base import Draft, StopRule


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
        """Up to k tokens; the stop rule may end the draft before token j is drawn or after it (`StopRule`).

        Each token's confidence is the largest probability of its q (for greedy drafting, that of the token itself).
        logits_for() first catches the cache up on whatever context it has not seen (missed rounds, rejections).
        """
        seq = list(context)
        rows: list[torch.Tensor] = []
        confidence: list[float] = []
        forwards = 0
        for j in range(k):
            q = probabilities(self.lm.logits_for(seq), params)[0]
            forwards += 1
            if stop is not None and stop.before(j, q):
                break
            seq.append(pick(q, params, generator))
            rows.append(q)
            confidence.append(float(q.max()))
            if stop is not None and j + 1 < k and stop.after(j, q, seq[-1]):
                break
        return Draft(seq[len(context) :], torch.stack(rows) if rows else None, confidence, forwards)
