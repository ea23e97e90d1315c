"""`metasd generate`: decode prompts and print the text and the decoding statistics."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from .args import (
    add_decoder_args,
    add_learning_args,
    add_policy_scope_arg,
    add_sampling_args,
    build_decoder,
    learning_config,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `metasd generate` subcommand's arguments."""
    gen = sub.add_parser("generate", help="decode prompts and print text and decoding statistics")
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help='JSONL, one {"prompt": ...} a line; one result a line')
    gen.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    add_policy_scope_arg(gen, "it keeps learning across the prompts of a --prompt-file")
    add_learning_args(gen)
    add_decoder_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(handler=run)


def _prompts(args: argparse.Namespace) -> Iterator[str]:
    if args.prompt is not None:
        yield args.prompt
        return
    try:
        lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
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


def run(args: argparse.Namespace) -> None:
    """Run `metasd generate` with the parsed arguments."""
    if args.prompt is None and args.prompt_file is None:
        raise ValueError("give --prompt TEXT or --prompt-file PATH")
    from ..sampling import SamplingParams

    SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)  # reject bad values before loading models
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts = list(_prompts(args))  # a malformed file fails before the models load
    learning = learning_config(args)
    decoder = build_decoder(args, policy_scope=args.policy_scope)
    learners = []
    if learning is not None:
        from ..learning import learn_heads

        learners = learn_heads(decoder, learning, args.learn_heads)
    for learner in learners:
        learner.start()
    try:
        _generate(args, decoder, prompts)
    finally:
        for learner in learners:
            learner.close()
    for learner in learners:  # what arrived since its last round, before the process ends (not after a failure)
        learner.learn_due()


def _generate(args: argparse.Namespace, decoder, prompts: list[str]) -> None:
    for prompt in prompts:
        result = decoder.generate(
            prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            raw=args.raw,
        )
        if args.json:
            print(
                json.dumps(
                    {
                        "text": result.text,
                        "token_ids": result.token_ids,
                        "finish_reason": result.finish_reason,
                        "stats": result.stats.to_dict(),
                    }
                ),
                flush=True,
            )
        else:
            print(result.text)
            print(_summary(result.stats), file=sys.stderr, flush=True)


def _summary(stats) -> str:
    s = stats.to_dict()
    lines = [
        f"--- {s['new_tokens']} tokens in {s['wall_time']:.2f}s ({s['tokens_per_second']:.1f} tok/s), "
        f"{s['rounds']} rounds, mean accepted tokens {s['mean_accepted_tokens']:.2f}, "
        f"switches {s['switches']}, catch-up tokens {s['catch_up_tokens']}"
    ]
    for name, d in s["drafters"].items():
        lines.append(
            f"    {name:<20} pulls {d['pulls']:>4}  drafted {d['drafted']:>5}  accepted {d['accepted']:>5}  "
            f"mean reward {d['mean_reward']:.3f}"
        )
    return "\n".join(lines)
