"""Retrieval drafting from a token datastore, after REST (He et al., arXiv 2311.08252): `datastore:PATH`.

REST looks up the longest suffix of the context in a corpus (with a suffix array) and drafts a tree of the frequent
prefixes of what follows its matches; here a draft is one path. A binary search over the suffix array (comparing
raw bytes) finds the longest suffix of the context, at most `depth` tokens, that occurs in the corpus; the walk then
drafts the most frequent next token among the matches, keeps the matches that continue with it, and so on for k
tokens (stopping at a document's end). Huge match sets (a one-token match on a common token) are thinned to
`max_matches` evenly spaced entries of the suffix-array range; the range is sorted by the following tokens, so the
sample stays representative.

The index (built by `metasd index`, `metasd.specialists.index`) is a directory of `tokens.npy`, `sa.npy` and
`header.json` (see `Datastore`); its arrays are memory-mapped, loaded once per process and shared by every drafter
and request that names the path.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import mmap
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..draft import Draft
from ..sampling import SamplingParams
from .base import Drafter

FORMAT = "metasd-datastore"
VERSION = 1
SEP = -1  # document separator in tokens.npy; never a token id
TOKENS_DTYPE = np.dtype(">i4")
SA_DTYPE = np.dtype("=i4")


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 over the tokenizer's vocabulary sorted by id: equal exactly when ids map to the same strings."""
    cached = _fingerprints.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()
    _fingerprints[id(tokenizer)] = (tokenizer, digest)
    return digest


_fingerprints: dict[int, tuple[object, str]] = {}


@dataclass
class Lookup:
    """One draft's provenance, per drafted token: how long the context match was, and how its continuation won."""

    tokens: list[int]
    match_length: int  # tokens of the context matched in the corpus (0: no match)
    matches: list[int]  # corpus matches left before each drafted token (counted on the thinned sample)
    counts: list[int]  # of those, how many continue with the drafted token

    @property
    def confidence(self) -> list[float]:
        """Per drafted token, the share of matches that continue with it, smoothed as count / (matches + 1) so
        that one match agreeing with itself (0.5) counts less than ten that agree (0.91)."""
        return [c / (m + 1) for c, m in zip(self.counts, self.matches, strict=True)]


