"""Training an EAGLE head on a corpus of the target's features (`corpus.py`), resumable from its checkpoint.

Loss per position i (EAGLE, arXiv 2401.15077): smooth-L1 between the predicted and the true feature f_(i+1), plus
the cross-entropy of the head's next-token distribution against the target's own (both over the draft vocabulary).
Input features get uniform noise, as EAGLE does, so the head tolerates its own imperfect predictions when drafting
several tokens from them. With `unroll` = s > 1 the head also trains on its own predictions, as drafting uses them
(EAGLE-3's training-time test, arXiv 2503.01840): pass s feeds entry i pass s - 1's predicted feature of
position i (from entry i - 1) instead of the true one, attending to the true entries up to i - s + 1 and to its own
chain of predicted entries, as the step drafting token s does, and adds that pass's loss. With `feature_layers` the
true features the head reads are fused from those decoder layers' outputs and the final norm's (EAGLE-3); the
feature it predicts, and the distribution it learns, stay the final norm's. Sequences are right-padded into batches
of similar length; causal attention keeps real positions from ever seeing padding.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from ..models.eagle_head import EagleHead, TargetCheck, head_config_for, save_head
from .distill import length_batches
from .eagle_corpus import TokenFeatures

MAX_UNROLL = 8  # EAGLE-3's recipes unroll up to 7-8 steps


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
    unroll: int = 1  # passes: from 2 on, also train on the head's own predicted features (training-time test)
    feature_layers: tuple[int, ...] = ()  # decoder layers fused with the final norm's output (EAGLE-3)
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
    """Right-padded tokens [B, n], features [B, n, D] (float32) and a mask of positions with a real feature."""
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


def _pass_loss(
    pred: torch.Tensor, want: torch.Tensor, target_p: torch.Tensor, readout: torch.Tensor, cfg: TrainConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, feature loss, token loss, per-row agreement of the argmax with the target's) for predicted features
    [N, d] against true ones [N, d] and the target's distributions over the draft vocabulary [N, Vd]."""
    feature_loss = torch.nn.functional.smooth_l1_loss(pred, want)
    logq = torch.log_softmax(pred @ readout.T, dim=-1)
    token_loss = -(target_p * logq).sum(-1).mean()
    agree = logq.argmax(-1) == target_p.argmax(-1)
    return cfg.feature_weight * feature_loss + cfg.token_weight * token_loss, feature_loss, token_loss, agree


