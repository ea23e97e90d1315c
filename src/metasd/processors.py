"""The target's own logits processors: what its generation config adds to generate() beyond sampling parameters.

A model's `generation_config` may set a repetition penalty, `no_repeat_ngram_size`, `bad_words_ids`, `min_length` /
`min_new_tokens`, `suppress_tokens`, a forced end-of-sequence token... transformers' `generate` then applies them to
every step's logits, so the target's distribution is the processed one and a lossless decoder must verify against
it. Each processor is a deterministic function of the tokens before the position it processes, so the row of the
verification forward that predicts the token after context + draft[:j] is processed with exactly that prefix, as
generate would process it had it reached that context: greedy verification takes the processed argmax, sampled
verification p = `probabilities` of the processed row, whatever q the drafter reported (the acceptance rule is exact
for any q). Sampling settings (temperature, top-k, top-p, min-p, typical-p...) are the request's business
(`SamplingParams`): the warpers generate would add under do_sample are left out.
"""

from __future__ import annotations

import copy

import torch

# Settings whose processor is not a function of the tokens alone, or that generate applies after its sampling warpers
UNSUPPORTED = {
    "guidance_scale": ("classifier-free guidance runs the model on a second, unconditional prompt", "None"),
    "watermarking_config": ("watermarking biases the logits after temperature, top-k and top-p", "None"),
}


def _unsupported(config: object) -> str | None:
    scale = getattr(config, "guidance_scale", None)
    if scale is not None and scale != 1:
        return "guidance_scale"
    if getattr(config, "watermarking_config", None) is not None:
        return "watermarking_config"
    return None


def target_processors(
    model: torch.nn.Module, prompt_len: int, max_new_tokens: int, spec: str = "the target", generation_config=None
):
    """The `LogitsProcessorList` that generate(input_ids, max_new_tokens=...) builds from the model's generation
    config (or `generation_config`, standing in for it) for a prompt of prompt_len tokens (warpers left out), or
    None when it is empty. Raises ValueError for a setting that cannot be applied row by row, saying how to clear it."""
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    setting = _unsupported(config)
    if setting is not None:
        why, cleared = UNSUPPORTED[setting]
        raise ValueError(
            f"model {spec!r}: its generation config sets {setting}={getattr(config, setting)!r}, which metasd cannot "
            f"apply ({why}), so its output would not be the model's own generate(); load the model and set "
            f"`model.generation_config.{setting} = {cleared}` (or save its generation_config.json without it)"
        )
    config.do_sample = False  # the warpers (temperature, top-k, top-p...) come from the request's SamplingParams
    config.max_new_tokens = max_new_tokens  # as generate's _prepare_generated_length: lengths count the prompt
    config.max_length = prompt_len + max_new_tokens
    if config.min_new_tokens is not None:
        config.min_length = config.min_new_tokens + prompt_len
    model._prepare_special_tokens(config, True, device="cpu")  # the verification rows are on the CPU
    processors = model._get_logits_processor(config, input_ids_seq_length=prompt_len, device="cpu")
    return processors if len(processors) else None


def process(processors, logits: torch.Tensor, context: list[int], prefixes: list[list[int]]) -> torch.Tensor:
    """logits [n, V] from one verification forward, row j predicting the token after context + prefixes[j] (a
    chain's draft[:j], a tree node's path): each row processed with its own input_ids, one row at a time."""
    return torch.cat(
        [processors(torch.tensor([context + prefix]), logits[j : j + 1].clone()) for j, prefix in enumerate(prefixes)]
    )
