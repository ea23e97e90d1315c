"""Files written whole or not at all: the caller writes to a path beside the file, named for this process, which is
renamed over the file when the writing ends and removed if it fails, so that a reader, a resumed run or another
process writing the same file at once never finds one cut short (checkpoints, corpus shards, cached T(M) tables,
the pointer to a learned head in service, the embedded model's GGUF)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def written_aside(path: Path) -> Iterator[Path]:
    """The path to write `path`'s new content to (beside it, hidden, with this process's id); it replaces `path`
    when the block ends, and is removed when the block raises."""
    aside = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield aside
        os.replace(aside, path)
    finally:
        aside.unlink(missing_ok=True)
