"""Training an EAGLE head on the target's features (`eagle_sequences`: stored or prefilled), resumable from its
checkpoint.

Loss per position i (EAGLE, arXiv 2401.15077): smooth-L1 between the predicted and the true feature f_(i+1), plus
the cross-entropy of the head's next-token distribution against the target's own (both over the draft vocabulary).
Input features get uniform noise, as EAGLE does, so the head tolerates its own imperfect predictions when drafting
several tokens from them. With `unroll` = s > 1 the head also trains on its own predictions, as drafting uses them
(EAGLE-3's training-time test, arXiv 2503.01840): pass s feeds entry i pass s - 1's predicted feature of
position i (from entry i - 1) instead of the true one, attending to the true entries up to i - s + 1 and to its own
chain of predicted entries, as the step drafting token s does, and adds that pass's loss. With `feature_layers` the
true features the head reads are fused from those decoder layers' outputs and the final norm's (EAGLE-3); the
feature it predicts, and the distribution it learns, stay the final norm's. Sequences are right-padded into batches
of similar length; causal attention keeps real positions from ever seeing padding. The loss itself: `eagle_loss`.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..files import written_aside
from ..models.eagle_head import EagleHead, TargetCheck, grown, head_config_for, head_fingerprint, save_head
from .eagle_loss import head_loss, step_masks
from .eagle_sequences import TrainingSequences
from .length_batches import length_batches

MAX_UNROLL = 8  # EAGLE-3's recipes unroll up to 7-8 steps
_LEARNING_KEYS = ("step", "tokens_seen", "train_seconds", "final", "held_out")


@dataclass(frozen=True)
class TrainConfig:
    """How a head trains: epochs, peak learning rate, batch size in tokens, sequence length, draft vocabulary,
    input noise, the loss weights, the training-time test's depth (`unroll`), fused layers, the alignment mask
    (`align_top`, 0 = off), seed, bfloat16 autocast, and the head's own decoder layers (`head_layers`)."""

    epochs: float = 2.0
    lr: float = 1e-3
    batch_tokens: int = 8192
    max_length: int = 768  # positions per sequence (longer ones are cut)
    draft_vocab: int = 8192
    noise: float = 0.1  # uniform noise amplitude on input features
    feature_weight: float = 1.0
    token_weight: float = 1.0
    unroll: int = 1  # passes: from 2 on, also train on the head's own predicted features (training-time test)
    feature_layers: tuple[int, ...] = ()  # decoder layers fused with the final norm's output (EAGLE-3)
    align_top: int = 0  # GRIFFIN's loss mask: pass s trains only where passes 1 .. s-1 held their token in top-k
    seed: int = 0
    autocast: bool = False  # the head's matmuls in bfloat16 (weights and optimiser stay float32)
    # the head's decoder layers (`HeadConfig.decoder_layers`; a head to start from grows to them: `eagle_head.grown`);
    # None: the head to start from's, else 1
    head_layers: int | None = None
    grown_lr: float | None = None  # peak learning rate of the layers a head to start from grows (None: `lr`)


def draft_vocabulary(seqs: TrainingSequences, size: int, vocab_size: int, always: frozenset[int]) -> torch.Tensor:
    """The `size` most frequent tokens of the corpus (the target's own answers: what it will emit), plus the end of
    sequence tokens, sorted; EAGLE-3's reduced draft vocabulary."""
    tokens = torch.cat([seqs.tokens(i).long() for i in range(len(seqs))])
    counts = torch.bincount(tokens, minlength=vocab_size).float()
    for token in always:
        counts[token] = float("inf")
    return counts.topk(min(size, vocab_size)).indices.sort().values


def _lengths(seqs: TrainingSequences, cfg: TrainConfig) -> list[int]:
    return [min(len(seqs.tokens(i)), cfg.max_length) for i in range(len(seqs))]


def _batches(seqs: TrainingSequences, cfg: TrainConfig, rng: random.Random) -> list[list[int]]:
    batches = length_batches(_lengths(seqs, cfg), cfg.batch_tokens)
    rng.shuffle(batches)
    return batches


