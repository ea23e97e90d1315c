"""`metasd.generate` for a transformers user's own model object: padded batches (left and right), rows ending at
different lengths, the model's generation_config honoured, sampling reproduced by torch's seed, refused options
named, transformers' `custom_generate` entry, and `Decoder` over model objects (target and drafter)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import metasd
from metasd import Decoder
from metasd.hf import CUSTOM_GENERATE

PROMPTS = [
    "Write a python function that reverses a list.",
    "Say only the word yes.",
    "What is the capital of France?",
    "List three prime numbers.",
]
NEW = 24


@pytest.fixture(scope="module")
def model(embedded):
    return embedded.model


@pytest.fixture(scope="module")
def tokenizer(embedded):
    return embedded.tokenizer


def _batch(tokenizer, side: str = "left"):
    """The prompts as one padded batch (chat template applied), as a tokenizer with padding would give them."""
    rows = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rows]
    width, pad = max(map(len, ids)), tokenizer.eos_token_id
    input_ids = torch.full((len(ids), width), pad)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, row in enumerate(ids):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        input_ids[i, span], mask[i, span] = torch.tensor(row), 1
    return {"input_ids": input_ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def reference(model, tokenizer):
    """transformers' own greedy generate on the left-padded batch."""
    inputs = _batch(tokenizer)
    return model.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=tokenizer.eos_token_id)


def test_greedy_on_a_left_padded_batch_is_generates_own_output(model, tokenizer, reference):
    out = metasd.generate(model, **_batch(tokenizer), max_new_tokens=NEW, tokenizer=tokenizer)
    assert torch.equal(out, reference)
    eos = tokenizer.eos_token_id
    ends = [row[-NEW:].tolist().index(eos) if eos in row[-NEW:].tolist() else NEW for row in out]
    assert min(ends) < NEW - 1 and max(ends) == NEW  # one row ended early and is padded, another ran to the limit


def test_a_right_padded_batch_gets_the_same_new_tokens(model, tokenizer, reference):
    inputs = _batch(tokenizer, "right")
    out = metasd.generate(model, **inputs, max_new_tokens=NEW, tokenizer=tokenizer, return_dict_in_generate=True)
    assert torch.equal(out.sequences[:, : inputs["input_ids"].shape[1]], inputs["input_ids"])
    assert torch.equal(out.sequences[:, -NEW:], reference[:, -NEW:])
    assert len(out.metasd_stats) == len(PROMPTS) and all(s.rounds for s in out.metasd_stats)


def test_a_generation_config_is_honoured_as_generate_honours_it(model, tokenizer):
    """max_new_tokens, a repetition penalty (a logits processor) and a stop string, from a config object."""
    inputs = _batch(tokenizer)
    config = GenerationConfig(max_new_tokens=12, repetition_penalty=1.3, do_sample=False)
    want = model.generate(**inputs, generation_config=config, pad_token_id=tokenizer.eos_token_id)
    got = metasd.generate(model, **inputs, generation_config=config, tokenizer=tokenizer)
    assert torch.equal(got, want)
    text = tokenizer.decode(want[0, -12:])
    stop = text.split()[2]
    want = model.generate(**inputs, max_new_tokens=12, stop_strings=stop, tokenizer=tokenizer, do_sample=False)
    got = metasd.generate(model, **inputs, max_new_tokens=12, stop_strings=stop, tokenizer=tokenizer)
    assert torch.equal(got[0], want[0])  # the row that meets the stop string ends with the token completing it


def test_sampling_is_reproduced_by_torchs_seed(model, tokenizer):
    """With a policy and pool whose choices depend on nothing but the request (the paper's UCB bandit, a fresh one
    per request; prompt lookup), the realized sample is the seed's: `torch.manual_seed` reproduces a call."""
    inputs = _batch(tokenizer)
    options = {"max_new_tokens": 12, "do_sample": True, "temperature": 0.8, "top_p": 0.9, "tokenizer": tokenizer}
    options |= {"drafters": ["ngram"], "policy": "metasd-ucb"}
    torch.manual_seed(7)
    first = metasd.generate(model, **inputs, **options)
    torch.manual_seed(7)
    again = metasd.generate(model, **inputs, **options)
    torch.manual_seed(8)
    other = metasd.generate(model, **inputs, **options)
    assert torch.equal(first, again) and not torch.equal(first, other)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"num_beams": 2}, "num_beams"),
        ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences"),
        ({"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
        ({"do_sample": True, "typical_p": 0.5}, "typical_p"),
        ({"logits_processor": [lambda ids, scores: scores]}, "logits_processor"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha"),
    ],
)
def test_what_metasd_cannot_honour_is_refused_by_name(model, tokenizer, options, named):
    with pytest.raises(ValueError, match=named):
        metasd.generate(model, **_batch(tokenizer), max_new_tokens=4, tokenizer=tokenizer, **options)


def test_what_generate_passes_for_not_used_is_accepted(model, tokenizer):
    from transformers import LogitsProcessorList, StoppingCriteriaList

    inputs = _batch(tokenizer)
    out = metasd.generate(model, **inputs, max_new_tokens=2, tokenizer=tokenizer, synced_gpus=False,
                          logits_processor=LogitsProcessorList(), stopping_criteria=StoppingCriteriaList())  # fmt: skip
    assert out.shape == (len(PROMPTS), inputs["input_ids"].shape[1] + 2)


def test_transformers_custom_generate_decodes_through_metasd(model, tokenizer, reference):
    inputs = _batch(tokenizer)
    out = model.generate(
        **inputs, max_new_tokens=NEW, do_sample=False, custom_generate=CUSTOM_GENERATE, trust_remote_code=True,
        tokenizer=tokenizer, return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, reference) and out.metasd_stats is not None


def test_a_decoder_takes_model_objects_as_target_and_drafter(pair, embedded):
    """The caller's objects decoded as they are: greedy output equal to the target's own, the drafter object used."""
    from helpers import greedy_reference

    target, target_dir, draft_dir = pair
    drafter = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    decoder = Decoder(target=target, tokenizer=embedded.tokenizer, drafters=[(drafter, embedded.tokenizer)])
    (name,) = decoder.drafter_names
    assert decoder.target.model is target and decoder.drafters[name].model is drafter
    assert name.startswith(f"lm:{draft_dir} (LlamaForCausalLM ") and "," not in name  # a comma separates specs
    result = decoder.generate([5, 6, 7, 8], max_new_tokens=16, policy=f"fixed:{name}")
    assert result.token_ids == greedy_reference(target, [5, 6, 7, 8], 16)
    assert result.stats.drafters()[name].drafted > 0


def test_model_objects_without_what_they_need_are_refused(pair, embedded):
    target, _, draft_dir = pair
    with pytest.raises(ValueError, match="needs its tokenizer"):
        Decoder(target=target)
    with pytest.raises(ValueError, match="goes with its tokenizer"):
        Decoder(target=target, tokenizer=embedded.tokenizer, drafters=[target])
    with pytest.raises(ValueError, match="tokenizer= goes with a model object"):
        Decoder(tokenizer=embedded.tokenizer)
    target.train()
    try:
        with pytest.raises(ValueError, match="training mode"):
            Decoder(target=target, tokenizer=embedded.tokenizer)
    finally:
        target.eval()
