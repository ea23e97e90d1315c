"""GGUF files converted once into transformers' own format, so that a model loads in a fraction of a second after
its first use.

transformers reads a GGUF file by parsing all of its metadata (for the tokenizer, hundreds of thousands of fields,
in Python) three times, for the config, the tokenizer and the weights, and then dequantizes every tensor: most of a
`metasd` command's start-up on the embedded model. The first load saves what it built under the cache
(`embedded.cache_dir()` / converted): the tokenizer, and per dtype the config, the generation config and the weights
as loaded (safetensors). A model read back from there is the same model, bit for bit, and the same tokenizer; later
loads of the file read that instead. The entry is named by the file (its path, size and modification time) and the
versions of transformers and gguf that converted it, so an edited file or an upgrade converts again, and replaces
the older entry of the same path. `METASD_GGUF_CACHE=off` converts at every load and saves nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .embedded import cache_dir

log = logging.getLogger(__name__)

TOKENIZER = "tokenizer"  # an entry's tokenizer, beside one directory per dtype


def converted_entry(gguf: Path) -> Path | None:
    """The cache entry of a GGUF file, whether written yet or not (None: the cache is off, or the file cannot be
    read): tokenizer/ and one directory per dtype."""
    if os.environ.get("METASD_GGUF_CACHE", "").strip().lower() in ("off", "0", "false", "no"):
        return None
    try:
        path = gguf.expanduser().resolve()
        stat = path.stat()
    except OSError:
        return None
    place = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    what = f"{stat.st_size}:{stat.st_mtime_ns}:{_version('transformers')}:{_version('gguf')}"
    return cache_dir() / "converted" / f"{path.stem}-{place}-{hashlib.sha256(what.encode()).hexdigest()[:16]}"


def save_converted(entry: Path, tokenizer, model, dtype: str) -> None:
    """Write what a GGUF load built into `entry` (each part whole or not at all: written aside, then renamed into
    place) and remove older entries of the same path. A cache that cannot be written costs the next load its
    conversion again, never this one its model."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        if not (entry / TOKENIZER).is_dir():
            _write(entry / TOKENIZER, tokenizer.save_pretrained)
        if not (entry / dtype).is_dir():
            _write(entry / dtype, lambda where: _save_dequantized(model, where))
            size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file()) / 1e9
            print(
                f"metasd: kept the model converted from its GGUF file ({size:.1f} GB) in {entry}, so that later loads "
                "read it (METASD_GGUF_CACHE=off: convert at every load instead)",
                file=sys.stderr,
            )
        same_path = entry.name.rsplit("-", 1)[0] + "-"
        for older in entry.parent.iterdir():
            if older.name.startswith(same_path) and older != entry:
                shutil.rmtree(older, ignore_errors=True)
    except Exception as err:  # noqa: BLE001 - a full disk or a read-only cache must not fail the load itself
        log.warning("could not cache the converted model in %s: %s", entry, err)


def read_converted(entry: Path | None, dtype: str):
    """(tokenizer, model) from a cache entry holding both, else None; an entry that cannot be read (cut short, written
    by another version) is removed, and the file is converted again."""
    if entry is None or not (entry / TOKENIZER).is_dir() or not (entry / dtype).is_dir():
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(entry / TOKENIZER)
        return tokenizer, AutoModelForCausalLM.from_pretrained(entry / dtype, dtype=getattr(torch, dtype))
    except Exception as err:  # noqa: BLE001 - whatever is wrong with the copy, the GGUF file is still there
        log.warning("the converted model in %s cannot be read (%s): converting the GGUF file again", entry, err)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _write(final: Path, save) -> None:
    aside = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        save(aside)
        os.replace(aside, final)  # another process that wrote it first: its copy stays, this one goes
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _save_dequantized(model, where: Path) -> None:
    """`save_pretrained` of a model transformers loaded from a GGUF file: it refuses while the model carries the
    GGUF quantizer, though the weights it holds are plain dequantized tensors; saved without it, the directory
    loads as an ordinary checkpoint. The model itself is left as it was."""
    quantizer, quantization = model.hf_quantizer, model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    try:
        model.save_pretrained(where)
    finally:
        model.hf_quantizer = quantizer
        if quantization is not None:
            model.config.quantization_config = quantization


def _version(package: str) -> str:
    with contextlib.suppress(PackageNotFoundError):
        return version(package)
    return "none"
