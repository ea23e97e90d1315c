"""`model.generate`, speculatively: a transformers user's own model object, padded batches in, a tensor out.

`generate(model, **inputs, max_new_tokens=..., do_sample=..., generation_config=...)` takes what `model.generate`
takes for greedy decoding and multinomial sampling, resolves it against the model's `generation_config` exactly as
`generate` does (`_prepare_generation_config`), decodes every row of a left- or right-padded batch together through
the batch engine (`metasd.batching`), and returns what `generate` returns: the input rows as given followed by each
row's new tokens, rows that end early padded with `pad_token_id`; with `return_dict_in_generate=True` an output
with `.sequences`, plus `.metasd_stats` (each row's `GenerationStats`). What `generate` would do that metasd cannot
(beam search, constraints, guidance, custom processors, returned scores...) is refused by name, never ignored.
The decoder built for a model (its drafters, its cost calibration) is kept on the model object for later calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..batching.batch import Batch
from ..drafters import DEFAULT_POOL
from ..engine import Decoder
from ..generation import Generation
from ..policy import DEFAULT_POLICY
from ..stats import GenerationStats
from ..tokens import token_ids

# generate's arguments metasd cannot honour (None, False or an empty list mean "not used")
_REFUSED_ARGUMENTS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "assistant_tokenizer",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "inputs_embeds",
    "cache",
    "past_key_values",
)
# generation settings metasd cannot honour, with the values that mean "not used" (sampling warpers only matter when
# sampling; beam-only settings are inert without beams, as generate treats them)
_REFUSED_SETTINGS = {
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "diversity_penalty": (None, 0.0),
    "penalty_alpha": (None,),
    "dola_layers": (None,),
    "constraints": (None,),
    "force_words_ids": (None,),
    "num_return_sequences": (None, 1),
    "output_scores": (None, False),
    "output_logits": (None, False),
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "max_time": (None,),
    "prompt_lookup_num_tokens": (None,),
    "assistant_early_exit": (None,),
    "token_healing": (None, False),
    "use_mtp": (None, False),
    "cache_implementation": (None,),
}
_SAMPLING_ONLY = {
    "min_p": (None,),
    "top_h": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
}


@dataclass
class MetasdGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` (`.sequences`), and each row's decoding statistics."""

    metasd_stats: list[GenerationStats] | None = None


def generate(
    model: torch.nn.Module,
    inputs: torch.Tensor | None = None,
    generation_config=None,
    *,
    tokenizer=None,
    drafters: Sequence = DEFAULT_POOL,
    policy: str = DEFAULT_POLICY,
    seed: int | None = None,
    **kwargs,
) -> torch.Tensor | MetasdGenerateOutput:
    """As `model.generate(inputs, generation_config, **kwargs)` for greedy decoding and multinomial sampling.

    Args:
        model: a transformers causal LM, decoded as it is (dtype, device, adapters; no copy of its weights).
        inputs / input_ids: [B, L] prompt ids, left- or right-padded; attention_mask marks the real tokens (without
            it, tokens equal to a pad id that is not an end-of-sequence id are padding, as generate infers).
        generation_config, **kwargs: as generate (max_new_tokens, do_sample, temperature, top_k, top_p,
            repetition_penalty, eos_token_id, pad_token_id, stop_strings, return_dict_in_generate, ...).
        tokenizer: the model's tokenizer (drafter checks, `stop_strings`); read from `model.name_or_path` if absent.
        drafters, policy: metasd's pool and policy (`Decoder`); drafters may include (model, tokenizer) pairs.
        seed: the sampling seed of row 0 (row i uses seed + i); default: drawn from torch's global generator, so
            `torch.manual_seed` reproduces a call where the drafts do not vary (docs/transformers.md).

    Returns:
        [B, L + T] sequences, or a `MetasdGenerateOutput` with return_dict_in_generate=True.
    """
    input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
    attention_mask = kwargs.pop("attention_mask", None)
    for name in _REFUSED_ARGUMENTS:
        value = kwargs.pop(name, None)
        if value is not None and value is not False and not (isinstance(value, Sequence) and len(value) == 0):
            raise ValueError(f"metasd.generate cannot honour {name}= (speculative decoding verifies its own rows)")
    kwargs.pop("use_cache", None)  # always on
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    if model_kwargs:
        raise ValueError(f"metasd.generate does not take {', '.join(sorted(model_kwargs))} (text-only causal LMs)")
    _refuse_settings(config)
    if input_ids is None or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [batch, length] tensor of token ids")
    prompts = _prompts(input_ids, attention_mask, config)
    decoder = decoder_for(model, tokenizer, drafters, policy)
    limit = config.max_new_tokens
    lengths = [limit if limit is not None else (config.max_length or 20) - input_ids.shape[1]] * len(prompts)
    if min(lengths) < 1:
        raise ValueError(f"nothing to generate: max_length {config.max_length} <= the input's {input_ids.shape[1]}")
    sampling = _sampling(config, seed, len(prompts))
    requests = [
        decoder.stream(ids, max_new_tokens=n, generation_config=config, **options)
        for ids, n, options in zip(prompts, lengths, sampling, strict=True)
    ]
    outputs = _decode_together(decoder, requests, config, decoder.tokenizer if config.stop_strings else None)
    pad = config.pad_token_id if config.pad_token_id is not None else _first(config.eos_token_id)
    sequences = _stack(input_ids, outputs, 0 if pad is None else pad)
    if not config.return_dict_in_generate:
        return sequences
    return MetasdGenerateOutput(sequences=sequences, metasd_stats=[r.stats for r in requests])


