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


def test_ngram_signal_grows_with_the_full_match_length():
    """The lookup needs 3 tokens to find a copy; its confidence says how long the match really is."""
    drafter = NgramDrafter(max_ngram=3)
    copy = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    long = drafter.propose(copy + [1, 2] + copy[:9], 2, SamplingParams(), None)  # 9 tokens match: a copy
    assert long.tokens == [19, 1] and long.confidence == [0.9, 0.9]
    short = drafter.propose([5, 6, 7, 9, 1, 2, 6, 7], 2, SamplingParams(), None)  # only "6 7" matches
    assert short.tokens == [9, 1] and short.confidence == [0.3, 0.3]
    one = drafter.propose([5, 6, 7, 8, 3, 7], 2, SamplingParams(), None)
    assert one.tokens == [8, 3] and one.confidence == [0.1, 0.1]


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


def test_suffix_index_follows_a_context_that_is_not_an_extension_of_the_last():
    """Asked for a continuation of a guessed context (a model's draft before verification), then for the true one,
    the local index holds exactly what a drafter that only ever saw the true context holds."""
    seen, truth = SuffixDrafter(depth=3), SuffixDrafter(depth=3)
    for d in (seen, truth):
        d.begin([1, 2])
    ctx = [1, 2, 5, 6, 5, 6, 4]
    for d in (seen, truth):
        d.propose(ctx, 2, GREEDY, None)
    seen.propose(ctx + [9, 9, 8], 2, GREEDY, None)  # the guess: rejected later
    true_next = ctx + [5, 6]
    assert seen.propose(true_next, 2, GREEDY, None).tokens == truth.propose(true_next, 2, GREEDY, None).tokens
    assert seen.local.next == truth.local.next
    assert (9,) not in seen.local.next


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


def _counts(index) -> dict:
    return {key: dict(counts) for key, counts in index.next.items() if counts}


def test_suffix_history_evicts_incrementally_and_stays_bounded():
    import random

    from metasd.drafters.suffix import SuffixIndex

    rng = random.Random(0)
    d = SuffixDrafter(depth=4, history_requests=8, history_tokens=10_000)
    outputs = [[rng.randrange(50) for _ in range(rng.randrange(2, 40))] for _ in range(30)]
    work = []
    original_add, original_remove = SuffixIndex.add, SuffixIndex.remove

    def counting_add(self, tokens, start):
        work.append(len(tokens) - start)
        original_add(self, tokens, start)

    def counting_remove(self, tokens):
        work.append(len(tokens))
        original_remove(self, tokens)

    SuffixIndex.add, SuffixIndex.remove = counting_add, counting_remove
    try:
        for i, out in enumerate(outputs):
            d.begin([7])
            work.clear()
            d.end([7, *out])
            evicted = outputs[i - 8] if i >= 8 else []
            # each request touches only its own output and the one it evicts, never the whole history
            assert sum(work) == len(out) + len(evicted)
    finally:
        SuffixIndex.add, SuffixIndex.remove = original_add, original_remove
    assert d.outputs == outputs[-8:]
    fresh = SuffixIndex(4)
    for out in outputs[-8:]:
        fresh.add(out, 0)
    assert _counts(d.history) == _counts(fresh)  # the same counts as a rebuild, with no emptied entries left
    assert all(d.history.next.values())


def test_suffix_history_is_bounded_in_tokens():
    d = SuffixDrafter(depth=2, history_requests=100, history_tokens=50)
    for i in range(20):
        d.begin([1])
        d.end([1, *range(i, i + 20)])
    assert sum(map(len, d.outputs)) <= 50 and d.outputs[-1] == list(range(19, 39))


def test_suffix_histories_are_isolated_by_key_or_off():
    d = SuffixDrafter(depth=2)
    d.use_history("alice")
    d.begin([9])
    d.end([9, 4, 5, 6])
    d.begin([9])
    assert d.propose([9, 4], 2, GREEDY, None).tokens == [5, 6]  # alice's own history
    d.use_history("bob")
    d.begin([9])
    assert d.propose([9, 4], 2, GREEDY, None).tokens == []  # bob cannot see alice's output
    d.end([9, 4, 7])
    d.use_history(None)
    d.begin([9])
    assert d.propose([9, 4], 2, GREEDY, None).tokens == []  # off: nothing from any history
    d.end([9, 4, 8])  # and nothing learned
    assert d.outputs == []
    d.use_history("alice")
    assert d.outputs == [[4, 5, 6]]


def test_suffix_token_bound_holds_across_all_histories():
    d = SuffixDrafter(depth=2, history_tokens=30)
    for i in range(10):
        d.use_history(f"key-{i % 3}")
        d.begin([1])
        d.end([1, *range(10 * i, 10 * i + 10)])
    assert sum(h.tokens for h in d._histories.values()) <= 30
    # key-1, least recently used, gave up its output (and its emptied history is gone); key-2 and key-0 keep theirs
    assert list(d._histories) == ["key-2", "key-0"]
    assert d.outputs == [list(range(60, 70)), list(range(90, 100))]
