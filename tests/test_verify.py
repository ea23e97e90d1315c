"""The acceptance rules: greedy prefix matching; the sampling rule's output distribution equals p, for one token and
over multi-token drafts against the exact distribution (Monte Carlo on a tiny vocabulary, with a control that breaks
q and must fail); and `probabilities` against transformers' own logits warpers."""

import math
from collections import Counter
from itertools import product

import pytest
import torch
from helpers import chi2, chi2_bound
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from metasd.drafters.base import Draft
from metasd.sampling import SamplingParams, draw, probabilities
from metasd.tree import DraftTree
from metasd.verify import Verdict, verify_greedy, verify_sampling, verify_tree_sampling

V = 6
P = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.10, 0.10], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
Q = torch.tensor([[0.50, 0.05, 0.25, 0.05, 0.10, 0.05]])  # a drafter that is badly wrong about p


def first_token_histogram(rule, trials: int, seed: int) -> torch.Tensor:
    """Distribution of the first emitted token when the drafter samples x ~ q and the rule verifies it."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V)
    for _ in range(trials):
        x = int(torch.multinomial(Q[0], 1, generator=g))
        verdict = rule(P, Q, [x], g)
        counts[x if verdict.accepted else verdict.next_token] += 1
    return counts / trials


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def accept_always(p, q, draft, g):
    return Verdict(len(draft), int(torch.multinomial(p[len(draft)], 1, generator=g)))


def resample_from_p(p, q, draft, g):  # a common bug: on rejection sample p instead of the residual max(0, p - q)
    u = float(torch.rand((), generator=g))
    if u < min(1.0, float(p[0, draft[0]] / q[0, draft[0]])):
        return Verdict(1, int(torch.multinomial(p[1], 1, generator=g)))
    return Verdict(0, int(torch.multinomial(p[0], 1, generator=g)))


# 20k trials: the sampling error of a 6-way histogram is about 0.01 in TV; the wrong rules are off by >= 0.08.
THRESHOLD = 0.03


def test_sampling_rule_output_matches_target_distribution():
    hist = first_token_histogram(verify_sampling, 20_000, seed=0)
    assert total_variation(hist, P[0]) < THRESHOLD
    assert total_variation(hist, Q[0]) > 0.3  # it is p we converge to, not q


@pytest.mark.parametrize("wrong_rule", [accept_always, resample_from_p])
def test_threshold_rejects_wrong_rules(wrong_rule):
    hist = first_token_histogram(wrong_rule, 20_000, seed=0)
    assert total_variation(hist, P[0]) > THRESHOLD


def test_one_hot_drafter_matches_target_distribution():
    """q=None: the drafter proposes a fixed token; accept with p(x), else sample p with x removed."""
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(V)
    trials = 20_000
    for _ in range(trials):
        verdict = verify_sampling(P, None, [2], g)
        counts[2 if verdict.accepted else verdict.next_token] += 1
    assert total_variation(counts / trials, P[0]) < THRESHOLD


def test_bonus_token_is_drawn_from_the_last_row():
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.1, 0.5]])
    counts = torch.zeros(V)
    for _ in range(10_000):
        verdict = verify_sampling(p, None, [1], g)
        assert verdict.accepted == 1  # p(x) = 1: always accepted
        counts[verdict.next_token] += 1
    assert total_variation(counts / 10_000, p[1]) < THRESHOLD


def test_sampling_never_accepts_a_token_the_target_excludes():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0]] * 2)
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        verdict = verify_sampling(p, None, [0], g)
        assert verdict.accepted == 0 and verdict.next_token in (1, 2)


def test_greedy_accepts_longest_matching_prefix_then_target_token():
    logits = torch.full((4, V), -1.0)
    for row, best in enumerate([3, 1, 4, 5]):
        logits[row, best] = 1.0
    assert verify_greedy(logits, [3, 1, 4]) == Verdict(3, 5)  # all accepted + bonus
    assert verify_greedy(logits, [3, 2, 4]) == Verdict(1, 1)  # rejected at position 1: target's token there
    assert verify_greedy(logits, [0, 1, 4]) == Verdict(0, 3)
    assert verify_greedy(logits[:1], []) == Verdict(0, 3)  # empty draft: one plain target step


# --- probabilities == transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper -> softmax ----


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.7])
@pytest.mark.parametrize("top_k", [0, 1, 5, 40])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
def test_probabilities_match_transformers_warpers(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(hash((temperature, top_k, top_p)) % 2**31)
    logits = torch.randn(6, 300, generator=gen) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    want = torch.softmax(scores, dim=-1)
    got = probabilities(logits, SamplingParams(temperature, top_k, top_p))
    assert torch.equal(got > 0, want > 0)  # the same support, token for token
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_a_tie_at_the_kth_logit_keeps_every_tied_token_as_transformers_does(top_p):
    """Top-k keeps every logit not below the k-th largest: three tokens tied there all stay (k likeliest alone
    would keep one of them), and a nucleus reaching past them keeps them all too."""
    logits = torch.full((2, 300), -2.0)
    logits[:, [7, 40, 41, 42]] = torch.tensor([4.0, 2.5, 2.5, 2.5])
    logits[1, 9] = 3.0  # the second row has no tie at its k-th
    scores = TopKLogitsWarper(2)(None, TemperatureLogitsWarper(0.7)(None, logits.clone()))
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    want = torch.softmax(scores, dim=-1)
    got = probabilities(logits, SamplingParams(0.7, 2, top_p))
    assert torch.equal(got > 0, want > 0)
    assert int((got[0] > 0).sum()) == 4 and int((got[1] > 0).sum()) == 2
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("scale", [8.0, 1.0, 0.05])
def test_a_nucleus_looked_for_among_the_likeliest_tokens_is_the_full_sorts(scale):
    """Peaked rows find their nucleus among the first tokens looked at, flat ones only after growing to the whole
    vocabulary; rows of both kinds in one batch: every row as transformers' full sort gives it."""
    gen = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(5, 20000, generator=gen) * torch.tensor([[scale], [scale], [0.05], [scale], [8.0]])
    for top_p in (0.5, 0.9, 0.99):
        scores = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(0.8)(None, logits.clone()))
        want = torch.softmax(scores, dim=-1)
        got = probabilities(logits, SamplingParams(0.8, 0, top_p))
        assert torch.equal(got > 0, want > 0)
        assert torch.allclose(got, want, atol=1e-6)