def decoder_for(model: torch.nn.Module, tokenizer, drafters: Sequence, policy: str) -> Decoder:
    """The decoder for this model object and pool, built once and kept on the model (cost calibration and drafters
    are not redone for every call)."""
    kept = model.__dict__.setdefault("_metasd_decoders", {})
    objects = (tokenizer, *(d for d in drafters if not isinstance(d, str)))  # kept alive with the decoder: an id
    key = (tuple(d if isinstance(d, str) else _ids_of(d) for d in drafters), policy, id(tokenizer))  # is not reused
    if key not in kept:
        tokenizer = tokenizer if tokenizer is not None else _tokenizer_of(model)
        built = Decoder(target=model, tokenizer=tokenizer, drafters=drafters, policy=policy)
        kept[key] = (built, objects)
    return kept[key][0]


def _ids_of(item) -> tuple[int, ...]:
    """A drafter object, or a (model, tokenizer) pair, by the identities of what it holds (a pair written inline is
    a new tuple at every call)."""
    return tuple(id(x) for x in item) if isinstance(item, tuple) else (id(item),)


def _tokenizer_of(model: torch.nn.Module):
    from transformers import AutoTokenizer

    name = getattr(model, "name_or_path", "")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise ValueError(f"pass tokenizer=: cannot load one for {name!r} ({err})") from None


def _refuse_settings(config) -> None:
    settings = dict(_REFUSED_SETTINGS, **(_SAMPLING_ONLY if config.do_sample else {}))
    for name, unused in settings.items():
        value = getattr(config, name, None)
        if value not in unused:
            raise ValueError(f"metasd.generate cannot honour {name}={value!r} (greedy decoding and sampling only)")


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config) -> list[list[int]]:
    """Each row's real tokens: the mask's contiguous run of ones (left or right padding)."""
    if attention_mask is None:
        pad, eos = config.pad_token_id, set(token_ids(config.eos_token_id))
        padded = pad is not None and pad not in eos and bool((input_ids == pad).any())
        attention_mask = (input_ids != pad) if padded else torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        shapes = f"{tuple(attention_mask.shape)} and {tuple(input_ids.shape)}"
        raise ValueError(f"attention_mask and input_ids differ in shape: {shapes}")
    prompts = []
    for row, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
        kept = [i for i, m in enumerate(mask) if m]
        if not kept:
            raise ValueError("a row of attention_mask has no token")
        if kept != list(range(kept[0], kept[-1] + 1)):
            raise ValueError("attention_mask must mark one contiguous run per row (left or right padding)")
        prompts.append(row[kept[0] : kept[-1] + 1])
    return prompts


def _sampling(config, seed: int | None, rows: int) -> list[dict]:
    if not config.do_sample:
        return [{} for _ in range(rows)]
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())  # torch.manual_seed reproduces it, as it does generate
    temperature = 1.0 if config.temperature is None else float(config.temperature)
    top_k = 0 if config.top_k is None else int(config.top_k)
    top_p = 1.0 if config.top_p is None else float(config.top_p)
    return [{"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed + i} for i in range(rows)]


def _decode_together(decoder: Decoder, requests: list[Generation], config, tokenizer) -> list[list[int]]:
    """Every request through one batch; a request whose output reaches a stop string leaves there, that token
    kept (as generate's StopStringCriteria ends a row)."""
    outputs = {id(r): r.token_ids for r in requests}
    batch = Batch(decoder, max_batch=len(requests))
    try:
        for request in requests:
            batch.join(request)
        while len(batch):
            for request, _ in batch.step():
                cut = _stop_at(request.token_ids, config.stop_strings, tokenizer) if tokenizer is not None else None
                if cut is not None:
                    outputs[id(request)] = request.token_ids[:cut]
                    batch.leave(request)
            if batch.failed:
                raise batch.failed[0][1]
    finally:  # a step that raised: every request still in leaves (drafters see their end, rows are given back)
        for request in list(batch.requests):
            with contextlib.suppress(Exception):
                batch.leave(request)
    return [list(outputs[id(r)]) for r in requests]


def _stop_at(tokens: list[int], stops, tokenizer) -> int | None:
    """The shortest prefix of `tokens` whose text contains a stop string (its length), if any."""
    stops = [stops] if isinstance(stops, str) else list(stops)
    if not any(stop in tokenizer.decode(tokens) for stop in stops):
        return None
    return next(n for n in range(1, len(tokens) + 1) if any(stop in tokenizer.decode(tokens[:n]) for stop in stops))


def _stack(input_ids: torch.Tensor, outputs: list[list[int]], pad: int) -> torch.Tensor:
    width = max(len(o) for o in outputs)
    new = torch.full((len(outputs), width), pad, dtype=input_ids.dtype)
    for i, out in enumerate(outputs):
        new[i, : len(out)] = torch.tensor(out, dtype=input_ids.dtype)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)


def _first(ids) -> int | None:
    found = token_ids(ids)
    return found[0] if found else None
