"""The routed linear layers compute what nn.Linear computes, survive a copy, and keep decoding lossless."""

import copy
import json

import pytest
import torch
from helpers import greedy_reference, tiny_llama

from metasd import Decoder
from metasd.models.linear_kernels import KERNELS, ONEDNN, RoutedLinear, install, installed, installed_beyond

needs_onednn = pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN linear op")


def seeded_llama():
    torch.manual_seed(0)
    return tiny_llama(64, layers=2, positions=128)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_weight_major_matches_torch_linear_with_and_without_bias(rows):
    torch.manual_seed(rows)
    for bias in (True, False):
        layer = torch.nn.Linear(24, 40, bias=bias)
        x = torch.randn(1, rows, 24)
        expected = layer(x)
        holder = torch.nn.Sequential(layer)
        install(holder, ["weight-major"] * 8)
        assert type(layer) is RoutedLinear
        got = layer(x)
        assert got.shape == expected.shape and got.is_contiguous()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        # the rows of a batch of two sequences count together: 2 x rows rows
        torch.testing.assert_close(layer(x.repeat(2, 1, 1)), expected.repeat(2, 1, 1), rtol=1e-5, atol=1e-6)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_matches_torch_linear_with_and_without_bias(dtype):
    torch.manual_seed(0)
    for bias in (True, False):
        layer = torch.nn.Linear(24, 40, bias=bias).to(dtype)
        install(torch.nn.Sequential(layer), ["onednn"] * 4, beyond="onednn")
        for shape in ((1, 24), (3, 24), (2, 5, 24), (1, 64, 24)):  # routed rows and rows beyond the table
            x = torch.randn(*shape, dtype=dtype)
            with torch.inference_mode():
                got = layer(x)
            tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
            torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), **tol)
            assert got.shape == (*shape[:-1], 40)


@needs_onednn
def test_onednn_follows_a_written_weight_and_leaves_training_to_autograd():
    """The reordered copy is made again when the weight changes (a learner updating a head in place), and a
    product that autograd records runs torch's own op (oneDNN's has no backward)."""
    torch.manual_seed(1)
    layer = torch.nn.Linear(8, 6)
    install(torch.nn.Sequential(layer), ["onednn"] * 4)
    x = torch.randn(2, 8)
    with torch.no_grad():
        before = layer(x)
        layer.weight.add_(1.0)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert not torch.allclose(layer(x), before)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    with torch.inference_mode():  # weights made under inference mode count no writes, and still compute
        made = torch.nn.Linear(8, 6)
        install(torch.nn.Sequential(made), ["onednn"] * 4)
        torch.testing.assert_close(made(x), torch.nn.functional.linear(x, made.weight, made.bias))


