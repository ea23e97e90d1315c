"""A ragged forward: every row's new tokens packed into one sequence, none padded (vLLM's flattened batch).

A batch forward pads every row to the widest one, and on a CPU a padded position costs what a real one does. That
is cheap while rows are a token and a draft each of about one length, and ruinous when one row is a prompt chunk of
a hundred tokens beside three rows of six: the chunk would widen every row (`BatchedTarget` packs once padding would
feed half again the rows' own tokens). Packed instead, the model's projections and MLPs run over the sum of the
rows' tokens; only attention is per row, and it reads each row's own keys and values from the batch's slots
(`slots._SlotLayer`). The attention of each row is the model's own SDPA attention over that row's span with its own
mask (causal, or a draft tree's), so a row's numbers are those of the padded forward.

The model runs with `config._attn_implementation` set to this module's function for the length of the forward
(`packed`); a model whose attention modules do not look it up at each call, or have no `layer_idx`, fails the
start-up check (`slots.check_batched_logits`) instead of decoding unlike itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "metasd_ragged"


@dataclass(frozen=True)
class Segment:
    """One row's tokens in the packed sequence: [start, end), attending to its slots [0, span) under `mask`
    ([1, 1, end - start, span], additive)."""

    row: int
    start: int
    end: int
    span: int
    mask: torch.Tensor


_ACTIVE: ContextVar[tuple[Sequence[Segment], Sequence] | None] = ContextVar("metasd_ragged", default=None)


def ragged_attention(module, query, key, value, attention_mask, **kwargs):
    """Per segment, the SDPA attention of its queries [1, h, n, d] over its row's cached keys and values. Outside
    a packed forward (the same model in another thread meanwhile), the model's SDPA attention as it is."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if _ACTIVE.get() is None:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    segments, layers = _ACTIVE.get()
    layer = layers[module.layer_idx]
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # [1, n, h, d]
    for s in segments:
        keys = layer.keys[s.row : s.row + 1, :, : s.span]
        values = layer.values[s.row : s.row + 1, :, : s.span]
        out[:, s.start : s.end], _ = sdpa(module, query[:, :, s.start : s.end], keys, values, s.mask, **kwargs)
    return out, None


ALL_ATTENTION_FUNCTIONS.register(NAME, ragged_attention)


@contextmanager
def packed(model: torch.nn.Module, segments: Sequence[Segment], layers: Sequence) -> Iterator[None]:
    """The model's attention reads each segment's row from `layers` (the slots) while the block runs."""
    token = _ACTIVE.set((segments, layers))
    # every config the attention layers read: a truncated model's (early exit) is its own, its layers keep the full
    # model's
    found = [model.config, *(getattr(m, "config", None) for m in model.modules())]
    configs = {id(c): c for c in found if isinstance(c, PretrainedConfig)}
    previous = {key: config._attn_implementation for key, config in configs.items()}
    for config in configs.values():
        config._attn_implementation = NAME
    try:
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation = previous[key]
        _ACTIVE.reset(token)
