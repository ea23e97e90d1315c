"""Training an EAGLE head on a corpus of the target's features (`corpus.py`), resumable from its checkpoint.

Loss per position i (EAGLE, arXiv 2401.15077): smooth-L1 between the predicted and the true feature f_(i+1), plus
the cross-entropy of the head's next-token distribution against the target's own (both over the draft vocabulary).
Input features get uniform noise, as EAGLE does, so the head tolerates its own imperfect predictions when drafting
several tokens from them. Sequences are right-padded into batches of similar length; causal attention keeps real
positions from ever seeing padding.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..models.eagle_head import EagleHead, TargetCheck, head_config_for, save_head
from .distill import length_batches
from .eagle_corpus import TokenFeatures


@dataclass(frozen=True)
class TrainConfig:
    epochs: float = 2.0
    lr: float = 1e-3
    batch_tokens: int = 8192
    max_length: int = 768  # positions per sequence (longer ones are cut)
    draft_vocab: int = 8192
    noise: float = 0.1  # uniform noise amplitude on input features
    feature_weight: float = 1.0
    token_weight: float = 1.0
    seed: int = 0


def draft_vocabulary(seqs: list[TokenFeatures], size: int, vocab_size: int, always: frozenset[int]) -> torch.Tensor:
    """The `size` most frequent tokens of the corpus (the target's own answers: what it will emit), plus the end of
    sequence tokens, sorted; EAGLE-3's reduced draft vocabulary."""
    counts = torch.bincount(torch.cat([s.tokens.long() for s in seqs]), minlength=vocab_size).float()
    for token in always:
        counts[token] = float("inf")
    return counts.topk(min(size, vocab_size)).indices.sort().values


def _batches(seqs: list[TokenFeatures], cfg: TrainConfig, rng: random.Random) -> list[list[int]]:
    batches = length_batches([min(len(s.tokens), cfg.max_length) for s in seqs], cfg.batch_tokens)
    rng.shuffle(batches)
    return batches


def _stack(
    seqs: list[TokenFeatures], idx: list[int], max_length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded tokens [B, n], features [B, n, d] (float32) and a mask of positions with a real feature."""
    n = min(max(len(seqs[i].tokens) for i in idx), max_length)
    d = seqs[idx[0]].features.shape[1]
    tokens = torch.zeros(len(idx), n, dtype=torch.long)
    feats = torch.zeros(len(idx), n, d)
    for row, i in enumerate(idx):
        t = seqs[i].tokens[:n]
        tokens[row, : len(t)] = t.long()
        feats[row, : len(t)] = seqs[i].features[:n].float()
    real = feats.abs().sum(-1) > 0  # positions whose feature was computed (padding and a final token's are 0)
    return tokens, feats, real


def head_loss(
    head: EagleHead,
    embed: torch.nn.Embedding,
    readout: torch.Tensor,
    tokens: torch.Tensor,
    feats: torch.Tensor,
    real: torch.Tensor,
    cfg: TrainConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss over every pair (f_i, token i+1) -> f_(i+1) whose target feature is real; readout [Vd, d]."""
    inputs = feats[:, :-1]
    if cfg.noise > 0:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * cfg.noise
    pred = head(inputs, embed(tokens[:, 1:]))
    want, mask = feats[:, 1:], real[:, 1:] & real[:, :-1]
    pred, want = pred[mask], want[mask]
    feature_loss = torch.nn.functional.smooth_l1_loss(pred, want)
    target_p = torch.softmax(want @ readout.T, dim=-1)
    logq = torch.log_softmax(pred @ readout.T, dim=-1)
    token_loss = -(target_p * logq).sum(-1).mean()
    top1 = (logq.argmax(-1) == target_p.argmax(-1)).float().mean()
    loss = cfg.feature_weight * feature_loss + cfg.token_weight * token_loss
    return loss, {"feature": feature_loss.item(), "token": token_loss.item(), "top1": top1.item()}


@torch.no_grad()
def held_out_metrics(head, embed, readout, seqs: list[TokenFeatures], cfg: TrainConfig) -> dict:
    """Losses and top-1 agreement with the target's next token on sequences kept out of training (no noise)."""
    quiet = TrainConfig(**{**asdict(cfg), "noise": 0.0})
    totals, n = {}, 0
    for idx in length_batches([min(len(s.tokens), cfg.max_length) for s in seqs], cfg.batch_tokens):
        _, metrics = head_loss(head, embed, readout, *_stack(seqs, idx, cfg.max_length), quiet)
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value * len(idx)
        n += len(idx)
    return {"sequences": len(seqs), **{k: round(v / n, 4) for k, v in totals.items()}}


def train_head(
    target,
    seqs: list[TokenFeatures],
    out: Path,
    cfg: TrainConfig,
    *,
    checkpoint: Path | None = None,
    save_every: int = 50,
    progress: Callable[[int, int, dict], None] | None = None,
) -> dict:
    """Train a head for `target` (a LoadedModel) on `seqs`, write it to `out`, and return its training summary.

    Every save_every steps (and at the end) the head, optimiser, step and random state are saved to `checkpoint`;
    a run started with the same checkpoint path resumes from it and ends where an uninterrupted run would.
    progress(step, steps, metrics) is called after each step (after its checkpoint)."""
    torch.manual_seed(cfg.seed)
    model = target.model
    held = seqs[: len(seqs) // 50]  # ~2 % kept out: the held-out check at the end
    seqs = seqs[len(held) :]
    vocab = draft_vocabulary(seqs, cfg.draft_vocab, target.vocab_size, target.eos_token_ids)
    head = EagleHead(head_config_for(model, len(vocab)), vocab)
    embed = model.get_input_embeddings().requires_grad_(False)  # the target's: gradients stop at the head
    readout = model.get_output_embeddings().weight[vocab].detach().float()
    steps_per_epoch = len(_batches(seqs, cfg, random.Random(0)))
    steps = max(1, math.ceil(cfg.epochs * steps_per_epoch))
    optim = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    step, seconds = 0, 0.0
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        if state["config"] != asdict(cfg) or state["steps"] != steps:
            raise ValueError(f"checkpoint {checkpoint} is of another training configuration; remove it to restart")
        head.load_state_dict(state["head"])
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        step, seconds = state["step"], state["seconds"]
        torch.set_rng_state(state["rng"])

    def save_checkpoint() -> None:
        if checkpoint is not None:
            tmp = checkpoint.with_suffix(".tmp")
            torch.save(
                {
                    "config": asdict(cfg),
                    "steps": steps,
                    "step": step,
                    "seconds": seconds,
                    "head": head.state_dict(),
                    "optim": optim.state_dict(),
                    "sched": sched.state_dict(),
                    "rng": torch.get_rng_state(),
                },
                tmp,
            )
            tmp.rename(checkpoint)

    head.train()
    metrics: dict[str, float] = {}
    epoch = step // steps_per_epoch
    while step < steps:
        batches = _batches(seqs, cfg, random.Random(cfg.seed + epoch))
        for idx in batches[step % steps_per_epoch :]:
            if step >= steps:
                break
            started = time.perf_counter()
            tokens, feats, real = _stack(seqs, idx, cfg.max_length)
            loss, metrics = head_loss(head, embed, readout, tokens, feats, real, cfg)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optim.step()
            sched.step()
            step += 1
            seconds += time.perf_counter() - started
            if step % save_every == 0:
                save_checkpoint()
            if progress is not None:
                progress(step, steps, metrics)
        epoch += 1
    save_checkpoint()
    head.eval()
    summary = {
        "train_config": asdict(cfg),
        "sequences": len(seqs),
        "tokens": int(sum(len(s.tokens) for s in seqs)),
        "steps": steps,
        "train_seconds": round(seconds, 1),
        "final": {k: round(v, 4) for k, v in metrics.items()},
        "held_out": held_out_metrics(head, embed, readout, held, cfg) if held else None,
    }
    save_head(out, head.eval(), target.spec, TargetCheck.of(model), summary)
    return summary
