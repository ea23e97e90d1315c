"""`metasd index`: tokenize a corpus with the target's tokenizer and write a datastore (`metasd.drafters.datastore`,
REST-style retrieval drafting, He et al., arXiv 2311.08252).

Inputs, any mix of:
- text files (one document each; large files are cut at line boundaries into ~1 MB documents);
- JSONL (`.jsonl`) or JSON (`.json`: a list of records): per record a `text` string, or a chat under `messages` /
  `conversations` (`role`/`content` or ShareGPT's `from`/`value`), rendered with the tokenizer's chat template when it
  has one, or prompt/response-like string fields (`prompt`, `instruction`, `input`, `question`, `response`, `output`,
  `answer`, `completion`) joined by newlines;
- directories, walked recursively for files matching `--include` (default: common source and text extensions),
  skipping `--exclude` names (default: site-packages, __pycache__, .git and the like).

The suffix array is sorted on the first `depth` tokens of each suffix by prefix doubling (log2(depth) rounds of a
NumPy argsort over (rank[i], rank[i + h]) pairs packed into one int64): vectorised, no Python loop over suffixes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..drafters.datastore import FORMAT, SA_DTYPE, SEP, TOKENS_DTYPE, VERSION, tokenizer_fingerprint
from .corpus_files import DEFAULT_EXCLUDE, DEFAULT_INCLUDE, corpus_files
from .prompts import chat_turn

CHUNK_CHARS = 1 << 20
_PAIR_FIELDS = ("system", "instruction", "prompt", "question", "input", "response", "output", "answer", "completion")


def _chat_text(turns: list, tokenizer) -> str | None:
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role, content = chat_turn(turn)
        if not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    if not messages:
        return None
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception:  # noqa: BLE001 - templates that reject a role order: fall back to plain text
            pass
    return "\n".join(m["content"] for m in messages)


def record_text(record, tokenizer) -> str | None:
    """The text to index for one JSON record, or None when it has none."""
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("text"), str):
        return record["text"]
    for field in ("messages", "conversations", "conversation"):
        if isinstance(record.get(field), list):
            return _chat_text(record[field], tokenizer)
    parts = [record[f] for f in _PAIR_FIELDS if isinstance(record.get(f), str) and record[f]]
    return "\n".join(parts) if parts else None


def iter_documents(path: Path, tokenizer) -> Iterator[str]:
    """The documents of one file."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    try:
                        text = record_text(json.loads(line), tokenizer)
                    except json.JSONDecodeError:
                        continue
                    if text:
                        yield text
        return
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        except json.JSONDecodeError:
            data = None
        if isinstance(data, list):
            for record in data:
                text = record_text(record, tokenizer)
                if text:
                    yield text
            return
        if isinstance(data, dict) and record_text(data, tokenizer):
            yield record_text(data, tokenizer)
            return
        # not records: index it as text
    raw = path.read_bytes()
    if b"\x00" in raw[:8192]:
        return  # binary
    text = raw.decode("utf-8", errors="replace")
    start = 0
    while start < len(text):  # cut large files at line boundaries
        end = len(text) if len(text) - start <= CHUNK_CHARS else text.rfind("\n", start, start + CHUNK_CHARS) + 1
        if end <= start:
            end = start + CHUNK_CHARS
        if text[start:end].strip():
            yield text[start:end]
        start = end


def suffix_array(tokens: np.ndarray, depth: int, progress=None) -> np.ndarray:
    """Positions of the non-separator tokens, sorted by the (at most) `depth` tokens starting there.

    Order: token ids ascending, the separator above every id, the end of the array below everything, which is
    the order of comparing big-endian int32 bytes (`>i4`, -1 = 0xFFFFFFFF) with shorter byte strings first.
    """
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=SA_DTYPE)
    t = np.asarray(tokens, dtype=np.int64)
    rank = np.where(t == SEP, int(t.max()) + 2, t + 1)  # 1.. ; 0 is reserved for "past the end"
    order = np.argsort(rank, kind="stable")
    h = 1
    while h < depth:
        sorted_rank = rank[order]
        distinct = 1 + int(np.count_nonzero(sorted_rank[1:] != sorted_rank[:-1]))
        if distinct == n:
            break  # every prefix already unique
        second = np.zeros(n, dtype=np.int64)
        second[: n - h] = rank[h:]
        key = rank * (int(rank.max()) + 1) + second
        del second
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        del key
        new_sorted = np.empty(n, dtype=np.int64)
        new_sorted[0] = 1
        np.cumsum(sorted_key[1:] != sorted_key[:-1], out=new_sorted[1:])
        new_sorted[1:] += 1
        del sorted_key
        rank = np.empty(n, dtype=np.int64)
        rank[order] = new_sorted
        del new_sorted
        h *= 2
        if progress is not None:
            progress.update(1)
    keep = t[order] != SEP
    return order[keep].astype(SA_DTYPE)


