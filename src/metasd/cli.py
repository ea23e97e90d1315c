"""The `metasd` command: generate (and the serve / bench subcommands registered below)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

from .drafters import DEFAULT_POOL, DRAFTER_KINDS
from .policies import POLICY_NAMES

DEFAULT_POLICY = "metasd-adaptive"  # = metasd.engine.DEFAULT_POLICY (not imported here: the CLI starts before torch)

DEFAULT_DRAFTERS = ",".join(DEFAULT_POOL)


def add_decoder_args(parser: argparse.ArgumentParser) -> None:
    """Options that build a Decoder; shared by every subcommand that loads models."""
    parser.add_argument("--target", default=None, help="hub id, directory or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--drafters", default=DEFAULT_DRAFTERS,
                        help=f"comma-separated pool; kinds: {', '.join(DRAFTER_KINDS)} (default: %(default)s)")
    parser.add_argument("--policy", default=DEFAULT_POLICY,
                        help=f"drafter selection: {', '.join(POLICY_NAMES)} (default: %(default)s)")
    parser.add_argument("--draft-len", type=int, default=5,
                        help="k, tokens drafted per round by the classic policies; metasd-adaptive chooses k itself, "
                             "up to its max parameter (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="model dtype; compare methods only at the same dtype (default: %(default)s)")
    parser.add_argument("--kernels", default="auto", choices=["auto", "torch"],
                        help="the target's linear layers: auto routes each draft length to the faster of two matmul "
                             "layouts, as calibrated on this machine; torch keeps F.linear (default: %(default)s)")
    add_device_args(parser)


def add_device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                        help="where the models run; auto: CUDA when available, else the CPU (default: %(default)s)")
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
                   dtype=args.dtype, device=args.device, seed=getattr(args, "seed", None), kernels=args.kernels,
                   **extra)


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


def _calibrate(args: argparse.Namespace) -> None:
    if not 1 <= args.max_tokens <= 256:
        raise ValueError(f"--max-tokens must be in 1..256, got {args.max_tokens}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    from .costs import cache_file, calibration_key, load_or_calibrate
    from .linear_kernels import KERNEL_MODES
    from .models import load_model

    target = load_model(args.target, args.dtype, args.device)
    candidates = KERNEL_MODES[args.kernels]
    found = load_or_calibrate(target.spec, target.model, args.max_tokens, refresh=args.refresh, candidates=candidates)
    table = found.table
    key = calibration_key(target.spec, target.model, args.max_tokens, candidates)
    print(f"T(M) for {key['model']} ({key['dtype']}, {key['threads']} threads, {key['device']}); "
          f"cache: {cache_file(key)}")
    print(f"{'M':>4} {'ms':>9} {'T(M)/T(1)':>10}  linear kernel")
    for m, (t, kernel) in enumerate(zip(table, found.kernels, strict=True), 1):
        print(f"{m:>4} {t * 1000:>9.2f} {t / table[0]:>10.2f}  {kernel}")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server: completions, chat, SSE streaming, /metrics")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    srv.add_argument("--api-key", default=os.environ.get("METASD_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1/*; several keys: KEY1,KEY2 "
                          "(default: $METASD_API_KEY, else none)")
    srv.add_argument("--max-body-bytes", type=int, default=2 << 20,
                     help="larger request bodies get 413 (default: %(default)s, 2 MiB)")
    srv.add_argument("--history-scope", choices=["shared", "per-key", "off"], default="shared",
                     help="what the suffix drafter learns across requests from: every client's outputs (shared), "
                          "the same API key's only (per-key), or nothing (off) (default: %(default)s)")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="requests that may wait behind the one decoding; more get 429 (default: %(default)s)")
    srv.add_argument("--policy-scope", choices=["request", "server"], default="request",
                     help="reset policy statistics per request or keep learning across them (default: %(default)s)")
    srv.add_argument("--replicas", type=int, default=None,
                     help="serve N replicas behind one endpoint on Ray Serve (pip install 'metasd[ray]'); with "
                          "--policy-scope server they pool their bandit statistics (default: one process, no Ray)")
    srv.add_argument("--ray", default=None, metavar="ADDRESS",
                     help="with --replicas: a running Ray cluster (auto, HOST:PORT); default: a local instance")
    srv.add_argument("--replica-cpus", type=float, default=None,
                     help="with --replicas: CPUs reserved per replica, also its torch threads (default: 1)")
    add_decoder_args(srv)
    srv.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.api_key is not None and not all(args.api_key.split(",")):
        raise ValueError("--api-key is empty; give a real key or leave it out")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.history_scope == "per-key" and args.api_key is None:
        raise ValueError("--history-scope per-key needs --api-key KEY[,KEY...]")
    if args.history_scope != "shared" and args.policy_scope == "server":
        raise ValueError(f"--history-scope {args.history_scope} isolates clients, but --policy-scope server shares "
                         "one policy across them; use --policy-scope request")
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"metasd: warning: serving on {args.host} without --api-key", file=sys.stderr)
    if args.replicas is not None:
        _serve_replicas(args)
        return
    from .server import serve

    serve(build_decoder(args, policy_scope=args.policy_scope), host=args.host, port=args.port, api_key=args.api_key,
          max_queue=args.max_queue, max_body_bytes=args.max_body_bytes, history_scope=args.history_scope)


def _serve_replicas(args: argparse.Namespace) -> None:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replica_cpus is not None and args.replica_cpus <= 0:
        raise ValueError(f"--replica-cpus must be > 0, got {args.replica_cpus}")
    try:
        from .serve_ray import serve_replicas
    except ImportError as err:
        raise ValueError(f"--replicas needs Ray Serve: pip install 'metasd[ray]' ({err})") from None
    decoder = {"target": args.target, "drafters": args.drafters, "policy": args.policy, "draft_len": args.draft_len,
               "dtype": args.dtype, "device": args.device, "policy_scope": args.policy_scope, "kernels": args.kernels}
    app = {"api_key": args.api_key, "max_queue": args.max_queue, "max_body_bytes": args.max_body_bytes,
           "history_scope": args.history_scope}
    serve_replicas(decoder, app, args.replicas, host=args.host, port=args.port, address=args.ray,
                   replica_cpus=args.replica_cpus, threads=args.threads)


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
    cal = sub.add_parser("calibrate", help="measure T(M), the target's forward time for M new tokens, and cache it")
    cal.add_argument("--max-tokens", type=int, default=13, help="largest M (default: %(default)s)")
    cal.add_argument("--refresh", action="store_true", help="measure again even if the cache has this machine's table")
    cal.add_argument("--target", default=None, help="hub id, directory or .gguf file (default: embedded SmolLM2)")
    cal.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    cal.add_argument("--kernels", default="auto", choices=["auto", "torch"],
                     help="auto: time both matmul layouts per M and keep the faster; torch: F.linear only")
    add_device_args(cal)
    cal.set_defaults(handler=_calibrate)
    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
    from .index import add_index_parser

    add_index_parser(sub)
    from .distill import add_distill_parser

    add_distill_parser(sub)

    args = parser.parse_args(argv)
    try:
        args.handler(args)
    except ValueError as err:
        print(f"metasd: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