def held_out_split(seqs: TrainingSequences) -> tuple[TrainingSequences, TrainingSequences]:
    """(held out, trained on): the first ~2 % of the sequences are kept out of training."""
    held = seqs[: len(seqs) // 50]
    return held, seqs[len(held) :]


@torch.no_grad()
def held_out_metrics(
    head, embed, readout, seqs: TrainingSequences, cfg: TrainConfig, whole: torch.Tensor | None = None
) -> dict:
    """Losses and top-1 agreement with the target's next token on sequences kept out of training (no noise): from
    true features (`top1`, a draft's first token), from the head's own prediction of the previous feature
    (`top1_2`, a second token's step) and both in a row (`both`: a greedy draft's first two tokens accepted),
    whatever the head was trained with; each averaged over the positions it counts. With `whole` (the target's
    readout over its whole vocabulary) a token the target picks outside the draft vocabulary counts as a miss."""
    quiet = TrainConfig(**{**asdict(cfg), "noise": 0.0, "unroll": max(cfg.unroll, 2)})
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for idx in length_batches(_lengths(seqs, cfg), cfg.batch_tokens):
        tokens, feats, real = seqs.stack(idx, cfg.max_length)
        _, metrics = head_loss(head, embed, readout, tokens, feats, real, quiet, whole)
        counted = [int(m.sum()) for m in step_masks(real[:, 1:] & real[:, :-1], quiet.unroll)]
        for key, value in metrics.items():
            step = 2 if key == "both" else int(key.rpartition("_")[2]) if "_" in key else 1  # top1_3, chain_3
            totals[key] = totals.get(key, 0.0) + value * counted[step - 1]
            counts[key] = counts.get(key, 0) + counted[step - 1]
    return {"sequences": len(seqs), **{k: round(totals[k] / max(1, counts[k]), 4) for k in totals}}


def check_init(init: EagleHead | None, cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its head's depth settled (`head_layers`: given, else the head to start from's, else 1); a
    ValueError for a head to start from that reads other feature layers than `cfg` or has more decoder layers than
    it trains, and for a rate of grown layers where none grow. Cheap: `metasd train-eagle` asks before it writes a
    corpus."""
    had = init.config.decoder_layers if init is not None else None
    cfg = replace(cfg, head_layers=cfg.head_layers or had or 1)
    if init is not None and tuple(init.config.feature_layers) != tuple(cfg.feature_layers):
        raise ValueError(
            f"the head to start from (--init) reads layers {list(init.config.feature_layers)}, the training "
            f"{list(cfg.feature_layers)}: train it with the --feature-layers it was made with"
        )
    if had is not None and had > cfg.head_layers:
        raise ValueError(
            f"the head to start from (--init) has {had} decoder layers: a training can grow a head, not cut it "
            f"(--head-layers {cfg.head_layers})"
        )
    if cfg.grown_lr is not None and (had is None or had == cfg.head_layers):
        raise ValueError("a rate of grown layers (--grown-lr) needs a head to start from (--init) that grows")
    return cfg


def _check_config(cfg: TrainConfig, hidden_size: int, *corpora: TrainingSequences | None) -> None:
    """Refuse fused features without the training-time test or with their layers unsorted, an unroll out of range,
    an alignment mask with nothing to mask, and a corpus whose features are not those `cfg` reads."""
    if cfg.feature_layers and (cfg.unroll < 2 or list(cfg.feature_layers) != sorted(set(cfg.feature_layers))):
        raise ValueError(
            "fused features need the training-time test (unroll >= 2: from its second draft token on, the head "
            "reads its own predictions, not fused features) and their layers sorted, each once"
        )
    if not 1 <= cfg.unroll <= MAX_UNROLL:
        raise ValueError(f"unroll must be 1 .. {MAX_UNROLL}, got {cfg.unroll}")
    if cfg.align_top < 0 or (cfg.align_top and cfg.unroll < 2):
        raise ValueError(f"align_top masks unrolled passes: 0 (off) or >= 1 with unroll >= 2, got {cfg.align_top}")
    width = (len(cfg.feature_layers) + 1) * hidden_size
    if any(s.feature_width() != width for s in corpora if s is not None and len(s)):
        raise ValueError(
            f"the corpus's features are not the final norm's and decoder layers {list(cfg.feature_layers)}' outputs "
            f"({width} columns); read it with read_corpus(dir, feature_layers)"
        )


def _optimiser(
    head: EagleHead, lr: float, steps: int, new_layers: int = 0, new_lr: float | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW at peak rate `lr` (the last `new_layers` decoder layers at `new_lr`: layers that start as the identity
    move only as far as their rate takes them), warmed up over the first ~5 % of the steps, with a cosine decay
    to 0."""
    layers = head.body.layers
    new = {id(p) for layer in layers[len(layers) - new_layers :] for p in layer.parameters()}
    groups = [{"params": [p for p in head.parameters() if id(p) not in new], "lr": lr}]
    if new:
        groups.append(
            {"params": [p for p in head.parameters() if id(p) in new], "lr": lr if new_lr is None else new_lr}
        )
    optim = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    return optim, sched


@dataclass
class _Training:
    """A head in training on `seqs`, reported on `held`. Its checkpoint holds what a resumed run needs to end where
    an uninterrupted one would: the head, optimiser and schedule, the step, the time, the positions seen and the
    random state (with the configuration and step count it belongs to)."""

    head: EagleHead
    embed: torch.nn.Module
    readout: torch.Tensor
    whole: torch.Tensor  # the target's readout over its whole vocabulary: held-out agreement with its true argmax
    seqs: TrainingSequences
    held: TrainingSequences
    cfg: TrainConfig
    steps: int
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    step: int = 0
    seconds: float = 0.0
    seen: int = 0  # real positions trained on
    init: str | None = None  # the fingerprint of the head it started from (None: a new head)

    def load(self, checkpoint: Path) -> None:
        state = torch.load(checkpoint, weights_only=False)
        # a setting the checkpoint predates had its default then (and every head had one decoder layer)
        then = asdict(replace(TrainConfig(), head_layers=1))
        same = {**then, **state["config"]} == asdict(self.cfg) and state["steps"] == self.steps
        if not same or state.get("init") != self.init:
            raise ValueError(
                f"checkpoint {checkpoint} is of another training (configuration or the head it started from); "
                "remove it to restart, or give the new phase its own --out"
            )
        self.head.load_state_dict(state["head"])
        self.optim.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])
        self.step, self.seconds, self.seen = state["step"], state["seconds"], state.get("tokens_seen", 0)
        torch.set_rng_state(state["rng"])

    def save(self, checkpoint: Path | None) -> None:
        if checkpoint is None:
            return
        with written_aside(checkpoint) as aside:
            torch.save(
                {
                    "config": asdict(self.cfg),
                    "steps": self.steps,
                    "step": self.step,
                    "seconds": self.seconds,
                    "tokens_seen": self.seen,
                    "init": self.init,
                    "head": self.head.state_dict(),
                    "optim": self.optim.state_dict(),
                    "sched": self.sched.state_dict(),
                    "rng": torch.get_rng_state(),
                },
                aside,
            )

    def train_step(self, idx: list[int]) -> dict[str, float]:
        """One optimiser step on the sequences `idx` (reading or computing their features counts in its time);
        the step's metrics."""
        started = time.perf_counter()
        tokens, feats, real = self.seqs.stack(idx, self.cfg.max_length)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.autocast):
            loss, metrics = head_loss(self.head, self.embed, self.readout, tokens, feats, real, self.cfg)
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optim.step()
        self.sched.step()
        self.step, self.seen = self.step + 1, self.seen + int(real.sum())
        self.seconds += time.perf_counter() - started
        return metrics

    def summary(self, metrics: dict[str, float]) -> dict:
        """The training summary: configuration, data, progress, the last step's metrics and the held-out ones."""
        self.head.eval()
        measured = (
            held_out_metrics(self.head, self.embed, self.readout, self.held, self.cfg, self.whole)
            if len(self.held)
            else None
        )
        self.head.train()
        return {
            "train_config": asdict(self.cfg),
            "sequences": len(self.seqs),
            "tokens": sum(len(self.seqs.tokens(i)) for i in range(len(self.seqs))),
            "steps": self.steps,
            "step": self.step,
            "tokens_seen": self.seen,
            "train_seconds": round(self.seconds, 1),
            "final": {k: round(v, 4) for k, v in metrics.items()},
            "held_out": measured,
        }


