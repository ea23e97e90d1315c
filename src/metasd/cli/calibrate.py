"""`metasd calibrate`: measure T(M), the target's forward time for M new tokens, and T(B, W) for batches of B rows
(`--max-batch`), and cache them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .args import add_device_args, add_model_args, set_threads


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `metasd calibrate` subcommand's arguments."""
    cal = sub.add_parser("calibrate", help="measure T(M), the target's forward time for M new tokens, and cache it")
    cal.add_argument("--max-tokens", type=int, default=13, help="largest M (default: %(default)s)")
    cal.add_argument(
        "--max-batch",
        type=int,
        default=1,
        help="also T(B, W) for batches of up to B rows, as `serve --max-batch B` uses (default: %(default)s: none)",
    )
    cal.add_argument("--refresh", action="store_true", help="measure again even if the cache has this machine's tables")
    add_model_args(cal)
    add_device_args(cal)
    cal.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """Run `metasd calibrate` with the parsed arguments."""
    if not 1 <= args.max_tokens <= 256:
        raise ValueError(f"--max-tokens must be in 1..256, got {args.max_tokens}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    set_threads(args.threads)
    from ..costs import batch_cache_file, cache_file, calibration_key, load_or_calibrate, load_or_calibrate_batch
    from ..models.linear_kernels import KERNEL_MODES
    from ..models.loading import load_model

    target = load_model(args.target, args.dtype, args.device)
    candidates = KERNEL_MODES[args.kernels]
    found = load_or_calibrate(target.spec, target.model, args.max_tokens, refresh=args.refresh, candidates=candidates)
    table = found.table
    key = calibration_key(target.spec, target.model, args.max_tokens, candidates)
    saved = _cached(cache_file(key)).get("table") == table
    print(
        f"T(M) for {key['model']} ({key['dtype']}, {key['threads']} threads, {key['device']}); "
        f"cache: {_where(cache_file(key), saved)}"
    )
    print(f"{'M':>4} {'ms':>9} {'T(M)/T(1)':>10}  linear kernel")
    for m, (t, kernel) in enumerate(zip(table, found.kernels, strict=True), 1):
        print(f"{m:>4} {t * 1000:>9.2f} {t / table[0]:>10.2f}  {kernel}")
    print(f"more than {len(table)} tokens (prefills, wide batches): {found.beyond}")
    if args.max_batch > 1:
        tables = load_or_calibrate_batch(
            target.spec, target.model, args.max_batch, args.max_tokens, candidates, refresh=args.refresh
        )
        held = _cached(batch_cache_file(key)).get("tables", {})
        saved = all(held.get(str(b)) == times for b, times in tables.items())
        print(f"T(B, W) in ms; cache: {_where(batch_cache_file(key), saved)}")
        print(f"{'B':>4} " + " ".join(f"{f'W={w}':>7}" for w in range(1, args.max_tokens + 1)))
        for b, times in tables.items():
            print(f"{b:>4} " + " ".join(f"{t * 1000:>7.1f}" for t in times))


def _cached(path: Path) -> dict:
    """The calibration cached at `path`, or {}."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _where(path: Path, saved: bool) -> str:
    return str(path) if saved else f"{path} (this table is not in it: see the warning above)"
