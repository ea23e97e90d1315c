"""EAGLE heads: the target cache's features, the head's own cache that cannot drift, lossless greedy decoding with a
head in the pool, and clear errors for a head that does not belong to the target."""

import pytest
import torch
from helpers import greedy_reference, tiny_llama

from metasd import Decoder
from metasd.cached_model import CachedModel
from metasd.draft import DraftJob
from metasd.drafters import DEFAULT_POOL, build_drafter
from metasd.drafters.eagle import EagleDrafter, shipped_head
from metasd.models.eagle_head import EagleHead, TargetCheck, head_config_for, load_head, save_head
from metasd.models.loading import LoadedModel
from metasd.sampling import SamplingParams

GREEDY = SamplingParams()


def make_head(
    model, path, vocab: torch.Tensor | None = None, seed: int = 0, layers: tuple = (), depth: int = 1
) -> EagleHead:
    """An untrained head of `depth` decoder layers for `model` (reading the outputs of decoder `layers` beside the
    final norm's), saved at `path` (random weights: it drafts, mostly wrongly)."""
    torch.manual_seed(seed)
    vocab = torch.arange(model.config.vocab_size) if vocab is None else vocab
    head = EagleHead(head_config_for(model, len(vocab), layers, depth), vocab)
    save_head(path, head, "test", TargetCheck.of(model), {})
    return head


def test_the_target_cache_keeps_the_features_of_exactly_its_tokens():
    model = tiny_llama(64, layers=2)
    lm = CachedModel(model, keep_features=True)
    lm.logits_for([1, 2, 3, 4, 5, 6])
    lm.logits_for([1, 2, 3, 9, 8], last=2)  # a rejection: crops to [1, 2, 3], feeds 9, 8
    with torch.no_grad():
        fresh = model.model(input_ids=torch.tensor([[1, 2, 3, 9, 8]])).last_hidden_state[0]
    assert torch.allclose(lm.features_for([1, 2, 3, 9, 8, 7]), fresh, atol=1e-5)
    assert lm.features_for([1, 2, 4]).shape[0] == 2  # only the common prefix


def test_fused_features_are_the_layers_outputs_then_the_final_norms():
    model = tiny_llama(64, layers=3)
    lm = CachedModel(model, keep_features=True, feature_layers=(0, 1))
    lm.logits_for([1, 2, 3, 4, 5, 6])
    lm.logits_for([1, 2, 3, 9, 8], last=2)
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([[1, 2, 3, 9, 8]]), output_hidden_states=True)
    want = torch.cat([out.hidden_states[1][0], out.hidden_states[2][0], out.last_hidden_state[0]], dim=-1)
    assert torch.allclose(lm.features_for([1, 2, 3, 9, 8]), want, atol=1e-5)
    with pytest.raises(ValueError, match="out of range"):
        CachedModel(model, keep_features=True, feature_layers=(3,)).logits_for([1, 2])


@pytest.mark.parametrize(
    ("weights", "layers", "depth"), [("unquantized", (), 1), ("int8", (), 1), ("auto", (0,), 1), ("auto", (0,), 2)]
)
def test_the_heads_cache_cannot_drift(tmp_path, weights, layers, depth):
    """After drafts, rejections and rounds it sat out, the head drafts what a fresh head drafts from the same
    context: its q rows are the same, whichever weights its draft steps run on, whichever features it fuses (here a
    cache keeping more layers than the head reads) and however many decoder layers it has."""
    model = tiny_llama(64, layers=2)
    head = make_head(model, tmp_path, layers=layers, depth=depth)
    lm = CachedModel(model, keep_features=True, feature_layers=(0, 1))
    drafter = EagleDrafter(head, model, "eagle", 64, weights=weights)
    drafter.read_features_from(lm)
    context = [5, 6, 7, 8]
    lm.logits_for(context)
    for extra in ([9], [9, 10, 11], [12], [13, 14]):  # each round: the drafter drafts, the target verifies
        draft = drafter.propose(context, 3, GREEDY, None)
        assert len(draft.tokens) == 3 and draft.forwards == 3
        lm.logits_for(context + draft.tokens, last=4)
        context = context + extra
        lm.logits_for(context)  # a round in which another drafter drafted
    mine = drafter.propose(context, 3, GREEDY, None)
    # the weights the first head's steps run on (`auto` would measure again and may choose other weights)
    same = "int8" if drafter.weights.startswith("int8") else "unquantized"
    fresh = EagleDrafter(head, model, "eagle", 64, weights=same)
    fresh.read_features_from(lm)
    theirs = fresh.propose(context, 3, GREEDY, None)
    assert mine.tokens == theirs.tokens
    assert torch.allclose(mine.q, theirs.q, atol=1e-5)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_k=20)], ids=["greedy", "sampled"])
