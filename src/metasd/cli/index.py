"""`metasd index`: build a datastore (a token suffix array) from corpora for the datastore: drafter."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..specialists.corpus_files import DEFAULT_EXCLUDE, DEFAULT_INCLUDE, corpus_files
from .args import add_target_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `metasd index` subcommand's arguments."""
    p = sub.add_parser("index", help="build a datastore (token suffix array) from corpora for the datastore: drafter")
    p.add_argument("corpora", nargs="+", metavar="CORPUS", help="text / JSONL / JSON files or source directories")
    p.add_argument("--out", required=True, help="index directory to write (tokens.npy, sa.npy, header.json)")
    add_target_arg(p, use="the model whose tokenizer the datastore uses: ")
    p.add_argument(
        "--depth",
        type=int,
        default=16,
        help="suffixes are sorted on this many tokens: the longest context match looked up (default: %(default)s)",
    )
    p.add_argument(
        "--include",
        action="append",
        default=None,
        metavar="GLOB",
        help=f"file names to take from directories, repeatable (default: {' '.join(DEFAULT_INCLUDE)})",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=None,
        metavar="GLOB",
        help=f"file or directory names to skip, repeatable (default: {' '.join(DEFAULT_EXCLUDE)})",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="stop reading the corpora after about this many")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """Run `metasd index` with the parsed arguments."""
    from ..models.loading import load_tokenizer
    from ..specialists.index import build_index

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    include, exclude = tuple(args.include or DEFAULT_INCLUDE), tuple(args.exclude or DEFAULT_EXCLUDE)
    if args.depth < 1:
        raise ValueError(f"--depth must be >= 1, got {args.depth}")
    corpus_files(args.corpora, include, exclude)  # a missing corpus fails before the tokenizer loads
    tokenizer = load_tokenizer(args.target)
    header = build_index(
        args.corpora,
        args.out,
        tokenizer,
        target=args.target or "embedded",
        depth=args.depth,
        include=include,
        exclude=exclude,
        max_tokens=args.max_tokens,
        progress=not args.quiet,
    )
    size = sum(f.stat().st_size for f in Path(args.out).iterdir())
    print(
        f"{args.out}: {header['n_tokens']:,} tokens from {header['n_documents']:,} documents, "
        f"{size / 2**20:.1f} MiB, built in {header['build_seconds']['total']:.1f}s"
    )
