"""Training data for an EAGLE head: the target's own answers to chat prompts, with its features at every position.

EAGLE (Li et al., arXiv 2401.15077) trains its head on the target's final-layer features; a head learns only what
it is shown, so the text is the target's own greedy answers (what it will draft at decoding time) to prompts from
corpora that are not benchmarks. One batched decoding pass writes both: the tokens of prompt + answer, and the
target's features (the output of its final norm, what its LM head reads, after the outputs of the decoder layers a
fused head reads: `models.features.feature_tap`) at each position, captured as it decodes (no second forward). Shards
are written per batch, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from ..files import written_aside
from ..models.chat import chat_prompt_ids
from ..models.features import feature_columns, feature_tap
from .eagle_sequences import TokenFeatures
from .prompts import chat_message, read_prompts


def read_prompt_files(paths: list[str]) -> list[list[dict]]:
    """Prompts (chat messages) from JSONL files in `metasd distill`'s formats, interleaved file by file: any prefix
    of the list keeps each file's share."""
    per_file = [read_prompts(path) for path in paths]
    return [group[i] for i in range(max(len(g) for g in per_file)) for group in per_file if i < len(group)]


@torch.inference_mode()
def _answer_batch(
    model, prompts: list[list[int]], max_new_tokens: int, eos: frozenset[int], feature_layers: tuple[int, ...]
) -> list[TokenFeatures]:
    """Greedy answers for a left-padded batch, with the features of every real position."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    cache = DynamicCache(config=model.config)
    answers: list[list[int]] = [[] for _ in prompts]
    feats: list[list[torch.Tensor]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    step_ids = ids
    for step in range(max_new_tokens + 1):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
        with feature_tap(model, feature_layers) as tapped:
            hidden = model.model(
                input_ids=step_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
            ).last_hidden_state
            features = tapped()
        for row in range(len(prompts)):
            if step == 0:
                feats[row].append(features[row, width - len(prompts[row]) :].float().cpu())
            elif step <= len(answers[row]):  # this step fed answers[row][step - 1], a real token
                feats[row].append(features[row, -1:].float().cpu())
        if step == max_new_tokens:
            break
        nxt = model.lm_head(hidden[:, -1]).argmax(-1).cpu()
        for row, token in enumerate(nxt.tolist()):
            if not done[row]:
                answers[row].append(token)
                done[row] = token in eos or len(answers[row]) >= max_new_tokens
        if bool(done.all()):
            break
        step_ids = nxt.view(-1, 1).to(device)
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long, device=device)], dim=1)
    out = []
    for row, p in enumerate(prompts):
        tokens = torch.tensor(p + answers[row], dtype=torch.int32)
        features = torch.cat(feats[row])[: len(tokens)]
        if features.shape[0] < len(tokens):  # the last token's feature was never computed: pad it (never read)
            features = torch.cat([features, torch.zeros(len(tokens) - features.shape[0], features.shape[1])])
        out.append(TokenFeatures(tokens, features.half()))
    return out


def encode_prompts(tokenizer, prompts: list[list[dict]], max_tokens: int) -> list[list[int]]:
    """Chat prompts with the generation prompt, as `Decoder.encode`; those over max_tokens are left out."""
    return [ids for ids in (chat_prompt_ids(tokenizer, m) for m in prompts) if len(ids) <= max_tokens]


def encode_documents(tokenizer, paths: list[str], max_tokens: int) -> list[list[int]]:
    """Whole conversations (JSONL records with "conversations" or "messages", ShareGPT's roles mapped to user /
    assistant) in the chat template, cut to their first max_tokens tokens: text the target reads in one prefill.
    Lines that are not such records are passed over."""
    out = []
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                turns = record.get("conversations") or record.get("messages") or []
                messages = [chat_message(t) for t in turns]
            except (json.JSONDecodeError, AttributeError):
                continue  # a record cut short in the corpus: the others suffice
            messages = [m for m in messages if isinstance(m["content"], str) and m["content"].strip()]
            if len(messages) >= 2:
                text = tokenizer.apply_chat_template(messages, tokenize=False)
                out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"])[:max_tokens])
    if not out:
        raise ValueError(f"no conversations in {paths}")
    return out


def write_corpus(
    loaded,
    sequences: list[list[int]],
    out: Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    max_tokens: int | None = None,
    feature_layers: tuple[int, ...] = (),
    progress: Callable[[int, int, int], None] | None = None,
) -> dict:
    """Decode every token sequence (an encoded prompt) with the target, greedy and batched, for up to max_new_tokens
    (0: a prefill only, for documents); write (tokens, features) under `out`, the features with the outputs of
    `feature_layers` before the final norm's (a directory holds one choice: a rerun with another is refused).

    Batches are formed from sequences sorted by length (less
    padding) and decoded in a fixed shuffled order (any prefix of the work is a fair sample of the sequences), until
    `max_tokens` tokens (sequences + answers) are written; each is written as `shard-NNNNN.safetensors`, and a shard
    already on disk is kept, so a rerun resumes.
    progress(batches_done, batches_total, tokens_written) is called after each batch. Returns the summary that is
    also written to out/corpus.json."""
    _claim(out, feature_layers)
    encoded = sorted(sequences, key=len)
    batches = [encoded[i : i + batch_size] for i in range(0, len(encoded), batch_size)]
    random.Random(0).shuffle(batches)
    started, tokens, used = time.perf_counter(), 0, 0
    for index, batch in enumerate(batches):
        if max_tokens is not None and tokens >= max_tokens:
            break
        used += len(batch)
        path = out / f"shard-{index:05d}.safetensors"
        if not path.is_file():
            seqs = _answer_batch(loaded.model, batch, max_new_tokens, loaded.eos_token_ids, tuple(feature_layers))
            _save_shard(path, seqs, [len(p) for p in batch])
        with safe_open(str(path), "pt") as shard:  # its lengths, not its features
            tokens += int(shard.get_tensor("lengths").sum())
        if progress is not None:
            progress(index + 1, len(batches), tokens)
    summary = {
        "target": loaded.spec,
        "sequences": used,
        "tokens": tokens,
        "max_new_tokens": max_new_tokens,
        "feature_layers": list(feature_layers),
        "seconds": round(time.perf_counter() - started, 1),
    }
    _write_summary(out, summary)
    return summary


def _claim(out: Path, feature_layers: tuple[int, ...]) -> None:
    """`out` will hold features of `feature_layers`: refused where its shards hold others (a rerun resumes)."""
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("shard-*.safetensors")) and corpus_layers(out) != tuple(feature_layers):
        raise ValueError(
            f"{out} holds features of decoder layers {list(corpus_layers(out))} (and the final norm), not "
            f"{list(feature_layers)}: write this corpus to another directory (a corpus holding more layers than a "
            "head reads is read for it as it is: train without --prompts)"
        )
    if not (out / "corpus.json").is_file():
        _write_summary(out, {"feature_layers": list(feature_layers)})


def _write_summary(out: Path, summary: dict) -> None:
    with written_aside(out / "corpus.json") as aside:
        aside.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")


def _save_shard(path: Path, seqs: list[TokenFeatures], prompt_lengths: list[int]) -> None:
    if not all(bool(s.features.isfinite().all()) for s in seqs):
        raise ValueError(f"{path}: a feature overflows float16 (a decoder layer's output): choose other layers")
    tensors = {
        "tokens": torch.cat([s.tokens for s in seqs]),
        "features": torch.cat([s.features for s in seqs]),
        "lengths": torch.tensor([len(s.tokens) for s in seqs], dtype=torch.int64),
        "prompt_lengths": torch.tensor(prompt_lengths, dtype=torch.int64),
    }
    with written_aside(path) as aside:
        save_file(tensors, str(aside))


def refeature_corpus(
    loaded,
    source: Path,
    out: Path,
    feature_layers: tuple[int, ...],
    progress: Callable[[int, int, int], None] | None = None,
) -> dict:
    """The corpus at `source`, shard by shard and in its order, with the features of `feature_layers` and the final
    norm, from one batched prefill of each shard's sequences (the same tokens, so the same held-out split): a
    corpus written before fused features, made readable by a head that fuses them, without decoding it again.
    Resumes like `write_corpus`."""
    shards = sorted(source.glob("shard-*.safetensors"))
    if not shards:
        raise ValueError(f"no corpus shards under {source}")
    _claim(out, feature_layers)
    started, sequences, tokens = time.perf_counter(), 0, 0
    for index, shard in enumerate(shards):
        data = load_file(str(shard))
        offsets = [0, *data["lengths"].cumsum(0).tolist()]
        batch = [data["tokens"][a:b].tolist() for a, b in zip(offsets, offsets[1:], strict=False)]
        path = out / shard.name
        if not path.is_file():
            seqs = _answer_batch(loaded.model, batch, 0, loaded.eos_token_ids, tuple(feature_layers))
            _save_shard(path, seqs, data["prompt_lengths"].tolist())
        sequences, tokens = sequences + len(batch), tokens + int(data["lengths"].sum())
        if progress is not None:
            progress(index + 1, len(shards), tokens)
    summary = {
        "target": loaded.spec,
        "source": str(source),
        "sequences": sequences,
        "tokens": tokens,
        "feature_layers": list(feature_layers),
        "seconds": round(time.perf_counter() - started, 1),
    }
    _write_summary(out, summary)
    return summary


def corpus_layers(out: Path) -> tuple[int, ...]:
    """The decoder layers whose outputs a corpus holds before the final norm's (none for one written before
    fused features)."""
    summary = out / "corpus.json"
    return tuple(json.loads(summary.read_text(encoding="utf-8")).get("feature_layers", [])) if summary.is_file() else ()


def read_corpus(out: Path, feature_layers: tuple[int, ...] | None = None) -> list[TokenFeatures]:
    """Every sequence of the shards under `out`; with feature_layers, only those layers' blocks of its features
    and the final norm's (a head reading fewer layers than the corpus holds trains on the same data)."""
    shards = sorted(out.glob("shard-*.safetensors"))
    if not shards:
        raise ValueError(f"no corpus shards under {out} (write them with write_corpus / metasd train-eagle)")
    held = corpus_layers(out)
    wanted = held if feature_layers is None else tuple(feature_layers)
    if not set(wanted) <= set(held):
        raise ValueError(
            f"{out} holds features of decoder layers {list(held)}, not {list(wanted)}: write a corpus with "
            f"--feature-layers {','.join(map(str, wanted))}"
        )
    seqs = []
    for path in shards:
        data = load_file(str(path))
        features = data["features"]
        if features.shape[1] % (len(held) + 1):
            raise ValueError(f"{path} has features of width {features.shape[1]}, not {len(held) + 1} blocks")
        columns = feature_columns(held, wanted, features.shape[1] // (len(held) + 1))
        if columns is not None:
            features = features[:, columns]
        offsets = [0, *data["lengths"].cumsum(0).tolist()]
        prompts = data["prompt_lengths"].tolist()
        for a, b, prompt in zip(offsets[:-1], offsets[1:], prompts, strict=True):
            seqs.append(TokenFeatures(data["tokens"][a:b], features[a:b], prompt if prompt < b - a else 0))
    return seqs
