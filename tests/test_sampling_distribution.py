"""Sampled output of the whole engine follows the target's distribution: a tiny random target and a different tiny
random model drafter (both with the embedded model's 49152-token tokenizer), many draws through speculative rounds
at temperature 0.7 with top-k and top-p, against the target's exact distribution of its first two tokens; and the
same check fails when the drafter reports a q other than the one it drew from."""

from collections import Counter

import numpy as np
import pytest
import torch
from helpers import chi2, chi2_bound, greedy_reference, tiny_vocab_llama
from transformers import LlamaForCausalLM

from metasd import Decoder
from metasd.drafters.base import Draft, Drafter
from metasd.models.eagle_head import EagleHead, TargetCheck, head_config_for, save_head
from metasd.policy.adaptive import AdaptivePolicy
from metasd.sampling import SamplingParams, probabilities

PARAMS = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
DRAWS = 800  # ~30 ms each on a busy 2-core machine; a broken q gives chi2 ~5x the bound at this size
PROMPT = [504, 2365, 314]  # any ids: the models are random


def exact_pairs(model: LlamaForCausalLM, process=None, prompt=PROMPT) -> dict[tuple[int, int], float]:
    """The target's own distribution of (first, second) token under PARAMS, from plain forwards; process(ids,
    logits), when given, changes each row of logits before PARAMS do (a logits processor of the model's own)."""

    def next_row(context: list[int]) -> torch.Tensor:
        with torch.no_grad():
            ids = torch.tensor([context], device=next(model.parameters()).device)
            logits = model(input_ids=ids).logits[0, -1:].float().cpu()
        return probabilities(logits if process is None else process(context, logits), PARAMS)[0]

    first = next_row(prompt)
    out = {}
    for x1 in first.nonzero().flatten().tolist():
        second = next_row(prompt + [x1])
        for x2 in second.nonzero().flatten().tolist():
            out[(x1, x2)] = float(first[x1]) * float(second[x2])
    return out


def draw(decoder: Decoder, prompt=PROMPT) -> tuple[Counter, int, int]:
    """DRAWS generations of 3 tokens with distinct seeds: the first two come from a round that drafted 2 tokens.
    Returns the counts of (first, second) and the drafted / accepted totals."""
    counts, drafted, accepted = Counter(), 0, 0
    for seed in range(DRAWS):
        result = decoder.generate(
            prompt, max_new_tokens=3, temperature=PARAMS.temperature, top_k=PARAMS.top_k, top_p=PARAMS.top_p, seed=seed
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


class TargetGuess(Drafter):
    """A free drafter that proposes the target's most likely next token: deterministic given the context."""

    name = "guess"

    def __init__(self, model: LlamaForCausalLM):
        self.model = model

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


class SecondGuess(TargetGuess):
    """Proposes the target's second likeliest next token: a sibling of TargetGuess's in a tree."""

    name = "second"

    def propose(self, context, k, params, generator) -> Draft:
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([context])).logits[0, -1]
        return Draft([int(torch.topk(logits, 2).indices[1])], confidence=[1.0])


def test_a_tree_of_siblings_from_three_drafters_keeps_the_distribution(pair, monkeypatch):
    """Each first round verifies a tree: the model drafter's 2 sampled tokens (with q) and, as siblings at the
    root, the target's likeliest and second likeliest tokens from two free drafters: SpecInfer's rule must emit
    the target's distribution whichever branch the path takes."""
    target, target_dir, draft_dir = pair
    decoder = Decoder(
        target=target_dir,
        drafters=[f"lm:{draft_dir}", TargetGuess(target), SecondGuess(target)],
        policy="metasd-adaptive:tree=2",
    )
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, k, *a, **kw: (0, 2))
    counts, branched, from_branches = Counter(), 0, 0
    for seed in range(DRAWS):
        result = decoder.generate(
            PROMPT, max_new_tokens=3, temperature=PARAMS.temperature, top_k=PARAMS.top_k, top_p=PARAMS.top_p, seed=seed
        )
        counts[tuple(result.token_ids[:2])] += 1
        first = result.stats.rounds[0]
        branched += first.branch_nodes > 0
        from_branches += first.branch_accepted > 0
    assert branched > 0.9 * DRAWS and from_branches > 0.1 * DRAWS
    stat, df = chi2(counts, exact_pairs(target), DRAWS)
    assert stat < chi2_bound(df), (stat, df)


