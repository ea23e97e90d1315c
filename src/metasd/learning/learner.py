"""A background trainer that fine-tunes an EAGLE head on the traffic it drafts for, and swaps it in only when it
measures better.

Online speculative decoding (Liu et al., arXiv 2310.07177) distils the drafter on the queries it serves. Here the
data costs nothing: each verified request leaves the target's features at every position in the target's cache,
and the final norm's feature gives the target's full next-token distribution (over the draft vocabulary) as soft
labels, so the loss is `train-eagle`'s (`eagle_loss.head_loss`: feature regression, cross-entropy against the
target's distribution, the training-time test over `unroll` steps). Per history key, once enough new tokens
arrived, a copy of the head in service trains on the buffer's older sequences and is judged with the head in
service on the newest ones (held out): it replaces it only if its expected accepted tokens per draft are higher.
The trainer is one thread of `threads` torch threads at the lowest CPU priority that also sleeps to use at most
`share` of a core; a failure in it is recorded and serving goes on with the head it has.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..drafters.eagle import SHARED_KEY, EagleDrafter
from ..models.eagle_head import EagleHead, head_fingerprint
from ..specialists.eagle_loss import head_loss
from ..specialists.eagle_sequences import StoredSequences
from ..specialists.eagle_train import TrainConfig, held_out_metrics
from ..specialists.length_batches import length_batches
from .buffer import TrafficBuffer
from .head_store import HeadStore, dir_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearningConfig:
    """How a head learns from traffic (per history key): `buffer_tokens` kept, `train_every` new tokens that start
    a round of training, `held_out` share of the buffer's tokens (the newest; at most `held_out_max` tokens) a
    candidate is judged on, `steps`
    optimiser steps at rate `lr` on batches of about `batch_tokens` tokens, the training-time test over `unroll`
    steps, `min_gain` expected tokens per draft a candidate must add, and the trainer's `share` of one core (CPU
    time), its torch `threads` and its CPU priority (`nice`: 19, the lowest, yields to serving; 0, serving's own,
    takes its share even on a saturated machine) and whether it trains while its server decodes (`when_busy`; by
    default it waits for the gaps between requests, so serving never shares the cores or the interpreter with
    it)."""

    buffer_tokens: int = 65_536
    total_tokens: int | None = None
    train_every: int = 4_096
    held_out: float = 0.25
    steps: int = 32
    lr: float = 1e-4
    batch_tokens: int = 2_048
    unroll: int = 2
    held_out_max: int = 4_096
    min_gain: float = 0.0
    share: float = 0.25
    threads: int = 1
    nice: int = 19
    when_busy: bool = False

    def __post_init__(self):
        if not 0 < self.share <= 1:
            raise ValueError(f"the trainer's share of a core must be in (0, 1], got {self.share}")
        if not 0 < self.held_out < 1:
            raise ValueError(f"the held-out share must be in (0, 1), got {self.held_out}")
        if self.threads < 1 or self.steps < 1 or self.train_every < 1 or not 1 <= self.unroll <= 8:
            raise ValueError("threads, steps and train_every must be >= 1, and unroll 1 .. 8")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be 0 .. 19, got {self.nice}")
        if self.total_tokens is not None and self.total_tokens < 2:
            raise ValueError(f"the buffers' total cap must be at least 2 tokens, got {self.total_tokens}")

    @property
    def total_cap(self) -> int:
        """Tokens every key's buffer may hold together."""
        return 4 * self.buffer_tokens if self.total_tokens is None else self.total_tokens


@dataclass
class _KeyState:
    """One history key's learning: its buffer, the head in service (None: the head as loaded) and its version,
    the buffer's count of added tokens when it last trained, and the learning record."""

    buffer: TrafficBuffer
    head: EagleHead | None = None
    version: int = 0
    trained_at: int = 0
    records: list[dict] = field(default_factory=list)


class _FrozenEmbedding(torch.nn.Module):
    """The target's input embeddings as the head reads them in training: no gradient ever reaches the target."""

    def __init__(self, embed: torch.nn.Module):
        super().__init__()
        self.weight = embed.weight.detach()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight).float()


def expected_tokens(metrics: dict) -> float:
    """Expected accepted tokens of a greedy draft of the measured depth: P(first right) + P(first two) + ..."""
    return metrics["top1"] + sum(v for k, v in metrics.items() if k == "both" or k.startswith("chain_"))


