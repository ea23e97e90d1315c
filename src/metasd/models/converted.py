"""GGUF files converted once into transformers' own format, so that a model loads in a fraction of a second after
its first use.

transformers reads a GGUF file by parsing all of its metadata (for the tokenizer, hundreds of thousands of fields,
in Python) three times, for the config, the tokenizer and the weights, and then dequantizes every tensor: most of a
`metasd` command's start-up on the embedded model. The first load saves what it built under the cache
(`embedded.cache_dir()` / converted): the tokenizer, and per dtype the config, the generation config and the weights
as loaded (safetensors). A model read back from there is the same model, bit for bit, and the same tokenizer; later
loads of the file read that instead. An entry is named by the file (its path, size and modification time) and the
versions of transformers and gguf that converted it: an edited file converts again and its older entries go; an
entry of other versions stays for the environment that has them. `METASD_GGUF_CACHE=off` converts at every load.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from .embedded import cache_dir

log = logging.getLogger(__name__)

TOKENIZER = "tokenizer"  # an entry's tokenizer, beside one directory per dtype
STALE_SECONDS = 3600  # a part written aside this long ago belonged to a process that died while writing it


def converted_entry(gguf: Path) -> Path | None:
    """The cache entry of a GGUF file, whether written yet or not (None: the cache is off, or the file cannot be
    read): tokenizer/ and one directory per dtype. Its name: the file's stem, a hash of its path, of its size and
    modification time, and of the converting versions."""
    if os.environ.get("METASD_GGUF_CACHE", "").strip().lower() in ("off", "0", "false", "no"):
        return None
    try:
        path = gguf.expanduser().resolve()
        stat = path.stat()
    except OSError:
        return None
    versions = f"{_version('transformers')}:{_version('gguf')}"
    parts = (str(path), f"{stat.st_size}:{stat.st_mtime_ns}", versions)
    return cache_dir() / "converted" / "-".join([path.stem[:64], *(_digest(p) for p in parts)])


def read_converted_tokenizer(entry: Path | None):
    """The tokenizer an entry holds, else None (none written, or one that cannot be read, which is removed)."""
    if entry is None or not (entry / TOKENIZER).is_dir():
        return None
    from transformers import AutoTokenizer

    return _read(entry / TOKENIZER, AutoTokenizer.from_pretrained)


def read_converted(entry: Path | None, dtype: torch.dtype):
    """(tokenizer, model) from an entry holding both for `dtype`, else None; a part that cannot be read (cut short,
    written by a process that died) is removed, and the file is converted again."""
    where = None if entry is None else entry / _dtype_name(dtype)
    if where is None or not where.is_dir() or (tokenizer := read_converted_tokenizer(entry)) is None:
        return None
    from transformers import AutoModelForCausalLM

    model = _read(where, lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=dtype))
    return None if model is None else (tokenizer, model)


def save_converted(entry: Path, tokenizer, model, dtype: torch.dtype) -> None:
    """Write what a GGUF load built into `entry` (each part whole or not at all: written aside, then renamed into
    place), and remove the entries of the file's earlier contents. A cache that cannot be written costs the next
    load its conversion again, never this one its model."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        _remove_stale(entry)
        _write(entry / TOKENIZER, tokenizer.save_pretrained)
        part = entry / _dtype_name(dtype)
        if _write(part, lambda where: _save_dequantized(model, where)):
            size = sum(f.stat().st_size for f in part.iterdir()) / 1e9
            print(
                f"metasd: kept the model converted from its GGUF file ({size:.1f} GB) in {entry}, so that later loads "
                "read it (METASD_GGUF_CACHE=off: convert at every load instead)",
                file=sys.stderr,
            )
        same_path, _, versions = entry.name.rsplit("-", 2)
        for other in entry.parent.iterdir():  # the same path with other contents, converted by these versions
            if other.name.startswith(f"{same_path}-") and other.name.endswith(f"-{versions}") and other != entry:
                shutil.rmtree(other, ignore_errors=True)
    except Exception as err:  # noqa: BLE001 - a full disk or a read-only cache must not fail the load itself
        log.warning("could not keep the converted model in %s (%s); METASD_GGUF_CACHE=off skips it", entry, err)


def _read(where: Path, load):
    """What `load` reads from a part, else None: the GGUF file is converted instead. A part this process may not
    read (another user's) stays for those who may; any other failure (cut short, corrupt) removes it."""
    try:
        return load(where)
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever is wrong with the copy, the GGUF file is still there
        log.warning("the converted copy in %s cannot be read (%s): converting the GGUF file again", where, err)
        if not isinstance(err, PermissionError):
            shutil.rmtree(where, ignore_errors=True)
        return None


def _write(final: Path, save) -> bool:
    """Save into a directory beside `final`, then rename it into place; False where it was already there (written
    before, or by another process first)."""
    if final.is_dir():
        return False
    aside = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        save(aside)
        aside.chmod(0o755)  # mkdtemp's 0700 would hide the copy from the other users of a shared cache
        os.replace(aside, final)
        return True
    except OSError:
        if not final.is_dir():
            raise
        return False
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _remove_stale(entry: Path) -> None:
    """Parts written aside by a process that died before renaming them (hours old), which nothing else removes."""
    for aside in entry.glob(".*-*"):
        with contextlib.suppress(OSError):
            if time.time() - aside.stat().st_mtime > STALE_SECONDS:
                shutil.rmtree(aside, ignore_errors=True)


def _save_dequantized(model, where: Path) -> None:
    """`save_pretrained` of a model transformers loaded from a GGUF file: it refuses while the model carries the
    GGUF quantizer, though the weights it holds are plain dequantized tensors; saved without it, the directory
    loads as an ordinary checkpoint. The model itself is left as it was."""
    quantizer = getattr(model, "hf_quantizer", None)
    quantization = model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    try:
        model.save_pretrained(where)
    finally:
        model.hf_quantizer = quantizer
        if quantization is not None:
            model.config.quantization_config = quantization


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _version(package: str) -> str:
    with contextlib.suppress(PackageNotFoundError):
        return version(package)
    return "none"
