"""`metasd serve-bench`: the server's throughput and latency at several numbers of concurrent clients, with
continuous batching against one request at a time and against the same batch without drafting."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .args import add_decoder_args, build_decoder


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `metasd serve-bench` subcommand's arguments."""
    p = sub.add_parser(
        "serve-bench",
        help="load test of the server: throughput and latency by concurrent clients, batched and one at a time",
    )
    p.add_argument("--clients", default="1,4,8,16", help="concurrent clients per load (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=16, help="the batched settings' --max-batch (default: %(default)s)")
    p.add_argument("--requests", type=int, default=16, help="requests per load, at least two per client (default: 16)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per request (default: %(default)s)")
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: as `metasd bench` finds it)")
    p.add_argument(
        "--learning",
        type=int,
        default=None,
        metavar="EVERY",
        help="also measure the batched setting with the pool's EAGLE heads learning from the traffic, a round of "
        "training every EVERY new tokens (`metasd serve --learn-heads`; default: not measured)",
    )
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="also plot each response's mean accepted tokens per round in the order answered, per setting and load "
        "(with --learning: does the head climb?)",
    )
    add_decoder_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """Run `metasd serve-bench` with the parsed arguments."""
    loads = [int(c) for c in args.clients.split(",")]
    if not loads or min(loads) < 1 or args.max_batch < 1 or args.requests < 1 or args.max_new_tokens < 1:
        raise ValueError("--clients, --max-batch, --requests and --max-new-tokens must be >= 1")
    from ..bench.load import Setting, first_turns, run_loads, table
    from ..bench.questions import load_questions
    from ..bench.spec_bench import spec_bench_questions

    questions = load_questions(args.questions or spec_bench_questions())
    interleaved = first_turns(questions, max(args.requests, 2 * max(loads)))
    settings = [
        Setting("max-batch 1", 1, args.policy),
        Setting(f"max-batch {args.max_batch}", args.max_batch, args.policy),
        Setting(f"max-batch {args.max_batch}, no drafting", args.max_batch, "none"),
    ]
    if args.learning is not None:
        from ..learning import LearningConfig

        learning = LearningConfig(train_every=args.learning)
        settings.append(Setting(f"max-batch {args.max_batch}, learning", args.max_batch, args.policy, learning))

    def make_decoder(policy: str):
        args.policy = policy
        return build_decoder(args)

    started = time.perf_counter()
    results, mismatches = run_loads(make_decoder, settings, interleaved, loads, args.max_new_tokens, args.requests)
    print(table(results, settings[0].label))
    for r in results:
        if r.setting == settings[0].label:  # every setting of a load serves the same prompts
            print(f"{r.clients} clients: {r.prompt_tokens} prompt tokens for {r.tokens} completion tokens")
    served = sum(len(r.texts) for r in results if r.setting != settings[0].label)
    print(f"greedy outputs differing from decoding alone: {len(mismatches)} of {served}")
    for m in mismatches:
        print(f"  prompt {m.prompt} ({m.setting}, {m.clients} clients): from token {m.position}, margin {m.margin:.4f}")
    print(f"wall time: {time.perf_counter() - started:.0f} s")
    if args.plot:
        from ..bench.plots import acceptance_over_requests

        if acceptance_over_requests(results, Path(args.plot)):
            print(f"wrote {args.plot}")
    if args.out:
        out = {
            "results": [
                {
                    "setting": r.setting,
                    "clients": r.clients,
                    "requests": r.requests,
                    "tokens": r.tokens,
                    "prompt_tokens": r.prompt_tokens,
                    "wall_s": r.wall_s,
                    "throughput": r.throughput,
                    "p50": r.latency(0.5),
                    "p95": r.latency(0.95),
                    "p99": r.latency(0.99),
                    "batch_rounds": r.batch_rounds,
                    "learning": r.learning,
                    "answers": [  # in the order answered
                        {"prompt": i, "answered_s": round(at, 3), "mean_accepted_tokens": accepted}
                        for i, (at, accepted) in sorted(r.acceptance.items(), key=lambda item: item[1])
                    ],
                }
                for r in results
            ],
            "mismatches": [vars(m) for m in mismatches],
        }
        Path(args.out).write_text(json.dumps(out, indent=1))