def test_draw_follows_the_row_and_never_draws_a_token_without_mass():
    row = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0]) * 0.999  # weights: they need not sum to exactly 1
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = Counter(draw(row, gen) for _ in range(n))
    assert set(counts) == {1, 3, 4}
    stat, df = chi2(counts, {1: 0.2, 3: 0.5, 4: 0.3}, n)
    assert stat < chi2_bound(df)
    assert draw(torch.tensor([0.0, 0.0, 1.0, 0.0]), gen) == 2
    for bad in ([0.0, 0.0], [0.5, float("nan")], [0.5, -0.1, 0.6], [float("inf"), 1.0]):
        with pytest.raises(ValueError, match="non-negative, finite weights"):
            draw(torch.tensor(bad), gen)
    assert probabilities(torch.zeros(0, 50), SamplingParams(0.8, 0, 0.9)).shape == (0, 50)


def test_tiny_temperatures_are_greedy_and_never_nan():
    logits = torch.randn(4, 1000) * 30
    for temperature in (0.0, 1e-300, 5e-324, 9.99e-6):
        assert SamplingParams(temperature).greedy
    for temperature in (1e-5, 1e-4, 0.01):
        params = SamplingParams(temperature, 0, 1e-300)
        assert not params.greedy
        probs = probabilities(logits, params)
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(4))


# --- verify_sampling: multi-token drafts, with and without q ----------------------------------------------------

SEQ_V, SEQ_K, SEQ_L = 4, 2, 3  # vocabulary, draft length, tokens per sampled sequence


def _table(seed: int, zero: int | None) -> dict[tuple[int, ...], torch.Tensor]:
    """A next-token distribution for every prefix shorter than SEQ_L; `zero` gets no mass after odd-length prefixes (as
    top-k would cut it), so drafts can propose tokens the target never emits and vice versa."""
    gen = torch.Generator().manual_seed(seed)
    rows = {}
    for n in range(SEQ_L):
        for prefix in product(range(SEQ_V), repeat=n):
            row = torch.softmax(torch.randn(SEQ_V, generator=gen) * 1.5, dim=-1)
            if zero is not None and n % 2 == 1:
                row[zero] = 0.0
                row /= row.sum()
            rows[prefix] = row
    return rows


SEQ_P = _table(1, zero=3)
SEQ_Q = _table(2, zero=0)


def exact() -> dict[tuple[int, ...], float]:
    out = {}
    for seq in product(range(SEQ_V), repeat=SEQ_L):
        out[seq] = math.prod(float(SEQ_P[seq[:i]][seq[i]]) for i in range(SEQ_L))
    return out


