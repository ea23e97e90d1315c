"""Which branches to verify beside a round's chosen draft, as one token tree (`metasd.tree`).

Several drafters' proposals merged into one tree as in SpecInfer (Miao et al., arXiv 2305.09781), a model draft's
runners-up as its siblings as in EAGLE-2 (Li et al., arXiv 2406.16858), and the tree grown greedily by net gain: a
new node is worth the chance that its path is accepted, its parent's reach times its own acceptance (capped by what
the parent's other children already claim, since at most one child is right), against the extra verification
T(M + e) - T(M) at the round's bar (`stop_rule.net_gains`). The offers and their conditional acceptance come from
the policy (`AdaptivePolicy.branches`).

Glossary: *reach* of a node, the chance that the path to it is accepted; *claim* of a node, the acceptance its
children already hold between them; an *offer*, (drafter, draft, conditional acceptance of each token).
"""

from __future__ import annotations

import numpy as np

from ..costs import CostModel
from ..draft import Draft
from ..tree import DraftTree
from .stop_rule import net_gains

Offer = tuple[int, Draft, np.ndarray]  # (drafter, draft, conditional acceptance of each of its tokens)


def grow(
    tree: DraftTree, main_rates: np.ndarray, offers: list[Offer], costs: CostModel, bar: float, max_nodes: int
) -> list[tuple[int, Draft]]:
    """The offers worth verifying in `tree` (whose one branch is the chosen draft, accepted at `main_rates`), each
    cut where its next token stops paying, best first, while the tree holds at most `max_nodes` nodes."""
    offers = list(offers)
    main = tree.branches[0]
    reach: list[float] = []  # per node: the chance that its path is accepted
    taken: dict[int, float] = {}  # per node (-1: the root): the acceptance its children already claim
    _claim(tree, main.draft.tokens, main_rates, reach, taken)
    tree, out = tree.copy(), []
    while offers:
        size, best = tree.size, (0.0, -1, 0)
        for i, (_, draft, rates) in enumerate(offers):
            start, own, shared = _new_nodes(tree, draft.tokens, rates, reach, taken, max_nodes - size)
            if len(own):
                verify = np.array([costs.target(size + 1 + e) for e in range(len(own) + 1)])
                net = net_gains(start, own, verify[1:] - verify[0], bar)
                e = int(np.argmax(net))
                if net[e] > best[0]:
                    best = (float(net[e]), i, shared + e + 1)
        if best[1] < 0:
            break
        arm, draft, rates = offers.pop(best[1])
        out.append((arm, draft.truncated(best[2])))
        tree.add(arm, out[-1][1])
        _claim(tree, out[-1][1].tokens, rates, reach, taken)
    return out


def whole(tree: DraftTree, proposals: list[tuple[int, Draft]], max_nodes: int) -> list[tuple[int, Draft]]:
    """Every proposal that adds a node, whole or cut to what still fits in `max_nodes` (`tree=2`)."""
    tree, out = tree.copy(), []
    for arm, draft in proposals:
        n = _fitting(tree, draft.tokens, max_nodes - tree.size)
        if n and tree.new_nodes(draft.tokens[:n]):
            out.append((arm, draft.truncated(n)))
            tree.add(*out[-1])
    return out


def _claim(tree: DraftTree, tokens: list[int], rates: np.ndarray, reach: list[float], taken: dict) -> None:
    """Record the reach of the nodes a branch with these tokens (already in the tree) added, in node order."""
    parent = -1
    for token, rate in zip(tokens, rates[: len(tokens)], strict=True):
        node = tree.child(parent, token)
        if node >= len(reach):
            own = min(float(rate), max(0.0, 1.0 - taken.get(parent, 0.0)))
            reach.append((reach[parent] if parent >= 0 else 1.0) * own)
            taken[parent] = taken.get(parent, 0.0) + own
        parent = node


def _new_nodes(
    tree: DraftTree, tokens: list[int], rates: np.ndarray, reach: list[float], taken: dict, room: int
) -> tuple[float, np.ndarray, int]:
    """What a branch with these tokens (conditional acceptance `rates`) would add: the reach of the node it leaves
    the tree from, the acceptance of each new node (at most `room`; the first capped by what its siblings claim),
    and how many of its tokens the tree already holds (a shared prefix)."""
    parent, shared = -1, 0
    while shared < len(tokens) and (node := tree.child(parent, tokens[shared])) is not None:
        parent, shared = node, shared + 1
    own = np.array(rates[shared : shared + max(room, 0)], dtype=float)
    if len(own):
        own[0] = min(own[0], max(0.0, 1.0 - taken.get(parent, 0.0)))
    return (reach[parent] if parent >= 0 else 1.0), own, shared


def _fitting(tree: DraftTree, tokens: list[int], room: int) -> int:
    """The most of `tokens` whose new nodes fit in `room` more nodes."""
    n = len(tokens)
    while n and tree.new_nodes(tokens[:n]) > room:
        n -= 1
    return n
