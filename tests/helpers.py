"""Helpers shared by the tests: tiny random models, the target's own greedy reference and the chi-square check of
sampled outputs."""

import math
from collections import Counter

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def greedy_reference(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation through transformers' generate(), on the model's device: what every
    lossless test compares metasd's output with."""
    import torch

    input_ids = torch.tensor([ids], device=next(model.parameters()).device)
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=max_new_tokens
    )
    return out[0, len(ids) :].tolist()


def chi2(counts: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic, cells with an expected count under 5 pooled into one; (statistic, degrees of freedom).
    A draw outside the expected support makes it infinite."""
    if any(cell not in expected or expected[cell] == 0 for cell in counts):
        return math.inf, 1
    big = [c for c, p in expected.items() if p * n >= 5]
    small = [c for c, p in expected.items() if 0 < p * n < 5]
    cells = [([c], expected[c]) for c in big] + ([(small, sum(expected[c] for c in small))] if small else [])
    stat = sum((sum(counts[c] for c in group) - n * p) ** 2 / (n * p) for group, p in cells)
    return stat, len(cells) - 1


def chi2_bound(df: int, z: float = 5.0) -> float:
    """Upper quantile of chi-square with df degrees of freedom at a normal z (Wilson-Hilferty); z = 5 is a tail of
    about 3e-7, so a correct sampler fails about never (the seeds make each run deterministic anyway)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def tiny_llama(vocab_size: int = 64, layers: int = 1, positions: int = 128, **overrides) -> LlamaForCausalLM:
    """A random Llama small enough to build in milliseconds (hidden size 16, two heads), in eval mode; `overrides`
    set other LlamaConfig fields."""
    settings = {
        "vocab_size": vocab_size,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": positions,
    }
    return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})).eval()


def tiny_vocab_llama(path, tokenizer, seed: int, base=None, noise: float = 0.0) -> LlamaForCausalLM:
    """A one-layer Llama over the full vocabulary; its head scaled so that top-p keeps a handful of tokens."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        if base is not None:  # the drafter: the target's weights plus noise, so q is near p but not equal
            model.load_state_dict(base.state_dict())
            for w in model.parameters():
                w.add_(torch.randn_like(w) * noise * w.std())
        else:
            model.lm_head.weight.mul_(60.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()


def decode_in_batch(decoder, prompts: list[str], max_new_tokens: int, **options) -> list:
    """Every prompt joined to one batch of the decoder at once and decoded to the end: the requests (`Generation`),
    in the prompts' order."""
    from metasd.batching.batch import Batch

    batch = Batch(decoder, max_batch=len(prompts))
    requests = [decoder.stream(p, max_new_tokens=max_new_tokens, **options) for p in prompts]
    for request in requests:
        batch.join(request)
    while len(batch):
        batch.step()
    return requests
