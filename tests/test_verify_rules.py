"""The sampling path against independent references: `probabilities` against transformers' own logits warpers, and
`verify_sampling` over multi-token drafts against the exact distribution of the emitted tokens (Monte Carlo on a
tiny vocabulary, with a control that breaks q and must fail)."""

import math
from collections import Counter
from itertools import product

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from metasd.sampling import SamplingParams, probabilities
from metasd.verify import verify_sampling


def chi2_bound(df: int, z: float = 5.0) -> float:
    """Upper quantile of chi-square with df degrees of freedom at a normal z (Wilson-Hilferty); z = 5 is a tail of
    about 3e-7, so a correct sampler fails about never (the seeds below make each run deterministic anyway)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic, cells with an expected count under 5 pooled into one; (statistic, degrees of freedom).
    A draw outside the expected support makes it infinite."""
    if any(cell not in expected or expected[cell] == 0 for cell in counts):
        return math.inf, 1
    big = [c for c, p in expected.items() if p * n >= 5]
    small = [c for c, p in expected.items() if 0 < p * n < 5]
    cells = [([c], expected[c]) for c in big] + ([(small, sum(expected[c] for c in small))] if small else [])
    stat = sum((sum(counts[c] for c in group) - n * p) ** 2 / (n * p) for group, p in cells)
    return stat, len(cells) - 1


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

V, K, L = 4, 2, 3  # vocabulary, draft length, tokens per sampled sequence


def _table(seed: int, zero: int | None) -> dict[tuple[int, ...], torch.Tensor]:
    """A next-token distribution for every prefix shorter than L; `zero` gets no mass after odd-length prefixes (as
    top-k would cut it), so drafts can propose tokens the target never emits and vice versa."""
    gen = torch.Generator().manual_seed(seed)
    rows = {}
    for n in range(L):
        for prefix in product(range(V), repeat=n):
            row = torch.softmax(torch.randn(V, generator=gen) * 1.5, dim=-1)
            if zero is not None and n % 2 == 1:
                row[zero] = 0.0
                row /= row.sum()
            rows[prefix] = row
    return rows


P = _table(1, zero=3)
Q = _table(2, zero=0)


def exact() -> dict[tuple[int, ...], float]:
    out = {}
    for seq in product(range(V), repeat=L):
        out[seq] = math.prod(float(P[seq[:i]][seq[i]]) for i in range(L))
    return out


def sample(n: int, seed: int, drafter: str) -> Counter:
    """n sequences of L tokens through speculative rounds of up to K drafted tokens, as the engine runs them.

    drafter: "q" (draws from Q and reports it), "one-hot" (Q's argmax, q None), "wrong-q" (draws from Q but
    reports Q sharpened, as if processed at another temperature: must be caught)."""
    gen = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(n):
        out: list[int] = []
        while len(out) < L:
            k = min(K, L - len(out) - 1)
            draft, rows = [], []
            for _ in range(k):
                q = Q[tuple(out + draft)]
                token = int(torch.argmax(q)) if drafter == "one-hot" else int(torch.multinomial(q, 1, generator=gen))
                reported = q ** 3 / (q ** 3).sum() if drafter == "wrong-q" else q
                draft.append(token)
                rows.append(reported)
            p = torch.stack([P[tuple(out + draft[:j])] for j in range(k + 1)])
            q_rows = None if drafter == "one-hot" or not rows else torch.stack(rows)
            verdict = verify_sampling(p, q_rows, draft, gen)
            assert 0 <= verdict.accepted <= len(draft)
            out += draft[: verdict.accepted] + [verdict.next_token]
        counts[tuple(out[:L])] += 1
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
