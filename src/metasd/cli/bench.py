"""`metasd bench`: argument parsing only; the work is in metasd.bench.run."""

from __future__ import annotations

import argparse
import shlex
import sys

from ..bench.presets import DRIFT, PRESETS, QUICK
from .args import DEFAULT_DRAFTERS, add_device_args, add_model_args, add_policy_scope_arg, add_pool_args


def _list(text: str) -> list[str]:
    """Comma-separated names; a `key=value` item continues the one before it, so a method with several
    parameters (`metasd-adaptive:spread=0,prior=5,beta=0.1`) stays whole."""
    items: list[str] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        if items and "=" in item and ":" not in item:
            items[-1] += "," + item
        else:
            items.append(item)
    return items


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `metasd bench` subcommand's arguments."""
    p = sub.add_parser(
        "bench",
        help="Spec-Bench speed benchmark: every method side by side, oracles, report and plots",
        description="Measure ar, the transformers anchors, every fixed drafter, the policies and the oracles on "
        "Spec-Bench questions (greedy), check every output against ar, and write summary.json, "
        "report.md, answers/<method>.jsonl and PNG plots into --out.",
    )
    add_question_args(p)
    add_pool_args(p, drafters_default=None)
    add_model_args(p, dtype_default=None, preset_note="; a preset's model, qwen-coder: bfloat16")
    p.add_argument("--out", default="bench-out", help="output directory (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the randomised policies (default: %(default)s)")
    add_device_args(p)
    add_policy_scope_arg(p, "it keeps learning across questions")
    add_preset_args(p)
    add_measurement_args(p)
    add_cluster_args(p)
    p.set_defaults(handler=run, bench_parser=p)
    return p


def add_question_args(p: argparse.ArgumentParser) -> None:
    """`--questions`, `--categories`, `--per-category`, `--max-new-tokens`, `--methods`: what is asked and measured."""
    p.add_argument(
        "--questions",
        default=None,
        help="questions in Spec-Bench's question.jsonl format (default: $METASD_SPEC_BENCH, else "
        "Spec-Bench's own, downloaded and cached on first use)",
    )
    p.add_argument(
        "--categories",
        type=_list,
        default=None,
        help="comma-separated groups (mt_bench, translation, summarization, qa, math_reasoning, rag) "
        "or MT-bench categories (writing, coding, ...); default: all",
    )
    p.add_argument("--per-category", type=int, default=None, help="questions per category (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per turn (default: 128; --quick: 64)")
    p.add_argument(
        "--methods",
        type=_list,
        default=None,
        help="comma-separated subset of ar, hf-ar, hf-pld, hf-assisted, fixed:<drafter>, metasd-ucb, "
        "ucb-be, exp3, sequential-halving, random, round-robin, oracle-round, oracle-category "
        "(default: all that apply; ar is always run)",
    )


def add_preset_args(p: argparse.ArgumentParser) -> None:
    """`--quick`, `--preset`, `--drift`, `--models-dir`: ready-made settings and where their models live."""
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"1 question per Spec-Bench group, {QUICK['max_new_tokens']} new tokens, every method "
        "(one pass takes minutes on a small target)",
    )
    p.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="qwen-coder: Qwen2.5-Coder-1.5B target + 0.5B lm: drafter beside ngram, suffix, early-exit; "
        "drift: the same as --drift; specialists: ngram, one datastore per domain, the mixed "
        "(one-size-fits-all) datastore and any distilled drafter from --models-dir (default "
        "./specialists, built by scripts/build_specialists.py) with the paper's Table-3 methods; "
        "eagle-specialists: the paper's Table 4, an EAGLE head per domain and one on their union, from the same "
        "folder (scripts/train_domain_heads.sh)",
    )
    p.add_argument(
        "--drift",
        action="store_true",
        help="drift workload: each request asks two Spec-Bench tasks of different groups in one turn "
        "(copying then reasoning or code, two translation directions), built from --seed; "
        "--categories then takes drift kinds (drift-copy-math, drift-copy-code, drift-translation), "
        "--per-category counts per kind (default 3), 192 new tokens; same as --preset drift",
    )
    p.add_argument(
        "--models-dir",
        default=None,
        help="where the qwen-coder pair lives (default: $METASD_MODELS or ~/.cache/metasd-models), or "
        "the specialists folder (default: $METASD_SPECIALISTS or ./specialists)",
    )


