"""Option groups shared by the commands: the model, the drafter pool and policy, the device, sampling.

Each option is defined once here; commands differ only in their defaults (the bench leaves `--target` and `--dtype`
to its presets, so its defaults are None)."""

from __future__ import annotations

import argparse
import os

from ..names import DEFAULT_POLICY, DEFAULT_POOL, DRAFTER_KINDS, POLICY_NAMES

DEFAULT_DRAFTERS = ",".join(DEFAULT_POOL)
DTYPES = ("float32", "bfloat16", "float16")


def add_target_arg(parser: argparse.ArgumentParser, *, use: str = "", preset_note: str = "") -> None:
    """`--target`: the target model, for every command that names one."""
    parser.add_argument(
        "--target",
        default=None,
        help=f"{use}hub id, directory or .gguf file (default: the embedded SmolLM2-135M{preset_note})",
    )


def add_model_args(
    parser: argparse.ArgumentParser, *, dtype_default: str | None = "float32", preset_note: str = ""
) -> None:
    """`--target`, `--dtype`, `--kernels`: the target model as loaded, for every command that loads one."""
    add_target_arg(parser, preset_note=preset_note)
    parser.add_argument(
        "--dtype",
        default=dtype_default,
        choices=DTYPES,
        help=f"model dtype; compare methods only at the same dtype (default: float32{preset_note})",
    )
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "torch"],
        help="the target's linear layers: auto routes each draft length, and longer inputs, to the fastest of "
        "torch's F.linear, a weight-major layout and oneDNN on reordered weights, as calibrated on this machine; "
        "torch keeps F.linear (default: %(default)s)",
    )


def add_pool_args(parser: argparse.ArgumentParser, *, drafters_default: str | None = DEFAULT_DRAFTERS) -> None:
    """`--drafters`, `--draft-len`: the drafter pool and the classic policies' draft length."""
    parser.add_argument(
        "--drafters",
        default=drafters_default,
        help=f"comma-separated pool; kinds: {', '.join(DRAFTER_KINDS)} (default: {DEFAULT_DRAFTERS})",
    )
    parser.add_argument(
        "--draft-len",
        type=int,
        default=5,
        help="k, tokens drafted per round by the classic policies; metasd-adaptive chooses k itself, "
        "up to its max parameter (default: %(default)s)",
    )


def add_policy_scope_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """`--policy-scope`: whether the policy starts afresh each request or keeps learning (`what` says how)."""
    parser.add_argument(
        "--policy-scope",
        choices=["request", "server"],
        default="request",
        help=f"request: every policy starts afresh each request; server: {what} (default: %(default)s)",
    )


def add_learning_args(parser: argparse.ArgumentParser) -> None:
    """`--learn-heads DIR` and how the pool's EAGLE heads learn from the requests they draft for."""
    parser.add_argument(
        "--learn-heads",
        metavar="DIR",
        default=None,
        help="the pool's EAGLE heads fine-tune themselves on the requests they draft for, in the background, and "
        "an improved head is swapped in when it measures better on recent requests; DIR keeps the improved heads "
        "and their learning records, and a restart resumes from them (default: off)",
    )
    parser.add_argument(
        "--learn-share",
        type=float,
        default=0.25,
        help="with --learn-heads: the most of one core the trainer uses, at the lowest CPU priority "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--learn-when-busy",
        action="store_true",
        help="with --learn-heads: train beside decoding too, at serving's expense (default: only in the gaps "
        "between requests, so a load that never pauses leaves no time to learn)",
    )
    parser.add_argument(
        "--learn-every",
        type=int,
        default=4096,
        help="with --learn-heads: new tokens of traffic that start a round of training (default: %(default)s)",
    )
    parser.add_argument(
        "--learn-buffer-tokens",
        type=int,
        default=65536,
        help="with --learn-heads: tokens of recent traffic kept to learn from, per history key; each costs 2 bytes "
        "per feature the head reads (default: %(default)s)",
    )


def learning_config(args: argparse.Namespace):
    """The `LearningConfig` of `--learn-*` (validated), or None without --learn-heads."""
    if args.learn_heads is None:
        return None
    from ..learning import LearningConfig

    if args.learn_every < 1 or args.learn_buffer_tokens < 2 or not 0 < args.learn_share <= 1:
        raise ValueError("--learn-every must be >= 1, --learn-buffer-tokens >= 2 and --learn-share in (0, 1]")
    return LearningConfig(
        share=args.learn_share,
        train_every=args.learn_every,
        buffer_tokens=args.learn_buffer_tokens,
        when_busy=args.learn_when_busy,
    )


def add_decoder_args(parser: argparse.ArgumentParser) -> None:
    """Everything that builds a Decoder: model, pool, policy, device."""
    add_model_args(parser, dtype_default="float32")
    add_pool_args(parser)
    parser.add_argument(
        "--policy", default=DEFAULT_POLICY, help=f"drafter selection: {', '.join(POLICY_NAMES)} (default: %(default)s)"
    )
    add_device_args(parser)


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """`--device` and `--threads`: where the models run and with how many CPU threads."""
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda", "mps"],
        help="where the models run; auto: CUDA when available, else the CPU (default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice); 1 is far faster on a busy machine",
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """`--max-new-tokens`, `--temperature`, `--top-k`, `--top-p`, `--seed`."""
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


def set_threads(threads: int | None) -> None:
    """Apply `--threads` (validated) before any model loads."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def build_decoder(args: argparse.Namespace, **extra):
    """The Decoder the parsed arguments describe (`extra`: further keyword arguments), threads set first."""
    set_threads(args.threads)
    from ..engine import Decoder

    return Decoder(
        target=args.target,
        drafters=args.drafters,
        policy=args.policy,
        draft_len=args.draft_len,
        dtype=args.dtype,
        device=args.device,
        seed=getattr(args, "seed", None),
        kernels=args.kernels,
        **extra,
    )
