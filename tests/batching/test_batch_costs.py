"""T(B, W), what batch rounds cost: the sizes calibrated, interpolation between them, refinement from real rounds,
and the disk cache (a tiny model: calibration takes milliseconds)."""

import json
import re

import pytest
import torch
from helpers import tiny_llama, tiny_vocab_llama
from test_batch import _option

from metasd.batching.decision import Plan, decide
from metasd.costs import CostModel, TargetCost, batch_sizes, load_or_calibrate_batch


def test_sizes_double_up_to_the_largest_batch():
    assert batch_sizes(1) == [] and batch_sizes(2) == [2]
    assert batch_sizes(6) == [2, 4, 6] and batch_sizes(16) == [2, 4, 8, 16]


def test_sizes_between_calibrated_ones_are_interpolated_and_rounds_refine_them():
    cost = CostModel(TargetCost([0.01, 0.02]))
    cost.add_batch_tables({2: [0.02, 0.04], 4: [0.04, 0.08]}, max_batch=4)
    assert cost.forward(1, 2) == 0.02 and cost.forward(2, 1) == 0.02 and cost.forward(4, 2) == 0.08
    assert abs(cost.forward(3, 2) - 0.06) < 1e-12
    assert cost.forward(9, 2) == 0.08  # past the largest batch: its table
    for _ in range(TargetCost.TRUSTED):
        cost.observe_forward(3, 2, 0.1)
    assert cost.forward(3, 2) == 0.1 and cost.forward(2, 2) == 0.04  # another size keeps its own
    cost.observe_forward(1, 1, 0.011)
    assert cost.target.observations() == 1  # a batch of one is the request's own T(M)
    cost.target = TargetCost([0.03, 0.05])  # the decoder extends T(M)'s range: B = 1 follows
    assert cost.forward(1, 2) == 0.05 and cost.forward(2, 2) == 0.04
    cost.add_batch_tables({2: [0.02, 0.04], 4: [0.04, 0.08], 6: [0.06, 0.12]}, max_batch=6)  # a larger batch
    assert cost.forward(3, 2) == 0.1  # a size known keeps what rounds taught it
    assert abs(cost.forward(5, 2) - 0.10) < 1e-12 and cost.forward(6, 2) == 0.12
    assert cost.covers(6, 2) and not cost.covers(6, 3) and not cost.covers(7, 2)
    cost.add_batch_tables({2: [0.02, 0.04, 0.06], 4: [0.04, 0.08, 0.12]}, max_batch=4)  # a wider draft's range
    assert cost.forward(3, 3) == 0.09 and cost.forward(3, 2) == 0.06  # re-measured: known widths were too few
    lone = CostModel(TargetCost([0.01, 0.02]))
    lone.observe_forward(2, 1, 0.5)  # no batch table: a batch's time is not taken for one request's
    assert lone.target.observations() == 0


def test_calibration_is_cached_per_model_and_a_larger_batch_measures_only_its_new_sizes(tmp_path, monkeypatch):
    import metasd.costs.calibration as calibration

    monkeypatch.setenv("METASD_CACHE_DIR", str(tmp_path))
    measured = []
    real = calibration.calibrate_batch
    monkeypatch.setattr(calibration, "calibrate_batch", lambda m, sizes, w: measured.append(sizes) or real(m, sizes, w))
    torch.manual_seed(0)
    model = tiny_llama(layers=1)
    tables = load_or_calibrate_batch("tiny", model, max_batch=4, max_width=3)
    assert sorted(tables) == [2, 4] and all(len(t) == 3 and min(t) > 0 for t in tables.values())
    files = list((tmp_path / "calibration").glob("*-batch.json"))
    assert len(files) == 1 and measured == [[2, 4]]
    assert load_or_calibrate_batch("tiny", model, max_batch=4, max_width=3) == tables  # read back, not measured
    larger = load_or_calibrate_batch("tiny", model, max_batch=8, max_width=3)
    assert measured == [[2, 4], [8]] and {b: larger[b] for b in (2, 4)} == tables  # sizes it had are read
    assert load_or_calibrate_batch("tiny", model, max_batch=2, max_width=3) == {2: tables[2]}
    load_or_calibrate_batch("tiny", model, max_batch=2, max_width=3, candidates=["linear"])
    assert measured[-1] == [2] and len(list((tmp_path / "calibration").glob("*-batch.json"))) == 2  # other kernels


def test_a_batch_cache_with_a_time_that_is_not_positive_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("METASD_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = tiny_llama(layers=1)
    load_or_calibrate_batch("tiny", model, max_batch=2, max_width=2)
    (path,) = (tmp_path / "calibration").glob("*-batch.json")
    data = json.loads(path.read_text())
    data["tables"]["2"][0] = 0.0
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="ignoring the calibration cache"):
        tables = load_or_calibrate_batch("tiny", model, max_batch=2, max_width=2)
    assert min(tables[2]) > 0 and min(json.loads(path.read_text())["tables"]["2"]) > 0