def test_a_model_drafts_runners_up_as_siblings_keep_the_distribution(pair, monkeypatch):
    """Each first round verifies the model drafter's 2 sampled tokens and, beside each, its runner-up (the
    likeliest token of that q other than the one drawn, which depends on the draw): tried only after the drawn
    token is rejected, it must leave the target's distribution as it is."""
    target, target_dir, draft_dir = pair
    decoder = Decoder(target=target_dir, drafters=[f"lm:{draft_dir}"], policy="metasd-adaptive:tree=1")
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, k, *a, **kw: (0, 2))

    def runners_up(self, tree, proposals, max_nodes):
        main = tree.branches[0].draft
        return [(0, Draft([*main.tokens[:j], token])) for j, (token, _) in enumerate(main.runners_up or [])]

    monkeypatch.setattr(AdaptivePolicy, "branches", runners_up)
    counts, from_branches = Counter(), 0
    for seed in range(DRAWS):
        result = decoder.generate(
            PROMPT, max_new_tokens=3, temperature=PARAMS.temperature, top_k=PARAMS.top_k, top_p=PARAMS.top_p, seed=seed
        )
        counts[tuple(result.token_ids[:2])] += 1
        from_branches += result.stats.rounds[0].branch_accepted > 0
    assert from_branches > 0.05 * DRAWS
    stat, df = chi2(counts, exact_pairs(target), DRAWS)
    assert stat < chi2_bound(df), (stat, df)


PENALTY = 1.3


@pytest.fixture(scope="module")
def penalised(embedded, tmp_path_factory):
    """A tiny target whose own generation config sets a repetition penalty: its generate() applies it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("penalised")
    model = tiny_vocab_llama(path, embedded.tokenizer, 2)
    model.generation_config.repetition_penalty = PENALTY
    model.generation_config.save_pretrained(path)
    yield model, str(path)
    torch.set_num_threads(threads)


def _unpenalised(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation with its repetition penalty switched off."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, repetition_penalty=1.0
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_output_applies_the_targets_own_logits_processors(penalised):
    """Greedy output equals the target's generate() with its generation config's repetition penalty, whichever
    drafter drafts: the n-gram copy, or the target itself (its drafts are the unpenalised argmax, often rejected)."""
    model, path = penalised
    reference = greedy_reference(model, PROMPT, 32)
    assert _unpenalised(model, PROMPT, 32) != reference  # the penalty changes this model's output: the test can tell
    decoder = Decoder(target=path, drafters=["ngram", f"lm:{path}"], draft_len=3)
    for policy in ("fixed:ngram", f"fixed:lm:{path}", "metasd-adaptive", "metasd-adaptive:tree=2", "none"):
        result = decoder.generate(PROMPT, max_new_tokens=32, policy=policy)
        assert result.token_ids == reference, policy


def test_sampled_output_applies_the_targets_own_logits_processors(penalised):
    """Sampled output follows the penalised distribution (transformers' processor applied to each prefix, then
    temperature, top-k and top-p), with the unpenalised target drafting: its q is not the p it is checked against.
    The prompt ends one token before the unpenalised target would repeat a token, so that the penalty decides the
    second token there."""
    from transformers import RepetitionPenaltyLogitsProcessor

    model, path = penalised
    plain = _unpenalised(model, PROMPT, 32)
    repeat = next(i for i, token in enumerate(plain) if token in PROMPT + plain[:i])
    prompt = PROMPT + plain[: repeat - 1]
    penalty = RepetitionPenaltyLogitsProcessor(PENALTY)
    expected = exact_pairs(model, lambda ids, logits: penalty(torch.tensor([ids]), logits), prompt)
    unpenalised = exact_pairs(model, prompt=prompt)
    assert 2 not in {x for cell in expected for x in cell} and 2 <= len(expected) <= 200
    decoder = Decoder(target=path, drafters=[f"lm:{path}"], policy=f"fixed:lm:{path}", draft_len=3)
    counts, drafted, accepted = draw(decoder, prompt)
    assert drafted >= DRAWS and 0 < accepted < drafted
    stat, df = chi2(counts, expected, DRAWS)
    assert stat < chi2_bound(df), (stat, df)
    # the check has power: the same draws are far from the unpenalised distribution
    stat, df = chi2(counts, unpenalised, DRAWS)
    assert stat > chi2_bound(df), (stat, df)


def test_a_target_whose_generation_config_needs_another_model_is_refused(embedded, tmp_path):
    """Classifier-free guidance runs the model on a second, unconditional prompt: not a function of the context
    that verification could apply, so the decoder refuses the target and says how to clear the setting."""
    model = tiny_vocab_llama(tmp_path, embedded.tokenizer, 3)
    model.generation_config.guidance_scale = 1.5
    model.generation_config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"guidance_scale.*generation_config\.guidance_scale = None"):
        Decoder(target=str(tmp_path), drafters=["ngram"])


class CountingStop:
    """A stop rule that counts where it cut the draft: before token j was drawn, or after it."""

    def __init__(self, rule, cuts: Counter):
        self.rule, self.cuts = rule, cuts

    def before(self, j: int, q: torch.Tensor) -> bool:
        stop = self.rule.before(j, q)
        self.cuts["before"] += stop
        return stop

    def after(self, j: int, q: torch.Tensor, token: int) -> bool:
        stop = self.rule.after(j, q, token)
        self.cuts["after"] += stop
        return stop


def test_the_adaptive_stop_rule_cutting_before_and_after_tokens_keeps_the_distribution(pair, monkeypatch):
    """metasd-adaptive's own stop rule, taught that this drafter's unsure tokens fail, ends drafts before a token
    whose q is unsure and after a token that leaves the rest unlikely: both depend on the tokens drawn, and the
    first two tokens must still follow the target's distribution. Its costs, bar and optimism are fixed so that
    the cuts do not depend on the machine's timings."""
    target, target_dir, draft_dir = pair
    spec = f"lm:{draft_dir}:unquantized"
    decoder = Decoder(target=target_dir, drafters=[spec], policy="metasd-adaptive", draft_len=3, policy_scope="server")
    policy = decoder._policy("metasd-adaptive", decoder.drafter_names, "sampled")
    for _ in range(200):  # the confidences this drafter's q rows have on this prompt's continuations
        policy.acceptance.learn(0, [0.69, 0.32], 1, 2)
        policy.acceptance.learn(0, [0.69, 0.79, 0.9], 1, 2)
        policy.acceptance.learn(0, [0.69, 1.0, 0.9], 3, 3)
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, k, *a, **kw: (0, min(3, k)))
    made, cuts = AdaptivePolicy.stop_rule, Counter()

    def stop_rule(self, arm: int, k: int) -> CountingStop:
        rule = made(self, arm, k)
        rule.rate, rule.bonus, rule.later = 100.0, 0.0, self.acceptance.plan_rates(arm, k)
        rule.step, rule.verify = 1e-3, 1e-2 + 1e-3 * np.arange(1, k + 2)
        return CountingStop(rule, cuts)

    monkeypatch.setattr(AdaptivePolicy, "stop_rule", stop_rule)
    counts = Counter()
    for seed in range(DRAWS):
        result = decoder.generate(
            PROMPT, max_new_tokens=4, temperature=PARAMS.temperature, top_k=PARAMS.top_k, top_p=PARAMS.top_p, seed=seed
        )
        counts[tuple(result.token_ids[:2])] += 1
    assert cuts["before"] > 100 and cuts["after"] > 20, cuts
    stat, df = chi2(counts, exact_pairs(target), DRAWS)
    assert stat < chi2_bound(df), (stat, df)


