"""The loss of an EAGLE head's training (`eagle_train`): feature regression and cross-entropy against the target's
distribution, for the first pass and each pass of EAGLE-3's training-time test (arXiv 2503.01840), with GRIFFIN's
alignment mask (arXiv 2502.11018) as an option, and the agreement metrics the held-out report reads."""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache

from ..models.eagle_head import EagleHead


class LossConfig(Protocol):
    """What the loss reads of a training's configuration (`eagle_train.TrainConfig`)."""

    noise: float
    feature_weight: float
    token_weight: float
    unroll: int
    align_top: int


def _pass_rows(
    pred: torch.Tensor, want: torch.Tensor, target_p: torch.Tensor, readout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: feature loss, token loss (cross-entropy against the target's distribution over the draft
    vocabulary [N, Vd]) and the log-probabilities [N, Vd] of predicted features [N, d] against true ones [N, d].
    Every pass reads the same target rows, so none is copied out per pass."""
    feature = torch.nn.functional.smooth_l1_loss(pred, want, reduction="none").mean(-1)
    logq = torch.log_softmax(pred @ readout.T, dim=-1)
    return feature, -(target_p * logq).sum(-1), logq


def _weighted(feature: torch.Tensor, token: torch.Tensor, rows: torch.Tensor | None, cfg: LossConfig):
    """(loss, feature loss, token loss) averaged over `rows` (all when None)."""
    if rows is not None:
        feature, token = feature[rows], token[rows]
    feature_loss, token_loss = feature.mean(), token.mean()
    return cfg.feature_weight * feature_loss + cfg.token_weight * token_loss, feature_loss, token_loss


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


def step_masks(first: torch.Tensor, unroll: int) -> list[torch.Tensor]:
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
    cfg: LossConfig,
    whole: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss over every pair (f_i, token i+1) -> f_(i+1) whose target feature is real, plus each unrolled pass's
    over the entries `step_masks` counts; readout [Vd, d]. Metrics: `top1` (a draft's first token), `top1_s` (its
    token s from the head's own entries), `both` / `chain_s` (a greedy draft's first 2 / s tokens all right), against
    the target's argmax over the draft vocabulary, or with `whole` (its readout [V, d]) over every token: a token
    outside the draft vocabulary is a miss, as in decoding."""
    inputs = feats[:, :-1]
    if cfg.noise > 0:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * cfg.noise
    preds = head_passes(head, inputs, embed(tokens[:, 1:]), cfg.unroll)
    masks = step_masks(real[:, 1:] & real[:, :-1], cfg.unroll)
    mask = masks[0]
    want = feats[:, 1:, -head.config.hidden_size :][mask]  # the final norm's output: what the readout reads
    target_p = torch.softmax(want @ readout.T, dim=-1)
    target_top = target_p.argmax(-1) if whole is None else _draft_index(head.draft_vocab, _argmax(want, whole))
    # the alignment mask's input: the token the next pass reads at each entry (entry i's prediction drafts i + 2)
    read_next = (
        _draft_index(head.draft_vocab, torch.nn.functional.pad(tokens[:, 2:], (0, 1)))[mask] if cfg.align_top else None
    )
    feature, token, logq = _pass_rows(preds[0][mask], want, target_p, readout)
    loss, feature_loss, token_loss = _weighted(feature, token, None, cfg)
    agree = logq.argmax(-1) == target_top
    metrics = {"feature": feature_loss.item(), "token": token_loss.item(), "top1": agree.float().mean().item()}
    chain = torch.zeros_like(mask)
    chain[mask] = agree
    aligned = _aligned(mask, logq, read_next, cfg.align_top)
    for step, (pred, counted) in enumerate(zip(preds[1:], masks[1:], strict=True), start=2):
        if not counted.any():  # sequences too short for this many steps
            break
        rows = counted[mask]  # this pass's rows among the first's: the same targets, computed once
        feature, token, logq = _pass_rows(pred[mask], want, target_p, readout)
        trained = rows if aligned is None else rows & _shifted(aligned)[mask]
        if trained.any():
            loss = loss + _weighted(feature, token, trained, cfg)[0]
        agree_s = (logq.argmax(-1) == target_top)[rows]
        right = torch.zeros_like(mask)
        right[counted] = agree_s
        chain = _shifted(chain) & right  # entry i: the draft after entry i - step + 1 right up to its token `step`
        metrics[f"top1_{step}"] = agree_s.float().mean().item()
        metrics["both" if step == 2 else f"chain_{step}"] = chain.sum().item() / int(counted.sum())
        if aligned is not None:
            aligned = _shifted(aligned) & _aligned(mask, logq, read_next, cfg.align_top)
    return loss, metrics


def _aligned(mask: torch.Tensor, logq: torch.Tensor, read_next: torch.Tensor | None, top: int) -> torch.Tensor | None:
    """GRIFFIN's token alignment (Hu et al., arXiv 2502.11018): the entries [B, n] whose prediction holds, among
    its `top` likeliest draft tokens, the token the next pass reads as its input. A later pass only trains where
    every earlier one was aligned so: elsewhere drafting never reaches that step with the input the training text
    gives it, and fitting it there pulls the head towards contexts it will not see. None when `top` is 0 (off)."""
    if top <= 0:
        return None
    held = (logq.topk(min(top, logq.shape[-1]), dim=-1).indices == read_next[:, None]).any(-1)
    out = torch.zeros_like(mask)
    out[mask] = held & (read_next >= 0)
    return out


def _argmax(features: torch.Tensor, readout: torch.Tensor) -> torch.Tensor:
    """The target's argmax at each row of final-norm `features` [N, d], in the readout's dtype, by blocks of rows."""
    return torch.cat([(block.to(readout.dtype) @ readout.T).argmax(-1) for block in features.split(1024)])


def _draft_index(vocab: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each token's index in the sorted draft vocabulary, -1 where it is not in it."""
    at = torch.searchsorted(vocab, tokens).clamp(max=len(vocab) - 1)
    return torch.where(vocab[at] == tokens, at, -1)
