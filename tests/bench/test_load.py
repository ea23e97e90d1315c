"""`serve-bench`'s load: every response's acceptance recorded in the order answered, and its plot."""

import pytest

from metasd import Decoder
from metasd.bench.load import LoadResult, Setting, run_load
from metasd.bench.plots import acceptance_over_requests

PROMPTS = ["Name three fruits.", "Count from one to five.", "What colour is the sky?", "Say hello in French."]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_load_records_each_responses_acceptance_when_it_arrived(embedded, tmp_path):
    decoder = Decoder(drafters="ngram")
    result = run_load(decoder, Setting("max-batch 2", 2, "fixed:ngram"), PROMPTS, clients=2, max_tokens=8)
    assert set(result.acceptance) == set(result.texts) == set(range(len(PROMPTS)))
    assert result.prompt_tokens == sum(len(decoder.encode(prompt)) for prompt in PROMPTS)  # chat template included
    for i, (seconds, accepted) in result.acceptance.items():
        assert 0 < seconds <= result.wall_s
        assert seconds >= result.latencies[i] - 1e-6  # answered no earlier than its own latency after the start
        assert accepted >= 1.0  # every round adds at least the target's own token
    ordered = [accepted for _, accepted in sorted(result.acceptance.values())]
    assert result.acceptance_in_order() == ordered
    path = tmp_path / "acceptance.png"
    assert acceptance_over_requests([result], path, window=2)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_orders_responses_by_arrival_and_skips_loads_without_reports(tmp_path):
    result = LoadResult(
        setting="s",
        clients=1,
        requests=3,
        tokens=3,
        wall_s=3.0,
        latencies=[1.0, 1.0, 1.0],
        texts={0: "a", 1: "b", 2: "c"},
        acceptance={0: (3.0, 1.5), 1: (1.0, 1.0), 2: (2.0, 2.0)},
    )
    assert result.acceptance_in_order() == [1.0, 2.0, 1.5]
    empty = LoadResult("s", 1, 0, 0, 1.0, [], {})
    assert not acceptance_over_requests([empty], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
