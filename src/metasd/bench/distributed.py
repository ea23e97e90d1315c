"""`metasd bench --ray`: the benchmark sharded over Ray workers, and `--resume` from per-question results.

Each worker (`QuestionBench`, one Ray actor) loads the models once, warms every method up, then measures whole
questions: `ar` first, the oracle table, then every other method in the order `run_bench` uses for that question,
so each speed ratio is still measured side by side on one machine. The driver hands out one question at a time,
writes each finished one to `OUT/partial/q<ID>.pkl` at once, and merges the records into the same outputs as a
one-machine run (Spec-Bench's speedup is a mean over questions, so the merge is exact). A question lost with its
worker goes to another worker once (the retry is reported); one that fails twice fails the run, after the others
finish, with their results kept for `--resume`.

Cross-request drafter state (the `suffix` drafter's history of earlier `ar` answers, `--policy-scope server`) is per
worker: a question starts from the answers of the questions its worker measured before, not of every earlier one.
Outputs are lossless either way; only the speed of history-using drafters can differ from a one-process run. The
in-process `--resume` path (no `--ray`) replays finished questions' `ar` answers into the history, so it measures
exactly what `run_bench` measures.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import platform
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from .history import DrafterHistory
from .methods import DERIVED, lm_drafters, longest_draft, resolve_methods, uses_drafters
from .oracles import question_oracle
from .questions import Question
from .run import WARMUP_PROMPT, BenchConfig, _loadavg, _select, bench_decoder, drafter_weights, write_outputs
from .runners import engine_turn, hf_turn, measure_question, oracle_turn

PARTIAL = "partial"
KILL_ENV = "METASD_TEST_KILL_AFTER"  # test hook: worker 0 exits (os._exit) when given a question after N finished
MAX_ATTEMPTS = 2  # a question lost with its worker is retried once elsewhere


def host_info() -> dict:
    """Which machine measured a question: hostname, Ray node id, CPU model and count, torch threads, accelerator."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    node = None
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "hostname": socket.gethostname(),
        "node_id": node,
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "accelerator": accelerator,
    }


@dataclass
class QuestionResult:
    """Everything one question contributes to the summary, as a worker returns it and `partial/` stores it."""

    index: int  # position in the run's question order (sets the method rotation)
    question: Question
    records: dict  # method -> QuestionRecord
    tables: list | None  # per turn AcceptanceTable (None when no method uses drafters)
    paths: list | None  # per turn OraclePath
    host: dict
    worker: int
    seconds: float
    attempt: int = 1
    failures: list = field(default_factory=list)  # earlier attempts lost with their worker


class QuestionBench:
    """A worker: models loaded once and warmed up; `measure` runs every method on one question, interleaved."""

    def __init__(self, cfg: BenchConfig, worker: int = 0, kill_after: int | None = None):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch
        import transformers

        from ..drafters import parse_drafters

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        transformers.utils.logging.set_verbosity_error()
        self.cfg, self.worker, self.kill_after, self.done = cfg, worker, kill_after, 0
        started = time.perf_counter()
        specs = parse_drafters(cfg.drafters)
        self.decoder = decoder = bench_decoder(cfg, specs)
        self.names = names = decoder.drafter_names
        self.methods = resolve_methods(cfg.methods, names, aliases=dict(zip(specs, names, strict=True)))
        self.pool = [decoder.drafters[n] for n in names]
        self.assistant = None
        if "hf-assisted" in self.methods:
            self.assistant = decoder.drafters[lm_drafters(names)[0]].model  # as loaded
        self.choices: dict[int, list] = {}
        self.oracle_k = longest_draft(self.methods, cfg.draft_len)
        decoder.cost_model(self.oracle_k + 1)  # now, for every method: requests never extend the calibrated T(M)
        self.history = DrafterHistory(decoder.drafters)
        self.timed = [m for m in self.methods if m not in DERIVED]
        self.others = [m for m in self.timed if m != "ar"]
        self.need_tables = "oracle-round" in self.methods and any(uses_drafters(m) for m in self.methods)
        loaded = time.perf_counter()
        for method in [m for m in self.timed if m != "oracle-round"] if cfg.warmup else []:
            self.history.restore()
            self._runner(method)(decoder.encode(WARMUP_PROMPT), 0)
        self.times = {"load_s": round(loaded - started, 1), "warmup_s": round(time.perf_counter() - loaded, 1)}
        self.host = host_info()

    def _runner(self, method: str, qid: int | None = None):
        decoder, cfg = self.decoder, self.cfg
        k, max_new, seed = cfg.draft_len, cfg.max_new_tokens, cfg.seed
        if method == "ar":
            return engine_turn(decoder, "none", max_new, seed)
        if method in ("hf-ar", "hf-pld", "hf-assisted"):
            return hf_turn(decoder, method[3:], max_new, k, assistant=self.assistant)
        if method == "oracle-round":
            return oracle_turn(decoder, self.choices[qid], self.oracle_k, max_new, seed)
        return engine_turn(decoder, method, max_new, seed)

    def describe(self) -> dict:
        """What the summary's config needs from a worker (the same on every worker of a run)."""
        import torch
        import transformers

        return {
            "target": self.decoder.target.spec,
            "drafters": self.names,
            "drafter_weights": drafter_weights(self.decoder),
            "methods": self.methods,
            "timed": self.timed,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "host": self.host,
            **self.times,
        }

    def measure(self, index: int, q: Question) -> QuestionResult:
        if self.kill_after is not None and self.done >= self.kill_after:
            os._exit(1)  # test hook: die with this question in flight
        start = time.perf_counter()
        cfg, decoder = self.cfg, self.decoder
        tables = paths = None

        def oracle_tables(reference) -> None:
            nonlocal tables, paths
            self.history.restore()
            tables, paths, self.choices[q.question_id] = question_oracle(
                self.pool, reference, self.oracle_k, cfg.max_new_tokens, decoder.cost_model(self.oracle_k + 1)
            )

        shift = index % len(self.others) if self.others else 0
        records = measure_question(
            decoder,
            q,
            ["ar", *self.others[shift:], *self.others[:shift]],
            lambda method: self._runner(method, q.question_id),
            cfg.repeat,
            self.history.restore,
            oracle_tables if self.need_tables else None,
        )
        reference = records["ar"]
        self.advance(reference)
        self.done += 1
        return QuestionResult(
            index, q, records, tables, paths, self.host, self.worker, round(time.perf_counter() - start, 3)
        )

    def advance(self, reference) -> None:
        """The drafters' cross-request history gains one question's `ar` answers (as after measuring it)."""
        self.history.advance([(t.prompt_ids, t.token_ids) for t in reference.turns])


