"""`run_bench`: load, measure every method on every question (interleaved), then write the outputs.

Per question: `ar` first (its output is the reference), then the oracle table from that reference, then the other
methods in an order rotated by one each question, so that machine drift and ordering effects spread over all
methods. Before every method the model-free drafters are put back to the same cross-request state. With --repeat N the
methods run N passes over each question from one state and each keeps its fastest run.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..drafters import DEFAULT_POOL
from .history import DrafterHistory
from .methods import DERIVED, file_stem, lm_drafters, longest_draft, resolve_methods, uses_drafters
from .oracles import question_oracle
from .questions import Question, load_questions, select_questions
from .runners import QuestionRecord, engine_turn, hf_turn, measure_question, oracle_turn

WARMUP_PROMPT = "Say hello in one short sentence."


@dataclass
class BenchConfig:
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


def _select(cfg: BenchConfig) -> list[Question]:
    if cfg.drift:
        from .drift import drift_questions

        return drift_questions(cfg.questions, cfg.seed, cfg.per_category, cfg.categories)
    questions = select_questions(load_questions(cfg.questions), cfg.categories, cfg.per_category)
    order = {"mt_bench": 0, "translation": 1, "summarization": 2, "qa": 3, "math_reasoning": 4, "rag": 5}
    return sorted(questions, key=lambda q: order.get(q.group, 99))  # stable: selection order within a group


def run_bench(cfg: BenchConfig) -> dict:
    """Run the benchmark described by cfg; writes summary.json, report.md, answers/ and plots into cfg.out."""
    cfg.check()
    from ..drafters import parse_drafters

    specs = parse_drafters(cfg.drafters)
    resolve_methods(cfg.methods, specs, strict=False)  # bad method names fail before any model loads
    questions = _select(cfg)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers
    from tqdm.auto import tqdm

    from ..models.linear_kernels import installed

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    transformers.utils.logging.set_verbosity_error()
    loadavg_start = _loadavg()
    started = time.perf_counter()
    decoder = bench_decoder(cfg, specs)
    names = decoder.drafter_names
    methods = resolve_methods(cfg.methods, names, aliases=dict(zip(specs, names, strict=True)))
    pool = [decoder.drafters[n] for n in names]
    assistant = None
    if "hf-assisted" in methods:
        assistant_name = lm_drafters(names)[0]
        assistant = decoder.drafters[assistant_name].model  # as loaded: no int8 twin

    k, max_new, seed = cfg.draft_len, cfg.max_new_tokens, cfg.seed
    oracle_k = longest_draft(methods, k)  # the oracle may draft as long as any method here can
    decoder.cost_model(oracle_k + 1)  # now, for every method: requests never extend the calibrated T(M)
    choices: dict[int, list] = {}

    def runner(method: str, qid: int | None = None):
        if method == "ar":
            return engine_turn(decoder, "none", max_new, seed)
        if method == "hf-ar":
            return hf_turn(decoder, "ar", max_new, k)
        if method == "hf-pld":
            return hf_turn(decoder, "pld", max_new, k)
        if method == "hf-assisted":
            return hf_turn(decoder, "assisted", max_new, k, assistant=assistant)
        if method == "oracle-round":
            return oracle_turn(decoder, choices[qid], oracle_k, max_new, seed)
        return engine_turn(decoder, method, max_new, seed)

    history = DrafterHistory(decoder.drafters)
    timed = [m for m in methods if m not in DERIVED]
    warm = [m for m in timed if m != "oracle-round"] if cfg.warmup else []
    loaded = time.perf_counter()
    bar = tqdm(
        total=len(warm) + len(questions) * len(timed) * cfg.repeat,
        desc="bench",
        unit="run",
        disable=not cfg.progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    for method in warm:  # first calls pay one-off costs (allocations, lazy inits): keep them out of the timings
        bar.set_postfix_str(f"warm-up {method}")
        history.restore()
        runner(method)(decoder.encode(WARMUP_PROMPT), 0)
        bar.update()
    warmed = time.perf_counter()
    # the hindsight tables (every drafter drafting at every position of the reference) feed oracle-round and the
    # regret against it; on a large target they take longer than the methods themselves, so only when asked for
    need_tables = "oracle-round" in methods and any(uses_drafters(m) for m in methods)
    others = [m for m in timed if m != "ar"]

    results: dict[str, dict[int, QuestionRecord]] = {m: {} for m in timed}
    tables: dict = {}
    paths: dict = {}
    try:
        for i, q in enumerate(questions):

            def oracle_tables(reference: QuestionRecord, q: Question = q) -> None:
                bar.set_postfix_str(f"q{q.question_id} {q.category} oracle table")
                history.restore()
                tables[q.question_id], paths[q.question_id], choices[q.question_id] = question_oracle(
                    pool, reference, oracle_k, max_new, decoder.cost_model(oracle_k + 1)
                )

            def next_run(method: str, q: Question = q) -> None:
                bar.update()
                bar.set_postfix_str(f"q{q.question_id} {q.category} {method}")

            shift = i % len(others) if others else 0
            records = measure_question(
                decoder,
                q,
                ["ar", *others[shift:], *others[:shift]],
                lambda method, q=q: runner(method, q.question_id),
                cfg.repeat,
                history.restore,
                oracle_tables if need_tables else None,
                next_run,
            )
            for method, record in records.items():
                results[method][q.question_id] = record
            history.advance([(t.prompt_ids, t.token_ids) for t in records["ar"].turns])
    finally:
        bar.close()
    measured = time.perf_counter()

    from .summary import summarize

    config = {
        "command": cfg.command,
        "target": decoder.target.spec,
        "drafters": names,
        "drafter_weights": drafter_weights(decoder),
        "draft_len": k,
        "dtype": cfg.dtype,
        "kernels": cfg.kernels,
        "device": str(decoder.target.device),
        "max_new_tokens": max_new,
        "questions_file": str(cfg.questions),
        "categories": cfg.categories,
        "per_category": cfg.per_category,
        "methods": methods,
        "turns": sum(len(q.turns) for q in questions),
        "seed": seed,
        "repeat": cfg.repeat,
        "policy_scope": cfg.policy_scope,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_s": round(loaded - started, 1),
        "warmup_s": round(warmed - loaded, 1),
        "measure_s": round(measured - warmed, 1),
        "loadavg_start": loadavg_start,
        "hf_pld": {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": 3},
        "hf_assisted": (
            {
                "assistant": lm_drafters(names)[0],
                "assistant_weights": "as loaded",
                "num_assistant_tokens": k,
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0,
            }
            if assistant is not None
            else None
        ),
        **cfg.extra,
    }
    if decoder._costs is not None:  # the T(M) the adaptive policy decided with: calibrated, and after the run
        target_cost = decoder._costs.target
        config["target_cost_ms"] = {
            "calibrated": [round(t * 1e3, 3) for t in target_cost.calibrated],
            "end_of_run": [round(t * 1e3, 3) for t in target_cost.table()],
            "linear_kernels": installed(decoder.target.model),
        }
    summary = summarize(results, questions, methods, names, tables, paths, config)
    return write_outputs(cfg, summary, results, questions, timed, names, tables, started)


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
    summary["config"]["loadavg_end"] = _loadavg()
    summary_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    from .report import render

    (out / "report.md").write_text(render(summary, plots), encoding="utf-8")
    return summary


def drafter_weights(decoder) -> dict[str, str]:
    """What each model drafter and EAGLE head drafts with ("int8", "int8 up to R rows", "unquantized" or, for a
    head, "unquantized, KERNEL"): `auto` decides per machine."""
    return {name: d.weights for name, d in decoder.drafters.items() if hasattr(d, "weights")}


def _loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other processes on the machine change absolute speeds."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
