"""The guarantees on a GPU, with the models on CUDA: the sampled distribution, and greedy output as exactly as floats
allow. CI has no GPU, so every test here is skipped there; on a machine with one, `pytest -m cuda tests/test_cuda.py`.

The reference is the target's own `generate()` on the same device. Plain steps run the very forwards it runs, so
they must match it exactly. Drafting verifies M tokens in one forward, for which CUDA can pick other kernels than
for a 1-token step: the logits may differ in the last bits, and a greedy token may differ where the target's top
two logits nearly tie. So with drafting the output must match up to its first near-tie, and no further.
"""

import json

import pytest
import torch
from helpers import chi2, chi2_bound, greedy_reference, tiny_vocab_llama
from test_engine import CATEGORIES, MAX_NEW
from test_sampling_distribution import DRAWS, draw, exact_pairs

from metasd import Decoder

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

POOL = ["ngram", "suffix", "early-exit:8", "lm:embedded"]


@pytest.fixture(scope="module")
def cuda_decoder(embedded):
    return Decoder(drafters=POOL, policy="metasd-adaptive", device="cuda")


@pytest.fixture(scope="module")
def cuda_cases(cuda_decoder, questions_path):
    questions = [json.loads(line) for line in questions_path.read_text().splitlines()]
    out = []
    for category in CATEGORIES:
        ids = cuda_decoder.encode(next(q for q in questions if q["category"] == category)["turns"][0])
        out.append((category, ids, greedy_reference(cuda_decoder.target.model, ids, MAX_NEW)))
    return out


def test_models_live_on_the_gpu(cuda_decoder):
    assert cuda_decoder.target.device.type == "cuda"
    assert cuda_decoder.drafters["lm:embedded"].lm.device.type == "cuda"


NEAR_TIE = 1e-3  # logits: float32 sums in another order differ by far less; a real divergence by far more


def test_plain_steps_equal_generate_on_cuda(cuda_decoder, cuda_cases):
    for category, ids, reference in cuda_cases:
        got = cuda_decoder.generate(ids, max_new_tokens=MAX_NEW, policy="none").token_ids
        assert got == reference, f"plain decoding diverged from generate() on {category}"


@pytest.mark.parametrize("policy", ["metasd-adaptive", "metasd-ucb", *(f"fixed:{d}" for d in POOL)])
def test_greedy_output_equals_generate_on_cuda_up_to_near_ties(cuda_decoder, cuda_cases, policy):
    model = cuda_decoder.target.model
    for category, ids, reference in cuda_cases:
        got = cuda_decoder.generate(ids, max_new_tokens=MAX_NEW, policy=policy, seed=0).token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, reference, strict=False)) if a != b), None)
        if first is None:
            assert got == reference
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + reference[:first]], device="cuda")).logits[0, -1].float()
        gap = float(logits[reference[first]] - logits[got[first]])
        assert gap < NEAR_TIE, f"{policy} diverged from generate() on {category} at token {first} (gap {gap:.3g})"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_on_cuda(embedded, dtype):
    decoder = Decoder(drafters=["ngram", "early-exit:8"], dtype=dtype, device="cuda")
    assert next(decoder.target.model.parameters()).dtype == getattr(torch, dtype)
    result = decoder.generate("Repeat after me: the quick brown fox jumps over the lazy dog.", max_new_tokens=24)
    assert result.stats.new_tokens == len(result.token_ids) > 0


def test_sampled_output_follows_the_targets_distribution_on_cuda(embedded, tmp_path):
    target_dir, draft_dir = tmp_path / "target", tmp_path / "drafter"
    target = tiny_vocab_llama(target_dir, embedded.tokenizer, 0)
    tiny_vocab_llama(draft_dir, embedded.tokenizer, 1, base=target, noise=0.15)
    decoder = Decoder(
        target=str(target_dir), drafters=[f"lm:{draft_dir}"], policy=f"fixed:lm:{draft_dir}", draft_len=3, device="cuda"
    )
    expected = exact_pairs(decoder.target.model)  # on the GPU too: top-k/top-p cut-offs must fall alike
    counts, drafted, accepted = draw(decoder)
    assert drafted >= DRAWS and 0.2 * drafted < accepted < 0.9 * drafted
    stat, df = chi2(counts, expected, DRAWS)
    assert stat < chi2_bound(df), (stat, df)
