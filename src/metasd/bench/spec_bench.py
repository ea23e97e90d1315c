"""Spec-Bench's questions, got the way the embedded model is got.

Spec-Bench (Xia et al., "Unlocking Efficiency in Large Language Model Inference: A Comprehensive Survey of
Speculative Decoding", ACL 2024 Findings; https://github.com/hemingkx/Spec-Bench, Apache-2.0) publishes its 480
questions as `data/spec_bench/question.jsonl`. Where to look, in order:

1. `$METASD_SPEC_BENCH`: a path to a local copy (an offline machine);
2. the cache, beside the embedded model's (`metasd.models.embedded.cache_dir`);
3. the download into that cache, pinned to one commit and checked against its SHA-256.

`metasd bench --questions PATH` skips all of this.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from pathlib import Path

from ..models.embedded import cache_dir

ENV = "METASD_SPEC_BENCH"
COMMIT = "66230f10cb0a02aced5ef3ce1e85163c16160454"  # the last commit that changed question.jsonl
URL = f"https://raw.githubusercontent.com/hemingkx/Spec-Bench/{COMMIT}/data/spec_bench/question.jsonl"
SHA256 = "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
TIMEOUT_S = 30.0


def cached_path() -> Path:
    """Where the downloaded question.jsonl is kept, under metasd's cache directory."""
    return cache_dir() / "spec_bench" / "question.jsonl"


def spec_bench_questions() -> Path:
    """The path of Spec-Bench's question.jsonl (see the module docstring); ValueError when it cannot be had."""
    override = os.environ.get(ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise ValueError(f"{ENV} points to {path}, which is not a file")
        return path
    target = cached_path()
    if target.is_file():
        return target
    try:
        with urllib.request.urlopen(URL, timeout=TIMEOUT_S) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as err:
        raise ValueError(
            f"Spec-Bench's questions could not be downloaded ({err}) from {URL}. On an offline machine, copy that "
            f"file here and pass --questions PATH or set {ENV}=PATH"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise ValueError(f"{URL} has SHA-256 {digest}, expected {SHA256}; not cached")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".part{os.getpid()}")
    partial.write_bytes(data)
    partial.replace(target)  # atomic: a concurrent reader sees the whole file or none
    return target
