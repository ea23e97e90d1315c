"""Self-speculative drafting: the target's first L layers + its final norm and LM head, no extra weights.

The early-exit drafter of LayerSkip (Elhoushi et al., arXiv 2404.16710), without its training recipe (layer dropout
and an early-exit loss) or its cache shared with verification: an off-the-shelf target's exit at layer L is used as
it is (the `distill` command trains such a cut instead). The truncated model is a shallow copy of the target whose
layer list is cut to L: the same parameter tensors, a config saying L layers, and so a KV cache of its own.
"""

from __future__ import annotations

import copy

import torch

from .lm import ModelDrafter


def truncated_config(config, layers: int, what: str = "early-exit needs L"):
    """A copy of a model config that says `layers` decoder layers (also for `metasd distill`'s drafters)."""
    total = config.num_hidden_layers
    if not 1 <= layers < total:
        raise ValueError(f"{what} in 1..{total - 1} (the target's layer count is {total}), got {layers}")
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    return config


def truncated(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """`model` cut to its first `layers` decoder layers: a shallow copy sharing the target's parameter tensors, with
    a config of its own (and so a KV cache of its own)."""
    config = truncated_config(model.config, layers)
    shallow = copy.copy(model)
    shallow._modules = dict(model._modules)
    shallow.model = copy.copy(model.model)
    shallow.model._modules = dict(model.model._modules)
    shallow.model.layers = torch.nn.ModuleList(model.model.layers[:layers])
    shallow.config = shallow.model.config = config
    return shallow


class EarlyExitDrafter(ModelDrafter):
    """LayerSkip's self-speculative drafter (Elhoushi et al., arXiv 2404.16710): the target's first `layers`
    layers, final norm and LM head, drafting with a KV cache of their own."""

    def __init__(self, model: torch.nn.Module, layers: int, vocab_size: int):
        super().__init__(truncated(model, layers), name=f"early-exit:{layers}", vocab_size=vocab_size)
