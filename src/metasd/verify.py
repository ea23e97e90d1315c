"""The acceptance rule: which drafted tokens the target keeps, and the one token it adds itself.

Greedy: the longest prefix equal to the target's argmax, then the target's argmax after it.
Sampling: speculative sampling (Leviathan, Kalman & Matias 2023, arXiv 2211.17192; Chen et al. 2023, arXiv
2302.01318): accept token x_j with probability min(1, p_j(x)/q_j(x)); at the first rejection sample from
norm(max(0, p_j - q_j)); if all k are accepted, sample the bonus token from p_k. Either way the output has exactly
the target's distribution. A drafter without q is one-hot (q(x) = 1).

Trees (`metasd.tree`): greedy follows the target's argmax down the tree as far as a child holds it. Sampling is
SpecInfer's multi-step speculative sampling (Miao et al., arXiv 2305.09781, Theorem 4.2): at a node, each branch's
proposal x (drawn from its q, or deterministic: a point mass) is tried in turn against the residual r, starting from
the target's p: accept with probability min(1, r(x)/q(x)), else r <- norm(max(0, r - q)) (for a point mass: r without
x, renormalised); if none is accepted, the token comes from r. Each emitted token has exactly the target's
distribution, whichever branches the tree holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, draw, probabilities
from .tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    """What the acceptance rule decided of a round's draft: the drafted tokens kept, the target's own token after
    them, and (a tree) the nodes that held the kept tokens."""

    accepted: int  # drafted tokens kept
    next_token: int  # the target's own token after them (correction or bonus)
    # greedy: the target's argmax at every drafted position and after (for rewards; not part of the verdict's value)
    target_tokens: list[int] | None = field(default=None, compare=False)
    # the tree nodes of the accepted tokens (a chain's are 0 .. accepted - 1)
    path: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.path is None:
            object.__setattr__(self, "path", tuple(range(self.accepted)))


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
        return Verdict(j, draw(row, generator))
    return Verdict(len(draft), draw(p[len(draft)], generator))


def verify_tree_greedy(target_logits: torch.Tensor, tree: DraftTree) -> Verdict:
    """target_logits: [1 + tree.size, V]; row 0 after the context, row 1 + i after node i."""
    choice = torch.argmax(target_logits, dim=-1).tolist()
    node, path = -1, []
    while (child := tree.child(node, choice[node + 1])) is not None:
        path.append(child)
        node = child
    return Verdict(len(path), choice[node + 1], [choice[0], *(choice[n + 1] for n in path)], tuple(path))


def verify_tree_sampling(p: torch.Tensor, tree: DraftTree, generator: torch.Generator | None) -> Verdict:
    """p: [1 + tree.size, V] target probabilities, rows as in `verify_tree_greedy`; each branch's q from its draft."""
    node, path = -1, []
    while True:
        r = p[node + 1]
        for child, branch, depth in tree.proposals(node):
            x, q = tree.tokens[child], branch.draft.q
            q_x = 1.0 if q is None else float(q[depth, x])
            u = float(torch.rand((), generator=generator))
            if q_x > 0 and u < min(1.0, float(r[x]) / q_x):
                path.append(child)
                node = child
                break
            if q is None:
                r = r.clone()
                r[x] = 0.0
            else:
                r = torch.clamp(r - q[depth], min=0.0)
            total = float(r.sum())
            r = r / total if total > 0 else p[node + 1]  # 0 only where r equalled q up to rounding
        else:
            return Verdict(len(path), draw(r, generator), None, tuple(path))


def verify_round(
    logits: torch.Tensor, tree: DraftTree, params: SamplingParams, generator: torch.Generator
) -> tuple[Verdict, torch.Tensor | None]:
    """The acceptance rule of a round over its tree, greedy or sampled as `params` say (logits already processed):
    the verdict and p (sampling only: the target's distributions at the rows of the chosen draft)."""
    p = None if params.greedy else probabilities(logits, params)
    main = tree.branches[0]
    if len(tree.branches) > 1:
        verdict = verify_tree_greedy(logits, tree) if p is None else verify_tree_sampling(p, tree, generator)
        p = None if p is None else p[[0, *(n + 1 for n in main.nodes)]]
    elif p is None:
        verdict = verify_greedy(logits, main.draft.tokens)
    else:
        verdict = verify_sampling(p, main.draft.q, main.draft.tokens, generator)
    return verdict, p