class Datastore:
    """A loaded index: memory-mapped tokens and suffix array, and the lookups on them. The directory holds:

    - `tokens.npy`: every document of the corpus tokenized with the target's tokenizer, one after another, each
      followed by a separator (-1), as big-endian int32 (`>i4`) so that comparing raw bytes compares token sequences;
    - `sa.npy`: a suffix array (native int32): the positions of every non-separator token, sorted by the first
      `depth` tokens that start there (ties in no particular order). Drafts need only the first few tokens of a
      suffix to match, so sorting on a fixed depth (16 by default) is enough and far cheaper to build than a full
      suffix array;
    - `header.json`: format and version, the depth, the counts, and the tokenizer it was built with (a SHA-256 over
      the sorted vocabulary): an index built for another tokenizer is refused, since its ids would mean other strings.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.header = read_header(self.path)
        self.depth = int(self.header["depth"])
        n_tokens, n_suffixes = int(self.header["n_tokens"]), int(self.header["n_suffixes"])
        try:
            self.tokens = np.load(self.path / "tokens.npy", mmap_mode="r")
            self.sa = np.load(self.path / "sa.npy", mmap_mode="r")
        except (OSError, ValueError) as err:
            raise ValueError(f"datastore {self.path}: cannot read its arrays ({err}); rebuild it") from err
        if self.tokens.dtype != TOKENS_DTYPE or self.tokens.shape != (n_tokens,):
            raise ValueError(
                f"datastore {self.path}: tokens.npy is {self.tokens.dtype}{self.tokens.shape}, "
                f"the header says >i4({n_tokens},); corrupt or from another version, rebuild it"
            )
        if self.sa.dtype != SA_DTYPE or self.sa.shape != (n_suffixes,):
            raise ValueError(
                f"datastore {self.path}: sa.npy is {self.sa.dtype}{self.sa.shape}, the header says "
                f"int32({n_suffixes},); corrupt or from another version, rebuild it"
            )
        if (
            n_tokens == 0
            or self.tokens[-1] != SEP
            or (n_suffixes and not (int(self.sa.min()) >= 0 and int(self.sa.max()) < n_tokens - 1))
        ):
            raise ValueError(
                f"datastore {self.path}: tokens.npy or sa.npy is corrupt (out-of-range entries); rebuild it"
            )
        # Raw views for the binary search: bytes slices of the token file compare like token sequences, and a
        # memoryview over the suffix array yields Python ints; both are far cheaper per probe than NumPy scalars.
        self._files = [open(self.path / name, "rb") for name in ("tokens.npy", "sa.npy")]  # noqa: SIM115
        self._maps = [mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) for f in self._files]
        self._tok_bytes = self._maps[0]
        self._tok_offset = int(self.tokens.offset)
        self._sa_ints = memoryview(self._maps[1])[int(self.sa.offset) :].cast("i") if n_suffixes else []

    @property
    def tokenizer_sha256(self) -> str:
        """The fingerprint of the tokenizer the corpus was tokenized with."""
        return self.header["tokenizer"]["sha256"]

    def check_tokenizer(self, tokenizer, target: str = "the target") -> None:
        """Refuse (ValueError) a `tokenizer` other than the one the index was built with: its token ids would mean
        other strings. `target` names the model in the message."""
        theirs = tokenizer_fingerprint(tokenizer)
        if theirs != self.tokenizer_sha256:
            built = self.header["tokenizer"]
            raise ValueError(
                f"datastore {self.path} was built with another tokenizer ({built.get('name')!r}, vocabulary "
                f"{built.get('vocab_size')}, sha256 {self.tokenizer_sha256[:12]}) than {target} uses "
                f"({getattr(tokenizer, 'name_or_path', '?')!r}, sha256 {theirs[:12]}); its token ids would mean other "
                "strings. Rebuild it with `metasd index ... --target` for this model"
            )

    def _key(self, length: int):
        off, buf = self._tok_offset, self._tok_bytes
        width = 4 * length
        return lambda pos: buf[off + 4 * pos : off + 4 * pos + width]

    def find(self, pattern: list[int]) -> tuple[int, int]:
        """[lo, hi) of the suffix-array entries whose suffix starts with pattern (len(pattern) <= depth)."""
        if not pattern:
            return 0, len(self._sa_ints)
        if len(pattern) > self.depth:
            raise ValueError(f"pattern of {len(pattern)} tokens is longer than the index depth {self.depth}")
        target = np.asarray(pattern, dtype=TOKENS_DTYPE).tobytes()
        key = self._key(len(pattern))
        lo = bisect.bisect_left(self._sa_ints, target, key=key)
        hi = bisect.bisect_right(self._sa_ints, target, lo=lo, key=key)
        return lo, hi

    def _first_at_least(self, pattern: list[int]) -> tuple[int, bool]:
        """(the first suffix-array row whose suffix is >= pattern, whether that suffix starts with pattern)."""
        target = np.asarray(pattern, dtype=TOKENS_DTYPE).tobytes()
        key = self._key(len(pattern))
        row = bisect.bisect_left(self._sa_ints, target, key=key)
        return row, row < len(self._sa_ints) and key(self._sa_ints[row]) == target

    def longest_match(self, context: list[int]) -> tuple[int, int, int]:
        """(length, lo, hi): the longest suffix of context (at most depth tokens) found, and its suffix-array range.

        A suffix that occurs implies every shorter one does, so the length is found by binary search, each probe
        one bisection; the range's end costs one more, for the winner only.
        """
        tail = [int(t) for t in context[-self.depth :]]
        if any(t < 0 for t in tail):
            raise ValueError("negative token id in the context")
        best, best_lo = 0, 0
        low, high = 1, len(tail)
        while low <= high:
            mid = (low + high) // 2
            row, found = self._first_at_least(tail[-mid:])
            if found:
                best, best_lo = mid, row
                low = mid + 1
            else:
                high = mid - 1
        if not best:
            return 0, 0, len(self._sa_ints)
        target = np.asarray(tail[-best:], dtype=TOKENS_DTYPE).tobytes()
        hi = bisect.bisect_right(self._sa_ints, target, lo=best_lo, key=self._key(best))
        return best, best_lo, hi

    def lookup(self, context: list[int], k: int, min_match: int = 1, max_matches: int = 256) -> Lookup:
        """Draft up to k tokens after context: the most frequent continuation path of its longest match."""
        length, lo, hi = self.longest_match(context)
        if length < max(1, min_match) or k < 1:
            return Lookup([], length, [], [])
        if hi - lo > max_matches:
            rows = lo + (np.arange(max_matches, dtype=np.int64) * (hi - lo)) // max_matches
            positions = self.sa[rows].astype(np.int64)
        else:
            positions = self.sa[lo:hi].astype(np.int64)
        positions += length
        drafted: list[int] = []
        matches: list[int] = []
        counts: list[int] = []
        while len(drafted) < k:
            if positions.size == 1:  # one match left: its continuation, up to the document's end, in one read
                rest = self.tokens[int(positions[0]) : int(positions[0]) + k - len(drafted)].tolist()
                rest = rest[: rest.index(SEP)] if SEP in rest else rest
                drafted += rest
                matches += [1] * len(rest)
                counts += [1] * len(rest)
                break
            following = self.tokens[positions]
            first = following[0]
            if (following == first).all():
                token, count = int(first), int(positions.size)
            else:
                values, freq = np.unique(following, return_counts=True)
                best = int(np.argmax(freq))  # ties: the smallest id, deterministic
                token, count = int(values[best]), int(freq[best])
            if token == SEP:  # most matches end their document here
                break
            drafted.append(token)
            matches.append(int(positions.size))
            counts.append(count)
            positions = positions[following == token] + 1
        return Lookup(drafted, length, matches, counts)

    def close(self) -> None:
        """Unmap and close the index files (a map still viewed elsewhere is left to the OS)."""
        self._sa_ints = []
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view is still alive somewhere; the OS unmaps at exit
                m.close()
        for f in self._files:
            f.close()


def read_header(path: Path) -> dict:
    """The index directory's header.json, validated (ValueError naming what to rebuild otherwise)."""
    head = path / "header.json"
    if not path.is_dir() or not head.is_file():
        raise ValueError(f"datastore {path}: not an index directory (no header.json); build one with `metasd index`")
    try:
        header = json.loads(head.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"datastore {path}: header.json is unreadable ({err}); rebuild it") from err
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"datastore {path}: header.json is not a {FORMAT} header; rebuild it")
    if header.get("version") != VERSION:
        raise ValueError(
            f"datastore {path}: format version {header.get('version')}, this metasd reads {VERSION}; rebuild it"
        )
    try:
        for key in ("depth", "n_tokens", "n_suffixes"):
            if int(header[key]) < 0:
                raise ValueError(key)
        if int(header["depth"]) < 1 or not isinstance(header["tokenizer"]["sha256"], str):
            raise ValueError("depth")
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"datastore {path}: header.json lacks or garbles {err}; rebuild it") from err
    return header


_stores: dict[Path, Datastore] = {}
_lock = threading.Lock()


def load_datastore(path: str | Path) -> Datastore:
    """Load once per process (by resolved path): every drafter naming it shares one memory map."""
    key = Path(path).expanduser().resolve()
    with _lock:
        if key not in _stores:
            _stores[key] = Datastore(key)
        return _stores[key]


class DatastoreDrafter(Drafter):
    """Drafts the corpus's most frequent continuation of the context's longest match; no cache, no model."""

    def __init__(self, store: Datastore, name: str | None = None, min_match: int = 1, max_matches: int = 256):
        if min_match < 1 or max_matches < 1:
            raise ValueError("datastore min_match and max_matches must be >= 1")
        self.store = store
        self.name = name or f"datastore:{store.path}"
        self.min_match = min_match
        self.max_matches = max_matches
        self.last: Lookup | None = None  # the latest lookup: match length and continuation counts per token

    def begin(self, prompt: list[int]) -> None:
        pass

    def end(self, context: list[int]) -> None:
        pass

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        self.last = self.store.lookup(context, k, self.min_match, self.max_matches)
        return Draft(self.last.tokens, confidence=self.last.confidence)
