"""`metasd serve --replicas N`: N copies of the OpenAI-compatible server behind one endpoint, on Ray Serve.

Each replica is a Serve deployment whose ingress is the very app `server.create_app` builds (same routes, errors,
streaming and metrics; /metrics is per replica). The replica loads its Decoder in its constructor; the app is built
from it when Serve asks for the ingress. A replica whose engine thread stopped fails Serve's health check and is
restarted while the others keep answering.

With `--policy-scope server` the replicas pool what their bandits learn: one Ray actor (`PolicyHub`) holds the sum of
every replica's per-arm sufficient statistics (pulls, reward sums, rounds) per (policy, pool). At the start of a
request, at most once every `sync_s` seconds, a replica sends what it learned since its last sync and adopts the
pooled totals, so a replica that just started begins from what the others learned. The sync runs in the engine
thread, between requests, so it never races a policy update. Shared: the plain UCB family (`metasd-ucb`,
`metasd-ucb-cost`, `metasd-fi`, `ucb-be`), whose choice depends only on those statistics; other policies keep
learning per replica.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray
from ray import serve

from ..engine import Decoder
from ..policy import UCB

log = logging.getLogger(__name__)
HUB_NAME = "metasd-policy-hub"
_REPLICA: dict[str, Any] = {}  # this replica process's app, for the ingress builder (see _holder)


def _shareable(policy: Any) -> bool:
    return type(policy) is UCB


def _diff(a: dict, b: dict | None) -> dict:
    """a - b, statistic by statistic (b None: zero)."""
    if b is None:
        return {"pulls": list(a["pulls"]), "sums": list(a["sums"]), "rounds": a["rounds"]}
    return {
        "pulls": [x - y for x, y in zip(a["pulls"], b["pulls"], strict=True)],
        "sums": [x - y for x, y in zip(a["sums"], b["sums"], strict=True)],
        "rounds": a["rounds"] - b["rounds"],
    }


def _add(a: dict | None, b: dict) -> dict:
    return (
        dict(b)
        if a is None
        else {
            "pulls": [x + y for x, y in zip(a["pulls"], b["pulls"], strict=True)],
            "sums": [x + y for x, y in zip(a["sums"], b["sums"], strict=True)],
            "rounds": a["rounds"] + b["rounds"],
        }
    )


class PolicyHub:
    """The pooled statistics of every replica (a Ray actor; usable in-process too)."""

    def __init__(self) -> None:
        self.totals: dict[tuple, dict] = {}
        self.merges = 0

    def merge(self, deltas: dict) -> dict:
        """Add each replica delta; return every pooled total."""
        for key, delta in deltas.items():
            self.totals[key] = _add(self.totals.get(key), delta)
        self.merges += 1
        return self.totals

    def snapshot(self) -> dict:
        return {"totals": self.totals, "merges": self.merges}


class PolicySync:
    """One replica's side: push what its shared policies learned since the last sync, adopt the pooled totals."""

    def __init__(self, decoder: Decoder, merge, interval_s: float = 5.0):
        self.decoder, self._merge, self.interval_s = decoder, merge, interval_s
        self.base: dict[tuple, dict] = {}  # per key: the pooled totals this replica last adopted
        self.last = float("-inf")
        self.syncs = 0

    def maybe_sync(self) -> None:
        if time.monotonic() - self.last >= self.interval_s:
            try:
                self.sync()
            except Exception:  # the hub is gone or slow: serve on with what this replica knows
                log.warning("policy statistics sync failed", exc_info=True)
            self.last = time.monotonic()

    def sync(self) -> None:
        dec = self.decoder
        deltas = {}
        for key, policy in list(dec._policies.items()):
            if _shareable(policy):
                delta = _diff(policy.state(), self.base.get(key))
                if any(delta["pulls"]) or delta["rounds"]:
                    deltas[key] = delta
        totals = self._merge(deltas)
        for key, total in totals.items():
            name, names = key
            policy = dec._policies.get(key)
            if policy is None:
                if not set(names) <= set(dec.drafters):
                    continue
                policy = dec._policy(name, list(names))  # server scope: created and kept
            if not _shareable(policy):
                continue
            missing = _diff(total, policy.state())
            if min(missing["pulls"]) < 0 or missing["rounds"] < 0:  # the hub restarted empty: push all next time
                self.base.pop(key, None)
                continue
            policy.merge(missing)
            self.base[key] = total
        self.syncs += 1


