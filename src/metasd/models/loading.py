"""Resolve a model spec (embedded default, hub id, directory, GGUF file) into a model and its tokenizer."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tokens import token_ids
from . import attention  # noqa: F401  (registers the `sdpa` attention every model reads: grouped queries on a CPU)
from .converted import converted_entry, read_converted, read_converted_tokenizer, save_converted
from .embedded import embedded_path

EMBEDDED = "embedded"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` is CUDA when available, else the CPU (MPS only when asked for: its kernels lack some ops and
    round differently). Asking for a device this machine lacks is a ValueError, not a late CUDA error."""
    kind, _, index = str(device).partition(":")
    if kind not in DEVICES or (index and (kind in ("auto", "cpu") or not index.isdigit())):
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)} (or cuda:N)")
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but torch {torch.__version__} sees no CUDA device")
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' asked for, but this torch build or machine has no MPS backend")
    if kind == "cpu":
        return torch.device("cpu")
    # with an index, as the weights will report it: the target and an `lm:` drafter naming the same model share them
    return torch.device(kind, int(index) if index else (torch.cuda.current_device() if kind == "cuda" else 0))


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM, its tokenizer and the spec it came from."""

    spec: str
    model: torch.nn.Module
    tokenizer: object

    @property
    def device(self) -> torch.device:
        """The device the model's weights are on."""
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        """The rows of the model's LM head: the vocabulary its logits cover."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_length(self) -> int:
        """The longest context in tokens metasd decodes the model within (`context_length`)."""
        return context_length(self.model.config)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids at which the model's own generate() stops."""
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return frozenset(token_ids(eos))


def _locate(spec: str) -> tuple[str, dict]:
    """Map a spec to from_pretrained's (name_or_dir, extra kwargs)."""
    if spec in ("", EMBEDDED, "default"):
        path = embedded_path()
        return str(path.parent), {"gguf_file": path.name}
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model file not found: {spec}")
        return str(path.parent), {"gguf_file": path.name}
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"model path {spec!r} is neither a directory nor a .gguf file")
        return str(path), {}
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ValueError(f"model path not found: {spec}")
    return spec, {}  # a hub id; from_pretrained reads the local cache when HF_HUB_OFFLINE=1


def _entry(name: str, kwargs: dict) -> Path | None:
    """Where a GGUF file's conversion is kept (`converted`); None for any other model, or with the cache off."""
    return converted_entry(Path(name) / kwargs["gguf_file"]) if "gguf_file" in kwargs else None


_cache: dict[tuple[str, str, str], LoadedModel] = {}
_lock = threading.Lock()


def load_model(spec: str | None = None, dtype: str = "float32", device: str = "auto") -> LoadedModel:
    """Load once per process: a drafter `lm:` spec equal to the target's reuses the same weights."""
    spec = spec or EMBEDDED
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    where = resolve_device(device)
    key = (spec, dtype, str(where))
    with _lock:
        if key in _cache:
            return _cache[key]
        name, kwargs = _locate(spec)
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        transformers.utils.logging.disable_progress_bar()

        entry = _entry(name, kwargs)
        converted = read_converted(entry, DTYPES[dtype])  # a GGUF file's model as its first load saved it
        try:
            if "gguf_file" not in kwargs:  # refuse before reading the weights (a GGUF is checked once loaded)
                from transformers import AutoConfig

                check_full_attention(AutoConfig.from_pretrained(name), spec)
            tokenizer, model = converted or (
                AutoTokenizer.from_pretrained(name, **kwargs),
                AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[dtype], **kwargs),
            )
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"cannot load model {spec!r}: {err}") from err
        check_full_attention(model.config, spec)
        if entry is not None and converted is None:
            save_converted(entry, tokenizer, model, DTYPES[dtype])
        model.to(where).eval()
        loaded = LoadedModel(spec=spec, model=model, tokenizer=tokenizer)
        _cache[key] = loaded
        return loaded


