"""The decoder is lossless: greedy output equals the target's own generate(), for every drafter and policy."""

import json
from itertools import pairwise

import pytest
from helpers import greedy_reference

from metasd import Decoder, Draft
from metasd.drafters.base import Drafter
from metasd.drafters.ngram import NgramDrafter
from metasd.drafters.suffix import SuffixDrafter
from metasd.policy.adaptive import AdaptivePolicy
from metasd.sampling import SamplingParams

CATEGORIES = [
    "writing",
    "roleplay",
    "coding",
    "math",
    "extraction",
    "translation",
    "summarization",
    "qa",
    "math_reasoning",
    "rag",
]
MAX_NEW = 32
GROUP_CASES = ("writing", "translation", "summarization", "qa", "math_reasoning", "rag")  # one per Spec-Bench group
DRAFTER_CASES = ("writing", "coding", "translation", "summarization", "math_reasoning")  # prose, code, copying, math
OTHER_POLICIES = [
    "none",
    "metasd-ucb-cost",
    "metasd-fi",
    "ucb-be",
    "exp3",
    "sequential-halving",
    "random",
    "round-robin",
    "ducb",
    "swucb:4",
]
# lm:embedded:unquantized is the target itself: it always agrees; lm:embedded:int8 is the target's int8 twin
POOL = ["ngram", "suffix", "early-exit:8", "lm:embedded:unquantized", "lm:embedded:int8"]
EXACT = "lm:embedded:unquantized"


class NeverAgrees(Drafter):
    """Drafts a token the target never predicts here: every round is a full rejection."""

    name = "never"

    def propose(self, context, k, params: SamplingParams, generator) -> Draft:
        return Draft([7] * k)  # a byte-fallback token that never appears in the outputs


@pytest.fixture(scope="module")
def decoder(embedded):
    return Decoder(drafters=[*POOL, NeverAgrees()], policy="metasd-ucb", draft_len=4)


@pytest.fixture(scope="module")
def cases(decoder, questions_path):
    """One prompt from each of 10 Spec-Bench categories, with the target's own greedy continuation."""
    questions = [json.loads(line) for line in questions_path.read_text().splitlines()]
    out = []
    for category in CATEGORIES:
        question = next(q for q in questions if q["category"] == category)
        ids = decoder.encode(question["turns"][0])
        out.append((category, ids, greedy_reference(decoder.target.model, ids, MAX_NEW)))
    return out


def assert_lossless(decoder, cases, **options):
    for category, ids, reference in cases:
        result = decoder.generate(ids, max_new_tokens=MAX_NEW, **options)
        assert result.token_ids == reference, f"{options} diverged from generate() on {category}"
        assert result.stats.new_tokens == len(reference)


@pytest.mark.parametrize("drafter", [*POOL, "never"])
def test_each_drafter_alone_is_lossless(decoder, cases, drafter):
    """Five categories of different character: every kind of drafter drafts and is rejected on each."""
    assert_lossless(decoder, [c for c in cases if c[0] in DRAFTER_CASES], policy=f"fixed:{drafter}")


@pytest.mark.parametrize(
    "policy", ["metasd-adaptive", "metasd-ucb", "metasd-adaptive:tree=1", "metasd-adaptive:tree=2"]
)
def test_the_default_and_the_papers_policy_are_lossless_on_every_category(decoder, cases, policy):
    """Also with draft trees: cost-sized, and every free proposal verified whole beside the chosen draft."""
    assert_lossless(decoder, cases, policy=policy, seed=0)


def test_trees_of_a_model_draft_and_every_free_proposal_are_lossless(decoder, cases, monkeypatch):
    """Every round a model drafter's draft (early exit, often wrong, or the target itself, always right) is the
    tree's first branch and every free proposal joins it whole, the never-agreeing one included: paths through
    any branch, the cache kept on the accepted path, must leave the output unchanged."""
    names = decoder.drafter_names
    early, model = names.index("early-exit:8"), names.index(EXACT)
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, k, *a, **kw: ((early, model)[self.rounds % 2], 3))
    trees = from_branches = 0
    for category, ids, reference in cases:
        result = decoder.generate(ids, max_new_tokens=MAX_NEW, policy="metasd-adaptive:tree=2")
        assert result.token_ids == reference, f"tree rounds diverged from generate() on {category}"
        stats = result.stats.to_dict()
        trees, from_branches = trees + stats["tree_rounds"], from_branches + stats["branch_accepted"]
        assert sum(r.emitted for r in result.stats.rounds) == len(reference)
    assert trees >= 50 and from_branches >= 5


@pytest.mark.parametrize("policy", OTHER_POLICIES)
def test_each_other_policy_over_the_full_pool_is_lossless(decoder, cases, policy):
    """Every policy drives the same loop (a choice of drafter and length per round), so two Spec-Bench groups per
    policy, rotating so that each group meets three or four policies, keep the suite short; the two above take all
    ten categories."""
    i = OTHER_POLICIES.index(policy)
    groups = {GROUP_CASES[(2 * i) % len(GROUP_CASES)], GROUP_CASES[(2 * i + 1) % len(GROUP_CASES)]}
    assert_lossless(decoder, [c for c in cases if c[0] in groups], policy=policy, seed=0)


