"""`metasd train-eagle` on a tiny random target: the corpus of its own answers and features, training that resumes
where it stopped, and a head the decoder drafts with (greedy output unchanged)."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers import greedy_reference, tiny_llama
from transformers import DynamicCache

from metasd import Decoder
from metasd.cached_model import CachedModel
from metasd.cli import main
from metasd.models.eagle_head import EagleHead, head_config_for, load_head
from metasd.specialists.eagle_corpus import (
    encode_documents,
    encode_prompts,
    read_corpus,
    refeature_corpus,
    write_corpus,
)
from metasd.specialists.eagle_loss import head_loss, head_passes
from metasd.specialists.eagle_sequences import StoredSequences
from metasd.specialists.eagle_train import TrainConfig, check_init, held_out_metrics, train_head

PROMPTS = ["Name a colour.", "Count to three.", "Say hello.", "What is two plus two?", "Write one word."]


@pytest.fixture(scope="module")
def tiny_target(embedded, tmp_path_factory):
    """A random two-layer Llama over the embedded model's vocabulary and tokenizer, saved as a directory."""
    torch.manual_seed(0)
    model = tiny_llama(49152, layers=2, positions=256, num_key_value_heads=1, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("tiny-target")
    model.save_pretrained(path)
    embedded.tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return str(path)


@pytest.fixture
def texts_file(tmp_path):
    """ShareGPT-style conversations, one cut short (passed over)."""
    chat = [{"from": "human", "value": p} for p in PROMPTS[:2]] + [{"from": "gpt", "value": "Blue, and three."}]
    path = tmp_path / "texts.jsonl"
    path.write_text(json.dumps({"conversations": chat}) + "\n" + '{"conversations": [{"from": "hum\n')
    return str(path)


def chat(prompts: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": p}] for p in prompts]


def test_train_eagle_writes_a_head_the_decoder_drafts_with(tiny_target, prompts_file, texts_file, tmp_path, capsys):
    out = tmp_path / "head"
    args = ["train-eagle", "--target", tiny_target, "--prompts", prompts_file, "--out", str(out), "--quiet"]
    args += ["--texts", texts_file]
    args += ["--max-new-tokens", "8", "--gen-batch", "2", "--epochs", "2", "--batch-tokens", "256"]
    assert main([*args, "--draft-vocab", "512", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["corpus"]["sequences"] == len(PROMPTS) and report["texts"]["sequences"] == 1
    held = report["training"]["held_out"]
    assert report["training"]["sequences"] + (held["sequences"] if held else 0) == len(PROMPTS) + 1
    seqs = read_corpus(out / "corpus")
    assert len(seqs) == len(PROMPTS) and all(s.features.shape == (len(s.tokens), 16) for s in seqs)
    decoder = Decoder(target=tiny_target, drafters=[f"eagle:{out}"], policy=f"fixed:eagle:{out}")
    ids = decoder.encode(PROMPTS[0])
    result = decoder.generate(ids, max_new_tokens=12)
    assert result.token_ids == greedy_reference(decoder.target.model, ids, 12)
    assert result.stats.drafters()[f"eagle:{out}"].drafted > 0


def test_train_eagle_grows_an_init_head_and_refuses_to_cut_one(tiny_target, prompts_file, tmp_path, capsys):
    """--head-layers grows an --init head (its default: the --init head's depth); fewer layers than the --init head
    has is refused before the target answers a single prompt."""
    base = ["train-eagle", "--target", tiny_target, "--quiet", "--threads", "1", "--batch-tokens", "256"]
    one = tmp_path / "one"
    answers = ["--prompts", prompts_file, "--max-new-tokens", "6", "--draft-vocab", "512"]
    assert main([*base, *answers, "--out", str(one)]) == 0
    phase = [*base, "--corpus", str(one / "corpus"), "--epochs", "0.01", "--lr", "0"]
    assert main([*phase, "--init", str(one), "--head-layers", "2", "--out", str(tmp_path / "two")]) == 0
    assert main([*phase, "--init", str(tmp_path / "two"), "--out", str(tmp_path / "three")]) == 0
    assert [load_head(tmp_path / n).head.config.decoder_layers for n in ("one", "two", "three")] == [1, 2, 2]
    capsys.readouterr()
    cut = [*base, "--prompts", prompts_file, "--init", str(tmp_path / "two"), "--head-layers", "1"]
    assert main([*cut, "--out", str(tmp_path / "four")]) == 2
    assert "can grow a head, not cut it" in capsys.readouterr().err
    assert not (tmp_path / "four" / "corpus").exists()


def test_a_head_trains_on_the_union_of_corpora_written_before(tiny_target, prompts_file, tmp_path, capsys):
    """The OFA head of the MetaEagle pool: no prompts, the domain corpora as they are; a missing one is refused."""
    from metasd.models.loading import load_model

    target = load_model(tiny_target)
    for name, prompts in (("a", PROMPTS[:3]), ("b", PROMPTS[3:])):
        write_corpus(target, encode_prompts(target.tokenizer, chat(prompts), 64), tmp_path / name, max_new_tokens=4)
    out = tmp_path / "union"
    args = ["train-eagle", "--target", tiny_target, "--out", str(out), "--quiet", "--epochs", "1", "--threads", "1"]
    args += ["--batch-tokens", "256", "--draft-vocab", "256"]
    assert main([*args, "--corpus", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    report = json.loads(capsys.readouterr().out)
    held = report["training"]["held_out"]
    assert report["corpus"] is None
    assert report["training"]["sequences"] + (held["sequences"] if held else 0) == len(PROMPTS)
    assert load_head(out).head.config.draft_vocab_size == 256
    assert main([*args, "--corpus", str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    assert "no corpus shards" in capsys.readouterr().err
    assert main(args) == 2
    assert "nothing to train on" in capsys.readouterr().err
    assert main([*args, "--corpus", str(tmp_path / "a"), "--feature-layers", "auto"]) == 2  # without --unroll 2
    assert "--feature-layers needs --unroll 2" in capsys.readouterr().err


def test_the_corpus_holds_the_targets_greedy_answers_and_features(tiny_target, tmp_path):
    from metasd.models.loading import load_model

    target = load_model(tiny_target)
    write_corpus(target, encode_prompts(target.tokenizer, chat(PROMPTS[:3]), 64), tmp_path, max_new_tokens=6)
    for seq in read_corpus(tmp_path):
        tokens = seq.tokens.long().tolist()
        with torch.no_grad():
            hidden = target.model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
        n = len(tokens) - 1  # the last token's feature is never needed (nothing follows it)
        assert torch.allclose(seq.features[:n].float(), hidden[:n], atol=1e-2)
    answers = [s.tokens.long().tolist() for s in read_corpus(tmp_path)]
    prompt_ids = [t[: len(t) - 6] for t in answers]
    assert all(a[len(p) :] == greedy_reference(target.model, p, 6) for a, p in zip(answers, prompt_ids, strict=True))


def test_training_resumes_from_its_checkpoint_where_it_stopped(tiny_target, tmp_path):
    from metasd.models.loading import load_model

    target = load_model(tiny_target)
    write_corpus(target, encode_prompts(target.tokenizer, chat(PROMPTS), 64), tmp_path / "corpus", max_new_tokens=6)
    seqs = read_corpus(tmp_path / "corpus")
    cfg = TrainConfig(epochs=3, batch_tokens=64, draft_vocab=256, unroll=2)  # with the training-time test
    train_head(target, StoredSequences(seqs), tmp_path / "whole", cfg)

    def interrupt(step: int, steps: int, metrics: dict) -> None:
        if step == 3:
            raise KeyboardInterrupt

    checkpoint = tmp_path / "checkpoint.pt"
    with pytest.raises(KeyboardInterrupt):
        train_head(
            target,
            StoredSequences(seqs),
            tmp_path / "resumed",
            cfg,
            checkpoint=checkpoint,
            save_every=1,
            progress=interrupt,
        )
    state = torch.load(checkpoint, weights_only=False)
    for setting in ("feature_layers", "head_layers", "grown_lr"):  # as written before these: read as they were then
        del state["config"][setting]
    torch.save(state, checkpoint)
    steps = []
    train_head(
        target,
        StoredSequences(seqs),
        tmp_path / "resumed",
        cfg,
        checkpoint=checkpoint,
        progress=lambda s, n, m: steps.append(s),
    )
    assert steps[0] == 4
    whole, resumed = load_head(tmp_path / "whole").head, load_head(tmp_path / "resumed").head
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_phase_starts_from_the_head_before_it_and_reads_text_it_did_not(tiny_target, tmp_path):
    from metasd.cli.train_eagle import _after_tokens, _first_tokens
    from metasd.models.loading import load_model

    target = load_model(tiny_target)
    write_corpus(target, encode_prompts(target.tokenizer, chat(PROMPTS), 64), tmp_path / "corpus", max_new_tokens=6)
    seqs = StoredSequences(read_corpus(tmp_path / "corpus"))
    first = TrainConfig(epochs=2, batch_tokens=64, draft_vocab=256, unroll=2)
    train_head(target, seqs, tmp_path / "one", first)
    before = load_head(tmp_path / "one").head
    again = TrainConfig(epochs=0.01, lr=0.0, batch_tokens=64, draft_vocab=64, unroll=2)  # a learning rate of 0
    record = train_head(target, seqs, tmp_path / "two", again, held_out=seqs, init=before)
    after = load_head(tmp_path / "two").head
    assert torch.equal(after.draft_vocab, before.draft_vocab)  # the head's own vocabulary, not a new 64
    for (name, a), (_, b) in zip(before.state_dict().items(), after.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # it started, and stayed, where the first phase ended
    assert record["held_out"]["sequences"] == len(seqs)
    with pytest.raises(ValueError, match="reads layers"):
        train_head(target, seqs, tmp_path / "four", TrainConfig(unroll=2, feature_layers=(0,)), init=before)
    deeper = TrainConfig(epochs=0.01, lr=0.0, batch_tokens=64, unroll=2, head_layers=2)
    train_head(target, seqs, tmp_path / "three", deeper, init=before)
    grown_head = load_head(tmp_path / "three").head
    assert len(grown_head.body.layers) == 2 and grown_head.config.decoder_layers == 2
    feats = torch.randn(1, 6, before.config.hidden_size)
    embeds = torch.randn(1, 6, before.config.hidden_size)
    with torch.no_grad():  # its new layer starts as the identity: it predicts what the head it grew from does
        torch.testing.assert_close(grown_head(feats, embeds), before(feats, embeds), atol=1e-3, rtol=1e-3)
    own_rate = replace(deeper, epochs=0.05, grown_lr=1e-2)  # the grown layer learns, the head's own stay put
    train_head(target, seqs, tmp_path / "six", own_rate, init=before)
    moved = load_head(tmp_path / "six").head
    for name, value in before.state_dict().items():
        assert torch.equal(moved.state_dict()[name], value), name
    assert moved.body.layers[1].self_attn.o_proj.weight.abs().max() > 0
    with pytest.raises(ValueError, match="2 decoder layers: a training can grow a head, not cut it"):
        train_head(target, seqs, tmp_path / "five", replace(again, head_layers=1), init=grown_head)
    assert check_init(grown_head, again).head_layers == 2  # unset: the depth of the head it starts from
    with pytest.raises(ValueError, match="--grown-lr"):  # a rate for layers where none grow
        check_init(grown_head, replace(again, grown_lr=1e-3))
    documents = [[1] * 5, [2] * 7, [3] * 4, [4] * 9]
    assert _first_tokens(documents, 10) == documents[:2] and _after_tokens(documents, 10) == documents[2:]
    assert _after_tokens(documents, 0) == documents and _after_tokens(documents, 100) == []


def test_documents_are_read_whole_in_one_prefill(tiny_target, texts_file, tmp_path):
    from metasd.models.loading import load_model

    target = load_model(tiny_target)
    (doc,) = encode_documents(target.tokenizer, [texts_file], 1000)
    assert target.tokenizer.decode(doc).count("Blue, and three.") == 1
    write_corpus(target, [doc, doc[:7]], tmp_path, max_new_tokens=0)
    assert sorted(s.tokens.tolist() for s in read_corpus(tmp_path)) == sorted([doc, doc[:7]])
    assert encode_documents(target.tokenizer, [texts_file], 7) == [doc[:7]]


def test_a_held_out_set_of_answers_counts_the_answers_positions_only(tiny_target, texts_file, tmp_path):
    """The corpus keeps each sequence's prompt length (a document's is 0); a held-out set of answers counts only
    the pairs whose next token is the answer's, the prompt staying context, while a document counts whole."""
    from metasd.models.loading import load_model

    target = load_model(tiny_target)
    prompts = encode_prompts(target.tokenizer, chat(PROMPTS[:3]), 64)
    write_corpus(target, prompts, tmp_path / "answers", max_new_tokens=6)
    (doc,) = encode_documents(target.tokenizer, [texts_file], 1000)
    write_corpus(target, [doc], tmp_path / "docs", max_new_tokens=0)
    answers, docs = read_corpus(tmp_path / "answers"), read_corpus(tmp_path / "docs")
    assert sorted(s.prompt for s in answers) == sorted(len(p) for p in prompts) and [s.prompt for s in docs] == [0]
    seqs = answers + docs
    rows = list(range(len(seqs)))
    _, feats, real = StoredSequences(seqs, answers_only=True).stack(rows, 256)
    _, same, every = StoredSequences(seqs).stack(rows, 256)
    torch.testing.assert_close(feats, same)  # the prompt's features stay: the head reads them as context
    counted = (real[:, 1:] & real[:, :-1]).sum(1).tolist()
    whole = (every[:, 1:] & every[:, :-1]).sum(1).tolist()
    assert whole[-1] == len(doc) - 1 and counted[-1] == whole[-1]  # a document: every next token
    for answer, n, all_pairs in zip(seqs[:-1], counted, whole, strict=False):  # the prompt's pairs left out
        assert n == all_pairs - (answer.prompt - 1) and n == len(answer.tokens) - answer.prompt - 1 > 0


@pytest.mark.parametrize(("layers", "depth"), [((), 1), ((0,), 1), ((0,), 2)])
def test_every_unrolled_pass_computes_what_the_draft_step_it_stands_for_computes(layers, depth):
    """Training-time test as deep as drafts go: pass s's entry i, fed pass s - 1's prediction of f_i, equals the
    step drafting token s after a catch-up over the true entries 0 .. i - s + 1 (the head's cache as `EagleDrafter`
    builds it) and s - 1 steps from its own predictions; in every decoder layer of a deeper head."""
    torch.manual_seed(0)
    model = tiny_llama(64, layers=1)
    head = EagleHead(head_config_for(model, 64, layers, depth), torch.arange(64)).eval()
    d = model.config.hidden_size
    feats, embeds = torch.randn(1, 9, d * (len(layers) + 1)), torch.randn(1, 9, d)
    with torch.no_grad():
        preds = head_passes(head, feats, embeds, unroll=4)
        assert len(preds) == 4 and len(head_passes(head, feats, embeds, unroll=1)) == 1
        for start in (0, 3, 5):  # a draft after true entry `start`
            cache = DynamicCache(config=head.body.config)
            out = head(head.fuse(feats[:, : start + 1]), embeds[:, : start + 1], cache=cache)[:, -1:]
            assert torch.allclose(out[:, 0], preds[0][:, start], atol=1e-5)
            for step in range(2, 5):  # draft token `step`, from the head's own previous prediction
                i = start + step - 1
                out = head(out, embeds[:, i : i + 1], cache=cache)
                assert torch.allclose(out[:, 0], preds[step - 1][:, i], atol=1e-5), (start, step)


def _chain_text(head, embed, readout, feats, n: int, follow: bool) -> torch.Tensor:
    """Tokens [1, n] built left to right so that the token each entry's first-pass prediction hands on (entry j
    drafts token j + 2) is the head's own top-1 there (`follow`) or never is."""
    tokens = torch.zeros(1, n, dtype=torch.long)
    with torch.no_grad():
        for j in range(n - 2):  # entry j reads tokens up to j + 1 only, so later tokens leave its prediction alone
            top = (head_passes(head, feats[:, : j + 1], embed(tokens[:, 1 : j + 2]), 1)[0][0, j] @ readout.T).argmax()
            tokens[0, j + 2] = top if follow else (top + 1) % readout.shape[0]
    return tokens


def test_the_alignment_mask_trains_an_unrolled_pass_only_where_the_draft_before_it_held_its_input():
    """GRIFFIN's mask (`align_top`): on text that always follows the head's own top-1 the second pass trains on every
    entry, as without the mask; on text that never does, on none, so the loss is the first pass's alone."""
    torch.manual_seed(0)
    model = tiny_llama(64, layers=1)
    head = EagleHead(head_config_for(model, 64, ()), torch.arange(64)).eval()
    embed, readout = model.get_input_embeddings(), model.get_output_embeddings().weight.detach()
    n = 12
    feats = torch.randn(1, n, model.config.hidden_size)
    real = torch.ones(1, n, dtype=torch.bool)

    def loss(tokens, **cfg):
        with torch.no_grad():
            return head_loss(head, embed, readout, tokens, feats, real, TrainConfig(noise=0.0, **cfg))[0]

    follows, never = (_chain_text(head, embed, readout, feats, n, follow) for follow in (True, False))
    torch.testing.assert_close(loss(follows, unroll=2, align_top=1), loss(follows, unroll=2))
    torch.testing.assert_close(loss(never, unroll=2, align_top=1), loss(never, unroll=1))
    assert loss(never, unroll=2) > loss(never, unroll=1) + 0.1
    torch.testing.assert_close(loss(never, unroll=2, align_top=64), loss(never, unroll=2))  # top-64: all of it
    with pytest.raises(ValueError, match="align_top"):
        train_head(SimpleNamespace(model=model), None, None, TrainConfig(unroll=1, align_top=2))


def _memorised(target, corpus, out, unroll: int, **overrides):
    """A head trained to memorise `corpus` (many epochs, no noise, nothing held out is needed)."""
    cfg = TrainConfig(epochs=600, lr=1e-2, batch_tokens=512, draft_vocab=512, noise=0.0, unroll=unroll, **overrides)
    train_head(target, StoredSequences(read_corpus(corpus)), out, cfg)
    return f"eagle:{out}"


def _acceptance(tiny_target, spec, prompts, k: int):
    """Through the engine: (share of drafted tokens accepted, per-position acceptance) drafting k tokens a round."""
    decoder = Decoder(target=tiny_target, drafters=[spec], policy=f"fixed:{spec}", draft_len=k)
    drafted = accepted = 0
    positions = []
    for prompt in prompts:
        stats = decoder.generate(prompt, max_new_tokens=24).stats
        drafted += stats.drafters()[spec].drafted
        accepted += stats.drafters()[spec].accepted
        positions.append(stats.per_position_acceptance())
    return accepted / max(drafted, 1), [sum(p[j] for p in positions) / len(positions) for j in range(k)]


@pytest.fixture(scope="module")
def memorised_corpus(tiny_target, tmp_path_factory):
    """The tiny target's own greedy answers to the prompts, with its features: text whose next token needs the
    feature (the answers share their first ten tokens and part after them)."""
    from metasd.models.loading import load_model

    target = load_model(tiny_target)
    out = tmp_path_factory.mktemp("memorised")
    write_corpus(target, encode_prompts(target.tokenizer, chat(PROMPTS), 64), out, max_new_tokens=24)
    return target, out


def test_a_head_that_memorised_its_corpus_drafts_it_through_the_engine(
    tiny_target, memorised_corpus, tmp_path, monkeypatch
):
    """Features and tokens are paired alike in training and in drafting: a head that memorised the target's
    answers drafts them at >= 90 % acceptance. Drafting from features one position late (the off-by-one a cache
    or a drafter could make), it does not, so that check fails on such a bug."""
    target, corpus = memorised_corpus
    spec = _memorised(target, corpus, tmp_path / "head", unroll=1)
    rate, _ = _acceptance(tiny_target, spec, PROMPTS, k=1)
    assert rate >= 0.9, rate
    features_for = CachedModel.features_for
    late = lambda cache, tokens: torch.roll(features_for(cache, tokens), 1, dims=0)  # noqa: E731
    monkeypatch.setattr(CachedModel, "features_for", late)
    rate, _ = _acceptance(tiny_target, spec, PROMPTS, k=1)
    assert rate < 0.5, rate


def test_a_deeper_unroll_keeps_a_drafts_later_positions(memorised_corpus, tmp_path):
    """On memorised text, a head trained with the training-time test over 4 steps agrees with the target at a
    draft's 4th token where one trained on the first step alone falls off (each pass computes what the drafting step
    it stands for computes: the test above; agreement here is acceptance there)."""
    target, corpus = memorised_corpus
    seqs = StoredSequences(read_corpus(corpus))
    four = TrainConfig(batch_tokens=512, draft_vocab=512, noise=0.0, unroll=4)
    rates = {}
    for unroll in (1, 4):
        _memorised(target, corpus, tmp_path / str(unroll), unroll)
        head = load_head(tmp_path / str(unroll)).head
        readout = target.model.get_output_embeddings().weight[head.draft_vocab].detach().float()
        rates[unroll] = held_out_metrics(head, target.model.get_input_embeddings(), readout, seqs, four)
    assert rates[4]["top1_4"] >= 0.8 and rates[4]["top1_4"] > rates[1]["top1_4"] + 0.3, rates


def test_held_out_agreement_misses_a_token_the_target_picks_outside_the_draft_vocabulary(memorised_corpus, tmp_path):
    """Agreement is judged against the target's argmax over its whole vocabulary: the memorised head with its draft
    vocabulary short of the tokens the target picks most still agrees over what is left of the vocabulary, but
    every position where the target picks one of those tokens is a miss, as it is in decoding."""
    target, corpus = memorised_corpus
    seqs = StoredSequences(read_corpus(corpus))
    cfg = TrainConfig(batch_tokens=512, draft_vocab=512, noise=0.0, unroll=2)
    _memorised(target, corpus, tmp_path / "head", unroll=1)
    head = load_head(tmp_path / "head").head
    whole = target.model.get_output_embeddings().weight.detach()
    hidden = target.model.config.hidden_size
    picks = torch.cat([(s.features[1:, -hidden:].float() @ whole.T).argmax(-1) for s in read_corpus(corpus)])
    tokens, counts = picks.unique(return_counts=True)
    vocab = set(head.draft_vocab.tolist())
    most = [t for t in tokens[counts.argsort(descending=True)].tolist() if t in vocab][:6]
    share = float(torch.isin(picks, torch.tensor(most)).float().mean())
    assert share >= 0.15, share
    spare = [t for t in range(whole.shape[0]) if t not in vocab][: len(most)]
    head.draft_vocab = torch.tensor(sorted(vocab - set(most) | set(spare)))
    embed, readout = target.model.get_input_embeddings(), whole[head.draft_vocab].float()
    over_the_draft_vocabulary = held_out_metrics(head, embed, readout, seqs, cfg)["top1"]
    over_every_token = held_out_metrics(head, embed, readout, seqs, cfg, whole)["top1"]
    assert over_every_token <= 1 - share + 1e-6 < over_the_draft_vocabulary - 0.05, (
        share,
        over_every_token,
        over_the_draft_vocabulary,
    )


def test_a_fused_corpus_trains_a_fused_head_and_a_plain_one_on_the_same_data(tiny_target, tmp_path):
    """EAGLE-3's fused features: the corpus holds layer 0's output then the final norm's; a head reading both and
    one reading the final norm's alone train on it; both draft losslessly; mismatches are clear errors."""
    from metasd.models.loading import load_model

    target = load_model(tiny_target)
    corpus = tmp_path / "corpus"
    write_corpus(
        target, encode_prompts(target.tokenizer, chat(PROMPTS), 64), corpus, max_new_tokens=6, feature_layers=(0,)
    )
    d = target.model.config.hidden_size
    for seq in read_corpus(corpus):
        tokens = seq.tokens.long().tolist()
        with torch.no_grad():
            out = target.model.model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
        want = torch.cat([out.hidden_states[1][0], out.last_hidden_state[0]], dim=-1)
        n = len(tokens) - 1
        assert seq.features.shape == (len(tokens), 2 * d)
        assert torch.allclose(seq.features[:n].float(), want[:n], atol=1e-2)
    final, whole = read_corpus(corpus, ()), read_corpus(corpus)
    assert all(torch.equal(a.features, b.features[:, d:]) for a, b in zip(final, whole, strict=True))
    with pytest.raises(ValueError, match=r"holds features of decoder layers \[0\], not \[1\]"):
        read_corpus(corpus, (1,))
    with pytest.raises(ValueError, match="write this corpus to another directory"):
        write_corpus(target, encode_prompts(target.tokenizer, chat(PROMPTS), 64), corpus, max_new_tokens=6)
    cfg = TrainConfig(epochs=2, batch_tokens=64, draft_vocab=256, unroll=2, feature_layers=(0,))
    with pytest.raises(ValueError, match="read it with read_corpus"):
        train_head(target, StoredSequences(read_corpus(corpus, ())), tmp_path / "wrong", cfg)
    with pytest.raises(ValueError, match="need the training-time test"):
        train_head(target, StoredSequences(read_corpus(corpus)), tmp_path / "wrong", TrainConfig(feature_layers=(0,)))
    for name, layers in (("fused", (0,)), ("plain", ())):
        cfg = TrainConfig(epochs=2, batch_tokens=64, draft_vocab=256, unroll=2, feature_layers=layers)
        train_head(target, StoredSequences(read_corpus(corpus, layers)), tmp_path / name, cfg)
        assert load_head(tmp_path / name).head.config.feature_layers == layers
    specs = [f"eagle:{tmp_path / name}" for name in ("fused", "plain")]
    decoder = Decoder(target=tiny_target, drafters=specs)
    ids = decoder.encode(PROMPTS[0])
    for spec in specs:
        result = decoder.generate(ids, max_new_tokens=12, policy=f"fixed:{spec}")
        assert result.token_ids == greedy_reference(decoder.target.model, ids, 12)
        assert result.stats.drafters()[spec].drafted > 0


def test_a_corpus_refeatured_keeps_its_sequences_in_order_with_the_layers_added(tiny_target, tmp_path):
    from metasd.models.loading import load_model

    target = load_model(tiny_target)
    plain, fused = tmp_path / "plain", tmp_path / "fused"
    write_corpus(target, encode_prompts(target.tokenizer, chat(PROMPTS), 64), plain, max_new_tokens=6, batch_size=2)
    summary = refeature_corpus(target, plain, fused, (0,))
    before, after = read_corpus(plain), read_corpus(fused)
    assert summary["sequences"] == len(before) == len(after)
    assert [p.name for p in sorted(fused.glob("shard-*"))] == [p.name for p in sorted(plain.glob("shard-*"))]
    d = target.model.config.hidden_size
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old.tokens, new.tokens)
        n = len(old.tokens) - 1  # the plain corpus never computed its last token's feature
        assert torch.allclose(old.features[:n].float(), new.features[:n, d:].float(), atol=1e-2)
        with torch.no_grad():
            out = target.model.model(input_ids=old.tokens.long()[None], output_hidden_states=True)
        assert torch.allclose(new.features[:, :d].float(), out.hidden_states[1][0], atol=1e-2)
    with pytest.raises(ValueError, match="write this corpus to another directory"):
        refeature_corpus(target, plain, fused, (1,))


def test_a_prefill_gives_the_features_the_corpus_captured_while_decoding(memorised_corpus):
    """Streamed training reads the features a batched prefill computes: the same, position by position, as those
    the corpus captured while the target wrote its answers (float16 there), fused layers included, and no feature
    where a row is padding."""
    from metasd.specialists.eagle_prefill import PrefilledSequences

    target, corpus = memorised_corpus
    layers = (0,)
    stored = read_corpus(corpus)
    refeature_corpus(target, corpus, corpus.parent / "fused", layers)
    fused = StoredSequences(read_corpus(corpus.parent / "fused"))
    streamed = PrefilledSequences(target.model, [s.tokens for s in stored], layers)
    assert streamed.feature_width() == fused.feature_width() == 32
    idx = [0, 3, 4]  # rows of different lengths: padding on the shorter ones
    tokens, feats, real = streamed.stack(idx, 64)
    want_tokens, want_feats, want_real = fused.stack(idx, 64)
    assert torch.equal(tokens, want_tokens) and len({int(n) for n in real.sum(-1)}) > 1
    assert torch.equal(real & want_real, want_real)  # the corpus lacks each answer's last feature; a prefill has it
    torch.testing.assert_close(feats[want_real], want_feats[want_real], atol=2e-3, rtol=2e-3)
    assert not feats[~real].any()


def test_train_eagle_streams_texts_and_reports_a_learning_curve(
    tiny_target, texts_file, memorised_corpus, tmp_path, capsys
):
    """--stream: the texts' features come from a prefill per batch (nothing written); --held-out reports on another
    corpus (the target's answers); --evaluate-every writes the head and a line of held-out metrics as it goes."""
    _, corpus = memorised_corpus
    out = tmp_path / "streamed"
    args = ["train-eagle", "--target", tiny_target, "--out", str(out), "--quiet", "--threads", "1", "--stream"]
    args += ["--texts", texts_file, texts_file, "--held-out", str(corpus), "--epochs", "4", "--batch-tokens", "64"]
    assert main([*args, "--draft-vocab", "256", "--evaluate-every", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["texts"]["streamed"] and report["texts"]["sequences"] == 2 and not (out / "texts").exists()
    assert report["training"]["sequences"] == 2 and report["training"]["held_out"]["sequences"] == len(PROMPTS)
    curve = [json.loads(line) for line in (out / "learning.jsonl").read_text().splitlines()]
    assert [c["step"] for c in curve] == list(range(2, report["training"]["steps"], 2)) and curve
    assert all(c["held_out"]["sequences"] == len(PROMPTS) for c in curve)
    assert load_head(out).head.config.draft_vocab_size == 256