def add_measurement_args(p: argparse.ArgumentParser) -> None:
    """`--repeat`, `--no-warmup`, `--no-plots`, `--no-progress`: how runs are timed and what is written besides."""
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="passes over each question's methods, each from the same state; every method keeps its "
        "fastest run (default: %(default)s; 2-3 tame a shared machine's noise on short runs)",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up call of each method")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """`--ray`, `--workers`, `--worker-cpus`, `--resume` (bench/distributed.py)."""
    p.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="shard the questions over Ray workers (pip install 'metasd[ray]'); ADDRESS of a running "
        "cluster (auto, HOST:PORT, ray://HOST:10001), none: start a local Ray instance",
    )
    p.add_argument("--workers", type=int, default=None, help="Ray workers (default: one per node)")
    p.add_argument(
        "--worker-cpus",
        type=int,
        default=None,
        help="CPUs per Ray worker, also its torch threads unless --threads (default: what fits one worker per node)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep each finished question in OUT/partial/ and skip those already there (start a long "
        "run with it, rerun the same command after an interruption; --ray always keeps them)",
    )


def drift_methods() -> list[str]:
    """The drift workload's default methods (bench/drift.py), less any policy this build does not have."""
    from ..bench.drift import METHODS
    from ..bench.methods import ORACLES, POLICIES

    return [m for m in METHODS if m in ("ar", *ORACLES) or m.partition(":")[0] in POLICIES]


def command_line(args: argparse.Namespace) -> str:
    """The bench command as given, rebuilt from the options that differ from their defaults."""
    parser: argparse.ArgumentParser = args.bench_parser
    words = ["metasd", "bench"]
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        value = getattr(args, action.dest, None)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        else:
            words += [flag, ",".join(value) if isinstance(value, list) else str(value)]
    return " ".join(shlex.quote(w) for w in words)


def run(args: argparse.Namespace) -> None:
    """Run `metasd bench` with the parsed arguments."""
    from ..bench.presets import preset
    from ..bench.run import BenchConfig, run_bench
    from ..bench.spec_bench import spec_bench_questions

    settings: dict = {"drafters": DEFAULT_DRAFTERS, "dtype": "float32", "max_new_tokens": 128}
    extra: dict = {}
    if args.quick:
        settings.update(QUICK)
        extra["quick"] = True
    if args.preset:
        settings.update(preset(args.preset, args.models_dir))
        extra["preset"] = args.preset
    if args.drift:
        settings.update(DRIFT)
    explicit = {
        "categories": args.categories,
        "per_category": args.per_category,
        "max_new_tokens": args.max_new_tokens,
        "drafters": args.drafters,
        "target": args.target,
        "dtype": args.dtype,
    }
    settings.update({key: value for key, value in explicit.items() if value is not None})
    preset_methods = settings.pop("methods", None)
    if settings.get("drift"):
        preset_methods = drift_methods()
    methods = args.methods if args.methods is not None else preset_methods
    questions = args.questions or spec_bench_questions()
    cfg = BenchConfig(
        questions=questions,
        out=args.out,
        methods=methods,
        draft_len=args.draft_len,
        seed=args.seed,
        device=args.device,
        threads=args.threads,
        policy_scope=args.policy_scope,
        kernels=args.kernels,
        repeat=args.repeat,
        warmup=not args.no_warmup,
        progress=not args.no_progress,
        plots=not args.no_plots,
        command=command_line(args),
        extra=extra,
        **settings,
    )
    if args.ray is not None or args.resume:
        from ..bench.distributed import ClusterOptions, run_distributed

        summary = run_distributed(cfg, ClusterOptions(args.ray, args.workers, args.worker_cpus, args.resume))
    else:
        if args.workers is not None or args.worker_cpus is not None:
            raise ValueError("--workers and --worker-cpus need --ray")
        summary = run_bench(cfg)
    overall = {m: e["overall"] for m, e in summary["methods"].items()}
    print(f"wrote {cfg.out}/summary.json, report.md, answers/ and {len(summary['plots'])} plots", file=sys.stderr)
    for method, o in overall.items():
        print(
            f"{method:<28} speedup {o['speedup']:.2f}  mean accepted tokens {o['mean_accepted_tokens']:.2f}  "
            f"mismatches {o['mismatches']}"
        )
