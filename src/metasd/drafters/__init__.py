"""Drafters, one kind per file, built from specs like `eagle`, `ngram`, `suffix`, `early-exit:8`, `lm:PATH:int8`."""

from __future__ import annotations

import torch

from ..draft import Draft
from ..models.int8_weights import WEIGHTS, split_weights
from ..models.loading import LoadedModel, adopt_model, load_model, same_tokenizer
from ..names import DEFAULT_POOL, DRAFTER_KINDS
from .base import Drafter
from .datastore import DatastoreDrafter, load_datastore
from .eagle import build_eagle, shipped_head
from .early_exit import EarlyExitDrafter
from .lm import ModelDrafter
from .ngram import NgramDrafter
from .suffix import SuffixDrafter

__all__ = [
    "DEFAULT_POOL",
    "DRAFTER_KINDS",
    "Draft",
    "Drafter",
    "build_drafter",
    "default_pool",
    "model_drafter",
    "parse_drafters",
    "pool_entry",
]


def default_pool(target: LoadedModel) -> list[str]:
    """DEFAULT_POOL for this target: without `eagle` when no shipped head fits it."""
    return [s for s in DEFAULT_POOL if s != "eagle" or shipped_head(target.model) is not None]


def _int_arg(spec: str, arg: str) -> int:
    try:
        return int(arg)
    except ValueError:
        raise ValueError(f"drafter {spec!r}: {arg!r} is not an integer") from None


def build_drafter(spec: str, target: LoadedModel, dtype: str = "float32") -> Drafter:
    """Build one drafter for this target; raises ValueError for unknown kinds and incompatible models."""
    kind, _, arg = spec.strip().partition(":")
    if kind == "eagle":
        return build_eagle(arg, target)
    if kind == "ngram":
        return NgramDrafter(max_ngram=_int_arg(spec, arg) if arg else 3, name=spec)
    if kind == "suffix":
        return SuffixDrafter(depth=_int_arg(spec, arg) if arg else 8, name=spec)
    if kind == "early-exit":
        layers = _int_arg(spec, arg) if arg else max(1, target.model.config.num_hidden_layers // 4)
        return EarlyExitDrafter(target.model, layers, vocab_size=target.vocab_size)
    if kind == "lm":
        model_spec, weights = split_weights(arg)
        if not model_spec:
            raise ValueError(f"drafter 'lm:' needs a model: lm:<hub id | directory | file.gguf>[:{'|'.join(WEIGHTS)}]")
        try:
            drafter = load_model(model_spec, dtype, str(target.device))  # beside the target: drafts feed its forward
        except ValueError as err:
            tail = arg.rpartition(":")[2]
            if tail and tail != arg and "/" not in tail and "\\" not in tail:  # lm:MODEL:int4: a mistyped word?
                raise ValueError(
                    f"{err} (after lm:MODEL, a ':' suffix names the drafter's weights: {', '.join(WEIGHTS)})"
                ) from err
            raise
        _check_vocabulary(spec, drafter, target)
        return ModelDrafter(drafter.model, name=spec, vocab_size=target.vocab_size, weights=weights or "auto")
    if kind == "datastore":
        if not arg:
            raise ValueError("drafter 'datastore:' needs an index directory (built by `metasd index`): datastore:PATH")
        store = load_datastore(arg)
        store.check_tokenizer(target.tokenizer, f"the target {target.spec!r}")
        return DatastoreDrafter(store, name=spec)
    raise ValueError(f"unknown drafter {spec!r}; choose from {', '.join(DRAFTER_KINDS)}")


def model_drafter(model: object, tokenizer: object, target: LoadedModel) -> Drafter:
    """An `lm:` drafter from a model object its caller loaded (with its tokenizer), drafting on it as it is: the
    checks of `lm:MODEL` (a causal LM, full attention, the target's vocabulary) and no copy of the weights."""
    drafter = adopt_model(model, tokenizer, role="drafter")
    _check_vocabulary(drafter.spec, drafter, target)
    return ModelDrafter(model, name=f"lm:{drafter.spec}", vocab_size=target.vocab_size, weights="unquantized")


def pool_entry(item: str | Drafter | tuple, target: LoadedModel, dtype: str) -> Drafter:
    """A drafter for one entry of a decoder's pool: a spec, a drafter object, or a (model, tokenizer) pair (an `lm:`
    drafter as it is)."""
    if isinstance(item, str):
        return build_drafter(item, target, dtype)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], torch.nn.Module):
        return model_drafter(item[0], item[1], target)
    if isinstance(item, torch.nn.Module):
        raise ValueError("a model object in the drafter pool goes with its tokenizer: (model, tokenizer)")
    if isinstance(item, Drafter):
        return item
    raise ValueError(f"a drafter is a spec, a Drafter object or a (model, tokenizer) pair, got {item!r}")


def _check_vocabulary(name: str, drafter: LoadedModel, target: LoadedModel) -> None:
    if not same_tokenizer(drafter.tokenizer, target.tokenizer):
        raise ValueError(
            f"drafter {name!r} uses a different tokenizer than the target {target.spec!r}; "
            "a drafter must share the target's vocabulary"
        )


def parse_drafters(specs: str | list[str] | tuple[str, ...]) -> list[str]:
    """'ngram,suffix' or a list -> a list of distinct, non-empty specs."""
    items = specs.split(",") if isinstance(specs, str) else list(specs)
    items = [s.strip() for s in items if s.strip()]
    if len(set(items)) != len(items):
        raise ValueError(f"drafter pool lists a drafter twice: {items}")
    return items
