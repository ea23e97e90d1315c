"""Shared fixtures: the embedded model (loaded once per test run: metasd.models.loading caches it per process) and
the tests' own questions in Spec-Bench's format (tests/data/questions.jsonl)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

QUESTIONS = Path(__file__).resolve().parent / "data" / "questions.jsonl"  # Spec-Bench's format, written for the tests


@pytest.fixture(scope="session")
def embedded():
    from metasd.models.loading import load_model

    return load_model()


@pytest.fixture(scope="session")
def questions_path() -> Path:
    return QUESTIONS
