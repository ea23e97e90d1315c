"""Which files a datastore indexes (`metasd index`): each file named, and under each directory named the files
matching `--include` globs, skipping `--exclude` names. Standard library only, so that the CLI reads the defaults
without loading the indexer."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

DEFAULT_INCLUDE = (
    "*.py",
    "*.pyi",
    "*.txt",
    "*.md",
    "*.rst",
    "*.jsonl",
    "*.json",
    "*.c",
    "*.h",
    "*.cpp",
    "*.js",
    "*.ts",
    "*.java",
    "*.go",
    "*.rs",
    "*.sh",
    "*.tex",
)
DEFAULT_EXCLUDE = (
    "site-packages",
    "dist-packages",
    "__pycache__",
    ".git",
    ".hg",
    ".svn",
    "node_modules",
    ".venv",
    "*.egg-info",
)


def corpus_files(paths: list[str], include: tuple[str, ...], exclude: tuple[str, ...]) -> list[Path]:
    """The files to index: each path that is a file, and under each directory, in sorted order, the files whose
    names match an `include` glob, skipping names and directories that match an `exclude` one."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():
            out.append(path)
        elif path.is_dir():
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not any(fnmatch.fnmatch(d, pat) for pat in exclude))
                for name in sorted(names):
                    if any(fnmatch.fnmatch(name, pat) for pat in include) and not any(
                        fnmatch.fnmatch(name, pat) for pat in exclude
                    ):
                        found.append(Path(root) / name)
            if not found:
                raise ValueError(f"{raw}: no files matching {', '.join(include)}")
            out.extend(found)
        else:
            raise ValueError(f"corpus not found: {raw}")
    return out