def _fingerprint(cfg: BenchConfig, questions: list[Question]) -> dict:
    """What must match for a partial result to be reused by --resume."""
    ids = [q.question_id for q in questions]
    return {
        "questions_file": str(cfg.questions),
        "target": cfg.target,
        "drafters": cfg.drafters,
        "methods": cfg.methods,
        "max_new_tokens": cfg.max_new_tokens,
        "draft_len": cfg.draft_len,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "seed": cfg.seed,
        "policy_scope": cfg.policy_scope,
        "drift": getattr(cfg, "drift", False),
        "kernels": cfg.kernels,
        "repeat": cfg.repeat,
        "questions": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
    }


class PartialStore:
    """`OUT/partial/`: one pickle per finished question, written atomically as it finishes."""

    def __init__(self, out: Path, fingerprint: dict, resume: bool):
        self.dir = out / PARTIAL
        meta = self.dir / "run.json"
        if resume and meta.is_file():
            old = json.loads(meta.read_text(encoding="utf-8"))
            if old != fingerprint:
                changed = sorted(k for k in fingerprint if old.get(k) != fingerprint[k])
                raise ValueError(
                    f"--resume: {self.dir} holds results of a different run (differs in "
                    f"{', '.join(changed)}); use another --out or drop --resume"
                )
        elif self.dir.is_dir():
            for stale in self.dir.glob("q*.pkl"):
                stale.unlink()
        self.dir.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps(fingerprint, indent=2) + "\n", encoding="utf-8")

    def load(self) -> dict[int, QuestionResult]:
        out = {}
        for path in self.dir.glob("q*.pkl"):
            try:
                result = pickle.loads(path.read_bytes())
            except Exception:  # a torn or foreign file: measure that question again
                continue
            if isinstance(result, QuestionResult):
                out[result.question.question_id] = result
        return out

    def save_info(self, info: dict) -> None:
        (self.dir / "workers.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")

    def load_info(self) -> dict | None:
        path = self.dir / "workers.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def save(self, result: QuestionResult) -> None:
        path = self.dir / f"q{result.question.question_id}.pkl"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        tmp.replace(path)


@dataclass
class ClusterOptions:
    address: str | None = None  # None: in process (no Ray); "local": a local Ray instance; else a Ray address
    workers: int | None = None  # None: one per Ray node
    worker_cpus: int | None = None  # None: what fits one worker per node (the smallest node's CPUs / workers there)
    resume: bool = False


def run_distributed(cfg: BenchConfig, opts: ClusterOptions) -> dict:
    """Like `run_bench`, over Ray workers (opts.address set) or in this process; resumable from OUT/partial/."""
    cfg.check()
    from ..drafters import parse_drafters

    resolve_methods(cfg.methods, parse_drafters(cfg.drafters), strict=False)
    if opts.workers is not None and opts.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {opts.workers}")
    if opts.worker_cpus is not None and opts.worker_cpus < 1:
        raise ValueError(f"--worker-cpus must be >= 1, got {opts.worker_cpus}")
    questions = _select(cfg)
    out = Path(cfg.out).expanduser()
    store = PartialStore(out, _fingerprint(cfg, questions), opts.resume)
    finished = {qid: r for qid, r in store.load().items() if qid in {q.question_id for q in questions}}
    todo = [(i, q) for i, q in enumerate(questions) if q.question_id not in finished]
    if cfg.progress:
        print(
            f"bench: {len(questions)} questions, {len(finished)} already finished in {store.dir}, "
            f"{len(todo)} to measure",
            file=sys.stderr,
        )
    loadavg_start = _loadavg()
    started = time.perf_counter()
    resumed = len(finished)
    if opts.address is None:
        info, cluster, failed = _run_local(cfg, questions, finished, todo, store)
    else:
        info, cluster, failed = _run_ray(cfg, opts, finished, todo, store)
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


