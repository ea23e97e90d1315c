"""The acceptance rule: which drafted tokens the target keeps, and the one token it adds itself.

Greedy: the longest prefix equal to the target's argmax, then the target's argmax after it.
Sampling: speculative sampling (Leviathan, Kalman & Matias 2023, arXiv 2211.17192; Chen et al. 2023, arXiv
2302.01318): accept token x_j with probability min(1, p_j(x)/q_j(x)); at the first rejection sample from
norm(max(0, p_j - q_j)); if all k are accepted, sample the bonus token from p_k. Either way the output has exactly
the target's distribution. A drafter without q is one-hot (q(x) = 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafted tokens kept
    next_token: int  # the target's own token after them (correction or bonus)
    # greedy: the target's argmax at every drafted position and after (for rewards; not part of the verdict's value)
    target_tokens: list[int] | None = field(default=None, compare=False)


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> Verdict:
    """target_logits: [len(draft) + 1, V] raw logits, row j predicting the token at draft position j."""
    choice = torch.argmax(target_logits, dim=-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == choice[n]:
        n += 1
    return Verdict(n, choice[n], choice)


def verify_sampling(
    p: torch.Tensor, q: torch.Tensor | None, draft: list[int], generator: torch.Generator | None
) -> Verdict:
    """p: [len(draft) + 1, V] target probabilities; q: [len(draft), V] drafter probabilities or None (one-hot)."""
    for j, token in enumerate(draft):
        p_x = float(p[j, token])
        q_x = 1.0 if q is None else float(q[j, token])
        u = float(torch.rand((), generator=generator))
        if q_x > 0 and u < min(1.0, p_x / q_x):
            continue
        if q is None:
            residual = p[j].clone()
            residual[token] = 0.0
        else:
            residual = torch.clamp(p[j] - q[j], min=0.0)
        total = float(residual.sum())
        # total == 0 only if p == q up to rounding, where a rejection has probability ~0: fall back to p
        row = residual / total if total > 0 else p[j]
        return Verdict(j, int(torch.multinomial(row, 1, generator=generator)))
    return Verdict(len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator)))
