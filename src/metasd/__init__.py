"""metasd: lossless multi-drafter speculative decoding with bandit drafter selection (MetaSD).

The public names load on first use (PEP 562), so that `import metasd.cli` and `metasd --help` load no torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names as type checkers and editors see them
    from .drafters import Draft as Draft
    from .drafters import Drafter as Drafter
    from .drafters import build_drafter as build_drafter
    from .engine import Decoder as Decoder
    from .generation import Generation as Generation
    from .hf import generate as generate
    from .policy import Policy as Policy
    from .policy import build_policy as build_policy
    from .sampling import SamplingParams as SamplingParams
    from .stats import GenerationResult as GenerationResult
    from .stats import GenerationStats as GenerationStats

_HOMES = {
    "Decoder": ".engine",
    "Draft": ".drafters",
    "Drafter": ".drafters",
    "Generation": ".generation",
    "GenerationResult": ".stats",
    "GenerationStats": ".stats",
    "Policy": ".policy",
    "SamplingParams": ".sampling",
    "build_drafter": ".drafters",
    "build_policy": ".policy",
    "generate": ".hf",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module 'metasd' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