def _plan(ray, opts: ClusterOptions) -> tuple[int, int, int]:
    """(workers, CPUs per worker, alive nodes): by default one worker per node, sized to the smallest node."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = [int(n.get("Resources", {}).get("CPU", 0)) for n in nodes] or [os.cpu_count() or 1]
    workers = opts.workers or len(nodes) or 1
    per_node = -(-workers // max(len(nodes), 1))
    worker_cpus = opts.worker_cpus or max(1, min(cpus) // per_node)
    return workers, worker_cpus, len(nodes)


def _run_ray(cfg, opts, finished, todo, store):
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'metasd[ray]'") from None
    from ray.exceptions import RayActorError, RayTaskError
    from tqdm.auto import tqdm

    started_here = not ray.is_initialized()
    if started_here:
        address = None if opts.address in ("local", "") else opts.address
        ray.init(address=address, include_dashboard=False, logging_level="warning", log_to_driver=cfg.progress)
    try:
        workers, worker_cpus, n_nodes = _plan(ray, opts)
        cluster = {
            "mode": "ray",
            "address": opts.address,
            "nodes": n_nodes,
            "workers": workers,
            "worker_cpus": worker_cpus,
            "retries": [],
            "workers_lost": [],
        }
        if not todo:
            return None, cluster, {}
        kill = os.environ.get(KILL_ENV)
        worker_cfg = BenchConfig(
            **{**cfg.__dict__, "threads": cfg.threads or worker_cpus, "progress": False, "plots": False}
        )
        gpus = 1 if cfg.device.startswith("cuda") else 0  # Ray hides GPUs from actors that reserve none
        Actor = ray.remote(num_cpus=worker_cpus, num_gpus=gpus, max_restarts=0, max_task_retries=0)(QuestionBench)
        actors = {
            rank: Actor.options(scheduling_strategy="SPREAD").remote(
                worker_cfg, rank, int(kill) if kill is not None and rank == 0 else None
            )
            for rank in range(min(workers, len(todo)))
        }
        info = None
        ready = {a.describe.remote(): rank for rank, a in actors.items()}
        for ref, rank in ready.items():  # surface a load error (bad target, missing model) once, before any question
            try:
                info = ray.get(ref)
            except RayActorError as err:
                cluster["workers_lost"].append({"worker": rank, "error": _short(err)})
                del actors[rank]
        if not actors:
            raise RuntimeError("no Ray worker started: " + "; ".join(w["error"] for w in cluster["workers_lost"]))
        store.save_info(info)
        queue = deque((i, q, 1, []) for i, q in todo)
        idle = list(actors)
        inflight: dict = {}
        failed: dict[int, str] = {}
        bar = tqdm(total=len(todo), desc="bench", unit="question", disable=not cfg.progress, file=sys.stderr)
        try:
            while queue or inflight:
                while queue and idle:
                    rank = idle.pop(0)
                    item = queue.popleft()
                    inflight[actors[rank].measure.remote(item[0], item[1])] = (rank, item)
                if not inflight:
                    for _, q, _, fails in queue:
                        failed[q.question_id] = f"q{q.question_id}: no worker left ({'; '.join(fails)})"
                    break
                done, _ = ray.wait(list(inflight), num_returns=1)
                ref = done[0]
                rank, (i, q, attempt, fails) = inflight.pop(ref)
                try:
                    result: QuestionResult = ray.get(ref)
                except RayTaskError as err:  # the question itself failed (bad input, a bug): retrying cannot help
                    raise RuntimeError(f"question {q.question_id} failed on worker {rank}: {err}") from None
                except RayActorError as err:
                    lost = f"worker {rank} died measuring q{q.question_id} (attempt {attempt}): {_short(err)}"
                    cluster["workers_lost"].append({"worker": rank, "question_id": q.question_id, "error": _short(err)})
                    del actors[rank]
                    print(f"bench: {lost}", file=sys.stderr)
                    if attempt < MAX_ATTEMPTS:
                        queue.appendleft((i, q, attempt + 1, [*fails, lost]))
                        cluster["retries"].append(
                            {"question_id": q.question_id, "lost_on_worker": rank, "attempt": attempt + 1}
                        )
                    else:
                        failed[q.question_id] = lost
                    continue
                result.attempt, result.failures = attempt, fails
                finished[q.question_id] = result
                store.save(result)
                idle.append(rank)
                bar.update()
        finally:
            bar.close()
            for actor in actors.values():
                ray.kill(actor)
        return info, cluster, failed
    finally:
        if started_here:
            ray.shutdown()


def _short(err: Exception) -> str:
    return str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__


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
        "hf_assisted": (
            {
                "assistant": lm_drafters(names)[0],
                "assistant_weights": "as loaded",
                "num_assistant_tokens": cfg.draft_len,
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0,
            }
            if "hf-assisted" in methods
            else None
        ),
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
