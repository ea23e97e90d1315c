"""Which methods a benchmark run measures, and how their names are checked.

- `ar`: the target alone through the engine (policy `none`); the baseline of every speedup and the reference output.
- `hf-ar`, `hf-pld`, `hf-assisted`: Hugging Face `generate` anchors (greedy, prompt lookup, an `lm:` assistant).
- `fixed:<drafter>`: single-drafter speculative decoding with each drafter of the pool.
- the policies: a bandit picks a drafter each round.
- `oracle-round` (a hindsight replay, measured) and `oracle-category` (derived from the fixed runs, not run).
"""

from __future__ import annotations

from ..models.int8_weights import split_weights
from ..policy import POLICY_NAMES, build_policy

HF_METHODS = ("hf-ar", "hf-pld", "hf-assisted")
# The paper's policies first, then whatever other policies the engine offers, so new ones get measured too.
_PAPER = ("metasd-ucb", "ucb-be", "exp3", "sequential-halving", "random", "round-robin")
POLICIES = tuple(p for p in _PAPER if p in POLICY_NAMES) + tuple(
    p for p in POLICY_NAMES if p not in _PAPER and p != "none"
)
ORACLES = ("oracle-round", "oracle-category")
DERIVED = ("oracle-category",)  # computed from other runs: no answers file, no timing of its own


def lm_drafters(drafters: list[str]) -> list[str]:
    """The pool's `lm:` drafters: those `hf-assisted` can take as its assistant."""
    return [d for d in drafters if d.startswith("lm:")]


def default_methods(drafters: list[str]) -> list[str]:
    """Every method that applies to this drafter pool: `ar`, the transformers anchors, each fixed drafter, the
    policies and the oracles."""
    hf = ["hf-ar", "hf-pld"] + (["hf-assisted"] if lm_drafters(drafters) else [])
    return ["ar", *hf, *(f"fixed:{d}" for d in drafters), *POLICIES, *ORACLES]


def resolve_methods(
    requested: list[str] | None, drafters: list[str], aliases: dict[str, str] | None = None, strict: bool = True
) -> list[str]:
    """Validate and complete a method list for this drafter pool.

    `ar` is always measured (it is the baseline and the reference output); `oracle-category` brings the
    `fixed:` runs it is made of. `aliases` maps drafter specs to pool names (`early-exit` -> `early-exit:7`).
    strict=False skips the check that a `fixed:` drafter is in the pool (used before the models load, when only
    the specs are known).
    """
    if not drafters:
        raise ValueError("the benchmark needs at least one drafter in --drafters")
    aliases = aliases or {}
    if requested is None:
        return default_methods(drafters)
    valid = ", ".join(["ar", *HF_METHODS, "fixed:<drafter>", *POLICIES, *ORACLES])
    out: list[str] = ["ar"]
    for raw in requested:
        name = raw.strip()
        if not name:
            continue
        base, _, param = name.partition(":")
        if name in ("ar", *HF_METHODS, *ORACLES):
            if name == "hf-assisted" and not lm_drafters(drafters):
                raise ValueError("method 'hf-assisted' needs an lm:<model> drafter in --drafters (its assistant)")
        elif base == "fixed":
            param = aliases.get(param, param)
            if not param:
                raise ValueError(f"method {name!r}: use fixed:<drafter> with one of {drafters}")
            if strict and param not in drafters:
                raise ValueError(f"method {name!r}: the drafter is not in the pool {drafters}")
            name = f"fixed:{param}"
        elif base in POLICIES:
            build_policy(name, drafters)  # raises ValueError with the valid forms for a bad parameter
        else:
            raise ValueError(f"unknown method {name!r}; choose from {valid}")
        if name not in out:
            out.append(name)
    if "oracle-category" in out:
        for d in drafters:
            if f"fixed:{d}" not in out:
                out.insert(out.index("oracle-category"), f"fixed:{d}")
    return out


def is_engine_method(method: str) -> bool:
    """Runs through metasd's Decoder (as opposed to transformers or derived)."""
    return method not in HF_METHODS and method not in DERIVED


def uses_drafters(method: str) -> bool:
    """Runs through metasd's Decoder with drafters: every engine method but `ar`."""
    return is_engine_method(method) and method != "ar"


def is_policy(method: str) -> bool:
    """A policy picks its drafter each round (whatever its parameters)."""
    return method.partition(":")[0] in POLICIES


def label(method: str) -> str:
    """Short display name: `fixed:lm:/long/path/model-q4.gguf` -> `fixed:lm:model-q4` (`:int8` and the like kept)."""
    base, sep, rest = method.partition("lm:")
    if not sep:
        return method
    model, weights = split_weights(rest)
    stem = model.rstrip("/").rsplit("/", 1)[-1]
    return f"{base}lm:{stem.removesuffix('.gguf')}" + (f":{weights}" if weights else "")


def file_stem(method: str) -> str:
    """A file name for a method's answers: `fixed:ngram` -> `fixed-ngram`."""
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in label(method))


def longest_draft(methods: list[str], draft_len: int) -> int:
    """The longest draft any of these methods may send: draft_len for the classic policies, `max` for
    metasd-adaptive. The hindsight oracle may draft as long, so that no method can beat it by drafting longer."""
    from ..policy.adaptive import parse_params

    longest = [parse_params(m.partition(":")[2])["max"] for m in methods if m.partition(":")[0] == "metasd-adaptive"]
    return max([draft_len, *longest])
