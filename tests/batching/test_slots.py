"""The batch's KV slots: every row's logits from one forward, padded or packed, equal a lone forward over that row's
context and draft (chains and trees, rows of different lengths), rows settle on accepted paths, and a row that leaves
moves another into its place without changing what it holds."""

import pytest
import torch
from helpers import tiny_llama

from metasd.cached_model import CachedModel
from metasd.drafters.base import Draft
from metasd.models.loading import context_length
from metasd.slots import BatchedTarget, check_batched_logits
from metasd.tree import DraftTree


@pytest.fixture
def model():
    torch.manual_seed(0)
    return tiny_llama(layers=2, num_key_value_heads=1)


@pytest.fixture(params=["padded", "packed"])
def body(request, monkeypatch):
    """Every forward padded to its widest row, or every forward packed (`ragged`), whatever its rows' widths."""
    monkeypatch.setattr(BatchedTarget, "PACK_WHEN_PADDED", float("inf") if request.param == "padded" else 0.0)
    return request.param


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
def test_every_rows_logits_equal_a_lone_forward(model, layers, body):
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


def test_a_leaving_row_moves_the_last_one_into_its_place(model, body):
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


def test_a_row_between_the_named_ones_is_fed_nothing_and_keeps_its_cache(model, body):
    """Rows 0 and 2 decode while row 1's prompt is half in (a chunked prefill): the forward over rows 0 and 2
    feeds row 1 nothing, and once its prompt is all in, its logits are still a lone forward's."""
    batch = BatchedTarget(model, rows=3, capacity=8)
    rows = [batch.add_row() for _ in range(3)]
    contexts = [[1, 2, 3, 4], list(range(10, 40)), [8, 9, 10, 11, 12]]
    batch.prefill(rows[0], contexts[0])
    batch.prefill(rows[2], contexts[2])
    assert not batch.prefill(rows[1], contexts[1], tokens=11)  # a chunk: 11 of its 29 tokens
    fed = rows[1].fed_tokens
    trees = [DraftTree.chain(Draft([5, 6])), DraftTree.chain(Draft([7]))]
    logits = batch.forward([(rows[2], contexts[2], trees[1]), (rows[0], contexts[0], trees[0])])
    assert rows[1].fed_tokens == fed and len(rows[1].tokens) == 11
    for got, context, tree in zip(logits, [contexts[2], contexts[0]], [trees[1], trees[0]], strict=True):
        torch.testing.assert_close(got, _alone(model, context, tree), atol=1e-5, rtol=1e-5)
    assert batch.prefill(rows[1], contexts[1], tokens=100)
    (got,) = batch.forward([(rows[1], contexts[1], DraftTree.chain(Draft([3])))])
    torch.testing.assert_close(got, _alone(model, contexts[1], DraftTree.chain(Draft([3]))), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="twice"):
        batch.forward([(rows[0], contexts[0], DraftTree()), (rows[0], contexts[0], DraftTree())])


@pytest.mark.parametrize("layers", [(), (0,)])
def test_prompt_chunks_packed_beside_the_rows_leave_every_row_as_alone(model, layers):
    """A forward verifying two rows (a chain and a tree) carries chunks of two more rows' prompts, packed with no
    padding (`ragged`): the two rows' logits, and each joiner's logits and features once its prompt is in, are a
    lone forward's."""
    batch = BatchedTarget(model, rows=4, keep_features=True, capacity=8, feature_layers=layers)
    rows = [batch.add_row() for _ in range(4)]
    contexts = [[1, 5, 7, 9, 11, 2, 4], list(range(20, 60)), [7, 3], [3 + 7 * i % 50 for i in range(30)]]
    batch.prefill(rows[0], contexts[0])
    batch.prefill(rows[2], contexts[2])
    batch.prefill(rows[1], contexts[1], tokens=5)
    batch.prefill(rows[3], contexts[3], tokens=3)
    trees = [DraftTree.chain(Draft([5, 9])), _tree()]
    for end, other in ((20, 12), (39, 29)):  # two steps: the second ends both prompts but for their last tokens
        got = batch.forward(
            [(rows[2], contexts[2], trees[1]), (rows[0], contexts[0], trees[0])],
            [(rows[1], contexts[1][:end]), (rows[3], contexts[3][:other])],
        )
        assert len(rows[1].tokens) == end and len(rows[3].tokens) == other
        for logits, context, tree in zip(got, [contexts[2], contexts[0]], [trees[1], trees[0]], strict=True):
            torch.testing.assert_close(logits, _alone(model, context, tree), atol=1e-5, rtol=1e-5)
        contexts[0], contexts[2] = contexts[0] + [5, 30], contexts[2] + [3, 8, 31]  # accepted paths, then next round
    for row in (1, 3):
        (got,) = batch.forward([(rows[row], contexts[row], _tree())])
        torch.testing.assert_close(got, _alone(model, contexts[row], _tree()), atol=1e-5, rtol=1e-5)
        fresh = CachedModel(model, keep_features=True, feature_layers=layers)
        fresh.logits_for(contexts[row])
        want = fresh.features_for(contexts[row])
        torch.testing.assert_close(rows[row].features_for(contexts[row]), want, atol=1e-5, rtol=1e-5)


