"""`metasd distill`: train a small drafter on the target's own greedy answers."""

from __future__ import annotations

import argparse
import json

from .args import add_target_arg, set_threads


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `metasd distill` subcommand's arguments."""
    p = sub.add_parser("distill", help="train a small drafter on the target's own greedy answers (lm:DIR loads it)")
    add_target_arg(p, use="the target whose answers the drafter learns: ")
    p.add_argument("--prompts", required=True, help='JSONL prompts: "prompt", "turns", "messages" or "conversations"')
    p.add_argument("--out", required=True, help="output directory (model, tokenizer, cached answers, checkpoint)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers taken from the target (default: %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, cosine to 10%% (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="target answer length (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts keep their end")
    p.add_argument("--gen-batch", type=int, default=8, help="prompts the target answers at once (default: 8)")
    p.add_argument("--holdout", type=float, default=0.1, help="share of prompts held out for the acceptance check")
    p.add_argument("--draft-len", type=int, default=5, help="k for the held-out acceptance (default: 5)")
    p.add_argument("--save-every", type=int, default=25, help="checkpoint period in steps (default: 25)")
    p.add_argument(
        "--eval-on",
        action="append",
        default=[],
        metavar="DIR",
        help="another distill --out DIR: also measure acceptance on (up to 100 of) its cached target "
        "answers, i.e. off this drafter's domain; repeatable",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--restart", action="store_true", help="ignore an existing checkpoint (cached answers are kept)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """Run `metasd distill` with the parsed arguments."""
    from ..specialists.distill import distill

    set_threads(args.threads)
    report = distill(
        args.target,
        args.prompts,
        args.out,
        layers=args.layers,
        steps=args.steps,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        gen_batch=args.gen_batch,
        holdout=args.holdout,
        draft_len=args.draft_len,
        save_every=args.save_every,
        seed=args.seed,
        restart=args.restart,
        progress=not args.quiet,
        eval_on=tuple(args.eval_on),
    )
    print(json.dumps(report, indent=1))
