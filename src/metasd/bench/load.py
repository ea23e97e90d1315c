"""Serving under load: throughput and latency of `metasd serve` at several numbers of concurrent clients.

Each setting (a `--max-batch` and a policy) runs a fresh server per load in this process (a fresh decoder, so no
load meets outputs an earlier one taught the suffix drafter); C clients send Spec-Bench first turns as chat
requests, greedy, one after another each, until every request of the load is answered. Throughput is generated
tokens per second of all clients together, from the first request sent to the last answer; latency is per request,
arrival to answer. Greedy outputs of every batched setting are compared with those of `--max-batch 1`, which
decodes each request alone (the single-request engine): a difference is reported with the reference's margin
between its two likeliest tokens where the outputs part, so a near-tie (summation order differs with the batch's
shape) is told apart from a defect.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from ..engine import Decoder
from ..learning import LearningConfig
from ..serving.background import running
from ..serving.server import create_app


@dataclass(frozen=True)
class Setting:
    """A server configuration the load test measures: its label, the largest batch, the policy, and whether its
    EAGLE heads learn from the traffic (`metasd.learning`; None: they do not)."""

    label: str
    max_batch: int
    policy: str
    learning: LearningConfig | None = None


@dataclass
class LoadResult:
    """One load's outcome: the setting and number of clients, the requests and completion tokens served, its wall
    time and each request's latency in seconds, the completions, the rounds per batch size, each response's mean
    accepted tokens per round with when it arrived, and the prompt tokens the server took in (chat template
    included: on a CPU the prompts can be more of the work than the answers)."""

    setting: str
    clients: int
    requests: int
    tokens: int
    wall_s: float
    latencies: list[float]
    texts: dict[int, str] = field(repr=False)  # prompt index -> completion
    batch_rounds: dict[str, float] = field(default_factory=dict)  # batch size -> rounds (from /metrics)
    learning: list[dict] = field(default_factory=list)  # the learners' state at the end (`HeadLearner.stats`)
    # prompt index -> (seconds from the load's start to its answer, the answer's mean accepted tokens per round)
    acceptance: dict[int, tuple[float, float]] = field(default_factory=dict)
    prompt_tokens: int = 0

    def acceptance_in_order(self) -> list[float]:
        """The responses' mean accepted tokens per round, in the order they were answered."""
        return [accepted for _, accepted in sorted(self.acceptance.values())]

    @property
    def throughput(self) -> float:
        """Completion tokens per second of wall time, over all clients."""
        return self.tokens / self.wall_s

    def latency(self, q: float) -> float:
        """The `q` quantile (0 .. 1) of the requests' latencies, in seconds."""
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def first_turns(questions: Sequence, count: int) -> list[str]:
    """`count` Spec-Bench first turns, the groups taking turns (so any prefix of them mixes every group)."""
    from .questions import GROUPS, select_questions

    per_group = -(-count // len(GROUPS))
    lanes = [[q.turns[0] for q in select_questions(questions, [group], per_group)] for group in GROUPS]
    return [lane[r] for r in range(per_group) for lane in lanes if r < len(lane)][:count]


def run_load(decoder: Decoder, setting: Setting, prompts: Sequence[str], clients: int, max_tokens: int) -> LoadResult:
    """One load: `clients` threads share the prompts (each prompt once) against a server over `decoder`."""
    app = create_app(decoder, max_queue=max(64, len(prompts)), max_batch=setting.max_batch, learning=setting.learning)
    latencies: list[float] = [0.0] * len(prompts)
    tokens: list[int] = [0] * len(prompts)
    prompt_tokens: list[int] = [0] * len(prompts)
    texts: dict[int, str] = {}
    answered: dict[int, tuple[float, float]] = {}  # prompt index -> (perf_counter at the answer, mean accepted)
    errors: list[str] = []
    next_prompt = iter(range(len(prompts)))
    lock = threading.Lock()

    def client(url: str) -> None:
        with httpx.Client(base_url=url, timeout=3600) as http:
            while True:
                with lock:
                    i = next(next_prompt, None)
                if i is None:
                    return
                start = time.perf_counter()
                body = {
                    "messages": [{"role": "user", "content": prompts[i]}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                }
                r = http.post("/v1/chat/completions", json=body)
                latencies[i] = time.perf_counter() - start
                if r.status_code != 200:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
                    continue
                data = r.json()
                tokens[i] = data["usage"]["completion_tokens"]
                prompt_tokens[i] = data["usage"]["prompt_tokens"]
                texts[i] = data["choices"][0]["message"]["content"]
                answered[i] = (time.perf_counter(), data["metasd"]["mean_accepted_tokens"])

    with running(app) as url:
        threads = [threading.Thread(target=client, args=(url,)) for _ in range(clients)]
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - began
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed under load, e.g. {errors[0]}")
    rounds = {
        sample.labels["le"]: sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "metasd:batch_size_bucket"
    }
    learned = [learner.stats() for learner in app.state.learners]
    return LoadResult(
        setting=setting.label,
        clients=clients,
        requests=len(prompts),
        tokens=sum(tokens),
        wall_s=wall,
        latencies=latencies,
        texts=texts,
        batch_rounds=rounds,
        learning=learned,
        acceptance={i: (at - began, accepted) for i, (at, accepted) in answered.items()},
        prompt_tokens=sum(prompt_tokens),
    )


@dataclass(frozen=True)
class Mismatch:
    """A batched output that differs from the reference decoded alone: which prompt, under which load, and where."""

    prompt: int
    setting: str
    clients: int
    position: int  # the first output token where the two differ
    margin: float  # the reference's logit margin between its two likeliest tokens there


def mismatches(
    decoder: Decoder, prompts: Sequence[str], reference: dict[int, str], results: Sequence[LoadResult]
) -> list[Mismatch]:
    """Every batched output that differs from the reference (decoded alone), with the logit margin where it parts."""
    out = []
    for result in results:
        for i, text in result.texts.items():
            if text == reference.get(i, text):
                continue
            ours = decoder.tokenizer(text, add_special_tokens=False)["input_ids"]
            theirs = decoder.tokenizer(reference[i], add_special_tokens=False)["input_ids"]
            position = next((j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(ours))
            context = decoder.encode(prompts[i]) + theirs[:position]
            with torch.inference_mode():
                ids = torch.tensor([context], device=decoder.target.device)
                logits = decoder.target.model(input_ids=ids).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            out.append(Mismatch(i, result.setting, result.clients, position, float(top[0] - top[1])))
    return out


def run_loads(
    make_decoder: Callable[[str], Decoder],
    settings: Sequence[Setting],
    prompts: Sequence[str],
    loads: Sequence[int],
    max_tokens: int,
    requests: int,
    log: Callable[[str], None] = print,
) -> tuple[list[LoadResult], list[Mismatch]]:
    """Every setting at every load: `requests` requests, or two per client where that is more. The settings take
    turns within each load, so a machine that drifts (clocks, neighbours) over the minutes a run takes weighs on
    every setting of a load alike. The first setting (max_batch 1) is the reference for outputs."""
    results = []
    for clients in loads:
        for setting in settings:
            count = min(len(prompts), max(requests, 2 * clients))
            result = run_load(make_decoder(setting.policy), setting, prompts[:count], clients, max_tokens)
            log(
                f"{setting.label:>24} clients {clients:>3}: {result.throughput:7.1f} tok/s, "
                f"p50 {result.latency(0.5):6.2f} s, p99 {result.latency(0.99):6.2f} s ({result.wall_s:.0f} s)"
            )
            results.append(result)
    alone = [r for r in results if r.setting == settings[0].label]
    reference = {i: t for r in alone for i, t in r.texts.items()}
    checker = make_decoder(settings[0].policy)
    return results, mismatches(checker, prompts, reference, [r for r in results if r.setting != settings[0].label])


def table(results: Sequence[LoadResult], baseline: str) -> str:
    """Markdown: per load, each setting's throughput (and its ratio to the baseline's), p50, p95 and p99 latency."""
    lines = [
        "| clients | setting | tokens/s | vs " + baseline + " | p50 latency (s) | p95 latency (s) | p99 latency (s) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    base = {r.clients: r.throughput for r in results if r.setting == baseline}
    for r in sorted(results, key=lambda r: (r.clients, r.setting != baseline)):
        ratio = r.throughput / base[r.clients] if r.clients in base else float("nan")
        lines.append(
            f"| {r.clients} | {r.setting} | {r.throughput:.1f} | {ratio:.2f}x | {r.latency(0.5):.2f} | "
            f"{r.latency(0.95):.2f} | {r.latency(0.99):.2f} |"
        )
    return "\n".join(lines)
