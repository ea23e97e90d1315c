"""Sampled output of the whole engine follows the target's distribution: a tiny random target and a different tiny
random model drafter (both with the embedded model's 49152-token tokenizer), many draws through speculative rounds
at temperature 0.7 with top-k and top-p, against the target's exact distribution of its first two tokens; and the
same check fails when the drafter reports a q other than the one it drew from."""

from collections import Counter

import pytest
import torch
from helpers import chi2, chi2_bound
from transformers import LlamaConfig, LlamaForCausalLM

from metasd import Decoder
from metasd.drafters.base import Draft
from metasd.policy.adaptive import AdaptivePolicy
from metasd.sampling import SamplingParams, probabilities

PARAMS = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
DRAWS = 800  # ~30 ms each on a busy 2-core machine; a broken q gives chi2 ~5x the bound at this size
PROMPT = [504, 2365, 314]  # any ids: the models are random


def _tiny(path, tokenizer, seed: int, base=None, noise: float = 0.0) -> LlamaForCausalLM:
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


@pytest.fixture(scope="module")
def pair(embedded, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("drafter")
    target = _tiny(target_dir, embedded.tokenizer, 0)
    _tiny(draft_dir, embedded.tokenizer, 1, base=target, noise=0.15)
    yield target, str(target_dir), str(draft_dir)
    torch.set_num_threads(threads)


def exact_pairs(model: LlamaForCausalLM) -> dict[tuple[int, int], float]:
    """The target's own distribution of (first, second) token under PARAMS, from plain forwards."""

    def next_row(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            ids = torch.tensor([ids], device=next(model.parameters()).device)
            return probabilities(model(input_ids=ids).logits[0, -1:].float().cpu(), PARAMS)[0]

    first = next_row(PROMPT)
    out = {}
    for x1 in first.nonzero().flatten().tolist():
        second = next_row(PROMPT + [x1])
        for x2 in second.nonzero().flatten().tolist():
            out[(x1, x2)] = float(first[x1]) * float(second[x2])
    return out


def draw(decoder: Decoder) -> tuple[Counter, int, int]:
    """DRAWS generations of 3 tokens with distinct seeds: the first two come from a round that drafted 2 tokens.
    Returns the counts of (first, second) and the drafted / accepted totals."""
    counts, drafted, accepted = Counter(), 0, 0
    for seed in range(DRAWS):
        result = decoder.generate(
            PROMPT, max_new_tokens=3, temperature=PARAMS.temperature, top_k=PARAMS.top_k, top_p=PARAMS.top_p, seed=seed
        )
        counts[tuple(result.token_ids[:2])] += 1
        for d in result.stats.drafters().values():
            drafted, accepted = drafted + d.drafted, accepted + d.accepted
    return counts, drafted, accepted


def _decoder(target_dir: str, draft_dir: str, weights: str = "unquantized") -> Decoder:
    spec = f"lm:{draft_dir}:{weights}"
    return Decoder(target=target_dir, drafters=[spec], policy=f"fixed:{spec}", draft_len=3)


@pytest.mark.parametrize("weights", ["unquantized", "int8"])
def test_sampled_output_follows_the_targets_distribution(pair, weights):
    """Also with the drafter on int8 weights: its q differs from the model's, and the rule must use the q drawn
    from."""
    target, target_dir, draft_dir = pair
    expected = exact_pairs(target)
    assert 2 not in {x for cell in expected for x in cell}  # no end-of-sequence: every draw has two tokens
    assert 4 <= len(expected) <= 200  # a handful of likely pairs: the test has power at DRAWS draws
    decoder = _decoder(target_dir, draft_dir, weights)
    assert decoder.drafters[decoder.drafter_names[0]].weights == weights
    counts, drafted, accepted = draw(decoder)
    assert drafted >= DRAWS and 0.2 * drafted < accepted < 0.9 * drafted  # rejections and acceptances both happen
    stat, df = chi2(counts, expected, DRAWS)
    assert stat < chi2_bound(df), (stat, df)


def test_the_check_fails_when_q_is_processed_differently(pair):
    """The drafter draws at temperature 0.7 but reports q as if at 0.35: the acceptance rule then favours the
    drafter's likely tokens, and the bound above must catch it."""
    target, target_dir, draft_dir = pair
    decoder = _decoder(target_dir, draft_dir)
    drafter = decoder.drafters[decoder.drafter_names[0]]

    def sharpened(draft: Draft) -> Draft:
        q = None if draft.q is None else draft.q**2 / (draft.q**2).sum(-1, keepdim=True)
        return Draft(draft.tokens, q, draft.confidence)

    for method in ("propose", "propose_until"):
        if hasattr(drafter, method):
            original = getattr(drafter, method)
            setattr(drafter, method, lambda *a, _f=original, **kw: sharpened(_f(*a, **kw)))
    counts, _, _ = draw(decoder)
    stat, df = chi2(counts, exact_pairs(target), DRAWS)
    assert stat > chi2_bound(df), (stat, df)


class TargetGuess:
    """A free drafter that proposes the target's most likely next token: deterministic given the context."""

    name = "guess"
    has_cache = False

    def __init__(self, model: LlamaForCausalLM):
        self.model = model

    def begin(self, prompt: list[int]) -> None:
        pass

    def end(self, context: list[int]) -> None:
        pass

    def propose(self, context, k, params, generator) -> Draft:
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([context])).logits[0, -1]
        return Draft([int(logits.argmax())], confidence=[1.0])


def test_a_model_draft_continued_by_a_free_drafter_keeps_the_distribution(pair, monkeypatch):
    """The first round drafts one token from the model drafter, then the free drafter's guess for the context it
    leads to (a one-hot row in q): the first two tokens must still follow the target's distribution."""
    target, target_dir, draft_dir = pair
    decoder = Decoder(
        target=target_dir, drafters=[f"lm:{draft_dir}", TargetGuess(target)], policy="metasd-adaptive:extend=1"
    )
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, k, *a, **kw: (0, 1))
    monkeypatch.setattr(AdaptivePolicy, "extension", lambda self, arm, draft, after: (1, 1) if after else None)
    counts, continued = Counter(), 0
    for seed in range(DRAWS):
        result = decoder.generate(
            PROMPT, max_new_tokens=3, temperature=PARAMS.temperature, top_k=PARAMS.top_k, top_p=PARAMS.top_p, seed=seed
        )
        counts[tuple(result.token_ids[:2])] += 1
        continued += result.stats.rounds[0].extended
    assert continued == DRAWS
    stat, df = chi2(counts, exact_pairs(target), DRAWS)
    assert stat < chi2_bound(df), (stat, df)