def test_model_drafts_continued_by_free_drafters_are_lossless(decoder, cases, monkeypatch):
    """Every round a model drafter drafts (early exit, often wrong, and the target itself, always right) and the
    first free proposal for the context its tokens lead to is appended whole: continuations of rejected tokens,
    and the suffix index asked about contexts that never happen, must not change the output."""
    names = decoder.drafter_names
    early, model = names.index("early-exit:8"), names.index(EXACT)
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, k, *a, **kw: ((early, model)[self.rounds % 2], 3))
    monkeypatch.setattr(
        AdaptivePolicy,
        "extension",
        lambda self, arm, draft, after: next(((a, len(d.tokens)) for a, d in after.items() if d.tokens), None),
    )
    continued, free = 0, [n for n in names if not decoder.drafters[n].runs_model]
    for category, ids, reference in cases:
        result = decoder.generate(ids, max_new_tokens=MAX_NEW, policy="metasd-adaptive:extend=1")
        assert result.token_ids == reference, f"continued drafts diverged from generate() on {category}"
        rounds = result.stats.rounds
        continued += sum(r.extended > 0 for r in rounds)
        # per drafter, a continuation's tokens are its free drafter's (without a pull), the rest the model's
        per_drafter = result.stats.drafters()
        assert sum(d.drafted for d in per_drafter.values()) == sum(r.drafted for r in rounds)
        assert sum(d.accepted for d in per_drafter.values()) == sum(r.accepted for r in rounds)
        assert sum(d.drafted for n, d in per_drafter.items() if n in free) == sum(r.extended for r in rounds)
        assert all(per_drafter[n].pulls == 0 for n in free if n in per_drafter)
    assert continued >= 10


def test_edge_drafters_accept_everything_or_nothing(decoder, cases):
    _, ids, reference = cases[0]
    always = decoder.generate(ids, max_new_tokens=MAX_NEW, policy=f"fixed:{EXACT}").stats
    assert always.drafters()[EXACT].accepted == always.drafters()[EXACT].drafted
    assert always.mean_accepted_tokens > 4.0  # k + 1 = 5 except the clipped last round
    never = decoder.generate(ids, max_new_tokens=MAX_NEW, policy="fixed:never").stats
    assert never.drafters()["never"].accepted == 0
    assert never.mean_accepted_tokens == 1.0


def test_full_information_scores_free_drafters_without_drafting_with_them(decoder, cases):
    _, ids, _ = cases[0]
    generation = decoder.stream(ids, max_new_tokens=MAX_NEW, policy="metasd-fi")
    for _ in generation:
        pass
    drafting_rounds = sum(r.drafter is not None for r in generation.stats.rounds)
    drafted = generation.stats.drafters()
    for i, drafter in enumerate(generation.pool):
        own = drafted[drafter.name].pulls if drafter.name in drafted else 0
        # free drafters are observed every round, drafting or not; model drafters only when they draft
        assert generation.policy.pulls[i] == (own if drafter.runs_model else drafting_rounds)
    assert sum(generation.policy.pulls) > drafting_rounds


def test_round_robin_switches_every_round_and_catches_up(decoder, cases):
    _, ids, reference = cases[1]
    stats = decoder.generate(ids, max_new_tokens=MAX_NEW, policy="round-robin").stats
    drafted = [r.drafter for r in stats.rounds if r.drafter]
    assert all(a != b for a, b in pairwise(drafted))
    assert stats.catch_up_tokens > 0  # model drafters had missed the rounds of the others
    assert stats.switches == len(drafted) - 1


def test_suffix_history_holds_whole_outputs_even_rounds_it_sat_out(embedded):
    suffix = SuffixDrafter()
    decoder = Decoder(drafters=[NgramDrafter(), suffix], draft_len=4)
    prompt = "Write a haiku about autumn leaves."
    first = decoder.generate(prompt, max_new_tokens=MAX_NEW, policy="fixed:ngram")  # suffix never drafts
    assert suffix._outputs == [first.token_ids]
    again = decoder.generate(prompt, max_new_tokens=MAX_NEW, policy="fixed:suffix")
    assert again.token_ids == first.token_ids
    assert again.stats.mean_accepted_tokens > 3.0  # it drafts the earlier answer back (k + 1 = 5 at best)
    generation = decoder.stream("Name three colours.", max_new_tokens=MAX_NEW, policy="fixed:ngram")
    rounds = iter(generation)
    next(rounds), next(rounds)
    generation.close()  # a consumer that stops early (a client disconnect): the partial output still counts
    assert suffix._outputs[-1] == generation.token_ids and len(generation.token_ids) >= 2