def test_install_routes_by_row_count_and_leaves_longer_inputs_to_torch(monkeypatch):
    model = seeded_llama()
    install(model, ["linear", "weight-major"])
    assert installed(model) == ["linear", "weight-major"]
    calls = []
    import metasd.models.linear_kernels as lk

    real = lk._weight_major
    monkeypatch.setattr(lk, "_weight_major", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.inference_mode():
        for rows in (1, 2, 3):
            calls.clear()
            model(input_ids=torch.arange(rows)[None])
            assert bool(calls) == (rows == 2), rows  # M = 2 weight-major; M = 1 and M beyond the table: torch's
    with pytest.raises(ValueError, match="unknown linear kernels"):
        install(model, ["linear", "mkl"])
    install(model, ["linear"], beyond="weight-major")  # a prefill's rows take the kernel chosen for them
    with torch.inference_mode():
        calls.clear()
        model(input_ids=torch.arange(5)[None])
        assert calls and not any(shape[-2] == 1 for shape in calls)


@pytest.mark.parametrize("kernel", KERNELS[1:])
def test_a_copied_model_computes_with_its_own_weights(kernel):
    """A routed layer must not keep pointing at the original's weights once copied (distillation copies layers),
    nor at the original's oneDNN copy of them (which is made again on use, as it cannot be copied)."""
    model = seeded_llama()
    install(model, [kernel] * 4, beyond=kernel)
    ids = torch.arange(3)[None]
    with torch.inference_mode():
        before = model(input_ids=ids).logits  # the oneDNN copies exist from here on
    clone = copy.deepcopy(model)
    with torch.inference_mode():
        for p in clone.parameters():
            p.add_(0.5)
        assert torch.equal(model(input_ids=ids).logits, before)
        assert not torch.allclose(clone(input_ids=ids).logits, before)
    assert installed(clone) == [kernel] * 4


def test_quantized_or_other_linear_subclasses_keep_their_forward():
    class Custom(torch.nn.Linear):
        pass

    holder = torch.nn.Sequential(Custom(4, 4), torch.nn.Linear(4, 4))
    install(holder, ["weight-major"])
    assert type(holder[0]) is Custom and type(holder[1]) is RoutedLinear


@pytest.mark.parametrize("kernel", KERNELS[1:])
def test_decoding_on_each_kernel_is_lossless(embedded, questions_path, kernel):
    """Whatever this machine's calibration chose, run every M on each kernel that is not torch's own, and check
    speculative decoding against the target's own greedy output computed on the same layers."""
    decoder = Decoder(drafters=["ngram", "lm:embedded:unquantized"], policy="fixed:ngram", draft_len=6)
    chosen, beyond = installed(decoder.target.model), installed_beyond(decoder.target.model)
    assert chosen is not None and set(chosen) <= set(KERNELS)  # the decoder calibrated and routed its target
    questions = [json.loads(line) for line in questions_path.read_text().splitlines()]
    try:
        install(decoder.target.model, [kernel] * 16, beyond=kernel)
        for category in ("summarization", "coding", "math_reasoning"):
            ids = decoder.encode(next(q for q in questions if q["category"] == category)["turns"][0])
            reference = greedy_reference(decoder.target.model, ids, 24)
            for policy in ("fixed:ngram", "fixed:lm:embedded:unquantized"):
                got = decoder.generate(ids, max_new_tokens=24, policy=policy)
                assert got.token_ids == reference, (category, policy)
    finally:
        install(decoder.target.model, chosen, beyond)


def test_torch_mode_keeps_torch_linear_everywhere(embedded):
    with pytest.raises(ValueError, match="kernels must be one of"):
        Decoder(drafters=["ngram"], kernels="fastest")
    before, beyond = installed(embedded.model), installed_beyond(embedded.model)
    try:
        decoder = Decoder(drafters=["ngram"], policy="none", kernels="torch")
        assert installed(decoder.target.model) == ["linear"] * decoder.cost_model().target.max_tokens
    finally:
        if before is not None:
            install(embedded.model, before, beyond)


MIXED = ["linear", "weight-major", "weight-major"]  # as calibration may route: M = 1 and M >= 4 torch's own


def _divergence(model, ids: list[int], reference: list[int], got: list[int]) -> str:
    """Where `got` leaves the reference, and the unrouted target's logit margin there (reference token's logit minus
    the other's): a last-bits difference can flip only a near-tie."""
    i = next((j for j, (a, b) in enumerate(zip(reference, got, strict=False)) if a != b), None)
    if i is None:
        return f"same first {min(len(reference), len(got))} tokens, lengths {len(reference)} and {len(got)}"
    install(model, ["linear"] * len(MIXED))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids + reference[:i]], device=model.device)).logits[0, -1].float()
    margin = float(logits[reference[i]] - logits[got[i]])
    return f"new token {i}: reference {reference[i]}, got {got[i]}, unrouted logit margin {margin:.3g}"


def test_decoding_on_a_mixed_routing_matches_the_unrouted_target(embedded, questions_path, monkeypatch):
    """Calibration routes each row count to its own kernel, so a verification forward over 2 or 3 tokens can run
    weight-major while the target's own step (M = 1) and the prefill run torch's F.linear: the output must still be
    the unrouted target's greedy output (its reference computed with F.linear for every M, as before any install)."""
    import metasd.models.linear_kernels as lk

    decoder = Decoder(drafters=["ngram", "lm:embedded:unquantized"], policy="fixed:ngram", draft_len=2)
    model = decoder.target.model
    chosen, beyond = installed(model), installed_beyond(model)
    questions = [json.loads(line) for line in questions_path.read_text().splitlines()]
    weight_major_rows = []
    real = lk._weight_major
    monkeypatch.setattr(lk, "_weight_major", lambda x, *a: weight_major_rows.append(x.shape[-2]) or real(x, *a))
    try:
        cases = []
        for category in ("writing", "coding", "summarization"):
            ids = decoder.encode(next(q for q in questions if q["category"] == category)["turns"][0])
            install(model, ["linear"] * len(chosen))  # F.linear for every M: bit for bit an unrouted nn.Linear
            cases.append((category, ids, greedy_reference(model, ids, 32)))
        mismatches = []
        for category, ids, reference in cases:
            # the n-gram copy: M = 1 to 3 as its matches come; the target itself (drafting on M = 1): M = 3 every
            # round; metasd-adaptive: lengths by cost, M = 4 and more too
            for policy in ("fixed:ngram", "fixed:lm:embedded:unquantized", "metasd-adaptive"):
                install(model, MIXED)
                got = decoder.generate(ids, max_new_tokens=32, policy=policy).token_ids
                if got != reference:
                    mismatches.append(f"{category} / {policy}: {_divergence(model, ids, reference, got)}")
        assert {2, 3} <= set(weight_major_rows) <= {2, 3}  # the mixed routing was exercised, and only for M = 2..3
        assert not mismatches, "\n".join(mismatches)
    finally:
        install(model, chosen, beyond)
