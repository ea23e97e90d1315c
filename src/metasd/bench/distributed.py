"""`metasd bench --ray`: the benchmark sharded over Ray workers (bench/cluster.py), and `--resume` from per-question
results (bench/partial.py).

Each worker (`QuestionBench`) measures whole questions in the order `run_bench` uses for them, so each speed ratio is
still measured side by side on one machine. The driver merges the per-question records into the same outputs as a
one-machine run (Spec-Bench's speedup is a mean over questions, so the merge is exact). The in-process `--resume`
path (no `--ray`) replays finished questions' `ar` answers into the drafters' history, so it measures exactly what
`run_bench` measures.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .cluster import KILL_ENV, ClusterOptions, run_ray
from .config import BenchConfig, bench_questions, hf_assisted_settings, loadavg
from .partial import PartialStore, fingerprint
from .run import write_outputs
from .worker import QuestionBench, QuestionResult

# KILL_ENV and ClusterOptions belong to this module's interface; QuestionResult is importable here because partial
# results pickled by earlier versions name it as this module's
__all__ = ["KILL_ENV", "ClusterOptions", "QuestionBench", "QuestionResult", "render_cluster", "run_distributed"]


def run_distributed(cfg: BenchConfig, opts: ClusterOptions) -> dict:
    """Like `run_bench`, over Ray workers (opts.address set) or in this process; resumable from OUT/partial/."""
    cfg.check()
    if opts.workers is not None and opts.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {opts.workers}")
    if opts.worker_cpus is not None and opts.worker_cpus < 1:
        raise ValueError(f"--worker-cpus must be >= 1, got {opts.worker_cpus}")
    questions = bench_questions(cfg)
    out = Path(cfg.out).expanduser()
    store = PartialStore(out, fingerprint(cfg, questions), opts.resume)
    finished = {qid: r for qid, r in store.load().items() if qid in {q.question_id for q in questions}}
    todo = [(i, q) for i, q in enumerate(questions) if q.question_id not in finished]
    if cfg.progress:
        print(
            f"bench: {len(questions)} questions, {len(finished)} already finished in {store.dir}, "
            f"{len(todo)} to measure",
            file=sys.stderr,
        )
    loadavg_start = loadavg()
    started = time.perf_counter()
    resumed = len(finished)
    if opts.address is None:
        info, cluster, failed = _run_local(cfg, questions, finished, todo, store)
    else:
        info, cluster, failed = run_ray(cfg, opts, finished, todo, store)
    measured = time.perf_counter()
    cluster["resumed_questions"] = resumed
    info = info or store.load_info()
    if info is None:
        raise RuntimeError(f"--resume: {store.dir} lacks workers.json; run without --resume")
    if failed:
        raise RuntimeError(
            f"questions {sorted(failed)} were lost with their workers twice; the other results are "
            f"in {store.dir} (rerun with --resume): " + "; ".join(failed.values())
        )
    return _merge(cfg, questions, finished, info, cluster, loadavg_start, started, measured)


def _run_local(cfg, questions, finished, todo, store):
    """Every question in this process, in order; finished ones only feed the drafters' history."""
    from tqdm.auto import tqdm

    if not todo:
        return None, {"mode": "in-process"}, {}
    bench = QuestionBench(cfg)
    store.save_info(bench.describe())
    bar = tqdm(total=len(todo), desc="bench", unit="question", disable=not cfg.progress, file=sys.stderr)
    try:
        for i, q in enumerate(questions):
            if q.question_id in finished:
                bench.advance(finished[q.question_id].records["ar"])
                continue
            bar.set_postfix_str(f"q{q.question_id} {q.category}")
            result = finished[q.question_id] = bench.measure(i, q)
            store.save(result)
            bar.update()
    finally:
        bar.close()
    return bench.describe(), {"mode": "in-process"}, {}