def test_a_forward_packs_where_padding_would_feed_more_than_its_rows_carry(model, monkeypatch):
    """Rows of one width are padded; a wide draft beside one-token rows, or one-token rows with rows fed nothing
    between them, are packed (a row's width: the token its prompt left out, or the target's last, and its draft)."""
    batch = BatchedTarget(model, rows=4, capacity=8)
    rows = [batch.add_row() for _ in range(4)]
    contexts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    for row, context in zip(rows, contexts, strict=True):
        batch.prefill(row, context)
    packs = []
    real = BatchedTarget._packed_body
    monkeypatch.setattr(BatchedTarget, "_packed_body", lambda self, *a: packs.append(True) or real(self, *a))

    def packed(widths: list[int | None]) -> bool:
        packs.clear()
        for i, width in enumerate(widths):
            if width is not None:
                contexts[i] = contexts[i] + [20 + i]
        items = [(rows[i], contexts[i], DraftTree.chain(Draft([3] * (w - 1)))) for i, w in enumerate(widths) if w]
        batch.forward(items)
        return bool(packs)

    assert not packed([2, 2, 2, 2])
    assert packed([6, 1, 1, 1])
    assert packed([1, None, None, 1])
    assert not packed([3, 3, None, 3])  # 12 padded positions for 9 fed
    assert packed([1, None, 1])  # 3 for 2: the ratio itself


def test_a_full_batch_and_a_sliding_window_model_are_refused(model):
    batch = BatchedTarget(model, rows=1)
    batch.add_row()
    with pytest.raises(RuntimeError, match="rows are in use"):
        batch.add_row()
    sliding = tiny_llama(layers=2, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="full attention"):
        BatchedTarget(sliding, rows=2)


def _two_rows_against_alone(model, contexts, drafts):
    """Each row's logits in one batched forward, and the model's own forward over that row alone."""
    batch = BatchedTarget(model, rows=len(contexts), capacity=8)
    rows = [batch.add_row() for _ in contexts]
    for row, context in zip(rows, contexts, strict=True):
        batch.prefill(row, context)
    trees = [DraftTree.chain(Draft(d)) for d in drafts]
    got = batch.forward(list(zip(rows, contexts, trees, strict=True)))
    want = [
        model(input_ids=torch.tensor([c + d])).logits[0, len(c) - 1 :] for c, d in zip(contexts, drafts, strict=True)
    ]
    return got, want


def _granite():
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, logits_scaling=8.0, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.3,
    )  # fmt: skip
    return GraniteForCausalLM(config).eval()


def _cohere():
    from transformers import CohereConfig, CohereForCausalLM

    config = CohereConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, logit_scale=0.25,
    )  # fmt: skip
    return CohereForCausalLM(config).eval()


def _granite_moe():
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    config = GraniteMoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, logits_scaling=8.0,
    )  # fmt: skip
    return GraniteMoeForCausalLM(config).eval()


@pytest.mark.parametrize(
    "build", [_granite, _cohere, _granite_moe], ids=["granite-logits-scaling", "cohere-logit-scale", "granite-moe"]
)
def test_logits_are_the_models_own_where_it_scales_them(build):
    """Granite divides its logits by `logits_scaling`, Cohere multiplies them by `logit_scale`: the head alone
    would sample from softmax(8 x logits / T). The batch's logits are the model's own forward's (and CachedModel's),
    a mixture of experts' too (its forward reads the router's logits from its body's output)."""
    torch.manual_seed(0)
    model = build()
    got, want = _two_rows_against_alone(model, [[1, 5, 7, 9, 11, 2], [7, 3]], [[4, 6], [9]])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], _alone(model, [7, 3], DraftTree.chain(Draft([9]))), atol=1e-5, rtol=1e-5)
    check_batched_logits(model)  # and it passes the start-up check


