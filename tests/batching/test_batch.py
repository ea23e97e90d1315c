"""Continuous batching end to end: requests that join and leave mid-batch (one ends at its first token, one is
cancelled, one is cut by its caller as a stop string would cut it) leave every other request's greedy output
exactly what it is decoding alone, with drafting forced on for every row and off; sampled output in a batch keeps
the target's distribution; and the batch decision drafts for everyone on a flat T and stops as T(B, W) grows."""

import copy
import time
from collections import Counter

import numpy as np
import pytest
import torch
from helpers import chi2, chi2_bound
from test_sampling_distribution import DRAWS, PARAMS, PROMPT, _decoder, exact_pairs

import metasd.generation as generation
from metasd import Decoder
from metasd.batching.batch import Batch
from metasd.batching.decision import Plan, decide
from metasd.cached_model import CachedModel
from metasd.drafters.eagle import EagleDrafter
from metasd.models.eagle_head import EagleHead, TargetCheck, head_config_for, save_head
from metasd.policy.adaptive import AdaptivePolicy, Option
from metasd.slots import BatchedTarget

PROMPTS = [
    "Write a python function that reverses a list.",
    "What is the capital of France? Explain briefly.",
    "Translate to German: The weather is nice today.",
    "List three prime numbers and say why they are prime.",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog was not amused.",
]


@pytest.fixture(scope="module")
def decoder(embedded):
    return Decoder()  # the default pool: the shipped EAGLE head reads each row's features


@pytest.fixture(scope="module")
def alone(decoder):
    return {p: decoder.generate(p, max_new_tokens=40).token_ids for p in PROMPTS}


def _priced(batch: Batch, widths) -> None:
    """The batch decides with T(B, W) = widths(B, max W) instead of the measured one (a copy of the decoder's costs,
    which other tests' batches share)."""
    costs = copy.copy(batch.costs)
    costs.forward_widths = widths
    batch.decision.costs = costs


def _flat(batch: Batch) -> None:
    """Every batch shape priced alike: drafting is free, so the decision drafts for every request."""
    _priced(batch, lambda size, max_width: [0.03] * max_width)


def _rising(batch: Batch) -> None:
    """Each token of a batch forward costs a little: wider rows and fuller batches cost more."""
    _priced(batch, lambda size, max_width: [0.03 * (1 + 0.02 * size * w) for w in range(1, max_width + 1)])


