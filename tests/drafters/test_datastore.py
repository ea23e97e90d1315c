"""Datastore drafters: index build and lookup against brute force, refusals, and lossless decoding with one."""

import json
import random
from collections import Counter

import numpy as np
import pytest
from helpers import greedy_reference

from metasd.drafters.datastore import SEP, Datastore, DatastoreDrafter, load_datastore, tokenizer_fingerprint
from metasd.sampling import SamplingParams
from metasd.specialists.index import build_index, suffix_array

GREEDY = SamplingParams()


class WordTokenizer:
    """A toy tokenizer: whitespace-separated words of a fixed vocabulary are ids."""

    def __init__(self, words):
        self.vocab = {w: i for i, w in enumerate(words)}
        self.name_or_path = "toy"
        self.chat_template = None

    def get_vocab(self):
        return dict(self.vocab)

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[self.vocab[w] for w in text.split()] for text in texts]}


WORDS = [f"w{i}" for i in range(12)]


def brute_suffixes(tokens: np.ndarray, depth: int) -> list[tuple]:
    """Every non-separator position's first `depth` tokens, in the byte order the index uses."""
    n = len(tokens)
    keys = []
    for p in range(n):
        if tokens[p] == SEP:
            continue
        window = tuple(int(t) if t != SEP else 1 << 40 for t in tokens[p : p + depth])
        keys.append(window)
    return sorted(keys)


def test_suffix_array_sorts_on_the_first_depth_tokens():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, size=400).astype(np.int32)
    tokens[rng.choice(400, 30, replace=False)] = SEP
    tokens[-1] = SEP
    for depth in (1, 3, 8, 16):
        sa = suffix_array(tokens, depth)
        assert sa.dtype == np.int32 and len(sa) == int((tokens != SEP).sum())
        got = [tuple(int(t) if t != SEP else 1 << 40 for t in tokens[p : p + depth]) for p in sa]
        assert got == brute_suffixes(tokens, depth)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A random corpus over a tiny vocabulary (so contexts repeat), as a text file, a JSONL file and a tree."""
    rng = random.Random(1)
    root = tmp_path_factory.mktemp("corpus")
    docs = [" ".join(rng.choice(WORDS[:6]) for _ in range(rng.randint(5, 60))) for _ in range(40)]
    (root / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[:20]) + "\n")
    tree = root / "tree" / "pkg"
    tree.mkdir(parents=True)
    for i, d in enumerate(docs[20:]):
        (tree / f"m{i}.py").write_text(d)
    (tree / "skip.bin").write_text("w11 w11 w11")  # not an included extension
    tok = WordTokenizer(WORDS)
    out = root / "index"
    header = build_index([str(root / "a.jsonl"), str(root / "tree")], out, tok, depth=6, progress=False)
    return docs, tok, out, header


def _occurrences(docs, tok, pattern):
    """Brute force: what follows each occurrence of pattern in any document (None at a document's end)."""
    follow = []
    for doc in docs:
        ids = tok([doc])["input_ids"][0]
        for i in range(len(ids) - len(pattern) + 1):
            if ids[i : i + len(pattern)] == pattern:
                follow.append(ids[i + len(pattern)] if i + len(pattern) < len(ids) else None)
    return follow


def test_index_header_and_files(corpus):
    docs, tok, out, header = corpus
    assert header["n_documents"] == 40
    assert header["n_tokens"] == sum(len(d.split()) for d in docs) + 40  # one separator per document
    assert header["tokenizer"]["sha256"] == tokenizer_fingerprint(tok)
    store = Datastore(out)
    assert store.tokens.dtype == np.dtype(">i4") and store.sa.dtype == np.int32
    assert isinstance(store.tokens, np.memmap) and isinstance(store.sa, np.memmap)
    assert store.depth == 6


def test_lookup_matches_brute_force(corpus):
    docs, tok, out, _ = corpus
    store = Datastore(out)
    rng = random.Random(2)
    for _ in range(300):
        context = [rng.randrange(8) for _ in range(rng.randint(1, 12))]
        length, lo, hi = store.longest_match(context)
        # the longest suffix (<= depth) that occurs, and exactly its occurrences
        expected = 0
        for m in range(1, min(len(context), store.depth) + 1):
            if _occurrences(docs, tok, context[-m:]):
                expected = m
        assert length == expected, context
        if length:
            follow = _occurrences(docs, tok, context[-length:])
            assert hi - lo == len(follow)
            draft = store.lookup(context, 1)
            counts = Counter(follow)
            top = max(counts.values())
            best = (
                min(t for t, c in counts.items() if c == top and t is not None)
                if any(c == top for t, c in counts.items() if t is not None)
                else None
            )
            if counts.get(None, 0) > top or best is None or (counts.get(None, 0) == top):
                continue  # ties with a document end: either answer is fine
            assert draft.tokens == [best], (context, counts)
            assert draft.counts == [top] and draft.matches == [len(follow)]


def test_drafter_proposes_the_known_continuation(tmp_path):
    tok = WordTokenizer(WORDS)
    corpus = tmp_path / "c.txt"
    # after "w1 w2" come "w3 w4 w5" twice, "w9" and "w7 w8" once each; the longer match "w0 w1 w2" says "w7 w8"
    corpus.write_text("w1 w2 w3 w4 w5 w6 w1 w2 w3 w4 w5 w1 w2 w9 w0 w1 w2 w7 w8")
    build_index([str(corpus)], tmp_path / "idx", tok, depth=4, progress=False)
    drafter = DatastoreDrafter(Datastore(tmp_path / "idx"))
    assert drafter.runs_model is False
    draft = drafter.propose([tok.vocab["w11"], 1, 2], 3, GREEDY, None)
    assert draft.tokens == [3, 4, 5]
    assert drafter.last.match_length == 2 and drafter.last.counts == [2, 2, 2] and drafter.last.matches == [4, 2, 2]
    assert drafter.last.confidence == pytest.approx([2 / 5, 2 / 3, 2 / 3])
    assert drafter.propose([0, 1, 2], 5, GREEDY, None).tokens == [7, 8]  # longest match wins; stops at the end
    assert drafter.propose([10, 11], 3, GREEDY, None).tokens == []  # never seen
    assert DatastoreDrafter(Datastore(tmp_path / "idx"), min_match=3).propose([11, 1, 2], 3, GREEDY, None).tokens == []


def test_bench_history_leaves_a_datastore_alone(tmp_path):
    """The benchmark snapshots drafters that learn across requests; a datastore's memory maps are shared, read-only
    and unpicklable (a bench with a datastore in the pool once failed here)."""
    from metasd.bench.history import DrafterHistory
    from metasd.drafters.suffix import SuffixDrafter

    tok = WordTokenizer(WORDS)
    (tmp_path / "c.txt").write_text("w1 w2 w3 w4 w5")
    build_index([str(tmp_path / "c.txt")], tmp_path / "idx", tok, depth=4, progress=False)
    datastore = DatastoreDrafter(Datastore(tmp_path / "idx"))
    history = DrafterHistory({"suffix": SuffixDrafter(depth=4), "ds": datastore})
    assert list(history.stateful) == ["suffix"]
    history.advance([([1, 2], [3, 4])])
    history.restore()
    assert datastore.propose([9, 2, 3], 2, GREEDY, None).tokens == [4, 5]


def test_loaded_once_per_path(corpus):
    out = corpus[2]
    assert load_datastore(out) is load_datastore(str(out) + "/")


def test_another_tokenizer_is_refused(corpus, embedded):
    from metasd.drafters import build_drafter

    with pytest.raises(ValueError, match="another tokenizer"):
        build_drafter(f"datastore:{corpus[2]}", embedded)
    with pytest.raises(ValueError, match="another tokenizer"):
        Datastore(corpus[2]).check_tokenizer(WordTokenizer([*WORDS, "extra"]))
    Datastore(corpus[2]).check_tokenizer(WordTokenizer(WORDS))  # the same vocabulary passes


def test_corrupt_or_missing_index_is_refused(corpus, tmp_path):
    import shutil

    src = corpus[2]
    with pytest.raises(ValueError, match="not an index directory"):
        Datastore(tmp_path / "nothing")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "header.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        Datastore(bad)
    shutil.copytree(src, bad, dirs_exist_ok=True)
    np.save(bad / "sa.npy", np.load(src / "sa.npy")[:-3])  # truncated
    with pytest.raises(ValueError, match="sa.npy"):
        Datastore(bad)
    shutil.copytree(src, bad, dirs_exist_ok=True)
    sa = np.load(src / "sa.npy")
    sa[0] = 10**6  # out of range
    np.save(bad / "sa.npy", sa)
    with pytest.raises(ValueError, match="corrupt"):
        Datastore(bad)
    shutil.copytree(src, bad, dirs_exist_ok=True)
    (bad / "tokens.npy").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="tokens.npy|arrays"):
        Datastore(bad)


