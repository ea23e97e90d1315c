"""Per-round rewards for the drafter-selection bandit, each in [0, 1].

`bd` (block divergence, MetaSD, arXiv 2604.05417): mean over the k requested positions of 1 - TV(p_j, q_j). It uses
every drafted position, also those after the first rejection, so it is a denser, lower-variance signal than `be`.
`be` (block efficiency, the paper's baseline reward): accepted / k.
`bd-cost` (ours): the paper's rewards ignore what a draft costs, so a slow drafter with slightly better alignment
wins over a free one. This one estimates tokens per unit time: the tokens a round is expected to yield under BD,
(1 + k * BD) / (k + 1), times the share of the round spent verifying, t_verify / (t_draft + t_verify). A free drafter
keeps its BD-based value; one whose draft costs as much as the verification is halved.
`be-cost` (ours): the same with the tokens the round did yield, (1 + accepted) / (k + 1). Unlike BD it can be
computed in hindsight for a drafter that did not draft, from the verified tokens alone (full-information feedback).
"""

from __future__ import annotations

import torch


def block_divergence(
    p: torch.Tensor | None, q: torch.Tensor | None, draft: list[int], k: int, target_tokens: list[int] | None = None
) -> float:
    """p: [>= len(draft), V] target probabilities at the drafted positions; q: [len(draft), V] or None.

    For a drafter without q (one-hot on its token x_j), 1 - TV(p_j, q_j) = p_j(x_j). Positions the drafter did not
    fill (a short or empty draft) count as 0: proposing nothing earns nothing.

    target_tokens (greedy decoding, p unused): the target's argmax at each drafted position. Under greedy decoding
    p and q are the distributions decoding actually uses: point masses at the target's and the drafter's argmax (a
    drafter's tokens are its argmax). BD is then the share of the k positions whose drafted token equals the
    target's argmax, counted past the first rejection too, on one scale for every kind of drafter. (Scoring the
    temperature-1 distributions instead would give a drafter of exactly the target's greedy tokens the target's
    probability of its argmax, often well below 1, when it sends tokens only, and 1.0 when it sends q: a scale that
    depends on the drafter's kind, not on its drafts.)
    """
    if k <= 0 or not draft:
        return 0.0
    m = len(draft)
    if target_tokens is not None:
        return sum(a == b for a, b in zip(draft, target_tokens, strict=False)) / k
    if q is None:
        overlap = p[torch.arange(m), torch.tensor(draft)]
    else:
        overlap = torch.minimum(p[:m], q).sum(-1)  # 1 - TV(p, q) = sum_x min(p(x), q(x))
    return float(overlap.clamp(0.0, 1.0).sum()) / k


def block_efficiency(accepted: int, k: int) -> float:
    """The share of the k requested positions the round accepted (MetaSD's baseline reward; 0 for k = 0)."""
    return accepted / k if k > 0 else 0.0


def per_time(tokens: float, k: int, draft_time: float, verify_time: float) -> float:
    """Tokens a round yields, as a share of the k + 1 possible, per unit of round time measured in verifications."""
    total = draft_time + verify_time
    return tokens / (k + 1) * (verify_time / total if total > 0 else 1.0)


REWARDS = ("bd", "be", "bd-cost", "be-cost")


def reward(
    kind: str,
    p: torch.Tensor | None,
    q: torch.Tensor | None,
    draft: list[int],
    accepted: int,
    k: int,
    draft_time: float = 0.0,
    verify_time: float = 1.0,
    target_tokens: list[int] | None = None,
) -> float:
    """One round's reward; under greedy decoding pass target_tokens (the target's argmax per position), not p."""
    if kind == "bd":
        return block_divergence(p, q, draft, k, target_tokens)
    if kind == "be":
        return block_efficiency(accepted, k)
    if kind == "bd-cost":
        return per_time(1 + k * block_divergence(p, q, draft, k, target_tokens), k, draft_time, verify_time)
    if kind == "be-cost":
        return per_time(1 + accepted, k, draft_time, verify_time)
    raise ValueError(f"unknown reward {kind!r}; choose one of {REWARDS}")
