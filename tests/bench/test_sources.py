"""Where the benchmark's inputs come from on a machine that has only the repository: Spec-Bench's questions
(downloaded, checked and cached, or named by the environment) and the Qwen pair (hub ids or a GGUF folder).
Nothing here reaches the network: the download is pointed at local file:// URLs."""

import hashlib
from pathlib import Path

import pytest

from metasd.bench import presets, spec_bench
from metasd.cli import main


@pytest.fixture
def source(tmp_path: Path, monkeypatch) -> Path:
    """A stand-in for Spec-Bench's file at a file:// URL, with its SHA-256 pinned; an empty cache."""
    upstream = tmp_path / "upstream.jsonl"
    upstream.write_text('{"question_id": 1, "category": "qa", "turns": ["Why is the sky blue?"]}\n')
    monkeypatch.setattr(spec_bench, "URL", upstream.as_uri())
    monkeypatch.setattr(spec_bench, "SHA256", hashlib.sha256(upstream.read_bytes()).hexdigest())
    monkeypatch.setenv("METASD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(spec_bench.ENV, raising=False)
    return upstream


def test_questions_are_downloaded_once_checked_and_cached(source: Path) -> None:
    path = spec_bench.spec_bench_questions()
    assert path == spec_bench.cached_path() and path.read_bytes() == source.read_bytes()
    source.unlink()  # the cache answers from now on
    assert spec_bench.spec_bench_questions() == path


def test_a_download_with_another_checksum_is_refused_and_not_cached(source: Path, monkeypatch) -> None:
    monkeypatch.setattr(spec_bench, "SHA256", "0" * 64)
    with pytest.raises(ValueError, match="expected 0000"):
        spec_bench.spec_bench_questions()
    assert not spec_bench.cached_path().exists()


def test_the_environment_names_a_local_copy(source: Path, tmp_path: Path, monkeypatch) -> None:
    local = tmp_path / "local.jsonl"
    local.write_text(source.read_text())
    monkeypatch.setenv(spec_bench.ENV, str(local))
    assert spec_bench.spec_bench_questions() == local
    monkeypatch.setenv(spec_bench.ENV, str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="not a file"):
        spec_bench.spec_bench_questions()


def test_without_network_or_copy_the_bench_says_both_ways(source: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(spec_bench, "URL", (tmp_path / "unreachable.jsonl").as_uri())
    assert main(["bench", "--quick", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--questions PATH" in err and spec_bench.ENV in err
    assert not (tmp_path / "out").exists()  # failed before any model loaded or output was written


def test_qwen_preset_takes_gguf_files_from_a_folder(tmp_path: Path) -> None:
    for name in (presets.QWEN_TARGET, presets.QWEN_DRAFTER):
        (tmp_path / name).write_bytes(b"")
    settings = presets.preset("qwen-coder", tmp_path)
    assert settings["target"] == str(tmp_path / presets.QWEN_TARGET)
    assert settings["drafters"].endswith(f"lm:{tmp_path / presets.QWEN_DRAFTER}")


def test_qwen_preset_uses_hub_ids_online_and_names_both_ways_offline(tmp_path: Path, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("METASD_MODELS", str(tmp_path))  # no GGUF files there
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    settings = presets.preset("qwen-coder")
    assert settings["target"] == presets.QWEN_TARGET_HUB
    assert settings["drafters"].endswith(f"lm:{presets.QWEN_DRAFTER_HUB}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="--models-dir DIR") as err:
        presets.preset("qwen-coder")
    assert presets.QWEN_TARGET_HUB in str(err.value)
