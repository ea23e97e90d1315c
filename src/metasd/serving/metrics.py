"""The server's Prometheus metrics: requests, tokens, speculation by drafter, queue and batch sizes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..stats import GenerationStats


class _Metrics:
    """Prometheus series in the spirit of vLLM's (`vllm:spec_decode_num_draft_tokens_total` ...), one registry per
    app so several apps can live in one process."""

    def __init__(self, drafters: list[str]):
        self.registry = r = CollectorRegistry()
        self.success = Counter(
            "metasd:request_success",
            "Finished requests by reason: stop, length, abort",
            ["finished_reason"],
            registry=r,
        )
        self.failure = Counter(
            "metasd:request_failure", "Requests answered with an error, by HTTP status", ["status"], registry=r
        )
        self.prompt_tokens = Counter("metasd:prompt_tokens", "Prompt tokens of decoded requests", registry=r)
        self.generation_tokens = Counter("metasd:generation_tokens", "Generated tokens", registry=r)
        self.rounds = Counter("metasd:spec_decode_num_rounds", "Decoding rounds, one target forward each", registry=r)
        self.drafts = Counter(
            "metasd:spec_decode_num_drafts",
            "Rounds each drafter was picked for (bandit pulls)",
            ["drafter"],
            registry=r,
        )
        self.draft_tokens = Counter(
            "metasd:spec_decode_num_draft_tokens", "Tokens proposed, by drafter", ["drafter"], registry=r
        )
        self.accepted = Counter(
            "metasd:spec_decode_num_accepted_tokens", "Draft tokens the target accepted", ["drafter"], registry=r
        )
        self.switches = Counter(
            "metasd:spec_decode_num_switches", "Rounds whose drafter differs from the last one's", registry=r
        )
        self.latency = Histogram(
            "metasd:e2e_request_latency_seconds",
            "Arrival to last token, queueing included",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640),
            registry=r,
        )
        self.waiting = Gauge("metasd:num_requests_waiting", "Requests queued for a place in the batch", registry=r)
        self.running = Gauge("metasd:num_requests_running", "Requests decoding (in the batch)", registry=r)
        self.batch_size = Histogram(
            "metasd:batch_size",
            "Requests verified by each round's target forward",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=r,
        )
        self.batch_drafted = Counter(
            "metasd:spec_decode_num_draft_tokens_by_batch_size",
            "Draft tokens verified, by the size of the batch that verified them",
            ["batch_size"],
            registry=r,
        )
        self.batch_accepted = Counter(
            "metasd:spec_decode_num_accepted_tokens_by_batch_size",
            "Draft tokens accepted, by the size of the batch that verified them",
            ["batch_size"],
            registry=r,
        )
        self.head_version = Gauge(
            "metasd:learning_head_version", "Version of the head in service (0: as loaded)", ["drafter"], registry=r
        )
        self.head_expected_tokens = Gauge(
            "metasd:learning_held_out_expected_tokens",
            "Expected accepted tokens per draft of the head in service, on held-out recent requests",
            ["drafter"],
            registry=r,
        )
        self.buffer_tokens = Gauge(
            "metasd:learning_buffer_tokens", "Tokens of verified traffic kept to learn from", ["drafter"], registry=r
        )
        self.training_share = Gauge(
            "metasd:learning_training_share", "Share of a core the head's trainer used so far", ["drafter"], registry=r
        )
        self.learning_failures = Gauge(
            "metasd:learning_failures", "Rounds of learning that failed (serving went on)", ["drafter"], registry=r
        )
        for name in drafters:  # export zeros from the start, so rate() works from the first scrape
            for counter in (self.drafts, self.draft_tokens, self.accepted):
                counter.labels(name)

    def record_learning(self, reports: list[dict]) -> None:
        """The learners' state (`HeadLearner.stats`) as gauges: the shared history key's head (per-key heads are
        each client's own business, summed into the buffer only)."""
        for report in reports:
            name, shared = report["drafter"], report["keys"].get("shared", {})
            self.head_version.labels(name).set(shared.get("version", 0))
            self.head_expected_tokens.labels(name).set(shared.get("held_out_expected_tokens") or 0.0)
            self.buffer_tokens.labels(name).set(sum(k["buffer_tokens"] for k in report["keys"].values()))
            self.training_share.labels(name).set(report["training_share"])
            self.learning_failures.labels(name).set(report["failures"])

    def record(self, stats: GenerationStats, finish_reason: str, latency: float) -> None:
        self.success.labels(finish_reason).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.new_tokens)
        self.rounds.inc(len(stats.rounds))
        self.switches.inc(stats.switches)
        for name, d in stats.drafters().items():
            self.drafts.labels(name).inc(d.pulls)
            self.draft_tokens.labels(name).inc(d.drafted)
            self.accepted.labels(name).inc(d.accepted)
        self.latency.observe(latency)