def sample(n: int, seed: int, drafter: str) -> Counter:
    """n sequences of SEQ_L tokens through speculative rounds of up to SEQ_K drafted tokens, as the engine runs them.

    drafter: "q" (draws from SEQ_Q and reports it), "one-hot" (Q's argmax, q None), "wrong-q" (draws from SEQ_Q but
    reports SEQ_Q sharpened, as if processed at another temperature: must be caught)."""
    gen = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(n):
        out: list[int] = []
        while len(out) < SEQ_L:
            k = min(SEQ_K, SEQ_L - len(out) - 1)
            draft, rows = [], []
            for _ in range(k):
                q = SEQ_Q[tuple(out + draft)]
                token = int(torch.argmax(q)) if drafter == "one-hot" else int(torch.multinomial(q, 1, generator=gen))
                reported = q**3 / (q**3).sum() if drafter == "wrong-q" else q
                draft.append(token)
                rows.append(reported)
            p = torch.stack([SEQ_P[tuple(out + draft[:j])] for j in range(k + 1)])
            q_rows = None if drafter == "one-hot" or not rows else torch.stack(rows)
            verdict = verify_sampling(p, q_rows, draft, gen)
            assert 0 <= verdict.accepted <= len(draft)
            out += draft[: verdict.accepted] + [verdict.next_token]
        counts[tuple(out[:SEQ_L])] += 1
    return counts


@pytest.mark.parametrize("drafter", ["q", "one-hot"])
def test_verify_sampling_emits_exactly_the_target_distribution(drafter):
    n = 12_000
    stat, df = chi2(sample(n, seed=7, drafter=drafter), exact(), n)
    assert stat < chi2_bound(df), (stat, df)


def test_verify_sampling_check_catches_a_q_that_is_not_what_was_drawn():
    n = 12_000
    stat, df = chi2(sample(n, seed=7, drafter="wrong-q"), exact(), n)
    assert stat > 3 * chi2_bound(df), (stat, df)  # the test above has the power to see a broken q


SEQ_R = _table(3, zero=None)  # what the deterministic branches follow


def sample_trees(n: int, seed: int, wrong_q: bool = False) -> tuple[Counter, Counter]:
    """n sequences of SEQ_L tokens through tree rounds: a branch drawn from SEQ_Q (with its q), then two
    deterministic ones: SEQ_R's argmax chain, and SEQ_P's second likeliest first token followed by SEQ_R's argmax.
    They share prefixes or split at the root from draw to draw. Returns the sequences and which branches the
    accepted paths ended in (shared nodes count for each; every branch must be taken for the test to mean
    anything)."""
    gen = torch.Generator().manual_seed(seed)
    counts, taken = Counter(), Counter()
    for _ in range(n):
        out: list[int] = []
        while len(out) < SEQ_L:
            k = SEQ_L - len(out) - 1
            sampled, rows = [], []
            for _ in range(k):
                q = SEQ_Q[tuple(out + sampled)]
                sampled.append(int(torch.multinomial(q, 1, generator=gen)))
                rows.append(q**3 / (q**3).sum() if wrong_q else q)
            tree = DraftTree.chain(Draft(sampled, torch.stack(rows) if rows else None), arm=0)
            for arm, first in ((1, None), (2, int(torch.argsort(SEQ_P[tuple(out)], descending=True)[1]))):
                chain = [] if first is None else [first]
                while len(chain) < k:
                    chain.append(int(torch.argmax(SEQ_R[tuple(out + chain)])))
                tree.add(arm, Draft(chain[:k]))
            p = torch.stack([SEQ_P[tuple(out + prefix)] for prefix in tree.prefixes()])
            verdict = verify_tree_sampling(p, tree, gen)
            taken.update(b.arm for b in tree.branches if verdict.path and verdict.path[-1] in b.nodes)
            out += tree.path_tokens(verdict.path) + [verdict.next_token]
        counts[tuple(out[:SEQ_L])] += 1
    return counts, taken


def test_tree_sampling_emits_exactly_the_target_distribution():
    """SpecInfer's multi-step rule over siblings from a sampled drafter and two deterministic ones."""
    n = 12_000
    counts, taken = sample_trees(n, seed=11)
    assert min(taken[arm] for arm in (0, 1, 2)) > 300
    stat, df = chi2(counts, exact(), n)
    assert stat < chi2_bound(df), (stat, df)


def test_tree_sampling_check_catches_a_q_that_is_not_what_was_drawn():
    n = 12_000
    stat, df = chi2(sample_trees(n, seed=11, wrong_q=True)[0], exact(), n)
    assert stat > 3 * chi2_bound(df), (stat, df)


def test_a_one_branch_tree_is_the_chain_rule():
    """Same draws, same verdicts: the tree rule reduces to `verify_sampling` on a chain."""
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        draft = [int(torch.multinomial(SEQ_Q[()], 1, generator=gen))]
        q = SEQ_Q[()][None]
        p = torch.stack([SEQ_P[()], SEQ_P[tuple(draft)]])
        chain = verify_sampling(p, q, draft, torch.Generator().manual_seed(seed))
        tree = verify_tree_sampling(p, DraftTree.chain(Draft(draft, q)), torch.Generator().manual_seed(seed))
        assert (chain.accepted, chain.next_token, chain.path) == (tree.accepted, tree.next_token, tree.path)
