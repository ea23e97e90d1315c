"""What a round costs on this machine: the cost model the decisions read (`model`), how the target's forward is
measured (`calibration`), and what a finished round tells both (`rounds`)."""

from .calibration import (
    CONTEXT,
    Calibration,
    batch_cache_file,
    batch_sizes,
    cache_file,
    calibrate,
    calibrate_batch,
    calibrated,
    calibration_key,
    load_or_calibrate,
    load_or_calibrate_batch,
)
from .model import REGIMES, CostModel, DrafterCost, TargetCost
from .rounds import observe_round, reward_times

__all__ = [
    "CONTEXT",
    "REGIMES",
    "Calibration",
    "CostModel",
    "DrafterCost",
    "TargetCost",
    "batch_cache_file",
    "batch_sizes",
    "cache_file",
    "calibrate",
    "calibrate_batch",
    "calibrated",
    "calibration_key",
    "load_or_calibrate",
    "load_or_calibrate_batch",
    "observe_round",
    "reward_times",
]
