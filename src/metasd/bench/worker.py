"""`QuestionBench`: the models loaded once and warmed up, then whole questions measured one at a time; the same
worker serves `run_bench`, the in-process `--resume` path and each Ray actor of `bench --ray`.

Per question: `ar` first (its output is the reference), then the oracle table from that reference, then the other
methods in an order rotated by one each question, so that machine drift and ordering effects spread over all
methods. Before every method the model-free drafters are put back to the same cross-request state. With --repeat N the
methods run N passes over each question from one state and each keeps its fastest run.
"""

from __future__ import annotations

import os
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from ..machine import cpu_name
from .config import BenchConfig, bench_decoder, drafter_weights
from .history import DrafterHistory
from .methods import DERIVED, lm_drafters, longest_draft, resolve_methods, uses_drafters
from .oracles import question_oracle
from .questions import Question
from .runners import QuestionRecord, engine_turn, hf_turn, measure_question, oracle_turn

WARMUP_PROMPT = "Say hello in one short sentence."


def host_info() -> dict:
    """Which machine measured a question: hostname, Ray node id, CPU model and count, torch threads, accelerator."""
    import torch

    cpu = cpu_name()
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
    """A worker: models loaded once and warmed up; `measure` runs every method on one question, interleaved.

    With warm=False the caller warms up itself, method by method (`warmup_methods`, `warm_up`), as `run_bench`
    does to show the warm-up on its progress bar.
    """

    def __init__(self, cfg: BenchConfig, worker: int = 0, kill_after: int | None = None, warm: bool = True):
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
            self.assistant = decoder.drafters[lm_drafters(names)[0]].model  # as loaded: no int8 twin
        self.choices: dict[int, list] = {}
        self.oracle_k = longest_draft(self.methods, cfg.draft_len)  # the oracle drafts as long as any method can
        decoder.cost_model(self.oracle_k + 1)  # now, for every method: requests never extend the calibrated T(M)
        self.history = DrafterHistory(decoder.drafters)
        self.timed = [m for m in self.methods if m not in DERIVED]
        self.others = [m for m in self.timed if m != "ar"]
        # the hindsight tables (every drafter drafting at every position of the reference) feed oracle-round and the
        # regret against it; on a large target they take longer than the methods themselves, so only when asked for
        self.need_tables = "oracle-round" in self.methods and any(uses_drafters(m) for m in self.methods)
        self.warmup_methods = [m for m in self.timed if m != "oracle-round"] if cfg.warmup else []
        loaded = time.perf_counter()
        self.times = {"load_s": round(loaded - started, 1)}
        if warm:
            for method in self.warmup_methods:
                self.warm_up(method)
            self.times["warmup_s"] = round(time.perf_counter() - loaded, 1)

    @cached_property
    def host(self) -> dict:
        """This worker's machine (`host_info`), looked up once, when a result or `describe` first needs it."""
        return host_info()

    def warm_up(self, method: str) -> None:
        """One untimed call of `method`: first calls pay one-off costs (allocations, lazy inits), kept out of the
        timings."""
        self.history.restore()
        self._runner(method)(self.decoder.encode(WARMUP_PROMPT), 0)

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
        """Question q measured (`measure_records`) and packed with where and how long it ran."""
        if self.kill_after is not None and self.done >= self.kill_after:
            os._exit(1)  # test hook: die with this question in flight
        start = time.perf_counter()
        records, tables, paths = self.measure_records(index, q)
        self.done += 1
        return QuestionResult(
            index, q, records, tables, paths, self.host, self.worker, round(time.perf_counter() - start, 3)
        )

    def measure_records(
        self,
        index: int,
        q: Question,
        on_run: Callable[[str], None] | None = None,
        on_tables: Callable[[], None] | None = None,
    ) -> tuple[dict[str, QuestionRecord], list | None, list | None]:
        """Every method on question q, `ar` first and the others rotated by `index` (q's position in the run), then
        the drafters' history gains q's `ar` answers. Returns (method -> record, the oracle tables, the oracle
        paths); both oracle parts are None when no method needs them. `on_run(method)` is called before each run
        and `on_tables()` before the oracle tables are built (progress reporting)."""
        cfg, decoder = self.cfg, self.decoder
        tables = paths = None

        def oracle_tables(reference: QuestionRecord) -> None:
            nonlocal tables, paths
            if on_tables is not None:
                on_tables()
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
            on_run,
        )
        self.advance(records["ar"])
        return records, tables, paths

    def advance(self, reference) -> None:
        """The drafters' cross-request history gains one question's `ar` answers (as after measuring it)."""
        self.history.advance([(t.prompt_ids, t.token_ids) for t in reference.turns])
