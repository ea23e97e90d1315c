"""Draft trees: the trie several drafters' proposals merge into, its attention mask and positions, the target's
logits for every node from one forward (equal to a plain forward over that node's path), and the KV cache after a
tree round (equal to one built from the accepted context alone)."""

import pytest
import torch
from helpers import tiny_llama

from metasd.cached_model import CachedModel
from metasd.drafters.base import Draft
from metasd.tree import DraftTree
from metasd.verify import verify_tree_greedy


def _tree() -> DraftTree:
    """a: 3 4 6 / b: 3 8 (shares 3 with a) / c: 12 13 14 (its own branch) / d: 3 4 (inside a: no new node)."""
    tree = DraftTree.chain(Draft([3, 4, 6]), arm=0)
    tree.add(1, Draft([3, 8]))
    tree.add(2, Draft([12, 13, 14]))
    tree.add(3, Draft([3, 4]))
    return tree


def test_shared_prefixes_are_stored_once_and_siblings_apart():
    tree = _tree()
    assert tree.tokens == [3, 4, 6, 8, 12, 13, 14]
    assert tree.parents == [-1, 0, 1, 0, -1, 4, 5]
    assert tree.depths == [0, 1, 2, 1, 0, 1, 2]
    assert [b.nodes for b in tree.branches] == [(0, 1, 2), (0, 3), (4, 5, 6), (0, 1)]
    assert not tree.is_chain and DraftTree.chain(Draft([5, 6])).is_chain
    assert tree.prefixes() == [[], [3], [3, 4], [3, 4, 6], [3, 8], [12], [12, 13], [12, 13, 14]]
    assert tree.new_nodes([3, 4, 7, 9]) == 2 and tree.new_nodes([3, 8]) == 0 and tree.new_nodes([5]) == 1
    # after the root: a's 3 (listed for a, b and d, each drew it) and c's 12, in branch order
    assert [(child, b.arm, depth) for child, b, depth in tree.proposals(-1)] == [
        (0, 0, 0),
        (0, 1, 0),
        (4, 2, 0),
        (0, 3, 0),
    ]
    assert [(child, b.arm) for child, b, _ in tree.proposals(0)] == [(1, 0), (3, 1), (1, 3)]
    assert tree.proposals(2) == []


def test_each_node_sees_the_context_and_its_ancestors_at_its_depth():
    tree = _tree()
    mask, positions = tree.attention(past=5, pending=2, dtype=torch.float32)
    allowed = (mask[0, 0] == 0).int()
    assert allowed.shape == (2 + 7, 5 + 2 + 7)
    assert allowed[0].tolist() == [1] * 6 + [0] * 8  # pending context tokens: causal
    assert allowed[1].tolist() == [1] * 7 + [0] * 7
    ancestors = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 3], 4: [4], 5: [4, 5], 6: [4, 5, 6]}
    for node, seen in ancestors.items():
        row = allowed[2 + node]
        assert row[:7].tolist() == [1] * 7
        assert [i for i in range(7) if row[7 + i]] == seen
    assert positions[0].tolist() == [5, 6, 7, 8, 9, 8, 7, 8, 9]


@pytest.fixture
def model():
    torch.manual_seed(0)
    return tiny_llama(layers=2)


def _path_to(tree: DraftTree, node: int) -> list[int]:
    return tree.prefixes()[node + 1]


@pytest.mark.parametrize("cached", [0, 3, 5])  # nothing cached, part of the context, all of it but its last token
def test_one_forward_gives_every_nodes_logits_as_a_plain_forward_would(model, cached):
    context, tree = [1, 5, 7, 9, 11, 2], _tree()
    lm, plain = CachedModel(model), CachedModel(model)
    if cached:
        lm.logits_for(context[:cached])
    logits = lm.logits_for_tree(context, tree)
    assert logits.shape[0] == tree.size + 1
    for row in range(tree.size + 1):
        plain.reset()
        expected = plain.logits_for(context + (_path_to(tree, row - 1) if row else []))[0]
        torch.testing.assert_close(logits[row], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("accepted", [[], [3], [3, 8], [12, 13, 14], [3, 4, 6]])
def test_after_a_tree_round_the_cache_holds_exactly_the_accepted_context(model, accepted):
    """The next call names the context the round produced (an accepted path, then the target's own token): only the
    path's entries stay, gathered behind the context, and the cache equals one built from that context alone."""
    context, tree = [1, 5, 7, 9, 11, 2], _tree()
    lm, fresh = CachedModel(model, keep_features=True), CachedModel(model, keep_features=True)
    lm.logits_for_tree(context, tree)
    after = context + accepted + [20]
    logits = lm.logits_for(after, last=2)
    torch.testing.assert_close(logits, fresh.logits_for(after, last=2), atol=1e-5, rtol=1e-5)
    assert lm.tokens == after and lm.cache.get_seq_length() == len(after)
    for ours, theirs in zip(lm.cache.layers, fresh.cache.layers, strict=True):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lm.features_for(after), fresh.features_for(after), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layers", [(), (0,)])
def test_features_read_after_a_tree_round_are_the_accepted_paths(model, layers):
    """An EAGLE head reads the target's features (fused from a lower layer's too, or not) of the new context before
    the target's next forward."""
    context, tree = [1, 5, 7, 9, 11, 2], _tree()
    lm = CachedModel(model, keep_features=True, feature_layers=layers)
    fresh = CachedModel(model, keep_features=True, feature_layers=layers)
    lm.logits_for_tree(context, tree)
    fresh.logits_for(context + [12, 13])
    torch.testing.assert_close(lm.features_for(context + [12, 13, 30]), fresh.features_for(context + [12, 13]))


def test_a_chain_is_verified_by_a_plain_forward(model, monkeypatch):
    context, lm = [1, 5, 7], CachedModel(model)
    seen = []
    monkeypatch.setattr(DraftTree, "attention", lambda *a, **kw: seen.append(1))
    logits = lm.logits_for_tree(context, DraftTree.chain(Draft([4, 6])))
    assert seen == [] and logits.shape[0] == 3 and lm.tokens == context + [4, 6]


def test_greedy_follows_the_targets_argmax_down_the_tree():
    tree = _tree()
    logits = torch.full((tree.size + 1, 32), -1.0)
    argmax = {-1: 3, 0: 8, 3: 9, 1: 6, 4: 13}  # root -> 3, then 8 (b's branch), then 9 (no such child)
    for node, token in argmax.items():
        logits[node + 1, token] = 1.0
    verdict = verify_tree_greedy(logits, tree)
    assert (verdict.path, verdict.accepted, verdict.next_token) == ((0, 3), 2, 9)
    logits[0, 3], logits[0, 12] = -1.0, 1.0  # root -> 12, 13, then after node 5 the argmax is index 0
    verdict = verify_tree_greedy(logits, tree)
    assert (verdict.path, verdict.next_token) == ((4, 5), 0)