def _tokenize(files: list[Path], tokenizer, max_tokens: int | None, progress: bool) -> tuple[np.ndarray, dict, int]:
    """The files' documents tokenized in batches into one array, each followed by the separator; with the
    documents and tokens per source (a file, or its directory when there are more than 20 files) and the number of
    documents. Stops after the batch that reaches `max_tokens`."""
    from tqdm import tqdm

    chunks: list[np.ndarray] = []
    sources: dict[str, dict] = {}
    total = docs = 0
    batch: list[str] = []
    sep = np.array([SEP], dtype=np.int32)

    def flush(source: dict) -> None:
        nonlocal total, docs
        if not batch:
            return
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            if ids:
                chunks.append(np.asarray(ids, dtype=np.int32))
                chunks.append(sep)
                total += len(ids) + 1
                docs += 1
                source["documents"] += 1
                source["tokens"] += len(ids)
        batch.clear()

    bar = tqdm(
        total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, desc="tokenizing", disable=not progress
    )
    for path in files:
        source = sources.setdefault(str(path.parent if len(files) > 20 else path), {"documents": 0, "tokens": 0})
        for text in iter_documents(path, tokenizer):
            batch.append(text)
            if len(batch) >= 256:
                flush(source)
                bar.set_postfix(tokens=f"{total / 1e6:.1f}M", refresh=False)
                if max_tokens is not None and total >= max_tokens:
                    break
        flush(source)
        bar.update(path.stat().st_size)
        if max_tokens is not None and total >= max_tokens:
            break
    bar.close()
    if not chunks:
        raise ValueError("the corpora hold no text to index")
    return np.concatenate(chunks), sources, docs


def _header(tokenizer, target: str, depth: int, tokens: np.ndarray, sa: np.ndarray, docs: int, sources: dict) -> dict:
    """header.json without its build times: the format, the sizes, the tokenizer and the sources."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "depth": depth,
        "n_tokens": int(tokens.size),
        "n_suffixes": int(sa.size),
        "n_documents": docs,
        "tokenizer": {
            "sha256": tokenizer_fingerprint(tokenizer),
            "name": getattr(tokenizer, "name_or_path", None),
            "vocab_size": len(tokenizer.get_vocab()),
            "target": target,
        },
        "sources": [{"path": path, **counts} for path, counts in sources.items()],
    }


def build_index(
    corpora: list[str],
    out: str | Path,
    tokenizer,
    target: str = "embedded",
    depth: int = 16,
    include: tuple[str, ...] = DEFAULT_INCLUDE,
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE,
    max_tokens: int | None = None,
    progress: bool = True,
) -> dict:
    """Tokenize the corpora, sort the suffixes, write out/{tokens.npy, sa.npy, header.json}; return the header."""
    from tqdm import tqdm

    if depth < 1:
        raise ValueError(f"--depth must be >= 1, got {depth}")
    started = time.perf_counter()
    files = corpus_files(corpora, tuple(include), tuple(exclude))
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    tokens, sources, docs = _tokenize(files, tokenizer, max_tokens, progress)
    if tokens.size >= 2**31 - 1:
        raise ValueError(f"{tokens.size} tokens: more than an int32 suffix array can address; index fewer")
    tokenize_s = time.perf_counter() - started
    rounds = max(0, (depth - 1).bit_length())
    with tqdm(total=rounds, desc="sorting suffixes", unit="round", disable=not progress) as sort_bar:
        sa = suffix_array(tokens, depth, sort_bar)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "tokens.npy", tokens.astype(TOKENS_DTYPE))
    np.save(out / "sa.npy", sa)
    header = _header(tokenizer, target, depth, tokens, sa, docs, sources)
    header["build_seconds"] = {"tokenize": round(tokenize_s, 2), "total": round(time.perf_counter() - started, 2)}
    header["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (out / "header.json").write_text(json.dumps(header, indent=1) + "\n", encoding="utf-8")
    return header