def _record_learning(training: _Training, target, out: Path, metrics: dict[str, float]) -> None:
    """Write the head so far to `out` and append its held-out metrics to out/learning.jsonl: a learning curve, and a
    usable head while a long run goes on."""
    record = training.summary(metrics)
    save_head(out, training.head.eval(), target.spec, TargetCheck.of(target.model), record)
    training.head.train()
    with open(out / "learning.jsonl", "a", encoding="utf-8") as log:
        log.write(json.dumps({k: record[k] for k in _LEARNING_KEYS}) + "\n")


def train_head(
    target,
    seqs: TrainingSequences,
    out: Path,
    cfg: TrainConfig,
    *,
    held_out: TrainingSequences | None = None,
    checkpoint: Path | None = None,
    save_every: int = 50,
    evaluate_every: int | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
    init: EagleHead | None = None,
) -> dict:
    """Train a head for `target` (a LoadedModel) on `seqs`, write it to `out`, and return its training summary.

    held_out: the sequences whose metrics are reported (default: the first ~2 % of `seqs`, then left out).
    Every save_every steps (and at the end) the head, optimiser, step and random state are saved to `checkpoint`;
    a run started with the same checkpoint path resumes from it and ends where an uninterrupted run would.
    Every evaluate_every steps the head is written to `out` and its held-out metrics appended to
    out/learning.jsonl (a learning curve, and a usable head while a long run goes on).
    progress(step, steps, metrics) is called after each step (after its checkpoint).
    init: a head to start from (its weights and draft vocabulary; its fused layers must be `cfg`'s) instead of a new
    one: a later phase of a long training, or a domain's head grown from a general one; with fewer decoder layers
    than `cfg.head_layers` it grows to them, the new ones starting as the identity."""
    torch.manual_seed(cfg.seed)
    model = target.model
    cfg = check_init(init, cfg)
    _check_config(cfg, model.config.hidden_size, seqs, held_out)
    held, seqs = (held_out, seqs) if held_out is not None else held_out_split(seqs)
    if init is None:
        vocab = draft_vocabulary(seqs, cfg.draft_vocab, target.vocab_size, target.eos_token_ids)
        head = EagleHead(head_config_for(model, len(vocab), cfg.feature_layers, cfg.head_layers), vocab)
    else:
        head = grown(init, cfg.head_layers).float()
        vocab = head.draft_vocab
        cfg = replace(cfg, draft_vocab=len(vocab))  # the record says what the head has
    embed = model.get_input_embeddings().requires_grad_(False)  # the target's: gradients stop at the head
    whole = model.get_output_embeddings().weight.detach()
    readout = whole[vocab].float()
    steps_per_epoch = len(_batches(seqs, cfg, random.Random(0)))
    steps = max(1, math.ceil(cfg.epochs * steps_per_epoch))
    grew = 0 if init is None else cfg.head_layers - init.config.decoder_layers
    optimiser = _optimiser(head, cfg.lr, steps, grew, cfg.grown_lr)
    training = _Training(head, embed, readout, whole, seqs, held, cfg, steps, *optimiser)
    training.init = None if init is None else head_fingerprint(init)
    if checkpoint is not None and checkpoint.is_file():
        training.load(checkpoint)
    head.train()
    metrics: dict[str, float] = {}
    epoch = training.step // steps_per_epoch
    while training.step < steps:
        batches = _batches(seqs, cfg, random.Random(cfg.seed + epoch))
        for idx in batches[training.step % steps_per_epoch :]:
            if training.step >= steps:
                break
            metrics = training.train_step(idx)
            step = training.step
            evaluating = bool(evaluate_every) and step % evaluate_every == 0 and step < steps
            if step % save_every == 0 or evaluating:
                training.save(checkpoint)
            if evaluating:
                _record_learning(training, target, out, metrics)
            if progress is not None:
                progress(step, steps, metrics)
        epoch += 1
    training.save(checkpoint)
    record = training.summary(metrics)
    save_head(out, head.eval(), target.spec, TargetCheck.of(model), record)
    return record
