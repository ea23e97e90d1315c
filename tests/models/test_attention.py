"""The `sdpa` attention metasd registers (`metasd.models.attention`) gives bitwise transformers' own outputs: a
grouped-query model (the embedded SmolLM2: 9 query heads, 3 key/value heads) over a cached context, with several
new tokens under a mask (a draft tree's, and the causal one the model builds), on a CPU."""

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from metasd.draft import Draft
from metasd.models.attention import sdpa_attention
from metasd.tree import DraftTree


def _forward(model, context, new, mask=None, positions=None):
    """Logits of `new` after `context` is cached: with a 4D additive mask, or the model's own."""
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([context]), cache=cache)
        kwargs = {"attention_mask": mask, "position_ids": positions} if mask is not None else {}
        return model(torch.tensor([new]), cache=cache, **kwargs).logits


def test_the_registered_attention_is_transformers_own_bitwise(embedded, monkeypatch):
    model = embedded.model
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped: the case it changes
    grouped = []  # per SDPA call: whether torch's kernel took the groups
    original = torch.nn.functional.scaled_dot_product_attention

    def recorded(*args, **kwargs):
        grouped.append(kwargs.get("enable_gqa", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    ids = embedded.tokenizer("The quick brown fox jumps over the lazy dog, and then it")["input_ids"]
    context, tree = ids[:-1], DraftTree.chain(Draft([11, 22, 33, 44]))  # one new token, then a draft of four
    new = [ids[-1], *tree.tokens]
    mask, positions = tree.attention(len(context), 1, torch.float32)
    outputs = {}
    for attention in (sdpa_attention, sdpa_attention_forward):  # metasd's, then transformers' own
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", attention)
        grouped.clear()
        tree_logits = _forward(model, context, new, mask, positions)
        took_groups = all(grouped[-model.config.num_hidden_layers :])
        outputs[attention] = (tree_logits, _forward(model, context, new), took_groups)
    mine, theirs = outputs[sdpa_attention], outputs[sdpa_attention_forward]
    assert mine[2] and not theirs[2]  # the tree's forward: the kernel took the groups, where transformers repeats
    assert torch.equal(mine[0], theirs[0])
    assert torch.equal(mine[1], theirs[1])