def test_greedy_decoding_with_datastores_in_the_pool_is_lossless(embedded, tmp_path):
    from metasd import Decoder
    from metasd.specialists.index import build_index

    tokenizer = embedded.tokenizer
    corpus = tmp_path / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": "Name three primary colors."},
                {"role": "assistant", "content": "The three primary colors are red, yellow and blue."},
            ]
        },
        {"text": "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"},
    ]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    build_index([str(corpus)], tmp_path / "idx", tokenizer, progress=False)
    decoder = Decoder(drafters=["ngram", f"datastore:{tmp_path / 'idx'}"], policy="round-robin", draft_len=4)
    ids = decoder.encode("Name three primary colors.")
    reference = greedy_reference(embedded.model, ids, 16)
    result = decoder.generate(ids, max_new_tokens=16)
    assert result.token_ids == reference
    drafted = result.stats.to_dict()["drafters"][f"datastore:{tmp_path / 'idx'}"]
    assert drafted["pulls"] > 0


def test_index_command_builds_with_the_targets_tokenizer(embedded, tmp_path, capsys):
    from metasd.cli import main
    from metasd.drafters import build_drafter

    src = tmp_path / "src"
    src.mkdir()
    (src / "mod.py").write_text("def greet(name):\n    return f'Hello, {name}!'\n")
    (src / "notes.bin").write_bytes(b"\x00\x01")
    assert main(["index", str(src), "--out", str(tmp_path / "idx"), "--quiet"]) == 0
    assert "tokens from 1 documents" in capsys.readouterr().out
    drafter = build_drafter(f"datastore:{tmp_path / 'idx'}", embedded)  # same tokenizer: accepted
    ids = embedded.tokenizer("def greet(name):\n    return", add_special_tokens=False)["input_ids"]
    expected = embedded.tokenizer(" f'Hello", add_special_tokens=False)["input_ids"]
    assert drafter.propose(ids, len(expected), GREEDY, None).tokens == expected
    assert main(["index", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert "corpus not found" in capsys.readouterr().err
