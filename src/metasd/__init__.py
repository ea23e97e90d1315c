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
    """A public name, or a subpackage read as an attribute (`metasd.hf`, as when the package imported them all)."""
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name], __name__), name)
        globals()[name] = value  # later reads skip this function
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
