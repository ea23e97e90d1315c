"""metasd: lossless multi-drafter speculative decoding with bandit drafter selection (MetaSD)."""

from .drafters import Draft, Drafter, build_drafter
from .engine import Decoder, Generation
from .hf import generate
from .policy import Policy, build_policy
from .sampling import SamplingParams
from .stats import GenerationResult, GenerationStats

__all__ = [
    "Decoder",
    "Draft",
    "Drafter",
    "Generation",
    "GenerationResult",
    "GenerationStats",
    "Policy",
    "SamplingParams",
    "build_drafter",
    "build_policy",
    "generate",
]