def test_forks_drafting_together_draft_what_each_drafts_alone(tmp_path, params, depth):
    """A batch's forks of one head, with contexts of different lengths and drafts of different lengths, draft in
    one step per token what each fork drafts alone: the same tokens from the same q (sampled: the same generator
    states), and the forks' caches are left as drafting alone leaves them for the next round; a deeper head lays
    every layer's cache side by side."""
    model = tiny_llama(64, layers=2)
    head = make_head(model, tmp_path, layers=(0,), depth=depth)
    with torch.no_grad():  # sharp attention: an untrained head attends almost evenly, blind to positions and masks
        for layer in head.body.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(10)
    contexts, ks = [[5, 6, 7, 8], [9, 3, 4, 1, 2, 11, 12], [20, 21]], [3, 4, 2]

    def forks() -> list[EagleDrafter]:
        """A fork per request, each reading its own target cache (a batch's row) that has verified its context."""
        drafter = EagleDrafter(head, model, "eagle", 64, weights="unquantized")
        out = []
        for context in contexts:
            fork = drafter.fork()
            fork.read_features_from(CachedModel(model, keep_features=True, feature_layers=(0,)))
            fork.begin(context)
            fork.target_lm.logits_for(context)
            out.append(fork)
        return out

    alone, together = [], forks()
    for fork, context, k in zip(forks(), contexts, ks, strict=True):
        alone.append(fork.propose(context, k, params, torch.Generator().manual_seed(len(context))))
    jobs = [
        DraftJob(fork, context, k, params, torch.Generator().manual_seed(len(context)))
        for fork, context, k in zip(together, contexts, ks, strict=True)
    ]
    unseen = together[0].fork()  # a request whose prompt the target has not verified yet: no draft, nothing shared
    unseen.read_features_from(CachedModel(model, keep_features=True, feature_layers=(0,)))
    results = EagleDrafter.draft_batch([*jobs, DraftJob(unseen, [30, 31, 32], 3, params, None)])
    assert results[-1][0].tokens == [] and results[-1][0].forwards == 0
    assert len({fork.batch_key() for fork in together}) == 1
    assert all(seconds > 0 for _, seconds in results)  # each row charged its catch-up and its share of the steps
    drafted = [draft for draft, _ in results[:-1]]
    for one, many, k in zip(alone, drafted, ks, strict=True):
        assert many.tokens == one.tokens and len(many.tokens) == k and many.forwards == one.forwards == k
        torch.testing.assert_close(many.q, one.q, atol=1e-5, rtol=1e-4)
        assert [t for t, _ in many.runners_up] == [t for t, _ in one.runners_up]
        assert many.confidence == pytest.approx(one.confidence, abs=1e-5)

    def as_fresh(fork, context, draft):  # what a head that never drafted before drafts from the same target cache
        fresh = EagleDrafter(head, model, "eagle", 64, weights="unquantized")
        fresh.read_features_from(fork.target_lm)
        torch.testing.assert_close(draft.q, fresh.propose(context, 2, GREEDY, None).q, atol=1e-5, rtol=1e-4)

    # the next round together: each cache cut back to what its target kept (one draft token, then another token)
    # and caught up in one forward beside the others; then a round alone: the caches are as if never batched
    afters = [context + one.tokens[:1] + [1] for context, one in zip(contexts, alone, strict=True)]
    for fork, after in zip(together, afters, strict=True):
        fork.target_lm.logits_for(after)
    again = EagleDrafter.draft_batch([DraftJob(f, a, 2, GREEDY, None) for f, a in zip(together, afters, strict=True)])
    for fork, after, (draft, _) in zip(together, afters, again, strict=True):
        as_fresh(fork, after, draft)
        later = after + draft.tokens[:1] + [2]
        fork.target_lm.logits_for(later)
        as_fresh(fork, later, fork.propose(later, 2, GREEDY, None))


