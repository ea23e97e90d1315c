"""Drafters on their own: prompt lookup, the suffix index, and model drafters' cache catch-up."""

import torch

from metasd.drafters import build_drafter
from metasd.drafters.ngram import NgramDrafter
from metasd.drafters.suffix import SuffixDrafter
from metasd.sampling import SamplingParams

GREEDY = SamplingParams()


def test_ngram_copies_what_followed_the_most_recent_match():
    d = NgramDrafter(max_ngram=3)
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert d.propose(ctx, 2, GREEDY, None).tokens == [7, 8]  # the later [1, 2, 3] wins
    assert d.propose([5, 6, 7, 5], 3, GREEDY, None).tokens == [6, 7, 5]  # falls back to a 1-gram
    assert d.propose([1, 2, 3], 3, GREEDY, None).tokens == []  # nothing repeats
    assert d.propose([4], 3, GREEDY, None).tokens == []


def test_suffix_follows_most_frequent_continuation_and_learns_across_requests():
    d = SuffixDrafter(depth=4)
    d.begin([1, 2])
    # context: after [5] came 6 twice and 7 once; the longest suffix [4, 5] was followed by 7
    ctx = [5, 6, 5, 6, 4, 5, 7, 0, 4, 5]
    assert d.propose(ctx, 1, GREEDY, None).tokens == [7]
    assert d.propose(ctx + [8], 2, GREEDY, None).tokens == []  # 8 was never seen
    # the request ends: its generated part (the context minus the 2-token prompt) joins the history
    d.end(ctx + [8, 3])
    d.begin([42])
    assert d.propose([42, 8], 1, GREEDY, None).tokens == [3]  # learned in the previous request


def test_model_drafter_catches_up_like_a_fresh_one(embedded):
    prompt = embedded.tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    missed = embedded.tokenizer(" Then it ran into the forest and", add_special_tokens=False)["input_ids"]
    late = build_drafter("early-exit:8", embedded)
    late.begin(prompt)
    first = late.propose(prompt, 3, GREEDY, None)
    context = prompt + first.tokens[:1] + missed  # one drafted token accepted, then rounds it sat out
    caught_up = late.propose(context, 3, GREEDY, None)
    fresh = build_drafter("early-exit:8", embedded)
    fresh.begin(prompt)
    expected = fresh.propose(context, 3, GREEDY, None)
    assert caught_up.tokens == expected.tokens
    assert torch.allclose(caught_up.q, expected.q, atol=1e-4)
    assert late.lm.tokens == context + caught_up.tokens[:-1]  # the cache mirrors the true context, no drift
    assert late.lm.cache.get_seq_length() == len(late.lm.tokens)


def test_early_exit_shares_the_targets_weights(embedded):
    d = build_drafter("early-exit:4", embedded)
    assert len(d.lm.model.model.layers) == 4
    assert d.lm.model.lm_head.weight.data_ptr() == embedded.model.lm_head.weight.data_ptr()
    assert embedded.model.config.num_hidden_layers == 30  # the target itself is untouched
