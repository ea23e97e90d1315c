"""Alternatives timed in turn: the warm-up pass is left out and a slow spell falls on every alternative alike."""

from metasd.models.timing import interleaved_medians


def test_the_warm_up_is_dropped_and_the_runs_take_turns():
    order = []

    times = {"a": [9.0, 1.0, 3.0, 2.0], "b": [9.0, 5.0, 4.0, 6.0]}

    def run(key: str) -> float:
        order.append(key)
        return times[key].pop(0)

    medians = interleaved_medians(run, ["a", "b"], reps=3)
    assert medians == {"a": 2.0, "b": 5.0}
    assert order == ["a", "b"] * 4  # pass by pass, not all of a's runs and then b's
