"""The target's features an EAGLE head reads: the outputs of some decoder layers and of the final norm, tapped during
a forward (EAGLE-3, arXiv 2503.01840, fuses a low, a middle and a high layer with the last), which layers a pool's
heads read, and which columns one head needs of features kept for several."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch


def feature_layers_read_by(drafters) -> tuple[int, ...]:
    """The decoder layers, beyond the final norm, whose outputs some drafter of `drafters` reads (EAGLE heads with
    fused features), sorted: what a target cache keeps for all of them."""
    return tuple(sorted({layer for d in drafters for layer in d.feature_layers}))


def feature_columns(kept: Sequence[int], wanted: Sequence[int], d: int) -> torch.Tensor | None:
    """The columns a reader of the layers `wanted` (then the final norm's) needs of features kept for the layers
    `kept` (then the final norm's), blocks of `d`, in its order; None where it needs them all as they are. Every
    wanted layer must be kept."""
    blocks = [list(kept).index(layer) for layer in wanted] + [len(kept)]
    if blocks == list(range(len(kept) + 1)):
        return None
    return torch.cat([torch.arange(b * d, (b + 1) * d) for b in blocks])


@contextmanager
def feature_tap(model: torch.nn.Module, layers: Sequence[int] = ()) -> Iterator[Callable[[], torch.Tensor]]:
    """During a forward of `model`: a function returning the outputs of the decoder `layers`, then of the final
    norm (what the LM head reads), concatenated on the last axis, [..., d * (len(layers) + 1)]: the target's
    features an EAGLE head reads (EAGLE-3, arXiv 2503.01840, fuses a low, a middle and a high layer). Hooked for
    this forward only: the weights may be shared with other caches (`lm:`)."""
    decoder = model.get_decoder()
    count = len(decoder.layers)
    if any(not 0 <= layer < count for layer in layers):
        raise ValueError(f"feature layers {list(layers)} out of range: this model has decoder layers 0..{count - 1}")
    captured: dict = {}

    def keep(key):
        def hook(module, args, out):
            captured[key] = out[0] if isinstance(out, tuple) else out

        return hook

    def features() -> torch.Tensor:
        if not layers:
            return captured["norm"]
        return torch.cat([captured[i] for i in layers] + [captured["norm"]], dim=-1)

    hooks = [decoder.layers[i].register_forward_hook(keep(i)) for i in layers]
    hooks.append(decoder.norm.register_forward_hook(keep("norm")))
    try:
        yield features
    finally:
        for hook in hooks:
            hook.remove()