def test_a_model_the_slots_decode_unlike_itself_is_refused_at_start_up():
    """What no rule foresaw (here a forward that adds a term growing with its input's length) is caught by
    comparing the batched path with the model's own forward on a few tokens."""
    from transformers import LlamaForCausalLM

    class Odd(LlamaForCausalLM):
        def forward(self, input_ids=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            out.logits = out.logits + 0.5 * input_ids.shape[1]
            return out

    torch.manual_seed(0)
    model = Odd(tiny_llama().config).eval()
    with pytest.raises(ValueError, match="differ from the model's own forward"):
        check_batched_logits(model)


def _longrope_phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    half = 16 // 2 // 2  # head_dim / 2 factors
    config = Phi3Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
                         "long_factor": [4.0] * half, "original_max_position_embeddings": 16},
        pad_token_id=0,
    )  # fmt: skip
    return Phi3ForCausalLM(config).eval()


def test_longrope_models_are_decoded_within_the_context_their_short_factors_cover():
    """LongRoPE picks short or long frequencies from the forward's largest position: a 40-token row would switch
    a 5-token row's frequencies. Such a model is decoded within `original_max_position_embeddings` (its
    context for metasd), a forward past it refused; within it each row's logits are its logits alone."""
    torch.manual_seed(0)
    model = _longrope_phi3()
    assert context_length(model.config) == 16
    batch = BatchedTarget(model, rows=2)
    long, short = batch.add_row(), batch.add_row()
    with pytest.raises(ValueError, match="past the 16 positions"):
        batch.forward([(long, list(range(1, 41)), DraftTree()), (short, [1, 2, 3, 4, 5], DraftTree())])
    with pytest.raises(ValueError, match="past the 16 positions"):  # a draft crossing it
        batch.forward([(long, list(range(1, 14)), DraftTree.chain(Draft([7, 8, 9, 10])))])
    got, want = _two_rows_against_alone(model, [list(range(1, 13)), [1, 2, 3, 4, 5]], [[3, 4, 5], [6]])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_slots_grow_no_further_than_the_context_and_shrink_when_the_long_request_leaves():
    torch.manual_seed(0)
    model = tiny_llama(layers=1, positions=300)
    batch = BatchedTarget(model, rows=2, keep_features=True, capacity=16)
    short, long = batch.add_row(), batch.add_row()
    batch.prefill(short, [1, 2, 3])
    context = torch.randint(0, 64, (295,)).tolist()
    batch.prefill(long, context)  # near the limit: doubling 16 -> 512 would pass 300
    batch.forward([(short, [1, 2, 3], DraftTree()), (long, context, DraftTree.chain(Draft([4, 5, 6, 7])))])
    assert 295 + 4 <= batch.slots.capacity <= 300 + 4
    assert batch.features.shape[1] == batch.slots.capacity
    batch.remove_row(long)
    assert batch.slots.capacity == 16 and batch.features.shape[1] == 16  # back to what the short row needs
    logits = batch.forward([(short, [1, 2, 3, 9], DraftTree())])[0]
    torch.testing.assert_close(logits, _alone(model, [1, 2, 3, 9], DraftTree()), atol=1e-5, rtol=1e-5)


_PEAK = """
import resource, sys, torch
sys.path.insert(0, {tests!r})
from helpers import tiny_llama
from metasd.slots import BatchedTarget
torch.manual_seed(0)
model = tiny_llama(layers=1, positions=4200)
batch = BatchedTarget(model, rows=1, capacity=4200)
row = batch.add_row()
batch.prefill(row, torch.randint(0, 64, (300,)).tolist())  # warm: kernels, allocator
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
batch.prefill(row, torch.randint(0, 64, (4096,)).tolist())
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def test_a_long_prefill_needs_no_prompt_by_prompt_mask():
    """Peak memory of a 4,096-token prefill (tiny model: its KV slots are 4 MB): a [4096, 4096] mask in float32 is
    64 MB, and a bool and two floats of it, plus attention scores, over 150 MB. In chunks: under 48 MB."""
    import subprocess
    import sys
    from pathlib import Path

    code = _PEAK.format(tests=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak_mb = float(out.stdout.strip().splitlines()[-1])
    assert peak_mb < 48, peak_mb
