"""The `metasd` command: generate, serve, calibrate, bench, serve-bench, index, distill and train-eagle, one module
each."""

from __future__ import annotations

import argparse
import sys

from . import bench, calibrate, distill, generate, index, serve, serve_bench, train_eagle


def build_parser() -> argparse.ArgumentParser:
    """The `metasd` command's parser, every subcommand in it. Building it and parsing load no model code (each
    subcommand imports what it runs when it runs), so that `--help` and argument errors answer at once."""
    parser = argparse.ArgumentParser(prog="metasd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, serve, calibrate, bench, serve_bench, index, distill, train_eagle):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `metasd` command on `argv` (default: the process's arguments); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except ValueError as err:
        print(f"metasd: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
