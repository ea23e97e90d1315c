"""`run_bench`: load, measure every method on every question (interleaved, by `QuestionBench`), then write the outputs.

The order of the methods on a question, the warm-up and the drafters' cross-request state are the worker's
(bench/worker.py); this module adds the progress bar, the summary's config and the output files.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

from .config import BenchConfig, bench_questions, drafter_weights, hf_assisted_settings, loadavg
from .methods import file_stem
from .questions import Question
from .runners import QuestionRecord
from .worker import QuestionBench

__all__ = ["BenchConfig", "run_bench", "write_outputs"]


def run_bench(cfg: BenchConfig) -> dict:
    """Run the benchmark described by cfg; writes summary.json, report.md, answers/ and plots into cfg.out."""
    cfg.check()
    questions = bench_questions(cfg)
    loadavg_start = loadavg()
    started = time.perf_counter()
    bench = QuestionBench(cfg, warm=False)
    loaded = time.perf_counter()
    bar = _progress_bar(cfg, len(bench.warmup_methods) + len(questions) * len(bench.timed) * cfg.repeat)
    _warm_up(bench, bar)
    warmed = time.perf_counter()
    try:
        results, tables, paths = _measure(bench, questions, bar)
    finally:
        bar.close()
    measured = time.perf_counter()

    from .summary import summarize

    timings = {
        "load_s": round(loaded - started, 1),
        "warmup_s": round(warmed - loaded, 1),
        "measure_s": round(measured - warmed, 1),
    }
    config = _run_config(cfg, bench, questions, timings, loadavg_start)
    summary = summarize(results, questions, bench.methods, bench.names, tables, paths, config)
    return write_outputs(cfg, summary, results, questions, bench.timed, bench.names, tables, started)


def _progress_bar(cfg: BenchConfig, total: int):
    """One step per warm-up call and per measured run (stderr; off with --no-progress)."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc="bench",
        unit="run",
        disable=not cfg.progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )


def _warm_up(bench: QuestionBench, bar) -> None:
    """Every timed method but `oracle-round` once, untimed: first calls pay one-off costs (allocations, lazy inits),
    so keep them out of the timings."""
    for method in bench.warmup_methods:
        bar.set_postfix_str(f"warm-up {method}")
        bench.warm_up(method)
        bar.update()


def _measure(bench: QuestionBench, questions: list[Question], bar) -> tuple[dict, dict, dict]:
    """Every question in order: (method -> question id -> record, question id -> oracle tables, question id ->
    oracle paths); the oracle parts only for the questions that needed them."""
    results: dict[str, dict[int, QuestionRecord]] = {m: {} for m in bench.timed}
    tables: dict = {}
    paths: dict = {}
    for i, q in enumerate(questions):
        records, q_tables, q_paths = bench.measure_records(i, q, *_progress_hooks(bar, q))
        for method, record in records.items():
            results[method][q.question_id] = record
        if q_tables is not None:
            tables[q.question_id], paths[q.question_id] = q_tables, q_paths
    return results, tables, paths


def _progress_hooks(bar, q: Question):
    """`measure_records`' on_run and on_tables for question q: a step per run, the current step's name."""

    def next_run(method: str) -> None:
        bar.update()
        bar.set_postfix_str(f"q{q.question_id} {q.category} {method}")

    def oracle_table() -> None:
        bar.set_postfix_str(f"q{q.question_id} {q.category} oracle table")

    return next_run, oracle_table


def _run_config(
    cfg: BenchConfig, bench: QuestionBench, questions: list[Question], timings: dict, loadavg_start
) -> dict:
    """summary.json's `config`: the settings, the software and machine, and where the time went."""
    import torch
    import transformers

    decoder, k = bench.decoder, cfg.draft_len
    config = {
        "command": cfg.command,
        "target": decoder.target.spec,
        "drafters": bench.names,
        "drafter_weights": drafter_weights(decoder),
        "draft_len": k,
        "dtype": cfg.dtype,
        "kernels": cfg.kernels,
        "device": str(decoder.target.device),
        "max_new_tokens": cfg.max_new_tokens,
        "questions_file": str(cfg.questions),
        "categories": cfg.categories,
        "per_category": cfg.per_category,
        "methods": bench.methods,
        "turns": sum(len(q.turns) for q in questions),
        "seed": cfg.seed,
        "repeat": cfg.repeat,
        "policy_scope": cfg.policy_scope,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        **timings,
        "loadavg_start": loadavg_start,
        "hf_pld": {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": 3},
        "hf_assisted": hf_assisted_settings(bench.names, k) if bench.assistant is not None else None,
        **cfg.extra,
    }
    if decoder.costs is not None:  # the T(M) the adaptive policy decided with: calibrated, and after the run
        config["target_cost_ms"] = _target_cost(decoder)
    return config


def _target_cost(decoder) -> dict:
    """The target's T(M) in ms, as calibrated and at the end of the run, and the linear kernel chosen per M."""
    from ..models.linear_kernels import installed, installed_beyond

    target_cost = decoder.costs.target
    return {
        "calibrated": [round(t * 1e3, 3) for t in target_cost.calibrated],
        "end_of_run": [round(t * 1e3, 3) for t in target_cost.table()],
        "linear_kernels": installed(decoder.target.model),
        "prefill_kernel": installed_beyond(decoder.target.model),
    }


def write_outputs(
    cfg: BenchConfig,
    summary: dict,
    results: dict,
    questions: list[Question],
    timed: list[str],
    names: list[str],
    tables: dict,
    started: float,
) -> dict:
    """answers/, plots, summary.json and report.md into cfg.out (also the merge step of `bench --ray`)."""
    out = Path(cfg.out).expanduser()
    answers = out / "answers"
    answers.mkdir(parents=True, exist_ok=True)
    for stale in answers.glob("*.jsonl"):
        stale.unlink()
    from .answers import write_answers

    files = {}
    for method in timed:
        path = answers / f"{file_stem(method)}.jsonl"
        write_answers(path, method, results[method], questions)
        files[method] = str(path.relative_to(out))
    summary["answer_files"] = files
    if cfg.drift:
        from .drift import add_drift

        add_drift(cfg, summary, results, out)
    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")  # what a failing plot cannot lose
    plots: list[str] = []
    if cfg.plots:
        from .plots import write_plots

        plots = write_plots(out, results, summary, names, tables)
    summary["plots"] = plots
    summary["config"]["wall_time_s"] = round(time.perf_counter() - started, 1)
    summary["config"]["loadavg_end"] = loadavg()
    summary_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    from .report import render

    (out / "report.md").write_text(render(summary, plots), encoding="utf-8")
    return summary
