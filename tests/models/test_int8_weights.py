"""Int8 drafter weights: a close approximation of each layer, a twin that leaves the loaded model alone, the
measured `auto` choice, and the spec suffix that asks for either."""

import pytest
import torch

from metasd.drafters import build_drafter
from metasd.models.int8_weights import Int8Linear, drafting_weights, int8_twin


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
        strided = x.transpose(0, 1)  # not contiguous
        assert torch.allclose(Int8Linear(layer)(strided).float(), got.transpose(0, 1).float())


def test_the_twin_shares_all_but_the_linear_layers_and_leaves_the_model_alone(embedded):
    model = embedded.model
    layer_types = [type(m) for m in model.modules()]
    twin = int8_twin(model)
    assert [type(m) for m in model.modules()] == layer_types  # the target is untouched
    assert not any(isinstance(m, torch.nn.Linear) for m in twin.modules())  # RoutedLinear included
    assert twin.get_input_embeddings().weight is model.get_input_embeddings().weight  # shared, not copied
    assert twin.lm_head.weight is model.lm_head.weight  # the int8 head keeps the float one for long products
    ids = torch.tensor([embedded.tokenizer("The capital of France is")["input_ids"]])
    with torch.inference_mode():
        want, got = model(input_ids=ids).logits[0], twin(input_ids=ids).logits[0]
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() >= 0.8  # a close drafter, not the same model
    assert not torch.equal(want, got)


def test_auto_routes_each_row_count_to_the_weights_measured_faster(embedded, monkeypatch):
    import metasd.models.int8_weights as int8

    model = embedded.model
    assert drafting_weights(model, "unquantized") == (model, "unquantized")
    twin, kind = drafting_weights(model, "int8")
    assert kind == "int8" and any(isinstance(m, Int8Linear) for m in twin.modules())
    for crossover in (0, 1, 8, 1000):  # the measurement decides, not an assumption about the machine

        def timed(m, rows, crossover=crossover):  # int8 products are faster up to `crossover` rows, float beyond
            layer = next((x for x in m.modules() if isinstance(x, Int8Linear)), None)
            in_int8 = layer is not None and rows <= layer.int8_rows
            return 0.5 if in_int8 == (rows <= crossover) else 1.0

        monkeypatch.setattr(int8, "forward_seconds", timed)
        chosen, kind = drafting_weights(model, "auto")
        assert (chosen is model) == (crossover == 0)
        if crossover:
            rows = min(crossover, int8.ROWS[-1])
            assert kind == f"int8 up to {rows} rows"
            assert {m.int8_rows for m in chosen.modules() if isinstance(m, Int8Linear)} == {rows}
        else:
            assert kind == "unquantized"
    monkeypatch.undo()

    def missing(self, x):
        raise NotImplementedError("no int8 kernel for this device")

    monkeypatch.setattr(Int8Linear, "forward", missing)
    with pytest.warns(UserWarning, match="drafting on the weights as loaded"):
        assert drafting_weights(model, "auto") == (model, "unquantized")  # auto falls back, and says so
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
    measured = build_drafter("lm:embedded", embedded)  # auto: int8 where measured faster, else the model itself
    assert measured.weights.startswith("int8") == (measured.lm.model is not embedded.model)
    with pytest.raises(ValueError, match="needs a model"):
        build_drafter("lm:int8", embedded)
    with pytest.raises(ValueError, match="a ':' suffix names the drafter's weights: auto, int8, unquantized"):
        build_drafter("lm:embedded:int4", embedded)