def test_a_cache_that_cannot_be_written_warns_and_the_tables_still_serve(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("METASD_CACHE_DIR", str(blocked))  # a file where the cache's folder should be
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="cannot write the calibration cache"):
        tables = load_or_calibrate_batch("tiny", tiny_llama(layers=1), max_batch=2, max_width=2)
    assert sorted(tables) == [2] and len(tables[2]) == 2


def test_widths_no_round_measured_follow_those_measured():
    """Nothing forces a plain round in a batch: with widths 2-4 measured at twice their calibrated time and none
    at width 1, the unmeasured widths must not keep idle-machine values that make them look half price. The
    decision on the refined table is the decision on the true one."""
    calibrated = [0.02, 0.021, 0.022, 0.023, 0.05, 0.07]
    cost = CostModel(TargetCost([0.01] * 6))
    cost.add_batch_tables({2: calibrated}, max_batch=2)
    for _ in range(TargetCost.TRUSTED):
        for width in (2, 3, 4):
            cost.observe_forward(2, width, 2 * calibrated[width - 1])
    plans = [Plan([_option(0, 0.7)]) for _ in range(2)]
    truth = decide(plans, [2 * t for t in calibrated])
    assert 2 <= truth.width <= 4
    assert decide(plans, cost.forward_widths(2, 6)).choices == truth.choices


@pytest.mark.parametrize("which", ["T(M)", "T(B, W)"])
def test_a_table_measured_while_other_processes_held_the_cpus_serves_the_run_but_is_not_cached(
    which, tmp_path, monkeypatch
):
    """Contention while measuring would skew every later run that reads the table: it is used now, not cached."""
    import metasd.costs.calibration as calibration

    monkeypatch.setenv("METASD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "CONTENDED", 0.25)
    torch.manual_seed(0)
    model = tiny_llama(layers=1)

    def measure():
        if which == "T(M)":
            return calibration.load_or_calibrate("tiny", model, 3).table
        return load_or_calibrate_batch("tiny", model, max_batch=2, max_width=3)[2]

    # (every CPU's ticks, busy ones, this process's): others busy (900 - 300) of 1000 ticks, then (800 - 700)
    ticks = iter([(1000, 600, 100), (2000, 1500, 400), (3000, 1600, 500), (4000, 2400, 1200)])
    monkeypatch.setattr(calibration, "cpu_ticks", lambda: next(ticks))
    with pytest.warns(UserWarning, match=re.escape(f"other processes used 60% of the CPUs while {which} was measured")):
        served = measure()
    assert len(served) == 3 and min(served) > 0
    assert not list((tmp_path / "calibration").glob("*.json"))
    measure()  # 10 % of the machine was others': cached
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1


def test_the_cpu_ticks_count_this_process_s_work():
    import os
    import time
    from pathlib import Path

    from metasd.costs.calibration import cpu_ticks

    if not Path("/proc/stat").is_file():
        pytest.skip("no /proc on this machine")
    before = cpu_ticks()
    started = time.process_time()
    while time.process_time() - started < 0.3:
        pass
    after = cpu_ticks()
    assert before is not None and after is not None
    total, busy, own = (a - b for a, b in zip(after, before, strict=True))
    rate = os.sysconf("SC_CLK_TCK")
    assert own >= 0.2 * rate  # 0.3 s of this process's CPU time
    assert total >= busy >= 0.8 * own  # its CPUs were busy at least while it ran (idle counted as idle)


def test_a_batch_prices_the_wider_drafts_its_decoder_is_extended_to(embedded, tmp_path, monkeypatch):
    """`Decoder.cost_model(n)` between requests widens T(M); a batch built before it reads T(B, W) over as many
    widths (else it would price every wider draft at its old widest width)."""
    from metasd import Decoder
    from metasd.batching.batch import Batch

    monkeypatch.setenv("METASD_CACHE_DIR", str(tmp_path))
    tiny_vocab_llama(tmp_path / "target", embedded.tokenizer, seed=0)
    decoder = Decoder(target=str(tmp_path / "target"), drafters=["ngram"])
    batch = Batch(decoder, max_batch=3)
    widths = batch.costs.target.max_tokens
    assert all(batch.costs.rows[b].max_tokens == widths for b in (2, 3))
    assert decoder.cost_model(widths + 3) is batch.costs
    assert batch.costs.target.max_tokens == widths + 3
    assert all(batch.costs.rows[b].max_tokens == widths + 3 for b in (2, 3))