def test_generation_stops_at_eos_where_generate_does(decoder):
    ids = decoder.encode("Reply with only the word: yes")
    reference = greedy_reference(decoder.target.model, ids, 64)
    result = decoder.generate(ids, max_new_tokens=64, policy="metasd-ucb")
    assert result.token_ids == reference
    assert result.finish_reason == "stop" and result.token_ids[-1] in decoder.target.eos_token_ids
    assert len(result.token_ids) < 64


def test_seeded_sampling_is_reproducible(embedded):
    """A seed reproduces a run from a fresh decoder (the suffix drafter's history is state that changes drafts)."""
    options = dict(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.95)

    def run(seed):
        return Decoder(drafters=POOL, policy="metasd-ucb", draft_len=4).generate(
            "Tell me a story about a robot.", seed=seed, **options
        )

    a, b, c = run(7), run(7), run(8)
    assert a.token_ids == b.token_ids
    assert [r.drafter for r in a.stats.rounds] == [r.drafter for r in b.stats.rounds]
    assert a.token_ids != c.token_ids


def test_stream_yields_each_rounds_tokens(decoder):
    generation = decoder.stream("Count from one to five.", max_new_tokens=16, policy="fixed:ngram")
    chunks = list(generation)
    assert [t for chunk in chunks for t in chunk] == generation.token_ids
    assert len(chunks) == len(generation.stats.rounds)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt="   "), "prompt is empty"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(policy="thompson"), "unknown policy"),
        (dict(policy="fixed:medusa"), "medusa"),
        (dict(drafters=["eagle"]), "not in the loaded pool"),
        (dict(prompt=[5] * 9000), "exceeds the model's context"),
    ],
)
def test_bad_requests_raise_value_error(decoder, options, message):
    options = {"prompt": "hello", **options}
    with pytest.raises(ValueError, match=message):
        decoder.stream(options.pop("prompt"), **options)


def test_bad_decoder_configurations_raise_value_error(embedded):
    with pytest.raises(ValueError, match="unknown drafter"):
        Decoder(drafters="ngram,medusa")
    with pytest.raises(ValueError, match="draft_len"):
        Decoder(drafters="ngram", draft_len=0)
    with pytest.raises(ValueError, match="twice"):
        Decoder(drafters="ngram,ngram")
    with pytest.raises(ValueError, match="early-exit"):
        Decoder(drafters="early-exit:30")


class SampledWithoutCache(Drafter):
    """A free drafter (no cache) that samples its tokens and reports q: the engine cuts free proposals to the
    chosen length after seeing them, which is unbiased only for deterministic (one-hot) tokens."""

    name = "sampled-free"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def propose(self, context, k, params: SamplingParams, generator) -> Draft:
        import torch

        q = torch.full((k, self.vocab_size), 1.0 / self.vocab_size)
        return Draft([int(torch.multinomial(row, 1, generator=generator)) for row in q], q)


@pytest.mark.parametrize("policy", ["fixed:sampled-free", "metasd-adaptive", "metasd-fi"])
def test_a_free_drafter_that_reports_q_is_refused(embedded, policy):
    """Whether the policy asks every free drafter for a proposal (metasd-adaptive, full information) or drafts with
    it directly (fixed), the first proposal with q is a ValueError naming the drafter, before any token is kept."""
    decoder = Decoder(drafters=["ngram", SampledWithoutCache(embedded.vocab_size)], draft_len=4)
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match="'sampled-free'.*q"):
            decoder.generate("Count from one to ten.", max_new_tokens=16, policy=policy, temperature=temperature)


def test_only_construction_extends_the_calibrated_draft_range(embedded, monkeypatch):
    """A decoder built with metasd-adaptive:max=K calibrates T(M) up to K + 1 once, at construction; a request
    whose policy drafts longer than that is a ValueError, never a calibration in the middle of serving."""
    from types import SimpleNamespace

    import metasd.costs.calibration

    calibrated = []

    def fake_calibration(spec, model, max_tokens, **kwargs):  # T(M) = T(1): no need to measure for this test
        calibrated.append(max_tokens)
        return SimpleNamespace(table=[1e-3] * max_tokens)

    monkeypatch.setattr(metasd.costs.calibration, "load_or_calibrate", fake_calibration)
    decoder = Decoder(drafters=["ngram", "suffix"], policy="metasd-adaptive:max=20")
    assert calibrated[-1] == 21 and decoder.cost_model().target.max_tokens == 21
    calibrated.clear()
    decoder.generate("Count: 1 2 3 1 2 3", max_new_tokens=4, policy="metasd-adaptive:max=16")
    for policy in ("metasd-adaptive:max=21", "metasd-adaptive:max=64"):
        with pytest.raises(ValueError, match="calibrated T\\(M\\) at start for drafts of up to 20"):
            decoder.generate("Count: 1 2 3 1 2 3", max_new_tokens=4, policy=policy)
    assert calibrated == [] and decoder.cost_model().target.max_tokens == 21
