"""Int8 drafter weights: a close approximation of each layer, a twin that leaves the loaded model alone, the
measured `auto` choice, and the spec suffix that asks for either."""

import pytest
import torch

from metasd.drafters import build_drafter
from metasd.int8_weights import Int8Linear, drafting_weights, int8_twin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_layer_approximates_its_float_layer_and_keeps_the_dtype(dtype):
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(96, 40, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=gen))
        layer.bias.copy_(torch.randn(40, generator=gen))
    x = torch.randn(3, 5, 96, generator=gen).to(dtype)
    with torch.inference_mode():
        want, got = layer(x), Int8Linear(layer)(x)
    assert got.shape == want.shape and got.dtype == dtype
    error = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert error < 0.03  # per-row int8 (1/254 of each row's range) and bfloat16 activations
    assert error > 0  # and it really is a different computation
    routed = Int8Linear(layer)
    routed.int8_rows = 14  # products of more rows take the float weights the layer shares with the model
    with torch.inference_mode():
        assert routed.weight is layer.weight
        assert torch.equal(routed(x), want)  # 15 rows
        assert torch.equal(routed(x[:2, :5]), got[:2, :5]) and not torch.equal(routed(x[:2, :5]), want[:2, :5])


def test_the_twin_shares_all_but_the_linear_layers_and_leaves_the_model_alone(embedded):
    model = embedded.model
    twin = int8_twin(model)
    assert not any(isinstance(m, Int8Linear) for m in model.modules())  # the target is untouched
    assert all(type(m) is not torch.nn.Linear for m in twin.modules())
    assert twin.get_input_embeddings().weight is model.get_input_embeddings().weight  # shared, not copied
    ids = torch.tensor([embedded.tokenizer("The capital of France is")["input_ids"]])
    with torch.inference_mode():
        want, got = model(input_ids=ids).logits[0], twin(input_ids=ids).logits[0]
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() >= 0.8  # a close drafter, not the same model
    assert not torch.equal(want, got)


def test_auto_routes_each_row_count_to_the_weights_measured_faster(embedded, monkeypatch):
    import metasd.int8_weights as int8

    model = embedded.model
    assert drafting_weights(model, "unquantized") == (model, "unquantized")
    twin, kind = drafting_weights(model, "int8")
    assert kind == "int8" and any(isinstance(m, Int8Linear) for m in twin.modules())
    for crossover in (0, 1, 8, 1000):  # the measurement decides, not an assumption about the machine
        def timed(m, rows, crossover=crossover):  # the twin is faster up to `crossover` rows
            return 1.0 if (m is model) == (rows <= crossover) else 0.5

        monkeypatch.setattr(int8, "forward_seconds", timed)
        chosen, kind = drafting_weights(model, "auto")
        assert (kind == "int8") == (crossover > 0) and (chosen is model) == (crossover == 0)
        if crossover:
            layers = [m for m in chosen.modules() if isinstance(m, Int8Linear)]
            assert {m.int8_rows for m in layers} == {min(crossover, int8.ROWS[-1])}
    monkeypatch.undo()

    def missing(self, x):
        raise NotImplementedError("no int8 kernel for this device")

    monkeypatch.setattr(Int8Linear, "forward", missing)
    assert drafting_weights(model, "auto") == (model, "unquantized")  # auto falls back
    with pytest.raises(ValueError, match="int8 drafter weights are not available"):
        drafting_weights(model, "int8")
    with pytest.raises(ValueError, match="drafter weights must be one of"):
        drafting_weights(model, "int4")


def test_the_spec_suffix_names_the_weights(embedded):
    exact = build_drafter("lm:embedded:unquantized", embedded)
    assert exact.weights == "unquantized" and exact.lm.model is embedded.model
    quantized = build_drafter("lm:embedded:int8", embedded)
    assert quantized.name == "lm:embedded:int8" and quantized.weights == "int8"
    assert quantized.model is embedded.model  # as loaded: what Hugging Face's assisted generation is given
    assert quantized.lm.model is not embedded.model
    assert build_drafter("lm:embedded", embedded).weights in ("int8", "unquantized")  # auto: measured
    with pytest.raises(ValueError, match="needs a model"):
        build_drafter("lm:int8", embedded)