def test_an_untrained_fusion_reads_the_final_norms_output_alone(tmp_path):
    model = tiny_llama(64, layers=2)
    fused = make_head(model, tmp_path, layers=(0,))
    features = torch.randn(3, 5, 2 * 16) * 100
    assert torch.equal(fused.fuse(features), features[..., 16:])


def test_each_head_reads_its_own_columns_of_a_cache_keeping_more_layers(tmp_path):
    """A head's q is the same from a cache keeping exactly its layers and from one keeping more (the pool's
    union): it picks its own blocks, in order, whatever else the cache holds."""
    model = tiny_llama(64, layers=3)
    context = [5, 6, 7, 8, 9]
    for layers in ((), (1,), (0, 2)):
        head = make_head(model, tmp_path / str(layers), layers=layers)
        if head.reduce is not None:
            torch.nn.init.normal_(head.reduce.weight)  # every block counts, not the final norm's alone
        drafts = []
        for kept in (layers, (0, 1, 2)):
            lm = CachedModel(model, keep_features=True, feature_layers=kept)
            drafter = EagleDrafter(head, model, "eagle", 64, weights="unquantized")
            drafter.read_features_from(lm)
            lm.logits_for(context)
            drafts.append(drafter.propose(context, 3, GREEDY, None))
        assert drafts[0].tokens == drafts[1].tokens
        assert torch.allclose(drafts[0].q, drafts[1].q, atol=1e-6)


def test_a_fused_head_needs_its_layers_in_the_target_and_in_its_cache(tmp_path):
    model = tiny_llama(64, layers=2)
    fused = make_head(model, tmp_path, layers=(1,))
    drafter = EagleDrafter(fused, model, "eagle", 64)
    with pytest.raises(ValueError, match=r"decoder layers \[1\]"):
        drafter.read_features_from(CachedModel(model, keep_features=True))  # keeps only the final norm's
    shallow = tiny_llama(64, layers=1)
    make_head(shallow, tmp_path / "shallow")
    with pytest.raises(ValueError, match=r"reads decoder layers \[1\]"):
        EagleDrafter(fused, shallow, "eagle", 64)


def test_no_draft_before_the_target_has_seen_the_context(tmp_path):
    model = tiny_llama(64)
    lm = CachedModel(model, keep_features=True)
    drafter = EagleDrafter(make_head(model, tmp_path), model, "eagle", 64)
    drafter.read_features_from(lm)
    assert drafter.propose([1, 2, 3], 3, GREEDY, None).tokens == []


