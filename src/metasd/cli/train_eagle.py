"""`metasd train-eagle`: train an EAGLE head (the `eagle:DIR` drafter) on the target's own answers and features."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .args import add_target_arg, set_threads


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `metasd train-eagle` subcommand's arguments."""
    p = sub.add_parser("train-eagle", help="train an EAGLE head that drafts from the target's features (eagle:DIR)")
    add_target_arg(p, use="the target the head drafts for: ")
    p.add_argument("--dtype", default="float32", help="the target's dtype while writing the corpus and training")
    p.add_argument(
        "--prompts",
        nargs="*",
        default=[],
        help="JSONL prompt files (metasd distill's formats), interleaved: the target answers them into the first "
        "--corpus directory (resumable)",
    )
    p.add_argument("--out", required=True, help="the head directory to write (eagle:OUT loads it)")
    p.add_argument(
        "--corpus",
        nargs="+",
        default=None,
        help="corpus directories to train on (default: OUT/corpus); the first receives the answers to --prompts, "
        "the others are read as written by earlier runs (e.g. domain corpora for a head trained on their union)",
    )
    p.add_argument(
        "--texts",
        nargs="*",
        default=[],
        help="JSONL conversations the target reads (prefill only: its features on them, no answers) as more data",
    )
    p.add_argument("--texts-corpus", default=None, help="where their features go (default: OUT/texts)")
    p.add_argument(
        "--stream",
        action="store_true",
        help="compute the texts' features by a prefill as each training batch needs them instead of writing them "
        "to --texts-corpus: no disk, any corpus size, one target forward per position per epoch",
    )
    p.add_argument(
        "--held-out",
        nargs="+",
        default=None,
        help="corpus directories to report held-out metrics on instead of the first ~2 %% of the training data "
        "(e.g. the target's answers to prompts no training text holds), counting the answers' tokens only (the "
        "prompts are context: drafting never drafts a prompt)",
    )
    p.add_argument(
        "--evaluate-every",
        type=int,
        default=None,
        help="every N steps, write the head to OUT and its held-out metrics to OUT/learning.jsonl",
    )
    p.add_argument("--texts-tokens", type=int, default=None, help="stop reading texts after this many tokens")
    p.add_argument(
        "--texts-skip-tokens",
        type=int,
        default=0,
        help="first skip the conversations that hold this many tokens (a later phase reads text an earlier one did "
        "not: give it the earlier phase's --texts-tokens)",
    )
    p.add_argument("--max-text-tokens", type=int, default=1024, help="each conversation's first N tokens")
    p.add_argument("--corpus-tokens", type=int, default=None, help="stop writing the corpus after this many tokens")
    p.add_argument("--max-new-tokens", type=int, default=256, help="target answer length (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts are skipped")
    p.add_argument("--gen-batch", type=int, default=48, help="prompts the target answers at once (default: 48)")
    _add_training_arguments(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=run)


def _add_training_arguments(p: argparse.ArgumentParser) -> None:
    """How the head trains: the schedule, the batches, the draft vocabulary, the unroll, the features and the
    head's depth."""
    p.add_argument(
        "--init",
        default=None,
        help="start from this head directory's weights and draft vocabulary (a later phase of a long training on "
        "more data, or a domain's head grown from a general one) instead of a new head",
    )
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the corpus (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, cosine to 0 (default: %(default)s)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="padded positions per step (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (default: %(default)s)")
    p.add_argument(
        "--unroll",
        type=int,
        choices=range(1, 9),  # specialists.eagle_train.MAX_UNROLL (not imported: --help stays light)
        metavar="1..8",
        default=1,
        help="passes per training step: from 2 on, also train on the head's own predicted features, as the steps "
        "drafting tokens 2 .. N read them (EAGLE-3's training-time test; about N times the training time; as deep "
        "as the drafts the policy makes) (default: %(default)s)",
    )
    p.add_argument(
        "--align-top",
        type=int,
        metavar="K",
        default=0,
        help="GRIFFIN's loss mask (arXiv 2502.11018): an unrolled pass trains only where every earlier pass held "
        "the token it hands on among its K likeliest; 0 trains every pass everywhere (default: %(default)s)",
    )
    p.add_argument(
        "--feature-layers",
        default="none",
        help="decoder layers whose outputs the head reads beside the final norm's (EAGLE-3's fused features): "
        "'auto' (a low and a middle layer: 1 and L/2 - 1 of L), comma-separated indices, or 'none'; needs "
        "--unroll >= 2; a corpus is written with them, and one holding more is read for these (default: %(default)s)",
    )
    p.add_argument(
        "--head-layers",
        type=int,
        metavar="N",
        default=None,
        help="the head's own decoder layers; a head given by --init grows to them, its new layers starting as the "
        "identity (default: the --init head's, else 1, EAGLE's)",
    )
    p.add_argument(
        "--grown-lr",
        type=float,
        metavar="LR",
        default=None,
        help="peak learning rate of the layers --head-layers adds to an --init head (they start as the identity, "
        "and the head's own layers may want a gentler rate) (default: --lr)",
    )
    p.add_argument(
        "--autocast",
        action="store_true",
        help="train the head's matmuls in bfloat16 (float32 weights): faster where the CPU has bfloat16 matmuls",
    )


