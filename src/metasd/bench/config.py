"""`BenchConfig` and what every way of running the benchmark shares: the checks made before any model loads, the
question order, the decoder every method shares, and the machine facts the summary's config records."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..drafters import DEFAULT_POOL, parse_drafters
from .methods import lm_drafters, resolve_methods
from .questions import Question, load_questions, select_questions


@dataclass
class BenchConfig:
    """Everything one `metasd bench` run is asked to do: the questions and which of them, the methods and drafter
    pool, the target and how it runs, and what the run writes to `out`."""

    questions: str | Path
    out: str | Path = "bench-out"
    categories: list[str] | None = None  # Spec-Bench groups or MT-bench categories; None = all groups
    per_category: int | None = None  # None = every question
    max_new_tokens: int = 128
    methods: list[str] | None = None  # None = every method that applies to the pool
    drafters: str | list[str] = ",".join(DEFAULT_POOL)
    target: str | None = None
    draft_len: int = 5
    dtype: str = "float32"
    seed: int = 0
    device: str = "auto"  # models.resolve_device: auto = CUDA when available
    threads: int | None = None  # torch threads; None = torch's default
    kernels: str = "auto"  # the target's linear layers (Decoder option): auto = calibrated per M; torch = F.linear
    policy_scope: str = "request"  # "server": each policy keeps learning across questions (engine option)
    warmup: bool = True
    progress: bool = True
    plots: bool = True
    command: str | None = None  # recorded in the report
    extra: dict = field(default_factory=dict)  # recorded in summary.json (e.g. the preset)
    drift: bool = False  # the drift workload (bench/drift.py): categories are drift kinds, per_category per kind
    repeat: int = 1  # passes over each question's methods from one state; the fastest run is kept (measure_question)

    def check(self) -> None:
        """Raise ValueError on a bad setting, method names included: before any model loads."""
        for name in ("max_new_tokens", "draft_len", "repeat"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.policy_scope not in ("request", "server"):
            raise ValueError(f"policy scope must be 'request' or 'server', got {self.policy_scope!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")
        out = Path(self.out).expanduser()
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} exists and is not a directory")
        resolve_methods(self.methods, parse_drafters(self.drafters), strict=False)


def bench_questions(cfg: BenchConfig) -> list[Question]:
    """The run's questions in the order they are measured: grouped as Spec-Bench lists its groups."""
    if cfg.drift:
        from .drift import drift_questions

        return drift_questions(cfg.questions, cfg.seed, cfg.per_category, cfg.categories)
    questions = select_questions(load_questions(cfg.questions), cfg.categories, cfg.per_category)
    order = {"mt_bench": 0, "translation": 1, "summarization": 2, "qa": 3, "math_reasoning": 4, "rag": 5}
    return sorted(questions, key=lambda q: order.get(q.group, 99))  # stable: selection order within a group


def bench_decoder(cfg: BenchConfig, specs: list[str]):
    """The decoder every method of a run shares (each method names its own policy per request)."""
    from ..engine import Decoder

    return Decoder(
        target=cfg.target,
        drafters=specs,
        policy="none",
        draft_len=cfg.draft_len,
        dtype=cfg.dtype,
        device=cfg.device,
        seed=cfg.seed,
        policy_scope=cfg.policy_scope,
        kernels=cfg.kernels,
    )


def drafter_weights(decoder) -> dict[str, str]:
    """What each model drafter and EAGLE head drafts with ("int8", "int8 up to R rows", "unquantized" or, for a
    head, "unquantized, KERNEL"): `auto` decides per machine."""
    return {name: d.weights for name, d in decoder.drafters.items() if hasattr(d, "weights")}


def hf_assisted_settings(drafters: list[str], draft_len: int) -> dict:
    """How the `hf-assisted` anchor drafts: the first lm: drafter as loaded, a constant draft length, no cut-off."""
    return {
        "assistant": lm_drafters(drafters)[0],
        "assistant_weights": "as loaded",
        "num_assistant_tokens": draft_len,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other processes on the machine change absolute speeds."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
