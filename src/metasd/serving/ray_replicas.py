"""`metasd serve --replicas N`: N copies of the OpenAI-compatible server behind one endpoint, on Ray Serve.

Each replica is a Serve deployment whose ingress is the app `server.create_app` builds (same routes, errors,
streaming; /metrics per replica); one whose engine thread stopped fails Serve's health check and is restarted.

With `--policy-scope server` the replicas pool what their bandits learn (the plain UCB family, whose choice depends
only on per-arm statistics). A `PolicyHub` actor keeps, per (policy, pool, regime), each replica policy's own
cumulative statistics; the pool is their sum. A push is a replica's whole contribution, not a difference, so a
retried, late or repeated push counts once, a hub restarted empty (a new `epoch`) is rebuilt from the next pushes,
and a policy evicted and made again is a new source that adopts the pool: no count can go down. The hub keeps at
most `MAX_KEYS` keys and answers only those a replica pushed. The sync runs in the engine thread between requests,
at most every `sync_s` seconds, and waits at most `SYNC_TIMEOUT_S` before serving on with local statistics.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from collections import OrderedDict
from typing import Any

import ray
from ray import serve
from ray.exceptions import GetTimeoutError

from ..engine import Decoder
from ..policy import UCB
from ..policy.base import state_delta

log = logging.getLogger(__name__)
HUB_NAME = "metasd-policy-hub"
_REPLICA: dict[str, Any] = {}  # this replica process's app, for the ingress builder (see _holder)
MAX_KEYS = 256  # (policy, pool, regime) keys the hub keeps; each replica's decoder keeps at most 64 policies
MAX_SOURCES = 256  # per key, the replicas' policies the hub tells apart; older ones are folded into one sum
SYNC_TIMEOUT_S = 2.0  # the longest a sync waits for the hub, in the engine thread, before serving on alone


def _shareable(policy: Any) -> bool:
    return type(policy) is UCB


def _add(a: dict | None, b: dict) -> dict:
    return (
        state_delta(b, None)  # a copy
        if a is None
        else {
            "pulls": [x + y for x, y in zip(a["pulls"], b["pulls"], strict=True)],
            "sums": [x + y for x, y in zip(a["sums"], b["sums"], strict=True)],
            "rounds": a["rounds"] + b["rounds"],
        }
    )


def _counts_ok(stats: dict, floor: dict | None = None) -> bool:
    """No count below zero, nor below `floor`'s (what the same source pushed before: counts only grow)."""
    pulls, rounds = stats["pulls"], stats["rounds"]
    if min(pulls, default=0) < 0 or rounds < 0:
        return False
    return floor is None or (
        rounds >= floor["rounds"] and all(n >= m for n, m in zip(pulls, floor["pulls"], strict=True))
    )


class _Pool:
    """One key's pooled statistics: per source (a replica's policy object) its latest cumulative push, plus the
    sum of sources that are gone (a replica that made a new policy for the key, or the oldest past MAX_SOURCES)."""

    def __init__(self) -> None:
        self.retired: dict | None = None
        self.sources: OrderedDict[str, tuple[int, dict]] = OrderedDict()  # replica -> (its policy's id, stats)

    def put(self, replica: str, policy_id: int, stats: dict, max_sources: int) -> bool:
        """Record a source's cumulative statistics; False (nothing changed) for one that would lower a count."""
        old = self.sources.get(replica)
        same = old is not None and old[0] == policy_id
        if not _counts_ok(stats, old[1] if same else None):
            return False
        if old is not None and not same:  # that replica's earlier policy for this key is gone: its learning stays
            self.retired = _add(self.retired, old[1])
        self.sources.pop(replica, None)
        self.sources[replica] = (policy_id, stats)
        while len(self.sources) > max_sources:
            self.retired = _add(self.retired, self.sources.popitem(last=False)[1][1])
        return True

    def total(self) -> dict:
        total = self.retired
        for _, stats in self.sources.values():
            total = _add(total, stats)
        return total


class PolicyHub:
    """The pooled statistics of every replica (a Ray actor; usable in-process too).

    `epoch` names this hub's life: a hub that restarted (empty) has a new one, so a replica can tell. Nothing
    else depends on it: replicas push cumulative statistics, which rebuild a new hub without double counting.
    """

    def __init__(self, max_keys: int = MAX_KEYS, max_sources: int = MAX_SOURCES) -> None:
        self.epoch = uuid.uuid4().hex
        self.pools: OrderedDict[tuple, _Pool] = OrderedDict()  # least recently synced first
        self.max_keys, self.max_sources = max_keys, max_sources
        self.merges = 0
        self.refused = 0  # pushes refused for lowering a count

    def merge(self, replica: str, pushed: dict) -> dict:
        """Record one replica's pushes ({key: {"policy": its policy's id, "pulls", "sums", "rounds"}}, each
        cumulative since that policy was made); return this hub's epoch and the pooled totals of those keys only."""
        for key, item in pushed.items():
            pool = self.pools.pop(key, None) or _Pool()
            self.pools[key] = pool
            stats = {"pulls": list(item["pulls"]), "sums": list(item["sums"]), "rounds": item["rounds"]}
            if not pool.put(replica, item["policy"], stats, self.max_sources):
                self.refused += 1
                log.warning("policy hub: refused statistics from %s for %s that would lower a count", replica, key)
        while len(self.pools) > self.max_keys:
            self.pools.popitem(last=False)
        self.merges += 1
        totals = {key: self.pools[key].total() for key in pushed if key in self.pools}
        return {"epoch": self.epoch, "totals": {key: total for key, total in totals.items() if total is not None}}

    @property
    def totals(self) -> dict:
        """The statistics every replica sent so far, summed."""
        return {key: pool.total() for key, pool in self.pools.items()}

    def snapshot(self) -> dict:
        return {"epoch": self.epoch, "totals": self.totals, "merges": self.merges, "refused": self.refused}


