"""Model specs: the embedded default, local directories, and the errors for paths and tokenizers that do not fit."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from metasd.drafters import build_drafter
from metasd.models import load_model


@pytest.fixture(scope="module")
def foreign_model_dir(tmp_path_factory):
    """A tiny random Llama with its own 64-word tokenizer, saved as a local directory."""
    path = tmp_path_factory.mktemp("foreign")
    vocab = {f"w{i}": i for i in range(64)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1").save_pretrained(path)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_embedded_default_loads_once(embedded):
    assert load_model() is embedded
    assert load_model("embedded") is embedded
    assert embedded.vocab_size == len(embedded.tokenizer) == 49152
    assert embedded.eos_token_ids


def test_local_directory_loads(foreign_model_dir):
    loaded = load_model(str(foreign_model_dir))
    assert loaded.vocab_size == 64 and loaded.max_length == 64


def test_drafter_with_another_tokenizer_is_a_clear_error(embedded, foreign_model_dir):
    with pytest.raises(ValueError, match="different tokenizer"):
        build_drafter(f"lm:{foreign_model_dir}", embedded)


@pytest.mark.parametrize("spec", ["/no/such/dir", "./missing-model", "/tmp/absent.gguf"])
def test_missing_model_paths_are_clear_errors(spec):
    with pytest.raises(ValueError, match="not found"):
        load_model(spec)


def test_unknown_dtype(embedded):
    with pytest.raises(ValueError, match="dtype"):
        load_model(None, "int3")


def test_lm_drafter_needs_a_model(embedded):
    with pytest.raises(ValueError, match="needs a model"):
        build_drafter("lm:", embedded)