class HeadLearner:
    """Learns one EAGLE drafter's head from its traffic, per history key (`HeadLearning` for the drafter).

    directory: where each key's improved head and its learning record (learning.jsonl) are kept; a learner made
    with the same directory resumes from them."""

    def __init__(self, drafter: EagleDrafter, target, config: LearningConfig, directory: Path | None = None):
        self.name = drafter.name
        self.config = config
        self.target = target
        self.base = copy.deepcopy(drafter.loaded_head).float().eval()
        self.base_fingerprint = head_fingerprint(self.base)
        self.embed = _FrozenEmbedding(target.model.get_input_embeddings())
        self.whole = target.model.get_output_embeddings().weight.detach()  # judged against the target's argmax
        self.readout = self.whole[self.base.draft_vocab].float()
        self.train_config = TrainConfig(
            noise=0.1, unroll=config.unroll, feature_layers=self.base.config.feature_layers, max_length=768
        )
        self.store = None
        if directory is not None:
            self.store = HeadStore(directory, self.name, target, self.base_fingerprint, self.base.draft_vocab)
        self.busy: Callable[[], bool] | None = None  # whether the server is decoding (`metasd.serving` sets it)
        self.keys: dict[str, _KeyState] = {}
        self.failures = 0
        self.last_error: str | None = None
        self.busy_seconds = 0.0
        self._started = time.monotonic()
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng = random.Random(0)
        for key, head, version in self.store.resume() if self.store is not None else ():
            state = self._state(key)
            state.head, state.version = head, version

    # --- what the drafter calls (serving threads) -----------------------------------------------------------------

    def current(self, key: str) -> tuple[int, EagleHead | None]:
        with self._lock:
            state = self.keys.get(key)
            return (0, None) if state is None else (state.version, state.head)

    def collect(self, key: str, tokens: torch.Tensor, features: torch.Tensor, prompt: int) -> None:
        with self._lock:
            self._state(key).buffer.add(tokens, features, prompt)
            self._within_total_cap()
            self._lock.notify()

    def _within_total_cap(self) -> None:
        """Past `total_tokens` over every key, the fullest buffer gives up its oldest sequence, until the buffers
        fit: each key keeps its newest traffic, and no number of keys grows memory without bound (caller holds the
        lock)."""
        total = sum(s.buffer.tokens for s in self.keys.values())
        while total > self.config.total_cap:
            fullest = max(self.keys.values(), key=lambda s: s.buffer.tokens)
            total -= fullest.buffer.drop_oldest()

    # --- the trainer thread ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the trainer thread (a daemon: it never keeps the process alive)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"learn-{self.name}", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the trainer after its current optimiser step (a candidate in training is discarded)."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def learn_due(self) -> list[dict]:
        """In the calling thread, a round of learning for every key with `train_every` new tokens (what a prompt
        file leaves after its last request, once `close` stopped the thread); their records."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"{self.name}: the trainer thread is still running (close() it first)")
        self._stop.clear()
        out = []
        while (key := self._due()) is not None:
            record = self._learn(key)
            if record is None:
                break
            out.append(record)
        return out

    def learn_now(self, key: str = SHARED_KEY) -> dict | None:
        """One round of learning for `key` in the calling thread, whatever its new tokens (tests, a final round
        after a prompt file): its record, or None when the buffer has too little to split."""
        return self._learn(key)

    def _run(self) -> None:
        torch.set_num_threads(self.config.threads)  # this thread's own: serving keeps its threads
        if sys.platform.startswith("linux"):  # a thread's own niceness: Linux's (elsewhere it would be a process's)
            with contextlib.suppress(OSError):  # at 19, the lowest, it gets what serving leaves
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.config.nice)
        while not self._stop.is_set():
            with self._lock:
                key = self._due()
                if key is None:
                    self._lock.wait(timeout=1.0)
                    continue
            if not self._wait_for_a_gap():
                return
            try:
                self._learn(key)
            except Exception as err:  # noqa: BLE001 - a failed round leaves the head in service; serving goes on
                self.failures += 1
                self.last_error = f"{type(err).__name__}: {err}"
                log.exception("learning %s's head failed", self.name)

    def _wait_for_a_gap(self) -> bool:
        """Unless `when_busy`, wait while the server decodes; False once the learner is stopping."""
        while not self.config.when_busy and self.busy is not None and self.busy() and not self._stop.is_set():
            self._stop.wait(0.05)
        return not self._stop.is_set()

    def _due(self) -> str | None:
        """The key with the most new tokens, if at least `train_every` (caller holds the lock)."""
        new = {k: s.buffer.added - s.trained_at for k, s in self.keys.items() if len(s.buffer.sequences) > 1}
        best = max(new, key=new.get, default=None)
        return best if best is not None and new[best] >= self.config.train_every else None

    def _learn(self, key: str) -> dict | None:
        """Train a copy of `key`'s head on its buffer, judge it against the head in service on held-out recent
        sequences, and swap it in if it is better; the round's record."""
        cfg = self.config
        with self._lock:
            state = self._state(key)
            held, train, mark = state.buffer.split(cfg.held_out, cfg.held_out_max)
            state.trained_at = state.buffer.added
            serving = state.head if state.head is not None else self.base
        if not held or not train:
            return None
        started = time.perf_counter()
        candidate = copy.deepcopy(serving).float().train()
        trained = self._fine_tune(candidate, StoredSequences(train))
        if trained is None:
            return None
        if not self._wait_for_a_gap():
            return None
        candidate.eval()
        judged = StoredSequences(held, answers_only=True)
        new = held_out_metrics(candidate, self.embed, self.readout, judged, self.train_config, self.whole)
        old = held_out_metrics(serving, self.embed, self.readout, judged, self.train_config, self.whole)
        swap = expected_tokens(new) > expected_tokens(old) + cfg.min_gain
        record = {
            "time": time.time(),
            "key": key,
            "buffer_tokens": state.buffer.tokens,
            "trained_positions": trained,
            "held_out_sequences": len(held),
            "serving": {"version": state.version, **old},
            "candidate": new,
            "swapped": swap,
            "seconds": round(time.perf_counter() - started, 2),
        }
        with self._lock:
            if swap:
                state.head, state.version = candidate, state.version + 1
                state.buffer.mark_trained(mark)
            record["version"] = state.version
            state.records.append(record)
        if self.store is not None:
            self.store.save(key, record, candidate if swap else None, asdict(self.config))
        return record

    def _fine_tune(self, head: EagleHead, seqs: StoredSequences) -> int | None:
        """`steps` optimiser steps on batches drawn from `seqs`; positions trained on (None: stopped)."""
        cfg, tcfg = self.config, self.train_config
        lengths = [min(len(seqs.tokens(i)), tcfg.max_length) for i in range(len(seqs))]
        batches = length_batches(lengths, cfg.batch_tokens)
        optim = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
        positions = 0
        for _ in range(cfg.steps):
            if not self._wait_for_a_gap():
                return None
            started = time.thread_time()  # this thread's CPU time: what its share is of
            tokens, feats, real = seqs.stack(self._rng.choice(batches), tcfg.max_length)
            loss, _ = head_loss(head, self.embed, self.readout, tokens, feats, real, tcfg)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optim.step()
            positions += int(real.sum())
            busy = time.thread_time() - started
            self.busy_seconds += busy
            self._stop.wait(busy * (1 - cfg.share) / cfg.share)  # keep to `share` of a core
        return positions

    # --- state, saving, resuming ----------------------------------------------------------------------------------

    def _state(self, key: str) -> _KeyState:
        if key not in self.keys:
            self.keys[key] = _KeyState(TrafficBuffer(self.config.buffer_tokens, self.train_config.max_length))
        return self.keys[key]

    def stats(self) -> dict:
        """What `/metrics` and the server's stats show: per key, the head's version, its last held-out expected
        tokens per draft, the buffer's size; the trainer's share of a core so far (its CPU time in optimiser steps
        over the wall time since the learner was made) and failures."""
        with self._lock:
            keys = {}
            for key, state in self.keys.items():
                last = state.records[-1] if state.records else None
                keys[dir_name(key)] = {
                    "version": state.version,
                    "buffer_tokens": state.buffer.tokens,
                    "buffer_sequences": len(state.buffer.sequences),
                    "rounds": len(state.records),
                    "held_out_expected_tokens": None if last is None else round(expected_tokens(_served(last)), 4),
                    "held_out_top1": None if last is None else _served(last)["top1"],
                }
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return {
            "drafter": self.name,
            "keys": keys,
            "training_share": round(self.busy_seconds / elapsed, 4),
            "failures": self.failures,
            "last_error": self.last_error,
        }

    def report(self, key: str | None) -> dict | None:
        """What a client of history `key` may see (None for none): the trainer's state and that key's learning
        curve, each round's time, version after it, held-out expected tokens per draft of the head then in
        service and of the candidate, and whether it was swapped in (the last 100 rounds)."""
        if key is None:
            return None
        stats = self.stats()
        with self._lock:
            state = self.keys.get(key)
            curve = [
                {
                    "time": r["time"],
                    "version": r["version"],
                    "serving": round(expected_tokens(r["serving"]), 4),
                    "candidate": round(expected_tokens(r["candidate"]), 4),
                    "swapped": r["swapped"],
                    "buffer_tokens": r["buffer_tokens"],
                }
                for r in ([] if state is None else state.records[-100:])
            ]
        own = stats["keys"].get(dir_name(key), {"version": 0, "buffer_tokens": 0, "rounds": 0})
        return {**{k: v for k, v in stats.items() if k != "keys"}, "key": dir_name(key), **own, "curve": curve}


def _served(record: dict) -> dict:
    """The held-out metrics of the head in service after a round: the candidate's if it was swapped in."""
    return record["candidate"] if record["swapped"] else record["serving"]


def learn_heads(decoder, config: LearningConfig, directory: Path | None = None) -> list[HeadLearner]:
    """A learner for every EAGLE drafter of the decoder's pool, each with its own subdirectory of `directory`
    (named after the drafter), attached to the drafter; `start` them when serving starts, `close` them when it
    ends."""
    learners = []
    for name, drafter in decoder.drafters.items():
        if isinstance(drafter, EagleDrafter):
            sub = None if directory is None else Path(directory) / dir_name(name)
            learner = HeadLearner(drafter, decoder.target, config, sub)
            drafter.learn_from(learner)
            learners.append(learner)
    if not learners:
        raise ValueError("learning heads needs an EAGLE drafter in the pool (e.g. --drafters eagle,ngram,suffix)")
    return learners