@pytest.mark.parametrize(("weights", "layers"), [("unquantized", ()), ("int8", ()), ("auto", (0,))])
def test_sampled_output_with_an_eagle_head_follows_the_targets_distribution(pair, tmp_path, weights, layers):
    """An EAGLE head (its draft steps on float or int8 weights; reading fused features or the final norm's alone)
    drafts the second token (the first round has no target features yet) from a draft vocabulary that lacks the
    target's likeliest second tokens: q is 0 there, and the rule must still give them their probability."""
    target, target_dir, _ = pair
    expected = exact_pairs(target)
    seconds = Counter()
    for (_, x2), p in expected.items():
        seconds[x2] += p
    left_out = {x for x, _ in seconds.most_common(2)}
    vocab = torch.tensor(sorted({x for cell in expected for x in cell} - left_out))
    head = EagleHead(head_config_for(target, len(vocab), layers), vocab)
    save_head(tmp_path, head, "tiny", TargetCheck.of(target), {})
    spec = f"eagle:{tmp_path}:{weights}"
    decoder = Decoder(target=target_dir, drafters=[spec], policy=f"fixed:{spec}", draft_len=3)
    counts, drafted, accepted = draw(decoder)
    assert drafted >= DRAWS // 2 and 0 < accepted < drafted
    assert any(counts[cell] for cell in counts if cell[1] in left_out)  # drawn though the head never proposes them
    stat, df = chi2(counts, expected, DRAWS)
    assert stat < chi2_bound(df), (stat, df)
