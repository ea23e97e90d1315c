"""The `metasd` command: generate (and the serve / bench subcommands registered below)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

from .drafters import DRAFTER_KINDS
from .policies import POLICY_NAMES

DEFAULT_DRAFTERS = "ngram,suffix,early-exit"


def add_decoder_args(parser: argparse.ArgumentParser) -> None:
    """Options that build a Decoder; shared by every subcommand that loads models."""
    parser.add_argument("--target", default=None, help="hub id, directory or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--drafters", default=DEFAULT_DRAFTERS,
                        help=f"comma-separated pool; kinds: {', '.join(DRAFTER_KINDS)} (default: %(default)s)")
    parser.add_argument("--policy", default="metasd-ucb",
                        help=f"drafter selection: {', '.join(POLICY_NAMES)} (default: %(default)s)")
    parser.add_argument("--draft-len", type=int, default=5, help="k, tokens drafted per round (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="model dtype; compare methods only at the same dtype (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice); 1 is far faster on a busy machine")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


def build_decoder(args: argparse.Namespace, **extra):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    from .engine import Decoder

    return Decoder(target=args.target, drafters=args.drafters, policy=args.policy, draft_len=args.draft_len,
                   dtype=args.dtype, seed=getattr(args, "seed", None), **extra)


def _prompts(args: argparse.Namespace) -> Iterator[str]:
    if args.prompt is not None:
        yield args.prompt
        return
    try:
        lines = open(args.prompt_file, encoding="utf-8").read().splitlines()
    except OSError as err:
        raise ValueError(f"cannot read --prompt-file: {err}") from err
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{args.prompt_file}:{number}: not JSON ({err})") from err
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f'{args.prompt_file}:{number}: expected an object with a string "prompt"')
        yield item["prompt"]


def _generate(args: argparse.Namespace) -> None:
    if args.prompt is None and args.prompt_file is None:
        raise ValueError("give --prompt TEXT or --prompt-file PATH")
    from .sampling import SamplingParams

    SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)  # reject bad values before loading models
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts = list(_prompts(args))  # a malformed file fails before the models load
    decoder = build_decoder(args, policy_scope=args.policy_scope)
    for prompt in prompts:
        result = decoder.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, raw=args.raw)
        if args.json:
            print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                              "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}), flush=True)
        else:
            print(result.text)
            print(_summary(result.stats), file=sys.stderr, flush=True)


def _summary(stats) -> str:
    s = stats.to_dict()
    lines = [f"--- {s['new_tokens']} tokens in {s['wall_time']:.2f}s ({s['tokens_per_second']:.1f} tok/s), "
             f"{s['rounds']} rounds, mean accepted tokens {s['mean_accepted_tokens']:.2f}, "
             f"switches {s['switches']}, catch-up tokens {s['catch_up_tokens']}"]
    for name, d in s["drafters"].items():
        lines.append(f"    {name:<20} pulls {d['pulls']:>4}  drafted {d['drafted']:>5}  accepted {d['accepted']:>5}  "
                     f"mean reward {d['mean_reward']:.3f}")
    return "\n".join(lines)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server: completions, chat, SSE streaming, /metrics")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    srv.add_argument("--api-key", default=os.environ.get("METASD_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: $METASD_API_KEY, else none)")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="requests that may wait behind the one decoding; more get 429 (default: %(default)s)")
    srv.add_argument("--policy-scope", choices=["request", "server"], default="request",
                     help="reset policy statistics per request or keep learning across them (default: %(default)s)")
    add_decoder_args(srv)
    srv.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.api_key == "":
        raise ValueError("--api-key is empty; give a real key or leave it out")
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"metasd: warning: serving on {args.host} without --api-key", file=sys.stderr)
    from .server import serve

    serve(build_decoder(args, policy_scope=args.policy_scope), host=args.host, port=args.port, api_key=args.api_key,
          max_queue=args.max_queue)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="metasd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="decode prompts and print text and decoding statistics")
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help='JSONL, one {"prompt": ...} a line; one result a line')
    gen.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    gen.add_argument("--policy-scope", choices=["request", "server"], default="request",
                     help="reset the policy per prompt (as the paper) or keep learning across the prompts of a "
                          "--prompt-file (default: %(default)s)")
    add_decoder_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(handler=_generate)
    _add_serve(sub)
    from .bench.cli import add_bench_parser

    add_bench_parser(sub)

    args = parser.parse_args(argv)
    try:
        args.handler(args)
    except ValueError as err:
        print(f"metasd: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