class _FeatureSpy:
    """Records what every EAGLE head's catch-up reads (the context and the target's features it was given), to
    compare with a lone forward over that context: a row reading another row's or a stale feature shows there."""

    def __init__(self, monkeypatch):
        self.reads: list[tuple[list[int], torch.Tensor]] = []
        original = EagleDrafter._catch_up

        def spy(drafter, context, features):
            self.reads.append((list(context), features.clone()))
            return original(drafter, context, features)

        monkeypatch.setattr(EagleDrafter, "_catch_up", spy)

    def assert_true_features(self, model, feature_layers=(), required: bool = True) -> None:
        assert self.reads or not required, "no head drafted"
        for context, features in self.reads:
            alone = CachedModel(model, keep_features=True, feature_layers=feature_layers)
            alone.logits_for(context)
            assert features.shape[0] >= len(context) - 1
            want = alone.features_for(context)[: features.shape[0]]
            torch.testing.assert_close(features, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(("costs", "policy"), [(_rising, None), (_flat, None), (_flat, "fixed:eagle")])
def test_joining_and_leaving_leaves_every_other_output_as_it_is_alone(decoder, alone, costs, policy, monkeypatch):
    """Rows drafted together (the shipped EAGLE head among the drafters; with fixed:eagle, every row every round)
    while others joined and left; every feature a head read was its own row's, as a lone forward computes it."""
    spy = _FeatureSpy(monkeypatch)
    batch = Batch(decoder, max_batch=3)
    costs(batch)
    one = decoder.stream(PROMPTS[0], max_new_tokens=1, policy=policy)  # ends at its first token
    cancelled = decoder.stream(PROMPTS[1], max_new_tokens=40, policy=policy)
    cut = decoder.stream(PROMPTS[2], max_new_tokens=40, policy=policy)  # its caller stops it at 6 tokens
    joiners = [decoder.stream(p, max_new_tokens=40, policy=policy) for p in PROMPTS[3:]]
    later = list(joiners)
    for request in (one, cancelled, cut):
        batch.join(request)
    rounds, sizes = 0, Counter()
    while len(batch) or later:
        if rounds == 2:
            batch.leave(cancelled)
        while later and not batch.full and rounds >= 1:  # joins while others are mid-way
            batch.join(later.pop(0))
        sizes[len(batch)] += 1
        for request, _ in batch.step():
            if request is cut and len(cut.token_ids) >= 6:
                batch.leave(cut)
        rounds += 1
    assert one.token_ids == alone[PROMPTS[0]][:1]
    assert cancelled.token_ids == alone[PROMPTS[1]][: len(cancelled.token_ids)] and len(cancelled.token_ids) < 40
    assert cut.token_ids == alone[PROMPTS[2]][: len(cut.token_ids)] and len(cut.token_ids) < 40
    for request, prompt in zip(joiners, PROMPTS[3:], strict=True):
        assert request.token_ids == alone[prompt]
    assert sizes[3] >= 2  # three decoded together for a while
    drafted = sum(n for size, n in batch.stats.drafted.items() if size > 1)
    accepted = sum(n for size, n in batch.stats.accepted.items() if size > 1)
    assert drafted > 0 and accepted > 0  # rows drafted and were verified together, and drafts were kept
    assert batch.target.active == 0 and not batch.requests
    spy.reads = spy.reads[:: max(1, len(spy.reads) // 24)]  # a sample: each check is a lone forward
    layers = decoder.drafters["eagle"].feature_layers  # the shipped head's: what the batch's rows keep
    spy.assert_true_features(decoder.target.model, layers, required=policy is not None)


def test_rows_keep_the_fused_features_a_head_reads_and_outputs_stay_as_alone(embedded, tmp_path, monkeypatch):
    """A head fusing two decoder layers' outputs with the final norm's (EAGLE-3) drafts for every row of a batch
    from the features the batched forward keeps per row (each read equal to a lone forward's, both layers and the
    final norm); each output is what it is alone."""
    spy = _FeatureSpy(monkeypatch)
    torch.manual_seed(0)
    head = EagleHead(head_config_for(embedded.model, 8192, (1, 14)), torch.arange(8192))  # untrained
    save_head(tmp_path, head, "test", TargetCheck.of(embedded.model), {})
    spec = f"eagle:{tmp_path}"
    decoder = Decoder(drafters=[spec, "eagle"], policy=f"fixed:{spec}")
    alone = {p: decoder.generate(p, max_new_tokens=16).token_ids for p in PROMPTS[:3]}
    batch = Batch(decoder, max_batch=3)
    _flat(batch)
    assert batch.target.feature_layers == (1, 14)
    requests = [decoder.stream(p, max_new_tokens=16) for p in PROMPTS[:3]]
    for request in requests:
        batch.join(request)
    while len(batch):
        batch.step()
    assert [r.token_ids for r in requests] == [alone[p] for p in PROMPTS[:3]]
    assert sum(n for size, n in batch.stats.drafted.items() if size > 1) > 0
    spy.reads = [(c, f) for c, f in spy.reads if f.shape[1] == 3 * embedded.model.config.hidden_size][-12:]
    spy.assert_true_features(embedded.model, (1, 14))


def test_a_batch_that_cannot_gain_from_drafting_skips_the_proposals(decoder, alone, monkeypatch):
    """Where even the best acceptance the policies have seen cannot pay for a wider forward, no request's free
    drafters propose and no option is weighed: the batch takes plain steps, outputs unchanged."""
    batch = Batch(decoder, max_batch=2)
    _priced(batch, lambda size, max_width: [0.03 * w * w for w in range(1, max_width + 1)])
    asked = Counter()
    for name in ("free_proposals", "options"):
        owner = generation if name == "free_proposals" else AdaptivePolicy
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _f=original, _n=name, **kw: asked.update([_n]) or _f(*a, **kw))
    requests = [decoder.stream(p, max_new_tokens=40) for p in PROMPTS[3:]]
    for request in requests:
        batch.join(request)
    while len(batch) > 1:
        batch.step()
    assert asked == Counter() and batch.stats.drafted[2] == 0
    while len(batch):
        batch.step()
    for request, prompt in zip(requests, PROMPTS[3:], strict=True):
        assert request.token_ids == alone[prompt]


class _TokenChunks(Batch):
    MIN_CHUNK = 1  # with a tiny prefill_share, a prompt enters a token a step


def test_sampled_output_in_a_batch_follows_the_targets_distribution(pair):
    """The request of interest decodes beside two others (different prompts and lengths, each drafting with its
    own q), joining at once at a rotating place, or after they started, its prompt then entering a token a step
    while they decode (chunked prefill): its first two tokens must follow the target's exact distribution."""
    target, target_dir, draft_dir = pair
    decoder = _decoder(target_dir, draft_dir)
    batch = _TokenChunks(decoder, max_batch=3, prefill_share=0.01)
    options = {"temperature": PARAMS.temperature, "top_k": PARAMS.top_k, "top_p": PARAMS.top_p}
    counts, batched_rounds, chunked = Counter(), 0, 0
    for seed in range(DRAWS):
        mine = decoder.stream(PROMPT, max_new_tokens=3, seed=seed, **options)
        others = [
            decoder.stream([7, 8, 9, 10, 11], max_new_tokens=4, seed=DRAWS + seed, **options),
            decoder.stream([12, 13], max_new_tokens=5, seed=2 * DRAWS + seed, **options),
        ]
        late = seed % 4 == 3
        order = others if late else others[: seed % 3] + [mine] + others[seed % 3 :]
        for request in order:
            batch.join(request)
        if late:
            batch.step()
            batch.join(mine)
        while len(batch):
            chunked += mine in batch.joining and len(batch) > len(batch.joining)
            batched_rounds += len(batch) > 1 and mine in batch.requests
            batch.step()
        counts[tuple(mine.token_ids[:2])] += 1
    assert batched_rounds >= DRAWS and chunked >= DRAWS // 4
    stat, df = chi2(counts, exact_pairs(target), DRAWS)
    assert stat < chi2_bound(df), (stat, df)


def test_a_long_prompt_enters_in_chunks_while_the_others_keep_decoding(decoder, alone):
    """A prompt of some hundreds of tokens joins two running requests: it enters over several steps, each of
    which also runs the others' round (none waits a whole prefill), and every output is what it is alone."""
    long_prompt = "Summarize this text in one sentence. " + " ".join(PROMPTS * 12)
    reference = decoder.generate(long_prompt, max_new_tokens=12).token_ids
    batch = Batch(decoder, max_batch=3, prefill_share=0.3)
    running = [decoder.stream(p, max_new_tokens=40) for p in PROMPTS[:2]]
    for request in running:
        batch.join(request)
    batch.step()
    joiner = decoder.stream(long_prompt, max_new_tokens=12)
    batch.join(joiner)
    chunks = 0
    while joiner in batch.joining:
        before = [len(r.token_ids) for r in running]
        batch.step()
        chunks += 1
        assert all(len(r.token_ids) > n or r.done for r, n in zip(running, before, strict=True))
    assert chunks >= 3 and len(joiner.prompt) > 300
    while len(batch):
        batch.step()
    assert joiner.token_ids == reference
    for request, prompt in zip(running, PROMPTS[:2], strict=True):
        assert request.token_ids == alone[prompt]


def test_prompts_outnumbering_the_decoding_requests_get_each_requests_part_of_a_step(decoder, monkeypatch):
    """Joining prompts get `prefill_share` of a step, or each request's equal part where more of them wait than that
    gives them: three long prompts joining one decoding request are given three quarters of a step, one prompt
    joining three decoding requests the default half; a larger share sizes a larger next chunk from the same step."""
    shares = []
    original = Batch._timed

    def timed(batch, seconds, share):
        shares.append(share)
        return original(batch, seconds, share)

    monkeypatch.setattr(Batch, "_timed", timed)
    long = ["Summarize this text in one sentence. " + " ".join(PROMPTS[i:] * 10) for i in range(4)]
    batch = Batch(decoder, max_batch=4)
    batch.join(decoder.stream(PROMPTS[0], max_new_tokens=30))
    batch.step()
    for prompt in long[:3]:
        batch.join(decoder.stream(prompt, max_new_tokens=2))
    batch.step()
    assert shares == [0.75]
    while len(batch):
        batch.step()
    for prompt in PROMPTS[:3]:
        batch.join(decoder.stream(prompt, max_new_tokens=30))
    batch.step()
    batch.join(decoder.stream(long[3], max_new_tokens=2))
    shares.clear()
    batch.step()
    assert shares == [0.5]

    monkeypatch.setattr(batch.costs, "forward", lambda size, width: 0.03)  # a forward: 30 ms shared, then per token
    sized = {}
    for share in (0.5, 0.75):
        batch._chunk, batch.target.last_forward = 32, (33, 0.09)
        original(batch, 0.1, share)
        sized[share] = batch._chunk
    assert Batch.MIN_CHUNK <= sized[0.5] < sized[0.75]


class _WideChunks(Batch):
    MIN_CHUNK = 256  # a step's prompt budget holds several short prompts


def test_short_prompts_waiting_together_enter_in_one_step(decoder, alone):
    """The step's prompt budget is filled in the order requests joined: two short prompts joining a decoding
    request both enter in the next step's forward (not one per step), and every output is what it is alone."""
    batch = _WideChunks(decoder, max_batch=3, prefill_share=0.5)
    running = decoder.stream(PROMPTS[0], max_new_tokens=40)
    batch.join(running)
    batch.step()
    joiners = [decoder.stream(p, max_new_tokens=40) for p in PROMPTS[1:3]]
    for request in joiners:
        batch.join(request)
    assert sum(len(r.context) for r in joiners) < _WideChunks.MIN_CHUNK
    before = len(running.token_ids)
    batch.step()
    assert batch.joining == [] and len(running.token_ids) > before  # both in, and the running one decoded
    while len(batch):
        batch.step()
    for request, prompt in zip([running, *joiners], PROMPTS[:3], strict=True):
        assert request.token_ids == alone[prompt]


def test_a_chunk_riding_in_a_round_is_left_out_of_the_decoding_requests_rewards(decoder, monkeypatch):
    """The decoding requests' policies are rewarded for a round as it costs without the joiner's chunk (a chunk
    made 0.3 s slower here), as for a prompt's prefill: a slow joiner must not teach them that rounds are slow. The
    round is priced as what it is, a forward of two rows (T(2, W), set to 0.2 s here), not one request's T(M)."""
    seen, chunks = [], []
    original_feedback, original_run = AdaptivePolicy.feedback, BatchedTarget._run

    def feedback(policy, outcome):
        seen.append(outcome.verify_time)
        return original_feedback(policy, outcome)

    def slow_chunk(target, items, logits, prefill=()):
        if prefill:  # inside the round's forward, packed or padded
            chunks.append(len(prefill))
            time.sleep(0.3)
        return original_run(target, items, logits, prefill)

    monkeypatch.setattr(AdaptivePolicy, "feedback", feedback)
    monkeypatch.setattr(BatchedTarget, "_run", slow_chunk)
    batch = Batch(decoder, max_batch=3)
    priced = batch.costs.forward
    monkeypatch.setattr(batch.costs, "forward", lambda size, width: 0.2 if size == 2 else priced(size, width))
    running = [decoder.stream(p, max_new_tokens=20) for p in PROMPTS[:2]]
    for request in running:
        batch.join(request)
    batch.step()
    batch.join(decoder.stream(" ".join(PROMPTS * 4), max_new_tokens=2))
    seen.clear()
    batch.step()
    assert chunks and len(seen) == 2 and all(0.2 <= t < 0.3 for t in seen), seen


def test_each_requests_verify_time_is_the_forward_and_its_own_acceptance(decoder, monkeypatch):
    """Requests conclude one after another; one's verify time must not count the acceptance and learning of the
    requests concluded before it (a cost-aware policy would read them as a slow round and favour slow drafters)."""
    original = AdaptivePolicy.feedback

    def slow_feedback(policy, outcome):
        time.sleep(0.05)
        return original(policy, outcome)

    monkeypatch.setattr(AdaptivePolicy, "feedback", slow_feedback)
    batch = Batch(decoder, max_batch=3)
    _flat(batch)
    requests = [decoder.stream(p, max_new_tokens=8) for p in PROMPTS[:3]]
    for request in requests:
        batch.join(request)
    batch.step()
    batch.step()
    times = [request.stats.rounds[-1].verify_time for request in requests]
    assert max(times) - min(times) < 0.02, times


def _option(arm: int, accept: float, m: int = 6, step: float = 0.0) -> Option:
    gain = np.cumsum([1.0] + [accept**j for j in range(1, m + 1)])
    draft = step * np.arange(m + 1)
    return Option(arm, gain, draft, gain, draft)


def test_the_decision_drafts_for_everyone_on_a_flat_t_and_stops_as_t_grows():
    plans = [Plan([_option(0, 0.7)]) for _ in range(8)]
    flat = decide(plans, [0.03] * 7)
    assert all(arm == 0 and k == 6 for arm, k in flat.choices) and flat.width == 7

    def growing(size: int) -> list[float]:  # each token in the forward costs the same: T ~ B x W
        return [0.01 + 0.004 * size * w for w in range(1, 8)]

    longest = {size: max(k for _, k in decide(plans[:size], growing(size)).choices) for size in (1, 2, 4, 8)}
    assert longest[1] > 0 and longest[8] == 0  # alone it drafts; a full batch takes plain steps
    assert longest[1] >= longest[2] >= longest[4] >= longest[8]


def test_the_decision_drafts_for_everyone_where_no_single_request_could_pay_for_the_wider_forward():
    """Widening the forward costs every row: here one request drafting alone would pay the whole widening for its
    own expected half token, which does not pay, while all eight drafting share it, which does (the shape of the
    embedded model's T(8, W) on a CPU). The decision must find the batch's best, not stop at nobody drafting."""
    times = [0.0708, 0.0773, 0.1094, 0.1084]
    plans = [Plan([_option(0, 0.47, m=3, step=0.002)]) for _ in range(8)]
    plain = 8 / times[0]
    one = (7 + 1.47) / (times[1] + 0.002)
    assert one < plain  # no single request's draft pays
    decision = decide(plans, times)
    assert decision.choices == [(0, 1)] * 8 and decision.width == 2
    assert decision.rate == pytest.approx(8 * 1.47 / (times[1] + 8 * 0.002))
    assert decision.rate > plain


def test_the_decision_prices_each_choice_at_the_width_it_needs():
    """A measured T need not grow with W (on one CPU a 4-token forward ran faster than a 3-token one): choices that
    need width 3, found while searching width 4, must be priced at T(3), not at the cheaper T(4)."""
    times = [0.030, 0.040, 0.080, 0.050]
    plans = [Plan([_option(0, 0.9, m=2)]), Plan([_option(1, 0.2, m=2)])]
    two = (1 + 0.9 + 0.81 + 1 + 0.2 + 0.04) / times[2]  # both drafting 2: width 3
    assert two < (1.9 + 1.2) / times[1] < (1 + 0.9 + 0.81 + 1 + 0.2 + 0.04) / times[3]  # at T(4) it would look best
    decision = decide(plans, times)
    assert decision.width == 2 and decision.choices == [(0, 1), (1, 1)]
    assert decision.rate == pytest.approx((1.9 + 1.2) / times[1])
    assert decide([], times).choices == []


def test_the_decision_keeps_fixed_choices_and_prices_drafting_time():
    plans = [Plan(fixed=(1, 3)), Plan([_option(0, 0.9, step=1.0)])]  # drafting costs a second a token
    decision = decide(plans, [0.03] * 7)
    assert decision.choices == [(1, 3), (None, 0)] and decision.width == 4
    assert decision.rate == pytest.approx(2 / 0.03)
