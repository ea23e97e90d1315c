"""Heads learned from traffic on disk, per history key (`--learn-heads DIR`): each improved head in its own
`head-vN` directory with the learning record beside it (`learning.jsonl`), `current` naming the one in service, so
that a restart resumes it. Writes are flushed and renamed into place: a process or machine that dies mid-write
leaves the head before it in service."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from ..drafters.eagle import SHARED_KEY
from ..files import written_aside
from ..models.eagle_head import EagleHead, TargetCheck, load_head, save_head

log = logging.getLogger(__name__)


class HeadStore:
    """One drafter's learned heads under `directory`, a subdirectory per history key. `base_fingerprint` and
    `draft_vocab` are those of the head the drafter loaded: only heads grown from it are resumed."""

    def __init__(self, directory: Path, drafter: str, target, base_fingerprint: str, draft_vocab: torch.Tensor):
        self.directory = directory
        self.drafter = drafter
        self.target = target
        self.base_fingerprint = base_fingerprint
        self.draft_vocab = draft_vocab

    def save(self, key: str, record: dict, head: EagleHead | None, config: dict) -> None:
        """Append the round to the key's learning.jsonl; a head swapped in is written whole to its own directory
        (`head-vN`, flushed to disk) before `current` names it (a temporary file renamed over the old one);
        versions before the previous one are removed."""
        out = self.directory / dir_name(key)
        out.mkdir(parents=True, exist_ok=True)
        if head is not None:
            name = f"head-v{record['version']}"
            training = {"learned_from_traffic": record, "base_head": self.base_fingerprint, "config": config}
            save_head(out / name, head, self.target.spec, TargetCheck.of(self.target.model), training)
            for written in (out / name / "head.safetensors", out / name / "config.json", out / name):
                _flush(written)
            with written_aside(out / "current") as pointer:
                pointer.write_text(name + "\n", encoding="utf-8")
                _flush(pointer)
            _flush(out)
            for old in _versions(out)[2:]:  # the new one and the one before it stay
                shutil.rmtree(old, ignore_errors=True)
        with open(out / "learning.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def resume(self) -> Iterator[tuple[str, EagleHead, int]]:
        """Each key's last saved head and its version, from an earlier run with this directory: the one `current`
        names, else the newest one readable; a head grown from another base head than the drafter's (another
        `eagle:PATH`, a retrained head) is not resumed, nor is one cut short or made for another target."""
        directory = self.directory
        for sub in sorted(p for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []:
            if (sub / "config.json").is_file():
                log.warning("%s: not resuming %s (an older layout: heads now go to head-vN)", self.drafter, sub)
            for path in _saved_heads(sub):
                try:
                    saved = load_head(path, self.target.model)
                    if saved.training.get("base_head") != self.base_fingerprint:
                        raise ValueError(f"it grew from another head than {self.drafter}'s (base head fingerprint)")
                    if not torch.equal(saved.head.draft_vocab, self.draft_vocab):
                        raise ValueError(f"it has another draft vocabulary than {self.drafter}'s")
                except ValueError as err:
                    log.warning("%s: not resuming %s (%s)", self.drafter, path, err)
                    continue
                version = int(saved.training.get("learned_from_traffic", {}).get("version", 1))
                yield _key_of(sub.name), saved.head.float().eval(), version
                break


def dir_name(key: str) -> str:
    """A history key as a directory name: the shared history is `shared`, a client's key as it is (`key-` and a
    hash of its API key, `serving.app.history_key`)."""
    return "shared" if key == SHARED_KEY else re.sub(r"[^A-Za-z0-9_.-]", "_", key)


def _key_of(name: str) -> str:
    return SHARED_KEY if name == "shared" else name


def _saved_heads(key_dir: Path) -> list[Path]:
    """A key's saved heads, the one to resume first: the one `current` names, then the others newest first."""
    try:
        named = key_dir / (key_dir / "current").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):  # none yet, or unreadable: the newest version readable is resumed
        named = None
    return ([named] if named is not None else []) + [p for p in _versions(key_dir) if p != named]


def _versions(key_dir: Path) -> list[Path]:
    """A key's head-vN directories, newest first."""
    found = [p for p in key_dir.glob("head-v*") if p.is_dir() and p.name[6:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[6:]), reverse=True)


def _flush(path: Path) -> None:
    """Push a written file (or a directory's entries) to the disk, where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # a directory on a platform that cannot sync one
        pass
    finally:
        os.close(fd)
