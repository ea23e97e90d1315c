"""transformers' SDPA attention, without repeating grouped-query keys and values on a CPU.

For several queries under a mask (a draft verified, a prompt chunk, a batch's rows), transformers' `sdpa` attention
copies a grouped-query model's cached keys and values once per query head in the group (`repeat_kv`: three times
for SmolLM2-135M's 9 query and 3 key/value heads), every layer, every forward, over the whole cached span. torch's
CPU kernel takes the groups itself (`enable_gqa`, torch >= 2.5) and gives bitwise the same output; transformers
only hands it the groups where no mask is given, because the CUDA kernels fall back to slow ones with a mask.
`sdpa_attention` does that on a CPU and leaves every other case to transformers' own function; it is registered
as the `sdpa` attention of every model in the process (`ALL_ATTENTION_FUNCTIONS.register`, the registry models read
at each call), so outputs do not change, only the copies go (docs/results/2026-12-07-gqa-attention.md).
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTENTION = "sdpa, grouped queries to torch's kernel on a CPU"  # in the calibration's key: T(M) depends on it


def sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' `sdpa_attention_forward`, except where it would repeat the keys and values of a grouped-query
    model for several queries under a mask on a CPU: there torch's kernel takes the groups (`enable_gqa`)."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if (
        grouped
        and query.device.type == "cpu"
        and query.shape[2] > 1
        and attention_mask is not None
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    ):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


ALL_ATTENTION_FUNCTIONS.register("sdpa", sdpa_attention)