def test_q_is_zero_outside_the_draft_vocabulary(tmp_path):
    model = tiny_llama(64)
    lm = CachedModel(model, keep_features=True)
    vocab = torch.arange(10, 40)
    drafter = EagleDrafter(make_head(model, tmp_path, vocab), model, "eagle", 64)
    drafter.read_features_from(lm)
    lm.logits_for([1, 2, 3])
    draft = drafter.propose([1, 2, 3], 2, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    outside = torch.ones(64, dtype=torch.bool)
    outside[vocab] = False
    assert draft.q.shape == (2, 64) and float(draft.q[:, outside].sum()) == 0.0
    assert all(10 <= t < 40 for t in draft.tokens)


def test_a_head_for_another_model_is_refused(tmp_path):
    ours, other = tiny_llama(64), tiny_llama(64)  # same shape, other random weights
    make_head(other, tmp_path / "other")
    with pytest.raises(ValueError, match="trained for"):
        load_head(tmp_path / "other", ours)
    wider = LoadedModel("wide", tiny_llama(80), None)
    with pytest.raises(ValueError, match="vocab_size"):
        build_drafter(f"eagle:{tmp_path / 'other'}", wider)


def test_a_missing_or_corrupt_head_is_a_clear_error(tmp_path):
    model = tiny_llama(64)
    with pytest.raises(ValueError, match="not an EAGLE head directory"):
        load_head(tmp_path / "nowhere", model)
    make_head(model, tmp_path / "head")
    (tmp_path / "head" / "head.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="does not hold"):
        load_head(tmp_path / "head", model)
    make_head(model, tmp_path / "head")
    (tmp_path / "head" / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config"):
        load_head(tmp_path / "head", model)


def test_no_shipped_head_for_another_target():
    target = LoadedModel("tiny", tiny_llama(64), None)
    assert shipped_head(target.model) is None
    with pytest.raises(ValueError, match="ships no EAGLE head"):
        build_drafter("eagle", target)


@pytest.fixture(scope="module")
def head_dir(embedded, tmp_path_factory):
    """An untrained head for the embedded model, over its 8192 lowest ids."""
    path = tmp_path_factory.mktemp("head")
    make_head(embedded.model, path, torch.arange(8192))
    return str(path)


@pytest.mark.parametrize("policy", ["fixed", "metasd-adaptive"])
def test_greedy_output_with_a_head_in_the_pool_is_the_targets(embedded, head_dir, policy):
    spec = f"eagle:{head_dir}"
    decoder = Decoder(drafters=[spec, "ngram"], policy=f"fixed:{spec}" if policy == "fixed" else policy)
    for prompt in ("Write a haiku about rivers.", "List three prime numbers and explain why they are prime."):
        ids = decoder.encode(prompt)
        result = decoder.generate(ids, max_new_tokens=24)
        assert result.token_ids == greedy_reference(embedded.model, ids, 24)
        if policy == "fixed":
            assert result.stats.drafters()[spec].drafted > 0


@pytest.mark.parametrize("weights", ["int8", "unquantized"])
def test_the_head_drafts_on_the_weights_asked_for_and_output_stays_the_targets(embedded, head_dir, weights):
    """`eagle:DIR:int8` drafts one-row steps on int8 weights (its catch-up on the float ones), `:unquantized` never
    does; either way the drafter says which and greedy output is the target's."""
    spec = f"eagle:{head_dir}:{weights}"
    decoder = Decoder(drafters=[spec], policy=f"fixed:{spec}")
    assert decoder.drafters[spec].weights.startswith(weights)
    ids = decoder.encode("Name two rivers in Europe.")
    result = decoder.generate(ids, max_new_tokens=24)
    assert result.token_ids == greedy_reference(embedded.model, ids, 24)
    assert result.stats.drafters()[spec].drafted > 0


def test_a_fused_head_and_a_plain_one_read_one_cache_and_output_stays_the_targets(embedded, head_dir, tmp_path):
    """The target cache keeps the union of the pool's feature layers; each head reads its own columns."""
    make_head(embedded.model, tmp_path, torch.arange(8192), layers=(1, 14))
    fused, plain = f"eagle:{tmp_path}", f"eagle:{head_dir}"
    decoder = Decoder(drafters=[fused, plain])
    assert decoder.target_cache.feature_layers == (1, 14)
    ids = decoder.encode("Name two rivers in Europe.")
    for spec in (fused, plain):
        result = decoder.generate(ids, max_new_tokens=24, policy=f"fixed:{spec}")
        assert result.token_ids == greedy_reference(embedded.model, ids, 24)
        assert result.stats.drafters()[spec].drafted > 0


def test_a_deeper_head_drafts_and_output_stays_the_targets(embedded, tmp_path):
    """A head of two decoder layers (its cache of both kept and cut as one) drafts, and greedy output is the
    target's."""
    make_head(embedded.model, tmp_path, torch.arange(8192), layers=(1, 14), depth=2)
    spec = f"eagle:{tmp_path}"
    decoder = Decoder(drafters=[spec], policy=f"fixed:{spec}")
    assert len(decoder.drafters[spec].loaded_head.body.layers) == 2
    ids = decoder.encode("Name two rivers in Europe.")
    result = decoder.generate(ids, max_new_tokens=24)
    assert result.token_ids == greedy_reference(embedded.model, ids, 24)
    assert result.stats.drafters()[spec].drafted > 0


def test_an_unknown_weights_word_is_read_as_part_of_the_path(embedded, head_dir):
    with pytest.raises(ValueError, match="not an EAGLE head directory.*a ':' suffix names the weights"):
        build_drafter(f"eagle:{head_dir}:int4", embedded)


def test_the_default_pool_drafts_with_the_shipped_head(embedded):
    """metasd ships a head for the embedded model: the default pool has it, and greedy output stays the target's."""
    assert shipped_head(embedded.model) is not None
    decoder = Decoder()
    assert decoder.drafter_names == list(DEFAULT_POOL)
    ids = decoder.encode("Explain what a binary search does, in two sentences.")
    result = decoder.generate(ids, max_new_tokens=48, policy="fixed:eagle")
    assert result.token_ids == greedy_reference(embedded.model, ids, 48)
    stats = result.stats.drafters()["eagle"]
    assert stats.accepted > 0  # a trained head: some of its tokens are the target's
