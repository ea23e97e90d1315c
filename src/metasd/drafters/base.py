"""The drafter interface: propose up to k tokens for the current context, with q or without (then q is one-hot)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..sampling import SamplingParams


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None = None  # [len(tokens), V] probabilities the tokens were drawn from; None = one-hot


@runtime_checkable
class Drafter(Protocol):
    name: str
    has_cache: bool  # True when sitting out rounds leaves state to catch up on (counted by the engine)

    def begin(self, prompt: list[int]) -> None:
        """A new request starts from this prompt."""

    def end(self, context: list[int]) -> None:
        """The request ended (finished or abandoned) with this context: prompt + every generated token.

        Drafters that learn across requests index the output here, not only the part they happened to draft on.
        """

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        """Up to k tokens to follow context (fewer or none is allowed), drawn under params."""
