"""A GGUF file's model converted once: read back, it is the model and tokenizer a GGUF load builds, bit for bit, and
`load_model` / `load_tokenizer` read it; a copy that cannot be read is converted again; an edited file gets a new
entry that replaces the old one; the cache can be turned off."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import metasd.models.loading as loading
from metasd.models.converted import (
    TOKENIZER,
    converted_entry,
    read_converted,
    read_converted_tokenizer,
    save_converted,
)
from metasd.models.embedded import embedded_path

TEXTS = ["Hello world", " leading space\n\nnew lines\ttab", "é 中文 🙂 def f(x):\n    return x"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The embedded GGUF file loaded by transformers itself (never from a cache), and its entry written and read
    back under a cache of the module's own: (tokenizer, model) as converted, as read back, and the entry."""
    gguf = embedded_path()  # before the cache moves: the file stays where it is
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("METASD_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        entry = converted_entry(gguf)
        assert read_converted(entry, torch.float32) is None  # nothing written yet
        save_converted(entry, tokenizer, model, torch.float32)
    return (tokenizer, model), read_converted(entry, torch.float32), entry, gguf


def test_a_model_read_back_from_its_conversion_is_the_one_the_gguf_file_gives(converted):
    (tokenizer, model), (tokenizer_back, model_back), _, _ = converted
    weights, back = model.state_dict(), model_back.state_dict()
    assert weights.keys() == back.keys()
    assert all(torch.equal(weights[k], back[k]) for k in weights)
    assert model_back.get_output_embeddings().weight.data_ptr() == model_back.get_input_embeddings().weight.data_ptr()
    differ = {k for k, v in model.config.to_dict().items() if model_back.config.to_dict().get(k) != v}
    assert differ == {"_name_or_path", "quantization_config"}  # where it was read from, and that it was a GGUF file
    assert model.generation_config.to_dict() == model_back.generation_config.to_dict()
    assert model.hf_quantizer is not None  # saving left the model it saved as it was
    assert tokenizer.get_vocab() == tokenizer_back.get_vocab()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "all_special_ids", "padding_side"):
        assert getattr(tokenizer, name) == getattr(tokenizer_back, name), name
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == tokenizer_back(text)["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == tokenizer_back.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": TEXTS[2]}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        tokenizer_back.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )
    ids = torch.tensor([tokenizer(TEXTS[0])["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model_back(ids).logits)


def test_load_model_and_load_tokenizer_read_the_conversion(converted, monkeypatch):
    _, _, entry, gguf = converted
    monkeypatch.setenv("METASD_EMBEDDED_GGUF", str(gguf))
    monkeypatch.setenv("METASD_CACHE_DIR", str(entry.parent.parent))
    monkeypatch.setattr(loading, "_cache", {})  # this process's models: the embedded one is not loaded again
    loaded = loading.load_model()
    assert loaded.model.name_or_path == str(entry / "float32")
    assert loading.load_tokenizer().name_or_path == str(entry / TOKENIZER)


def test_a_copy_this_process_may_not_read_stays_for_those_who_may(converted, monkeypatch):
    _, _, entry, _ = converted

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refused)
    assert read_converted_tokenizer(entry) is None  # the file is converted instead
    assert (entry / TOKENIZER).is_dir()


def test_a_copy_that_cannot_be_read_is_removed_and_an_edited_file_gets_a_new_entry(converted, tmp_path, monkeypatch):
    (tokenizer, model), _, entry, _ = converted
    monkeypatch.setenv("METASD_CACHE_DIR", str(entry.parent.parent))
    weights = entry / "float32" / "model.safetensors"
    weights.unlink()  # a new file where the read-back model may still map the old one
    weights.write_bytes(b"cut short")
    assert read_converted(entry, torch.float32) is None and not (entry / "float32").exists()
    assert (entry / TOKENIZER).is_dir()  # the part that reads stays

    gguf = tmp_path / "model.gguf"  # entries are named by the file's path, size and time, not its contents
    gguf.write_bytes(b"first")
    first = converted_entry(gguf)
    save_converted(first, tokenizer, model, torch.float32)
    assert (first / TOKENIZER).is_dir() and (first / "float32" / "config.json").is_file()
    gguf.write_bytes(b"edited")
    second = converted_entry(gguf)
    assert second != first
    save_converted(second, tokenizer, model, torch.float32)
    assert (second / "float32").is_dir() and not first.exists()


def test_the_cache_can_be_turned_off(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"weights")
    assert converted_entry(gguf) is not None
    monkeypatch.setenv("METASD_GGUF_CACHE", "off")
    assert converted_entry(gguf) is None