def run(args: argparse.Namespace) -> None:
    """Run `metasd train-eagle` with the parsed arguments."""
    from ..models.eagle_head import load_head
    from ..models.loading import load_model
    from ..specialists.eagle_train import check_init

    set_threads(args.threads)
    _check_args(args)
    out = Path(args.out)
    corpus_dirs = [Path(c) for c in args.corpus] if args.corpus else [out / "corpus"] if args.prompts else []
    if not corpus_dirs and not args.texts:
        raise ValueError("nothing to train on: give --prompts (the target answers them), --corpus or --texts")
    target = load_model(args.target, args.dtype)
    layers = feature_layers(args.feature_layers, target.model.config.num_hidden_layers)
    init = None if args.init is None else load_head(args.init, target.model).head
    cfg = check_init(init, _train_config(args, layers))  # refused before the corpus is written, not after
    started = time.perf_counter()
    corpus, texts, seqs = _corpus(args, target, layers, corpus_dirs)
    corpus_seconds = time.perf_counter() - started
    summary = _train(args, target, layers, seqs, cfg, init)
    report = {"corpus": corpus, "texts": texts, "corpus_wall_seconds": round(corpus_seconds, 1), "training": summary}
    print(json.dumps(report, indent=1))


def _check_args(args: argparse.Namespace) -> None:
    """Refuse counts below 1, and fused features without the training-time test."""
    for name in (
        "corpus_tokens",
        "texts_tokens",
        "max_text_tokens",
        "max_new_tokens",
        "max_prompt_tokens",
        "gen_batch",
        "batch_tokens",
        "draft_vocab",
        "evaluate_every",
        "head_layers",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.texts_skip_tokens < 0:
        raise ValueError(f"--texts-skip-tokens must be >= 0, got {args.texts_skip_tokens}")
    if args.texts_skip_tokens and not args.stream:
        raise ValueError("--texts-skip-tokens reads texts streamed (--stream)")
    if args.feature_layers != "none" and args.unroll < 2:
        raise ValueError(
            "--feature-layers needs --unroll 2 or more: from its second draft token on, a head reads its own "
            "predictions, and only the training-time test shows it those"
        )


def _corpus(args: argparse.Namespace, target, layers: tuple[int, ...], corpus_dirs: list[Path]):
    """(the report of the answers written, the report of the texts, the sequences to train on): the target's answers
    to --prompts written to the first corpus directory, every corpus directory read, then the texts, streamed or
    written to --texts-corpus."""
    from tqdm import tqdm

    from ..specialists.eagle_corpus import encode_prompts, read_corpus, read_prompt_files, write_corpus

    with tqdm(unit="batch", desc="target answers", disable=args.quiet) as bar:

        def answered(done: int, total: int, tokens: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
            bar.set_postfix(tokens=tokens)

        corpus = None
        if args.prompts:
            corpus = write_corpus(
                target,
                encode_prompts(target.tokenizer, read_prompt_files(args.prompts), args.max_prompt_tokens),
                corpus_dirs[0],
                max_new_tokens=args.max_new_tokens,
                batch_size=args.gen_batch,
                max_tokens=args.corpus_tokens,
                feature_layers=layers,
                progress=answered,
            )
        seqs = [s for d in corpus_dirs for s in read_corpus(d, layers)]
        texts = None
        if args.texts and args.stream:
            texts, more = _streamed_texts(args, target)
            seqs += more
        elif args.texts:
            bar.reset()
            bar.set_description("texts read")
            texts, more = _stored_texts(args, target, layers, answered)
            seqs += more
    return corpus, texts, seqs


def _streamed_texts(args: argparse.Namespace, target) -> tuple[dict, list]:
    """The texts' report and token sequences, with no features: a prefill computes them as training needs them."""
    import torch

    from ..specialists.eagle_corpus import encode_documents
    from ..specialists.eagle_sequences import TokenFeatures

    documents = encode_documents(target.tokenizer, args.texts, args.max_text_tokens)
    documents = _first_tokens(_after_tokens(documents, args.texts_skip_tokens), args.texts_tokens)
    texts = {"sequences": len(documents), "tokens": sum(map(len, documents)), "streamed": True}
    return texts, [TokenFeatures(torch.tensor(d, dtype=torch.int32), torch.zeros(0)) for d in documents]


def _stored_texts(args: argparse.Namespace, target, layers: tuple[int, ...], progress) -> tuple[dict, list]:
    """The texts' report and sequences: the target's features on them written to --texts-corpus (default:
    OUT/texts), then read back."""
    from ..specialists.eagle_corpus import encode_documents, read_corpus, write_corpus

    texts_dir = Path(args.texts_corpus) if args.texts_corpus else Path(args.out) / "texts"
    texts = write_corpus(
        target,
        encode_documents(target.tokenizer, args.texts, args.max_text_tokens),
        texts_dir,
        max_new_tokens=0,
        batch_size=8,
        max_tokens=args.texts_tokens,
        feature_layers=layers,
        progress=progress,
    )
    return texts, read_corpus(texts_dir, layers)


def _train_config(args: argparse.Namespace, layers: tuple[int, ...]):
    """How the head trains, from the arguments."""
    from ..specialists.eagle_train import TrainConfig

    return TrainConfig(
        epochs=args.epochs,
        lr=args.lr,
        batch_tokens=args.batch_tokens,
        max_length=max(TrainConfig.max_length, args.max_text_tokens) if args.stream else TrainConfig.max_length,
        draft_vocab=args.draft_vocab,
        unroll=args.unroll,
        align_top=args.align_top,
        feature_layers=layers,
        autocast=args.autocast,
        head_layers=args.head_layers,
        grown_lr=args.grown_lr,
    )


def _train(args: argparse.Namespace, target, layers: tuple[int, ...], seqs: list, cfg, init) -> dict:
    """Train the head on `seqs` as `cfg` says (and report on --held-out), starting from `init` (None: a new head),
    write it to OUT; its training summary."""
    from tqdm import tqdm

    from ..specialists.eagle_corpus import read_corpus
    from ..specialists.eagle_prefill import PrefilledSequences
    from ..specialists.eagle_sequences import StoredSequences
    from ..specialists.eagle_train import train_head

    # streamed: every sequence's features (the answers' too) come from a prefill as its batch needs them
    training = (
        PrefilledSequences(target.model, [s.tokens for s in seqs], layers) if args.stream else StoredSequences(seqs)
    )
    held_out = (
        StoredSequences([s for d in args.held_out for s in read_corpus(Path(d), layers)], answers_only=True)
        if args.held_out
        else None
    )
    out = Path(args.out)
    with tqdm(unit="step", desc="training", disable=args.quiet) as bar:

        def trained(step: int, steps: int, metrics: dict) -> None:
            bar.total = steps
            bar.update(step - bar.n)
            bar.set_postfix({k: round(v, 3) for k, v in metrics.items()})

        out.mkdir(parents=True, exist_ok=True)
        return train_head(
            target,
            training,
            out,
            cfg,
            held_out=held_out,
            checkpoint=out / "checkpoint.pt",
            evaluate_every=args.evaluate_every,
            progress=trained,
            init=init,
        )


def _after_tokens(documents: list[list[int]], skip: int) -> list[list[int]]:
    """The documents after those that bring their tokens to `skip` (what `_first_tokens(documents, skip)` took)."""
    return documents[len(_first_tokens(documents, skip)) :] if skip > 0 else documents


def _first_tokens(documents: list[list[int]], budget: int | None) -> list[list[int]]:
    """The documents, in their order, up to the one that brings their tokens to `budget` (all without one)."""
    if budget is None:
        return documents
    total = 0
    for n, document in enumerate(documents):
        total += len(document)
        if total >= budget:
            return documents[: n + 1]
    return documents


def feature_layers(value: str, layers: int) -> tuple[int, ...]:
    """`--feature-layers`: none, auto (EAGLE-3 captures layers 1, L/2 - 1 and L - 4; the final norm's output stands
    in for the high one here, as the head's readout and feature loss read it) or indices in [0, layers)."""
    if value == "none":
        return ()
    if value == "auto":
        return tuple(sorted({1, layers // 2 - 1} & set(range(layers - 1))))
    try:
        chosen = tuple(sorted({int(part) for part in value.split(",")}))
    except ValueError:
        raise ValueError(f"--feature-layers takes none, auto or comma-separated layer indices, got {value!r}") from None
    if not all(0 <= layer < layers for layer in chosen):
        raise ValueError(f"--feature-layers {value}: this target has decoder layers 0..{layers - 1}")
    return chosen
