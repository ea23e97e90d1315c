"""Forks of one model drafter (`lm:`) drafting together in a batch: one forward per drafted token for every row,
proposing what each fork proposes alone, with rows kept across rounds, made anew when more forks draft together
than there are rows, and given back when a request ends."""

import dataclasses

import pytest
import torch
from helpers import decode_in_batch, greedy_reference, tiny_llama

from metasd import Decoder
from metasd.costs import DrafterCost
from metasd.draft import DraftJob
from metasd.drafters.lm import ModelDrafter, SharedRows
from metasd.sampling import SamplingParams

GREEDY = SamplingParams()


def sharp_llama() -> torch.nn.Module:
    """A tiny random Llama whose attention is sharp (an untrained one attends almost evenly, blind to positions and
    masks) and whose logits are spread (ties of a near-uniform q would make greedy drafts fragile)."""
    torch.manual_seed(0)
    model = tiny_llama(64, layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
        model.lm_head.weight.mul_(20)
    return model


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_k=20)], ids=["greedy", "sampled"])
def test_forks_drafting_together_draft_what_each_drafts_alone(params):
    model = sharp_llama()
    drafter = ModelDrafter(model, "lm:tiny", 64)
    contexts, ks = [[5, 6, 7, 8], [9, 3, 4, 1, 2, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32]], [3, 4, 2, 1]
    together = [drafter.fork() for _ in contexts]
    unseen = [0] * len(contexts)
    for rounds in range(3):  # the same forks, round after round: each row takes in only what it has not seen
        alone = [
            drafter.fork().propose(c, k, params, torch.Generator().manual_seed(len(c)))
            for c, k in zip(contexts, ks, strict=True)
        ]
        jobs = [
            DraftJob(fork, c, k, params, torch.Generator().manual_seed(len(c)))
            for fork, c, k in zip(together, contexts, ks, strict=True)
        ]
        assert len({fork.batch_key() for fork in together}) == 1
        results = ModelDrafter.draft_batch(jobs)
        assert all(seconds > 0 for _, seconds in results)
        for one, (many, _), k, c, n in zip(alone, results, ks, contexts, unseen, strict=True):
            assert many.tokens == one.tokens and len(many.tokens) == k and many.forwards == one.forwards == k
            torch.testing.assert_close(many.q, one.q, atol=1e-5, rtol=1e-4)
            assert [t for t, _ in many.runners_up] == [t for t, _ in one.runners_up]
            assert many.taken_in == (len(c) if rounds == 0 else n)  # a new row takes in the whole context
        # the next round: each context grew by a verified prefix of its draft and the target's token (one that is
        # not the draft's next, as a rejection gives); its row holds the context and the first k - 1 draft tokens,
        # so it takes in the rest of the prefix and the target's token
        kept = [min(rounds % 2 + 1, k) for k in ks]
        contexts = [
            c + d.tokens[:n] + [next(t for t in (40 + i, 50 + i) if d.tokens[n : n + 1] != [t])]
            for i, (c, d, n) in enumerate(zip(contexts, alone, kept, strict=True))
        ]
        unseen = [n + 1 - min(n, k - 1) for n, k in zip(kept, ks, strict=True)]
    assert drafter.slots.target.active == len(together) and drafter.slots.generation == 1  # rows kept, not remade
    for fork, context in zip(together, contexts, strict=True):  # a round of its own: from its row, as a fresh fork
        mine = fork.propose(context, 3, GREEDY, None)
        assert fork.lm.tokens == [] and mine.tokens == drafter.fork().propose(context, 3, GREEDY, None).tokens
    long = list(range(1, 60)) * 2 + [5, 6, 7, 8, 9]  # 123 tokens: a draft of 6 reaches past the model's 128
    results = ModelDrafter.draft_batch([DraftJob(together[0], long, 6, GREEDY, None), jobs[1]])
    assert (
        len(results[0][0].tokens) == 6 and results[0][0].tokens == drafter.fork().propose(long, 6, GREEDY, None).tokens
    )


def test_rows_are_given_back_and_made_anew_when_too_few():
    model = sharp_llama()
    drafter = ModelDrafter(model, "lm:tiny", 64)
    forks = [drafter.fork() for _ in range(20)]
    context = [1, 2, 3, 4, 5]
    first = ModelDrafter.draft_batch([DraftJob(f, context, 2, GREEDY, None) for f in forks[:8]])
    rows = len(drafter.slots.target.rows)
    assert drafter.slots.target.active == 8 and rows >= 8
    forks[0].end(context)  # a request ended: its row is free for another
    assert drafter.slots.target.active == 7 and forks[0].row is None
    ModelDrafter.draft_batch([DraftJob(f, context, 2, GREEDY, None) for f in forks[1 : rows + 1]])
    assert drafter.slots.generation == 1 and drafter.slots.target.active == rows  # the freed row reused
    grown = ModelDrafter.draft_batch([DraftJob(f, context, 2, GREEDY, None) for f in forks])  # more forks than rows
    assert drafter.slots.generation == 2 and len(drafter.slots.target.rows) >= 20
    assert [d.tokens for d, _ in grown] == [first[0][0].tokens] * 20  # every row caught up anew: the same draft


def test_a_model_the_rows_decode_differently_drafts_one_by_one(monkeypatch):
    slots = SharedRows(sharp_llama())

    def refuse(model):
        raise ValueError("differs")

    monkeypatch.setattr("metasd.drafters.lm.check_batched_logits", refuse)
    assert not slots.usable()
    drafter = ModelDrafter(sharp_llama(), "lm:tiny", 64)
    drafter.slots = slots
    assert drafter.fork().batch_key() is None


def test_a_batch_of_requests_with_an_lm_drafter_decodes_each_as_alone(embedded):
    """End to end, the embedded model's first 8 layers drafting for it (early exit, a model drafter) in a batch of
    three whose forks draft together: every request's greedy output is the target's."""
    decoder = Decoder(drafters=["early-exit:8"], policy="fixed:early-exit:8", draft_len=3)
    prompts = ["Name three colours.", "Count to five.", "What is a river?"]
    requests = decode_in_batch(decoder, prompts, 12, policy="fixed:early-exit:8")
    for request, prompt in zip(requests, prompts, strict=True):
        assert request.token_ids == greedy_reference(embedded.model, decoder.encode(prompt), 12)
    drafted = [r.stats.drafters()["early-exit:8"].drafted for r in requests]
    assert all(n > 0 for n in drafted)
    slots = decoder.drafters["early-exit:8"].slots
    assert slots.usable() and slots.generation == 1  # a truncated model's forks drafted together in rows
    assert slots.target.active == 0  # every request gave its row back


def test_the_drafters_own_count_of_what_it_took_in_is_what_its_costs_learn_from(embedded, monkeypatch):
    """A model drafter that says what it took in (a fork moving to a row of its own takes in its whole context,
    more than the engine counts) is believed: its cost observations read its count, not the engine's."""
    decoder = Decoder(drafters=["early-exit:8"], policy="fixed:early-exit:8", draft_len=3)
    propose, observe = ModelDrafter.propose, DrafterCost.observe
    seen = []
    monkeypatch.setattr(ModelDrafter, "propose", lambda *a: dataclasses.replace(propose(*a), taken_in=99))
    monkeypatch.setattr(
        DrafterCost, "observe", lambda self, f, missed, s: seen.append(missed) or observe(self, f, missed, s)
    )
    decoder.generate("Name three colours.", max_new_tokens=8)
    assert seen and set(seen) == {99}
