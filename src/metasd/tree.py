"""A draft tree: several drafters' proposals for one round merged into a trie, verified in one target forward.

SpecInfer (Miao et al., arXiv 2305.09781) merges the token trees of several small models and scores them in one
forward with a tree attention mask: every node attends to the context and to its own ancestors, at the position its
depth gives it. A chain (one drafter's draft) is the one-branch case. Each branch keeps the `Draft` it came from, so
the acceptance rule still sees each drafter's q at each depth (`verify.verify_tree_sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .draft import Draft


@dataclass(frozen=True)
class Branch:
    """One drafter's proposal in the tree: `nodes[j]` is the node holding `draft.tokens[j]`."""

    arm: int | None  # the drafter's index in the round's pool
    draft: Draft
    nodes: tuple[int, ...]


@dataclass
class DraftTree:
    """Nodes in insertion order (a parent always before its children); parent -1 is the root, the context's last
    position. Shared prefixes are stored once: two drafters proposing the same tokens share nodes."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    branches: list[Branch] = field(default_factory=list)
    _children: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node

    @classmethod
    def chain(cls, draft: Draft, arm: int | None = None) -> DraftTree:
        """A tree of one branch: drafter `arm`'s `draft`."""
        tree = cls()
        tree.add(arm, draft)
        return tree

    def copy(self) -> DraftTree:
        """A tree that can grow apart from this one (the drafts are shared, not copied)."""
        return DraftTree(
            list(self.tokens), list(self.parents), list(self.depths), list(self.branches), dict(self._children)
        )

    @property
    def size(self) -> int:
        """The number of nodes: the drafted tokens one forward verifies."""
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Every node is its predecessor's child: a plain draft, verified without a tree mask."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def add(self, arm: int | None, draft: Draft) -> Branch:
        """Insert a drafter's proposal as a branch from the root, reusing the nodes of any shared prefix."""
        parent, nodes = -1, []
        for token in draft.tokens:
            node = self._children.get((parent, token))
            if node is None:
                node = len(self.tokens)
                self._children[(parent, token)] = node
                self.tokens.append(token)
                self.parents.append(parent)
                self.depths.append(self.depths[parent] + 1 if parent >= 0 else 0)
            nodes.append(node)
            parent = node
        branch = Branch(arm, draft, tuple(nodes))
        self.branches.append(branch)
        return branch

    def new_nodes(self, tokens: list[int]) -> int:
        """How many nodes inserting `tokens` as a branch would add (the rest already exist)."""
        parent = -1
        for j, token in enumerate(tokens):
            parent = self._children.get((parent, token), -2)
            if parent == -2:
                return len(tokens) - j
        return 0

    def child(self, parent: int, token: int) -> int | None:
        """The node holding `token` under `parent` (-1: the root), or None."""
        return self._children.get((parent, token))

    def follow(self, tokens: list[int]) -> list[int]:
        """The nodes of the longest path from the root that spells a prefix of `tokens`."""
        parent, path = -1, []
        for token in tokens:
            node = self._children.get((parent, token))
            if node is None:
                break
            path.append(node)
            parent = node
        return path

    def path_tokens(self, path: list[int] | tuple[int, ...]) -> list[int]:
        """The tokens the nodes of `path` hold."""
        return [self.tokens[n] for n in path]

    def prefixes(self) -> list[list[int]]:
        """What each verification row follows after the context: [] for the root, then each node's path."""
        out: list[list[int]] = [[]]
        for token, parent in zip(self.tokens, self.parents, strict=True):
            out.append([*out[parent + 1], token])
        return out

    def proposals(self, node: int) -> list[tuple[int, Branch, int]]:
        """What the branches propose after `node` (-1: the root), in branch order: (child node, branch, depth of
        the child in that branch). A child two branches share is listed once per branch, as each drew it."""
        depth = self.depths[node] + 1 if node >= 0 else 0
        out = []
        for branch in self.branches:
            if len(branch.nodes) > depth and (depth == 0 or branch.nodes[depth - 1] == node):
                out.append((branch.nodes[depth], branch, depth))
        return out

    def attention(self, past: int, pending: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        """The forward's inputs for the tree after `pending` context tokens not yet cached (behind `past` cached
        ones): a 4D additive mask [1, 1, pending + size, past + pending + size] (0 where attended, the dtype's
        minimum elsewhere: the form eager and SDPA attention both accept) and position ids [1, pending + size]."""
        n, ctx = self.size, past + pending
        allowed = torch.zeros(pending + n, ctx + n, dtype=torch.bool)
        allowed[:pending, :past] = True
        allowed[:pending, past:ctx] = torch.ones(pending, pending, dtype=torch.bool).tril()
        allowed[pending:, :ctx] = True
        for i, parent in enumerate(self.parents):  # parents come first: copy the parent's row, then itself
            if parent >= 0:
                allowed[pending + i, ctx:] = allowed[pending + parent, ctx:]
            allowed[pending + i, ctx + i] = True
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        positions = torch.tensor([*range(past, ctx), *(ctx + d for d in self.depths)])
        return mask[None, None].to(device), positions[None].to(device)
