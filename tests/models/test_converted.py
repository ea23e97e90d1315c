"""A GGUF file's model converted once: read back, it is the model and tokenizer a GGUF load builds, bit for bit; a
copy that cannot be read is converted again; an edited file gets a new entry that replaces the old one; the cache
can be turned off."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from metasd.models.converted import TOKENIZER, converted_entry, read_converted, save_converted
from metasd.models.embedded import embedded_path

TEXTS = ["Hello world", " leading space\n\nnew lines\ttab", "é 中文 🙂 def f(x):\n    return x"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The embedded GGUF file loaded by transformers itself (never from a cache), and its entry written and read
    back under a cache of the module's own: (tokenizer, model) as converted, as read back, and the entry."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("METASD_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        gguf = embedded_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        entry = converted_entry(gguf)
        assert read_converted(entry, "float32") is None  # nothing written yet
        save_converted(entry, tokenizer, model, "float32")
        yield (tokenizer, model), read_converted(entry, "float32"), entry


def test_a_model_read_back_from_its_conversion_is_the_one_the_gguf_file_gives(converted):
    (tokenizer, model), (tokenizer_back, model_back), _ = converted
    weights, back = model.state_dict(), model_back.state_dict()
    assert weights.keys() == back.keys()
    assert all(torch.equal(weights[k], back[k]) for k in weights)
    assert model_back.get_output_embeddings().weight.data_ptr() == model_back.get_input_embeddings().weight.data_ptr()
    differ = {k for k, v in model.config.to_dict().items() if model_back.config.to_dict().get(k) != v}
    assert differ == {"_name_or_path", "quantization_config"}  # where it was read from, and that it was a GGUF file
    assert model.generation_config.to_dict() == model_back.generation_config.to_dict()
    assert model.hf_quantizer is not None  # saving left the model it saved as it was
    assert tokenizer.get_vocab() == tokenizer_back.get_vocab()
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == tokenizer_back(text)["input_ids"]
    chat = [{"role": "user", "content": TEXTS[2]}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        tokenizer_back.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )
    ids = torch.tensor([tokenizer(TEXTS[0])["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model_back(ids).logits)


def test_a_copy_that_cannot_be_read_is_removed_and_an_edited_file_gets_a_new_entry(converted, tmp_path, monkeypatch):
    (tokenizer, model), _, entry = converted
    monkeypatch.setenv("METASD_CACHE_DIR", str(entry.parent.parent))
    (entry / "float32" / "model.safetensors").write_bytes(b"cut short")
    assert read_converted(entry, "float32") is None and not entry.exists()

    gguf = tmp_path / "model.gguf"  # entries are named by the file's path, size and time, not its contents
    gguf.write_bytes(b"first")
    first = converted_entry(gguf)
    save_converted(first, tokenizer, model, "float32")
    assert (first / TOKENIZER).is_dir() and (first / "float32" / "config.json").is_file()
    os.utime(gguf, ns=(1, 1))
    second = converted_entry(gguf)
    assert second != first
    save_converted(second, tokenizer, model, "float32")
    assert (second / "float32").is_dir() and not first.exists()


def test_the_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("METASD_GGUF_CACHE", "off")
    assert converted_entry(embedded_path()) is None
