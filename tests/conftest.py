"""Shared fixtures: the embedded model (loaded once per test run: metasd.models.loading caches it per process) and
the tests' own questions in Spec-Bench's format (tests/data/questions.jsonl)."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

QUESTIONS = Path(__file__).resolve().parent / "data" / "questions.jsonl"  # Spec-Bench's format, written for the tests


@pytest.fixture(scope="session", autouse=True)
def _no_calibrations_left_behind(tmp_path_factory):
    """The tests' temporary models lie under a new path every run, so the T(M) and T(B, W) tables measured for them
    would pile up in the calibration cache, never read again: they are removed when the run ends (the embedded
    model's stay, for the next run)."""
    yield
    from metasd.models.embedded import cache_dir

    base = str(tmp_path_factory.getbasetemp())
    for path in (cache_dir() / "calibration").glob("*.json"):
        try:
            model = str(json.loads(path.read_text())["key"]["model"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if model.startswith(base):
            path.unlink(missing_ok=True)


@pytest.fixture(scope="session", autouse=True)
def _calibrations_cached_whatever_the_load():
    """Tests share machines with other work, and whether other processes kept the CPUs busy while a test calibrated
    decides whether its table is cached (`costs.calibration.quiet_since`), which the caching tests do not check:
    nothing counts as contention here, for every fixture's decoder too (the tests of that rule set the threshold
    back themselves)."""
    import metasd.costs.calibration as calibration

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibration, "CONTENDED", 1.0)
        yield


@pytest.fixture(scope="session")
def embedded():
    from metasd.models.loading import load_model

    return load_model()


@pytest.fixture(scope="session")
def questions_path() -> Path:
    return QUESTIONS


@pytest.fixture(scope="module")
def pair(embedded, tmp_path_factory):
    """A tiny random target and a drafter near it (its weights plus noise), saved with the embedded tokenizer:
    the sampling-distribution tests' pair, (target model, target dir, drafter dir)."""
    from helpers import tiny_vocab_llama

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("drafter")
    target = tiny_vocab_llama(target_dir, embedded.tokenizer, 0)
    tiny_vocab_llama(draft_dir, embedded.tokenizer, 1, base=target, noise=0.15)
    yield target, str(target_dir), str(draft_dir)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module whose server threads decode beside the test's own: on two cores shared with
    other work, several OpenMP threads per process thrash (measured 40x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
