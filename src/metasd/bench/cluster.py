"""The Ray side of `metasd bench --ray`: workers (`QuestionBench` actors) planned over the nodes, one question at a
time handed to each, every finished one stored at once in `OUT/partial/`.

A question lost with its worker goes to another worker once (the retry is reported); one that fails twice fails the
run, after the others finish, with their results kept for `--resume`. Cross-request drafter state (the `suffix`
drafter's history of earlier `ar` answers, `--policy-scope server`) is per worker: a question starts from the
answers of the questions its worker measured before, not of every earlier one. Outputs are lossless either way;
only the speed of history-using drafters can differ from a one-process run.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from dataclasses import dataclass

from .config import BenchConfig
from .partial import PartialStore
from .worker import QuestionBench, QuestionResult

KILL_ENV = "METASD_TEST_KILL_AFTER"  # test hook: worker 0 exits (os._exit) when given a question after N finished
MAX_ATTEMPTS = 2  # a question lost with its worker is retried once elsewhere


@dataclass
class ClusterOptions:
    """Where `metasd bench` runs its questions: in process or on which Ray cluster, with how many workers of how
    many CPUs each, and whether it resumes from stored results."""

    address: str | None = None  # None: in process (no Ray); "local": a local Ray instance; else a Ray address
    workers: int | None = None  # None: one per Ray node
    worker_cpus: int | None = None  # None: what fits one worker per node (the smallest node's CPUs / workers there)
    resume: bool = False


def plan(ray, opts: ClusterOptions) -> tuple[int, int, int]:
    """(workers, CPUs per worker, alive nodes): by default one worker per node, sized to the smallest node."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = [int(n.get("Resources", {}).get("CPU", 0)) for n in nodes] or [os.cpu_count() or 1]
    workers = opts.workers or len(nodes) or 1
    per_node = -(-workers // max(len(nodes), 1))
    worker_cpus = opts.worker_cpus or max(1, min(cpus) // per_node)
    return workers, worker_cpus, len(nodes)


def run_ray(cfg: BenchConfig, opts: ClusterOptions, finished: dict, todo: list, store: PartialStore):
    """The questions of `todo` ((index, question) pairs) measured on Ray workers, each result added to `finished`
    and `store` as it comes: (the workers' `describe`, the cluster record, question id -> why it failed). Ray is
    started here unless it already runs, and then shut down again."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'metasd[ray]'") from None

    started_here = not ray.is_initialized()
    if started_here:
        address = None if opts.address in ("local", "") else opts.address
        ray.init(address=address, include_dashboard=False, logging_level="warning", log_to_driver=cfg.progress)
    try:
        workers, worker_cpus, n_nodes = plan(ray, opts)
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
        actors = _start_workers(ray, cfg, min(workers, len(todo)), worker_cpus)
        info = _describe(ray, actors, cluster)
        store.save_info(info)
        try:
            failed = _dispatch(ray, cfg, actors, todo, finished, store, cluster)
        finally:
            for actor in actors.values():
                ray.kill(actor)
        return info, cluster, failed
    finally:
        if started_here:
            ray.shutdown()


def _start_workers(ray, cfg: BenchConfig, count: int, worker_cpus: int) -> dict:
    """rank -> a `QuestionBench` actor, spread over the nodes; each worker's torch threads are its CPUs unless
    --threads says otherwise."""
    kill = os.environ.get(KILL_ENV)
    worker_cfg = BenchConfig(
        **{**cfg.__dict__, "threads": cfg.threads or worker_cpus, "progress": False, "plots": False}
    )
    gpus = 1 if cfg.device.startswith("cuda") else 0  # Ray hides GPUs from actors that reserve none
    Actor = ray.remote(num_cpus=worker_cpus, num_gpus=gpus, max_restarts=0, max_task_retries=0)(QuestionBench)
    return {
        rank: Actor.options(scheduling_strategy="SPREAD").remote(
            worker_cfg, rank, int(kill) if kill is not None and rank == 0 else None
        )
        for rank in range(count)
    }


def _describe(ray, actors: dict, cluster: dict) -> dict:
    """A worker's `describe` (the same on all); workers that failed to load are dropped from `actors` and recorded.

    Surfaces a load error (bad target, missing model) once, before any question."""
    from ray.exceptions import RayActorError

    info = None
    ready = {a.describe.remote(): rank for rank, a in actors.items()}
    for ref, rank in ready.items():
        try:
            info = ray.get(ref)
        except RayActorError as err:
            cluster["workers_lost"].append({"worker": rank, "error": _short(err)})
            del actors[rank]
    if not actors:
        raise RuntimeError("no Ray worker started: " + "; ".join(w["error"] for w in cluster["workers_lost"]))
    return info


def _dispatch(ray, cfg: BenchConfig, actors: dict, todo: list, finished: dict, store: PartialStore, cluster: dict):
    """One question at a time to each idle worker until none is left: question id -> why it failed, for those lost
    with their worker MAX_ATTEMPTS times (or left when no worker was)."""
    from ray.exceptions import RayActorError, RayTaskError
    from tqdm.auto import tqdm

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
                del actors[rank]
                _lost(err, rank, (i, q, attempt, fails), queue, failed, cluster)
                continue
            result.attempt, result.failures = attempt, fails
            finished[q.question_id] = result
            store.save(result)
            idle.append(rank)
            bar.update()
    finally:
        bar.close()
    return failed


def _lost(err: Exception, rank: int, item: tuple, queue: deque, failed: dict, cluster: dict) -> None:
    """Worker `rank` died measuring `item`: recorded, and the question queued again first, or failed after
    MAX_ATTEMPTS."""
    i, q, attempt, fails = item
    lost = f"worker {rank} died measuring q{q.question_id} (attempt {attempt}): {_short(err)}"
    cluster["workers_lost"].append({"worker": rank, "question_id": q.question_id, "error": _short(err)})
    print(f"bench: {lost}", file=sys.stderr)
    if attempt < MAX_ATTEMPTS:
        queue.appendleft((i, q, attempt + 1, [*fails, lost]))
        cluster["retries"].append({"question_id": q.question_id, "lost_on_worker": rank, "attempt": attempt + 1})
    else:
        failed[q.question_id] = lost


def _short(err: Exception) -> str:
    return str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
