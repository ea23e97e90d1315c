"""The one function that builds a policy from its name as the CLI, the server and the benchmark spell it (`base` or
`base:PARAM`; the names are in `metasd.names`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..names import POLICY_NAMES
from . import adaptive
from .bandits import EXP3, UCB, DiscountedUCB, Fixed, RandomPolicy, RoundRobin, SequentialHalving, SlidingWindowUCB
from .base import Policy

_UCB_REWARDS = {"metasd-ucb": "bd", "metasd-ucb-cost": "bd-cost", "metasd-fi": "be-cost", "ucb-be": "be"}
# beta 1 is the paper's. Ours default to 0.1: a request is only some tens of rounds and the gaps between drafters'
# mean rewards are small next to beta 1's bonus, so beta 1 spends most of a request exploring a slow drafter
# (chosen by measurement: see docs/policies.md, "Beyond the paper", and docs/decisions.md).
_DEFAULTS: dict[str, float] = {
    "metasd-ucb": 1.0,
    "ucb-be": 1.0,
    "metasd-ucb-cost": 0.1,
    "metasd-fi": 0.1,
    "exp3": 0.1,
    "sequential-halving": 32,
}
# The forgetting bandits (see DiscountedUCB): base -> (class, reward, first parameter's name, kind, default, bounds).
_DRIFTING: dict[str, tuple] = {
    "ducb": (DiscountedUCB, "bd", "gamma", float, 0.95, (0.0, 1.0)),
    "swucb": (SlidingWindowUCB, "bd", "window", int, 32, (1, 100_000)),
    "ducb-cost": (DiscountedUCB, "bd-cost", "gamma", float, 0.95, (0.0, 1.0)),
    "swucb-cost": (SlidingWindowUCB, "bd-cost", "window", int, 32, (1, 100_000)),
}
_DRIFT_BETA = 0.1
# Upper bounds on client-chosen parameters (a server takes them from requests): far above any useful value, low
# enough that nothing a client sends can cost memory or time.
MAX_BETA = 100.0
MAX_BUDGET = 1_000_000
_CHOICES = (
    "metasd-adaptive[:beta=B,gamma=G,max=K,spread=S,prior=W,extend=E], "
    "metasd-ucb[:BETA], metasd-ucb-cost[:BETA], metasd-fi[:BETA], ducb[:GAMMA[:BETA]], swucb[:WINDOW[:BETA]], "
    "ducb-cost[:GAMMA[:BETA]], swucb-cost[:WINDOW[:BETA]], ucb-be[:BETA], exp3[:GAMMA], "
    "sequential-halving[:BUDGET], random, round-robin, fixed:<drafter>, none"
)


def _parse(name: str, param: str, kind: type[float] | type[int]) -> float:
    try:
        value = kind(param)
    except ValueError:
        raise ValueError(f"policy {name!r}: parameter {param!r} is not a valid {kind.__name__}") from None
    if not math.isfinite(value):
        raise ValueError(f"policy {name!r}: parameter {param!r} must be finite")
    return value


def _drifting_params(name: str, base: str, param: str) -> tuple[float, float]:
    """`GAMMA[:BETA]` (ducb) or `WINDOW[:BETA]` (swucb), defaults filled in, bounds checked."""
    _, _, what, kind, default, (lo, hi) = _DRIFTING[base]
    first, sep, second = param.partition(":")
    if sep and not second.strip() or param and not first.strip():
        raise ValueError(f"policy {name!r}: bad parameter; valid choices: {_CHOICES}")
    value = _parse(name, first.strip(), kind) if first.strip() else default
    beta = _parse(name, second.strip(), float) if sep else _DRIFT_BETA
    if kind is float and not lo < value <= hi:
        raise ValueError(f"policy {name!r}: {what} must be in ({lo:g}, {hi:g}]")
    if kind is int and not lo <= value <= hi:
        raise ValueError(f"policy {name!r}: {what} must be an integer in [{lo}, {hi}]")
    if not 0 <= beta <= MAX_BETA:
        raise ValueError(f"policy {name!r}: beta must be in [0, {MAX_BETA:g}]")
    return value, beta


def build_policy(name: str, drafter_names: Sequence[str], seed: int | None = None) -> Policy | None:
    """Build a policy from its CLI name (``base`` or ``base:PARAM``); ``none`` means plain autoregressive decoding."""
    base, sep, param = _split(name)
    if base not in POLICY_NAMES and base != "fixed":
        raise ValueError(f"unknown policy {name!r}; valid choices: {_CHOICES}")
    takes_param = base in _DEFAULTS or base in _DRIFTING or base in ("fixed", "metasd-adaptive")
    if sep and (not param or not takes_param):
        raise ValueError(f"policy {name!r}: bad parameter; valid choices: {_CHOICES}")
    if base == "none":
        return None
    if not drafter_names:
        raise ValueError(f"policy {name!r} needs at least one drafter (use 'none' for plain decoding)")
    k = len(drafter_names)
    if base == "metasd-adaptive":
        return adaptive.from_params(k, param)
    if base == "fixed":
        if param not in drafter_names:
            raise ValueError(f"policy {name!r}: use fixed:<drafter> with one of {list(drafter_names)}")
        return Fixed(k, list(drafter_names).index(param))
    if base == "random":
        return RandomPolicy(k, seed)
    if base == "round-robin":
        return RoundRobin(k)
    if base in _DRIFTING:
        cls, kind = _DRIFTING[base][0], _DRIFTING[base][1]
        return cls(k, *_drifting_params(name, base, param), reward=kind)
    value = _parse(name, param, int if base == "sequential-halving" else float) if sep else _DEFAULTS[base]
    if base == "exp3":
        if not 0 < value <= 1:
            raise ValueError(f"policy {name!r}: gamma must be in (0, 1]")
        return EXP3(k, value, seed)
    if base == "sequential-halving":
        if not 1 <= value <= MAX_BUDGET:
            raise ValueError(f"policy {name!r}: budget must be an integer in [1, {MAX_BUDGET}]")
        return SequentialHalving(k, int(value))
    if not 0 <= value <= MAX_BETA:
        raise ValueError(f"policy {name!r}: beta must be in [0, {MAX_BETA:g}]")
    return UCB(k, value, reward=_UCB_REWARDS[base], full_information=base == "metasd-fi")


def canonical_policy(name: str, drafter_names: Sequence[str]) -> str:
    """One spelling per policy: defaults filled in and numbers normalised (`metasd-ucb`, `metasd-ucb:1` and
    ` metasd-ucb:1.0` are one policy), so caches keyed by it cannot grow with every spelling a client sends.
    Raises ValueError for what build_policy would refuse."""
    build_policy(name, drafter_names)  # validates
    base, sep, param = _split(name)
    if base == "metasd-adaptive":
        return adaptive.canonical(adaptive.parse_params(param))
    if base in _DRIFTING:
        return ":".join([base, *map(_number, _drifting_params(name, base, param))])
    if base in _DEFAULTS:
        value = _parse(name, param, int if base == "sequential-halving" else float) if sep else _DEFAULTS[base]
        return f"{base}:{_number(value)}"
    return f"{base}:{param}" if base == "fixed" else base


def _split(name: str) -> tuple[str, str, str]:
    """`base:param` with the spaces around either part removed."""
    base, sep, param = name.strip().partition(":")
    return base.strip(), sep, param.strip()


def _number(value: float) -> str:
    """Integers as integers, floats in their shortest round-trip form: 1, 1.0 and 1e0 all give `1.0` (not `:g`,
    which would merge 0.1234567 and 0.1234568)."""
    return str(value) if isinstance(value, int) else repr(float(value))
