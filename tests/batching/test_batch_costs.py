"""T(B, W), what batch rounds cost: the sizes calibrated, interpolation between them, refinement from real rounds,
and the disk cache (a tiny model: calibration takes milliseconds)."""

import torch
from helpers import tiny_llama
from test_batch import _option

from metasd.batching.costs import BatchCost, batch_sizes, load_or_calibrate_batch
from metasd.batching.decision import Plan, decide
from metasd.costs import CostModel, TargetCost


def test_sizes_double_up_to_the_largest_batch():
    assert batch_sizes(1) == [] and batch_sizes(2) == [2]
    assert batch_sizes(6) == [2, 4, 6] and batch_sizes(16) == [2, 4, 8, 16]


def test_sizes_between_calibrated_ones_are_interpolated_and_rounds_refine_them():
    single = CostModel(TargetCost([0.01, 0.02]))
    cost = BatchCost(single, {2: [0.02, 0.04], 4: [0.04, 0.08]}, max_batch=4)
    assert cost(1, 2) == 0.02 and cost(2, 1) == 0.02 and cost(4, 2) == 0.08
    assert abs(cost(3, 2) - 0.06) < 1e-12
    for _ in range(TargetCost.TRUSTED):
        cost.observe(3, 2, 0.1)
    assert cost(3, 2) == 0.1 and cost(2, 2) == 0.04  # another size keeps its own
    cost.observe(1, 1, 0.011)
    assert single.target.observations() == 1  # a batch of one is the decoder's own T(M)


def test_calibration_is_cached_per_model_and_sizes(tmp_path, monkeypatch):
    monkeypatch.setenv("METASD_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = tiny_llama(layers=1)
    tables = load_or_calibrate_batch("tiny", model, max_batch=4, max_width=3)
    assert sorted(tables) == [2, 4] and all(len(t) == 3 and min(t) > 0 for t in tables.values())
    files = list((tmp_path / "calibration").glob("*-batch.json"))
    assert len(files) == 1
    assert load_or_calibrate_batch("tiny", model, max_batch=4, max_width=3) == tables  # read back, not measured


def test_widths_no_round_measured_follow_those_measured():
    """Nothing forces a plain round in a batch: with widths 2-4 measured at twice their calibrated time and none
    at width 1, the unmeasured widths must not keep idle-machine values that make them look half price. The
    decision on the refined table is the decision on the true one."""
    calibrated = [0.02, 0.021, 0.022, 0.023, 0.05, 0.07]
    cost = BatchCost(CostModel(TargetCost([0.01] * 6)), {2: calibrated}, max_batch=2)
    for _ in range(TargetCost.TRUSTED):
        for width in (2, 3, 4):
            cost.observe(2, width, 2 * calibrated[width - 1])
    plans = [Plan([_option(0, 0.7)]) for _ in range(2)]
    truth = decide(plans, [2 * t for t in calibrated])
    assert 2 <= truth.width <= 4
    assert decide(plans, cost.widths(2, 6)).choices == truth.choices