def _step_mask(n: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, 1, n, step * n] additive mask of unrolled pass `step` (2, 3, ...) over the keys of passes 1 .. step: its
    entry i sees the first pass's (true) entries j <= i - step + 1 and, of each later pass k, entry i - step + k,
    nothing else: what the step drafting token `step` of a draft after true entry i - step + 1 sees in the head's
    cache (the true context, then the head's own entries for the tokens drafted before it)."""
    i = torch.arange(n, device=device)
    blocks = [i[None, :] <= i[:, None] - step + 1]
    blocks += [i[None, :] == i[:, None] - step + k for k in range(2, step + 1)]
    allowed = torch.cat(blocks, dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _shifted(x: torch.Tensor) -> torch.Tensor:
    """x moved one entry right along dim 1 (entry i holds entry i - 1's), the first entry zero."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def _step_masks(first: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """Per pass, the entries it counts: pass 1 those with a real target; pass s those whose s - 1 predecessors
    were counted too (a draft of s tokens after a real entry)."""
    masks = [first]
    for _ in range(1, unroll):
        masks.append(masks[-1] & _shifted(masks[-1]))
    return masks


def head_passes(head: EagleHead, inputs: torch.Tensor, embeds: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """The head's predictions [B, n, d] per pass: pass 1 from entries (inputs_i [D], fused; embeds_i); pass s > 1
    (EAGLE-3's training-time test, as deep as drafts go) from entries (pass s - 1's prediction of f_i, embeds_i),
    each attending as `_step_mask` says (entries with no such predecessor are not steps drafting makes; the loss
    leaves them out)."""
    cache = DynamicCache(config=head.body.config) if unroll > 1 else None
    preds = [head(head.fuse(inputs), embeds, cache=cache)]
    b, n = preds[0].shape[:2]
    positions = torch.arange(n, device=preds[0].device).expand(b, n)
    for step in range(2, unroll + 1):
        mask = _step_mask(n, step, preds[0].dtype, preds[0].device).expand(b, 1, n, step * n)
        preds.append(head(_shifted(preds[-1]), embeds, cache=cache, position_ids=positions, attention_mask=mask))
    return preds


def head_loss(
    head: EagleHead,
    embed: torch.nn.Embedding,
    readout: torch.Tensor,
    tokens: torch.Tensor,
    feats: torch.Tensor,
    real: torch.Tensor,
    cfg: TrainConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss over every pair (f_i, token i+1) -> f_(i+1) whose target feature is real, plus each unrolled pass's
    over the entries `_step_masks` counts; readout [Vd, d]. Metrics: `top1` (a draft's first token), `top1_s` (its
    token s from the head's own entries), `both` / `chain_s` (a greedy draft's first 2 / s tokens all right)."""
    inputs = feats[:, :-1]
    if cfg.noise > 0:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * cfg.noise
    preds = head_passes(head, inputs, embed(tokens[:, 1:]), cfg.unroll)
    masks = _step_masks(real[:, 1:] & real[:, :-1], cfg.unroll)
    mask = masks[0]
    want = feats[:, 1:, -head.config.hidden_size :][mask]  # the final norm's output: what the readout reads
    target_p = torch.softmax(want @ readout.T, dim=-1)
    loss, feature_loss, token_loss, agree = _pass_loss(preds[0][mask], want, target_p, readout, cfg)
    metrics = {"feature": feature_loss.item(), "token": token_loss.item(), "top1": agree.float().mean().item()}
    chain = torch.zeros_like(mask)
    chain[mask] = agree
    for step, (pred, counted) in enumerate(zip(preds[1:], masks[1:], strict=True), start=2):
        if not counted.any():  # sequences too short for this many steps
            break
        rows = counted[mask]  # this pass's rows among the first's: the same targets, computed once
        loss_s, _, _, agree_s = _pass_loss(pred[counted], want[rows], target_p[rows], readout, cfg)
        loss = loss + loss_s
        right = torch.zeros_like(mask)
        right[counted] = agree_s
        chain = _shifted(chain) & right  # entry i: the draft after entry i - step + 1 right up to its token `step`
        metrics[f"top1_{step}"] = agree_s.float().mean().item()
        metrics["both" if step == 2 else f"chain_{step}"] = chain.sum().item() / int(counted.sum())
    return loss, metrics


def held_out_split(seqs: list[TokenFeatures]) -> tuple[list[TokenFeatures], list[TokenFeatures]]:
    """(held out, trained on): the first ~2 % of the sequences are kept out of training."""
    held = seqs[: len(seqs) // 50]
    return held, seqs[len(held) :]


@torch.no_grad()
def held_out_metrics(head, embed, readout, seqs: list[TokenFeatures], cfg: TrainConfig) -> dict:
    """Losses and top-1 agreement with the target's next token on sequences kept out of training (no noise): from
    true features (`top1`, a draft's first token), from the head's own prediction of the previous feature
    (`top1_2`, a second token's step) and both in a row (`both`: a greedy draft's first two tokens accepted),
    whatever the head was trained with; each averaged over the positions it counts."""
    quiet = TrainConfig(**{**asdict(cfg), "noise": 0.0, "unroll": max(cfg.unroll, 2)})
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for idx in length_batches([min(len(s.tokens), cfg.max_length) for s in seqs], cfg.batch_tokens):
        tokens, feats, real = _stack(seqs, idx, cfg.max_length)
        _, metrics = head_loss(head, embed, readout, tokens, feats, real, quiet)
        counted = [int(m.sum()) for m in _step_masks(real[:, 1:] & real[:, :-1], quiet.unroll)]
        for key, value in metrics.items():
            step = 2 if key == "both" else int(key.rpartition("_")[2]) if "_" in key else 1  # top1_3, chain_3
            totals[key] = totals.get(key, 0.0) + value * counted[step - 1]
            counts[key] = counts.get(key, 0) + counted[step - 1]
    return {"sequences": len(seqs), **{k: round(totals[k] / max(1, counts[k]), 4) for k in totals}}


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
    if cfg.feature_layers and (cfg.unroll < 2 or list(cfg.feature_layers) != sorted(set(cfg.feature_layers))):
        raise ValueError(
            "fused features need the training-time test (unroll >= 2: from its second draft token on, the head "
            "reads its own predictions, not fused features) and their layers sorted, each once"
        )
    if not 1 <= cfg.unroll <= MAX_UNROLL:
        raise ValueError(f"unroll must be 1 .. {MAX_UNROLL}, got {cfg.unroll}")
    width = (len(cfg.feature_layers) + 1) * model.config.hidden_size
    if any(s.features.shape[1] != width for s in seqs):
        raise ValueError(
            f"the corpus's features are not the final norm's and decoder layers {list(cfg.feature_layers)}' outputs "
            f"({width} columns); read it with read_corpus(dir, feature_layers)"
        )
    held, seqs = held_out_split(seqs)
    vocab = draft_vocabulary(seqs, cfg.draft_vocab, target.vocab_size, target.eos_token_ids)
    head = EagleHead(head_config_for(model, len(vocab), cfg.feature_layers), vocab)
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
        # a setting the checkpoint predates had its default then
        if {**asdict(TrainConfig()), **state["config"]} != asdict(cfg) or state["steps"] != steps:
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