class SyncedDecoder(Decoder):
    """A Decoder that syncs its shared policies (if `sync` is set) before each request, in the engine thread."""

    sync: PolicySync | None = None

    def stream(self, *args, **kwargs):
        if self.sync is not None:
            self.sync.maybe_sync()
        return super().stream(*args, **kwargs)


def _holder() -> dict[str, Any]:
    """This module's `_REPLICA`, imported: Serve pickles the deployment class and the builder by value, each with
    its own copy of module globals, so they meet only through the imported module."""
    import metasd.serving.ray_replicas

    return metasd.serving.ray_replicas._REPLICA


def _build_app():
    return _holder()["app"]


@serve.deployment(name="metasd", health_check_period_s=5)
@serve.ingress(_build_app)
class MetasdReplica:
    """One replica: a Decoder and the app `create_app` builds over it."""

    def __init__(
        self, decoder_options: dict, app_options: dict, threads: int | None = None, hub: Any = None, sync_s: float = 5.0
    ):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if threads:
            import torch

            torch.set_num_threads(threads)
        from .server import create_app

        self.decoder = SyncedDecoder(**decoder_options)
        if hub is not None and self.decoder.policy_scope == "server":
            self.decoder.sync = PolicySync(self.decoder, lambda deltas: ray.get(hub.merge.remote(deltas)), sync_s)
            self.decoder.sync.maybe_sync()  # start from what the other replicas learned
        self.metasd_app = create_app(self.decoder, **app_options)  # `app` is Serve's: the wrapped ingress
        _holder()["app"] = self.metasd_app

    def check_health(self) -> None:
        if not self.metasd_app.state.engine.alive:
            raise RuntimeError("the engine thread stopped")


def _gpus(decoder_options: dict) -> int:
    return 1 if str(decoder_options.get("device", "auto")).startswith("cuda") else 0


def build(
    decoder_options: dict,
    app_options: dict,
    replicas: int,
    replica_cpus: float | None = None,
    threads: int | None = None,
    sync_s: float = 5.0,
):
    """The Serve application (and its hub) for `serve.run`; call after ray.init."""
    hub = None
    if decoder_options.get("policy_scope") == "server":
        hub = ray.remote(num_cpus=0)(PolicyHub).options(name=HUB_NAME, get_if_exists=True).remote()
    cpus = replica_cpus if replica_cpus is not None else 1
    deployment = MetasdReplica.options(
        # Ray hides GPUs from actors that reserve none: `--device cuda` reserves one per replica
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus, "num_gpus": _gpus(decoder_options)},
        # the app queues and answers 429 itself (--max-queue): let Serve hand it that many
        max_ongoing_requests=app_options.get("max_queue", 64) + 1,
    )
    return deployment.bind(decoder_options, app_options, threads or (int(cpus) if cpus >= 1 else None), hub, sync_s)


def serve_replicas(
    decoder_options: dict,
    app_options: dict,
    replicas: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    replica_cpus: float | None = None,
    threads: int | None = None,
    sync_s: float = 5.0,
) -> None:
    """Run `replicas` copies until interrupted (`metasd serve --replicas N`)."""
    ray.init(
        address=None if address in (None, "", "local") else address, include_dashboard=False, logging_level="warning"
    )
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(
            build(decoder_options, app_options, replicas, replica_cpus, threads, sync_s),
            name="metasd",
            route_prefix="/",
        )
        print(f"metasd: {replicas} replicas on http://{host}:{port} (Ctrl-C stops)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