class _Tracked:
    """A shared policy object this replica syncs: `adopted` is what it took from the pool (other replicas' learning,
    as of the last sync), so its own learning, what it pushes, is its state minus that."""

    def __init__(self, policy: Any, policy_id: int) -> None:
        self.policy, self.policy_id = policy, policy_id
        self.adopted: dict | None = None


class PolicySync:
    """One replica's side: push what its shared policies learned themselves, adopt the pooled totals of their keys.

    `merge(replica, pushed)` is `PolicyHub.merge` (in process) or `remote_merge(hub)` (over Ray, with a timeout).
    """

    def __init__(self, decoder: Decoder, merge, interval_s: float = 5.0):
        self.decoder, self._merge, self.interval_s = decoder, merge, interval_s
        self.replica = uuid.uuid4().hex
        self.tracked: dict[tuple, _Tracked] = {}  # per key: the policy object alive in the decoder at the last sync
        self._ids = itertools.count()
        self.epoch: str | None = None  # the hub's, as of the last sync
        self.last = float("-inf")
        self.syncs = 0

    def maybe_sync(self) -> None:
        """Sync with the hub if `every` requests ended since the last sync."""
        if time.monotonic() - self.last >= self.interval_s:
            try:
                self.sync()
            except Exception:  # the hub is gone or slow: serve on with what this replica knows
                log.warning("policy statistics sync failed; serving on with this replica's statistics", exc_info=True)
            self.last = time.monotonic()

    def sync(self) -> None:
        """Send what this replica learned since the last sync and take in what the others sent."""
        live = {key: p for key, p in self.decoder.policies.items() if _shareable(p)}
        for key in [key for key, t in self.tracked.items() if live.get(key) is not t.policy]:
            del self.tracked[key]  # evicted from the decoder's cache: what it pushed stays pooled
        for key, policy in live.items():
            if key not in self.tracked:  # new, or made again after an eviction: a new source, from zero
                self.tracked[key] = _Tracked(policy, next(self._ids))
        pushed = {
            key: {"policy": t.policy_id, **state_delta(t.policy.state(), t.adopted)} for key, t in self.tracked.items()
        }
        reply = self._merge(self.replica, pushed)
        if self.epoch is not None and reply["epoch"] != self.epoch:
            log.warning("the policy hub restarted: its statistics were rebuilt from the replicas' pushes")
        self.epoch = reply["epoch"]
        for key, total in reply["totals"].items():
            t = self.tracked.get(key)
            if t is None:
                continue
            # the pool is the reference, also where it holds less than this policy (a restarted hub before every
            # replica pushed again): what this policy learned itself is in it, and `adopted` keeps it apart
            missing = state_delta(total, t.policy.state())
            t.policy.merge(missing)
            t.adopted = _add(t.adopted, missing)
        self.syncs += 1


def remote_merge(hub: Any, timeout_s: float = SYNC_TIMEOUT_S):
    """`hub.merge` over Ray for a PolicySync, waiting at most `timeout_s` (it runs in the engine thread, before a
    request): an unresponsive hub costs a request that long at most. A push applied after the timeout is harmless
    (pushes are cumulative, so the next one supersedes it)."""

    def merge(replica: str, pushed: dict) -> dict:
        ref = hub.merge.remote(replica, pushed)
        try:
            return ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            raise TimeoutError(f"the policy hub did not answer within {timeout_s:g} s") from None

    return merge


class SyncedDecoder(Decoder):
    """A Decoder that syncs its shared policies (if `sync` is set) before each request, in the engine thread."""

    sync: PolicySync | None = None

    def stream(self, *args, **kwargs):
        generation = super().stream(*args, **kwargs)  # the request's policy exists now: a new one joins this sync
        if self.sync is not None:
            self.sync.maybe_sync()
        return generation


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
        self,
        decoder_options: dict,
        app_options: dict,
        threads: int | None = None,
        hub: Any = None,
        sync_s: float = 5.0,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
    ):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if threads:
            import torch

            torch.set_num_threads(threads)
        from .server import create_app

        self.decoder = SyncedDecoder(**decoder_options)
        if hub is not None and self.decoder.policy_scope == "server":
            self.decoder.sync = PolicySync(self.decoder, remote_merge(hub, sync_timeout_s), sync_s)
            self.decoder.sync.maybe_sync()  # start from what the other replicas learned
        self.metasd_app = create_app(self.decoder, **app_options)  # `app` is Serve's: the wrapped ingress
        _holder()["app"] = self.metasd_app

    def check_health(self) -> None:
        """Ray Serve's health check: raise once the decoding thread stopped."""
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
        # restarted by Ray if it dies: empty, with a new epoch, and rebuilt from the replicas' next pushes
        actor = ray.remote(num_cpus=0, max_restarts=-1)(PolicyHub)
        hub = actor.options(name=HUB_NAME, get_if_exists=True).remote()
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