def adopt_model(model: torch.nn.Module, tokenizer: object | None, role: str = "target") -> LoadedModel:
    """A causal LM object its caller loaded, used as it is (its dtype, device, adapters, no copy of its weights),
    after the checks a spec's model gets. Its spec (messages, the calibration cache) is its `name_or_path`, class and
    size."""
    if not callable(getattr(model, "get_output_embeddings", None)) or getattr(model, "generation_config", None) is None:
        raise ValueError(
            f"the {role} object is a {type(model).__name__}, not a transformers causal LM (what "
            "AutoModelForCausalLM.from_pretrained returns)"
        )
    if tokenizer is None or not callable(getattr(tokenizer, "get_vocab", None)):
        raise ValueError(
            f"a {role} model object needs its tokenizer beside it (a transformers tokenizer), got {tokenizer!r}"
        )
    if model.training:
        raise ValueError(f"the {role} model is in training mode (dropout on): call model.eval() first")
    # named by where it came from and what it is: the calibration cache is keyed by this name, and one directory
    # can hold several GGUF files (their models' name_or_path is the directory)
    params = sum(p.numel() for p in model.parameters())
    spec = f"{getattr(model, 'name_or_path', '') or 'model object'} ({type(model).__name__} {params / 1e6:.0f}M)"
    check_full_attention(model.config, spec)
    return LoadedModel(spec=spec, model=model, tokenizer=tokenizer)


def dtype_name(model: torch.nn.Module) -> str:
    """The model's dtype as `DTYPES` names it (what drafters built beside it load in)."""
    dtype = next(model.parameters()).dtype
    return next((name for name, d in DTYPES.items() if d == dtype), "float32")


def load_tokenizer(spec: str | None = None) -> object:
    """The tokenizer alone (a Ray driver that reports on a GPU run may have no GPU): a loaded model's if any."""
    spec = spec or EMBEDDED
    with _lock:
        loaded = next((m for key, m in _cache.items() if key[0] == spec), None)
    if loaded is not None:
        return loaded.tokenizer
    from transformers import AutoTokenizer

    name, kwargs = _locate(spec)
    converted = read_converted_tokenizer(_entry(name, kwargs))
    if converted is not None:
        return converted
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"cannot load the tokenizer of {spec!r}: {err}") from err


def context_length(config: object) -> int:
    """The positions metasd decodes a model within: its `max_position_embeddings`, or for LongRoPE (Phi-3/3.5/4-mini)
    its `original_max_position_embeddings`. LongRoPE picks its short or long frequencies from the largest position
    in each forward, so beyond that point one row of a batch would rotate every other row's queries with the other
    set, and a verification forward crossing it would rotate positions the cache holds with the short set
    (transformers' own generate re-computes the whole cache there). Within it every forward uses the short set."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = int(getattr(config, "max_position_embeddings", None) or 2048)
    rope = getattr(config, "rope_parameters", None) or {}
    for params in rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]:
        if params.get("rope_type") == "longrope":
            original = params.get("original_max_position_embeddings")
            original = original or getattr(config, "original_max_position_embeddings", None) or context
            context = min(context, int(original))
    return context


def check_full_attention(config: object, spec: str) -> None:
    """Refuse sliding-window attention (Mistral, Gemma 2/3, Qwen2 with use_sliding_window...): the caches re-use
    a prefix and crop the rest, which a sliding-window cache cannot do once its window is full."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "use_sliding_window", True) is False:
        return
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    context = getattr(config, "max_position_embeddings", None)
    kinds = set(getattr(config, "layer_types", None) or [])
    windowed = bool(kinds & {"sliding_attention", "chunked_attention"}) or (not kinds and window is not None)
    if windowed and window is not None and (context is None or window < context):
        raise ValueError(
            f"model {spec!r} uses sliding-window attention (a window of {window} tokens, context {context}), which "
            "metasd does not support: its KV caches keep a prefix and crop the rest after each rejection, and a "
            "sliding-window cache cannot be cropped once the window is full. Use a model with full attention"
        )


def same_tokenizer(a: object, b: object) -> bool:
    """Drafts are token ids, so drafter and target must map ids to the same strings."""
    return a.get_vocab() == b.get_vocab()
