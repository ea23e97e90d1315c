"""`metasd serve`: the OpenAI-compatible server, in one process or as Ray Serve replicas."""

from __future__ import annotations

import argparse
import os
import sys

from ..batching import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_SHARE
from .args import add_decoder_args, add_learning_args, add_policy_scope_arg, build_decoder, learning_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `metasd serve` subcommand's arguments."""
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server: completions, chat, SSE streaming, /metrics")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    srv.add_argument(
        "--api-key",
        default=os.environ.get("METASD_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/*; several keys: KEY1,KEY2 "
        "(default: $METASD_API_KEY, else none)",
    )
    srv.add_argument(
        "--max-body-bytes",
        type=int,
        default=2 << 20,
        help="larger request bodies get 413 (default: %(default)s, 2 MiB)",
    )
    srv.add_argument(
        "--history-scope",
        choices=["shared", "per-key", "off"],
        default="shared",
        help="what the suffix drafter learns across requests from: every client's outputs (shared), "
        "the same API key's only (per-key), or nothing (off) (default: %(default)s)",
    )
    srv.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait behind the one decoding; more get 429 (default: %(default)s)",
    )
    srv.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help="requests decoded together, one target forward per round for all, each one's speculation chosen for "
        "the whole batch; 1: one request at a time (default: %(default)s)",
    )
    srv.add_argument(
        "--prefill-share",
        type=float,
        default=DEFAULT_PREFILL_SHARE,
        help="share of a round's time joining prompts get while others decode, in (0, 1] (more where more prompts "
        "wait than decode: each request an equal part): its chunk rides in the round's forward, so the others wait "
        "about 1 / (1 - share) rounds between theirs; 1: a prompt enters whole, "
        "the others waiting for it (default: %(default)s)",
    )
    add_policy_scope_arg(srv, "it keeps learning across requests")
    add_learning_args(srv)
    srv.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N replicas behind one endpoint on Ray Serve (pip install 'metasd[ray]'); with "
        "--policy-scope server they pool their bandit statistics (default: one process, no Ray)",
    )
    srv.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="with --replicas: a running Ray cluster (auto, HOST:PORT); default: a local instance",
    )
    srv.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        help="with --replicas: CPUs reserved per replica, also its torch threads (default: 1)",
    )
    add_decoder_args(srv)
    srv.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """Run `metasd serve` with the parsed arguments (refusing option combinations that cannot work)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.api_key is not None and not all(args.api_key.split(",")):
        raise ValueError("--api-key is empty; give a real key or leave it out")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.history_scope == "per-key" and args.api_key is None:
        raise ValueError("--history-scope per-key needs --api-key KEY[,KEY...]")
    if args.history_scope != "shared" and args.policy_scope == "server":
        raise ValueError(
            f"--history-scope {args.history_scope} isolates clients, but --policy-scope server shares "
            "one policy across them; use --policy-scope request"
        )
    learning = learning_config(args)
    if learning is not None and args.replicas is not None:
        raise ValueError("--learn-heads runs in one process; leave out --replicas")
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"metasd: warning: serving on {args.host} without --api-key", file=sys.stderr)
    if args.replicas is not None:
        _serve_replicas(args)
        return
    from ..serving.server import serve

    serve(
        build_decoder(args, policy_scope=args.policy_scope),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        history_scope=args.history_scope,
        max_batch=args.max_batch,
        prefill_share=args.prefill_share,
        learning=learning,
        learn_dir=args.learn_heads,
    )


def _serve_replicas(args: argparse.Namespace) -> None:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replica_cpus is not None and args.replica_cpus <= 0:
        raise ValueError(f"--replica-cpus must be > 0, got {args.replica_cpus}")
    try:
        from ..serving.ray_replicas import serve_replicas
    except ImportError as err:
        raise ValueError(f"--replicas needs Ray Serve: pip install 'metasd[ray]' ({err})") from None
    decoder = {
        "target": args.target,
        "drafters": args.drafters,
        "policy": args.policy,
        "draft_len": args.draft_len,
        "dtype": args.dtype,
        "device": args.device,
        "policy_scope": args.policy_scope,
        "kernels": args.kernels,
    }
    app = {
        "api_key": args.api_key,
        "max_queue": args.max_queue,
        "max_body_bytes": args.max_body_bytes,
        "history_scope": args.history_scope,
        "max_batch": args.max_batch,
        "prefill_share": args.prefill_share,
    }
    serve_replicas(
        decoder,
        app,
        args.replicas,
        host=args.host,
        port=args.port,
        address=args.ray,
        replica_cpus=args.replica_cpus,
        threads=args.threads,
    )
