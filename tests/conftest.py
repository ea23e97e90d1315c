"""Shared fixtures: the embedded model loads once per session (metasd.models caches it per process)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


@pytest.fixture(scope="session")
def embedded():
    from metasd.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def questions_path() -> Path:
    if not QUESTIONS.is_file():
        pytest.fail(f"Spec-Bench questions not found at {QUESTIONS} (the shared/ folder beside the repo)")
    return QUESTIONS


def greedy_reference(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation through transformers' generate(), on the model's device: what every
    lossless test compares metasd's output with."""
    import torch

    input_ids = torch.tensor([ids], device=next(model.parameters()).device)
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens)
    return out[0, len(ids):].tolist()