def _merge(cfg, questions, finished, info, cluster, loadavg_start, started, measured) -> dict:
    """The one-machine outputs from per-question results, plus where each question ran."""
    from .summary import summarize

    methods, names, timed = info["methods"], info["drafters"], info["timed"]
    results = {m: {q.question_id: finished[q.question_id].records[m] for q in questions} for m in timed}
    tables = {q.question_id: finished[q.question_id].tables for q in questions if finished[q.question_id].tables}
    paths = {q.question_id: finished[q.question_id].paths for q in questions if finished[q.question_id].paths}
    hosts: dict[str, dict] = {}
    for r in finished.values():
        hosts.setdefault(r.host.get("node_id") or r.host["hostname"], r.host)
    config = {
        "command": cfg.command,
        "target": info["target"],
        "drafters": names,
        "drafter_weights": info.get("drafter_weights", {}),
        "draft_len": cfg.draft_len,
        "dtype": cfg.dtype,
        "kernels": cfg.kernels,
        "device": cfg.device,
        "max_new_tokens": cfg.max_new_tokens,
        "questions_file": str(cfg.questions),
        "categories": cfg.categories,
        "per_category": cfg.per_category,
        "methods": methods,
        "turns": sum(len(q.turns) for q in questions),
        "seed": cfg.seed,
        "policy_scope": cfg.policy_scope,
        "threads": info["host"]["torch_threads"],
        "cpus": info["host"]["cpus"],
        "torch": info["torch"],
        "transformers": info["transformers"],
        "python": info["python"],
        "load_s": info.get("load_s", 0.0),
        "warmup_s": info.get("warmup_s", 0.0),
        "measure_s": round(max(0.0, measured - started - info.get("load_s", 0.0) - info.get("warmup_s", 0.0)), 1),
        "loadavg_start": loadavg_start,
        "hf_pld": {"prompt_lookup_num_tokens": cfg.draft_len, "max_matching_ngram_size": 3},
        "hf_assisted": hf_assisted_settings(names, cfg.draft_len) if "hf-assisted" in methods else None,
        "cluster": {**cluster, "hosts": list(hosts.values())},
        **cfg.extra,
    }
    summary = summarize(results, questions, methods, names, tables, paths, config)
    for entry in summary["questions"]:
        r = finished[entry["question_id"]]
        entry["ran_on"] = {
            "hostname": r.host["hostname"],
            "node_id": r.host.get("node_id"),
            "worker": r.worker,
            "attempt": r.attempt,
            "seconds": r.seconds,
        }
    summary = write_outputs(cfg, summary, results, questions, timed, names, tables, started)
    out = Path(cfg.out).expanduser()
    with (out / "report.md").open("a", encoding="utf-8") as f:
        f.write(render_cluster(summary))
    return summary


def render_cluster(summary: dict) -> str:
    """The report's section on where questions ran, retries and lost workers."""
    c = summary["config"].get("cluster") or {}
    lines = ["", "## Where questions ran", ""]
    if c.get("mode") == "ray":
        lines.append(
            f"Ray at `{c.get('address')}`: {c.get('workers')} workers of {c.get('worker_cpus')} CPUs on "
            f"{c.get('nodes')} nodes."
        )
    else:
        lines.append("In this process.")
    lines += [
        "",
        "| host | node | CPU | CPUs | torch threads | accelerator | questions |",
        "|---|---|---|---:|---:|---|---:|",
    ]
    for h in c.get("hosts", []):
        n = sum(
            1
            for q in summary["questions"]
            if (q["ran_on"]["node_id"] or q["ran_on"]["hostname"]) == (h.get("node_id") or h["hostname"])
        )
        lines.append(
            f"| {h['hostname']} | {(h.get('node_id') or '–')[:12]} | {h['cpu']} | {h['cpus']} | "
            f"{h['torch_threads']} | {h.get('accelerator') or '–'} | {n} |"
        )
    lines.append("")
    for r in c.get("retries", []):
        lines.append(
            f"- question {r['question_id']}: its worker {r['lost_on_worker']} died; measured again "
            f"(attempt {r['attempt']})."
        )
    for w in c.get("workers_lost", []):
        if "question_id" not in w:
            lines.append(f"- worker {w['worker']} failed to start: {w['error']}")
    return "\n".join(lines) + "\n"
