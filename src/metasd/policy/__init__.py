"""Drafter-selection policies: the paper's bandits, metasd-adaptive, and the registry that builds them by name."""

from ..names import DEFAULT_POLICY, POLICY_NAMES
from .adaptive import AdaptivePolicy
from .bandits import (
    EXP3,
    UCB,
    DiscountedUCB,
    Fixed,
    RandomPolicy,
    RoundRobin,
    SequentialHalving,
    SlidingWindowUCB,
)
from .base import ArmStats, Policy
from .registry import MAX_BETA, MAX_BUDGET, build_policy, canonical_policy

__all__ = [
    "DEFAULT_POLICY",
    "EXP3",
    "MAX_BETA",
    "MAX_BUDGET",
    "POLICY_NAMES",
    "UCB",
    "AdaptivePolicy",
    "ArmStats",
    "DiscountedUCB",
    "Fixed",
    "Policy",
    "RandomPolicy",
    "RoundRobin",
    "SequentialHalving",
    "SlidingWindowUCB",
    "build_policy",
    "canonical_policy",
]
