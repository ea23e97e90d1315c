"""The batch's KV slots: every row's logits from one padded forward equal a lone forward over that row's context
and draft (chains and trees, rows of different lengths), rows settle on accepted paths, and a row that leaves
moves another into its place without changing what it holds."""

import pytest
import torch
from helpers import tiny_llama

from metasd.batching.slots import BatchedTarget
from metasd.cached_model import CachedModel
from metasd.drafters.base import Draft
from metasd.tree import DraftTree


@pytest.fixture
def model():
    torch.manual_seed(0)
    return tiny_llama(layers=2, num_key_value_heads=1)


def _tree() -> DraftTree:
    tree = DraftTree.chain(Draft([3, 4, 6]), arm=0)
    tree.add(1, Draft([3, 8]))
    tree.add(2, Draft([12, 13]))
    return tree


def _alone(model, context, tree):
    return CachedModel(model, keep_features=True).logits_for_tree(context, tree)


def _rounds():
    """Three requests of different lengths: a chain, a tree, a plain step; then each one's next round."""
    contexts = [[1, 5, 7, 9, 11, 2, 4], [7, 3], list(range(20, 45))]
    trees = [DraftTree.chain(Draft([5, 9])), _tree(), DraftTree.chain(Draft([]))]
    return contexts, trees


@pytest.mark.parametrize("layers", [(), (0,)])
def test_every_rows_logits_equal_a_lone_forward(model, layers):
    """Each row's logits and its features (the final norm's, after a lower layer's where a fused head reads it)."""
    batch = BatchedTarget(model, rows=4, keep_features=True, capacity=8, feature_layers=layers)  # grows as it goes
    rows = [batch.add_row() for _ in range(3)]
    contexts, trees = _rounds()
    for row, context in zip(rows, contexts, strict=True):
        batch.prefill(row, context)
    logits = batch.forward(list(zip(rows, contexts, trees, strict=True)))
    for got, context, tree in zip(logits, contexts, trees, strict=True):
        assert got.shape[0] == tree.size + 1
        torch.testing.assert_close(got, _alone(model, context, tree), atol=1e-5, rtol=1e-5)
    # next round: each row's context took an accepted path (two through a tree branch) and the target's token
    after = [contexts[0] + [5, 30], contexts[1] + [3, 8, 31], contexts[2] + [32]]
    nxt = [DraftTree.chain(Draft([1, 2, 3])), DraftTree.chain(Draft([9])), _tree()]
    logits = batch.forward(list(zip(rows, after, nxt, strict=True)))
    for got, row, context, tree in zip(logits, rows, after, nxt, strict=True):
        torch.testing.assert_close(got, _alone(model, context, tree), atol=1e-5, rtol=1e-5)
        fresh = CachedModel(model, keep_features=True, feature_layers=layers)
        fresh.logits_for(context)
        torch.testing.assert_close(row.features_for(context), fresh.features_for(context), atol=1e-5, rtol=1e-5)


def test_a_leaving_row_moves_the_last_one_into_its_place(model):
    batch = BatchedTarget(model, rows=3)
    rows = [batch.add_row() for _ in range(3)]
    contexts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    batch.forward([(r, c, DraftTree()) for r, c in zip(rows, contexts, strict=True)])
    batch.remove_row(rows[0])
    assert rows[2].index == 0 and rows[1].index == 1 and batch.active == 2
    later = [contexts[1] + [14], contexts[2] + [13]]
    logits = batch.forward([(rows[1], later[0], DraftTree()), (rows[2], later[1], DraftTree())])  # not in row order
    assert rows[2].fed_tokens == len(contexts[2]) + 1  # it kept its cache: only the new token was fed
    for got, context in zip(logits, later, strict=True):
        torch.testing.assert_close(got, _alone(model, context, DraftTree()), atol=1e-5, rtol=1e-5)
    assert batch.add_row().index == 2


def test_rows_of_one_forward_must_be_consecutive(model):
    batch = BatchedTarget(model, rows=3)
    rows = [batch.add_row() for _ in range(3)]
    with pytest.raises(ValueError, match="consecutive"):
        batch.forward([(rows[0], [1, 2], DraftTree()), (rows[2], [3, 4], DraftTree())])


def test_a_full_batch_and_a_sliding_window_model_are_refused(model):
    batch = BatchedTarget(model, rows=1)
    batch.add_row()
    with pytest.raises(RuntimeError, match="rows are in use"):
        batch.add_row()
    sliding = tiny_llama(layers=2, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="full attention"):
        BatchedTarget(sliding, rows=2)
