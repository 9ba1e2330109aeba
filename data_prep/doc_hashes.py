"""Which texts a preparation put into training: hashes of every training document and of its 13-word sequences.

`train_documents.u64` (little-endian uint64, sorted, distinct) holds blake2b-64 of the UTF-8 text of every
document the training split holds, exactly as it was tokenised (after the source's cleaning, e.g. Gutenberg's
header and licence stripped): a document found there is a training document, character for character.
`train_ngrams.u64` (same layout) holds a content-defined sample of the hashes of the training text's 13-word
sequences (lower-cased `\\w+` words, the n-gram unit of GPT-3's contamination study, Brown et al. 2020 App. C):
a sequence is kept when its hash is 0 modulo 16 (8 bytes per 16 words of training text), so a sequence kept
in training is kept in any text that contains it, and an excerpt of L words has about (L - 12)/16 sampled
sequences to be found by.
lm/evaluate.py looks documents up in both to say when a "held-out" perplexity is measured on training text;
`prepare` also counts the validation documents that are exact copies of a training document and the share
of the validation split's sampled sequences found in training (index.json: val_copies_of_train,
val_ngram_share), which make the validation loss optimistic.
"""
from __future__ import annotations

import hashlib
import re
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.atomic import atomic_write

FILE = "train_documents.u64"
NGRAM_FILE = "train_ngrams.u64"
NGRAM_WORDS = 13
KEEP_ONE_IN = 16  # a power of two: sequences whose hash is 0 modulo it are kept
# Text with at least this share of its sampled sequences in the training text counts as training text (an
# excerpt, an edited copy, a quoting document): unrelated books share under 0.2% (80 Gutenberg books against 14
# others, at most 0.15%), an excerpt of a training book all of them.
SHARE_IN_TRAINING = 0.01
_WORD = re.compile(r"\w+")
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd: the polynomial rolling hash over word hashes


def text_hash(text: str) -> int:
    """The 64-bit hash a document's text is recorded under (a text wrongly found among 10^9 documents: p ~ 5e-11)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=b"document").digest(), "little")


def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8, person=b"word").digest(), "little")


def sequence_hashes(text: str, words: int = NGRAM_WORDS) -> np.ndarray:
    """The hash (uint64) of every `words`-word sequence of `text`'s lower-cased `\\w+` words, in order: a polynomial
    rolling hash of the words' blake2b-64 hashes, mixed by splitmix64's finaliser. Empty under `words` words."""
    found = _WORD.findall(text.lower())
    if len(found) < words:
        return np.zeros(0, dtype=np.uint64)
    table = {w: _word_hash(w) for w in set(found)}
    w = np.fromiter((table[x] for x in found), dtype=np.uint64, count=len(found))
    n = len(w) - words + 1
    h = np.zeros(n, dtype=np.uint64)
    for j in range(words):  # uint64 arithmetic wraps: the hash is modulo 2^64
        h = h * _MULTIPLIER + w[j:j + n]
    h ^= h >> np.uint64(30)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(27)
    h *= np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    return h


def word_spans(text: str) -> np.ndarray:
    """[words, 2] start and end offsets in `text` of the words `sequence_hashes` reads (found in the lower-cased
    text; a character whose lower case is longer, like U+0130, maps its span back to itself)."""
    lowered = text.lower()
    spans = np.array([m.span() for m in _WORD.finditer(lowered)], dtype=np.int64).reshape(-1, 2)
    if len(lowered) != len(text):
        origin = np.repeat(np.arange(len(text)), [len(c.lower()) for c in text])  # lowered offset -> text offset
        spans = np.stack([origin[spans[:, 0]], origin[spans[:, 1] - 1] + 1], axis=1)
    return spans


def ngram_hashes(text: str, words: int = NGRAM_WORDS, keep_one_in: int = KEEP_ONE_IN) -> np.ndarray:
    """The sorted distinct sampled sequence hashes of `text`: those of `sequence_hashes` that are 0 modulo
    `keep_one_in`."""
    h = sequence_hashes(text, words)
    return np.unique(h[h % np.uint64(keep_one_in) == 0])


class SplitHashes:
    """Collects the text and sampled 13-word-sequence hashes of one pass's documents by split; `write`
    stores the training ones. Memory: 8 bytes per document and per 16 words of the pass, in flat arrays (a
    per-document object would add ~100 bytes to each: 40 GB over C4's 365M documents); `write` needs as much again."""

    def __init__(self) -> None:
        self.by_split: dict[str, array] = {"train": array("Q"), "val": array("Q")}
        self.ngrams: dict[str, array] = {"train": array("Q"), "val": array("Q")}

    def add(self, split: str, text: str) -> None:
        self.by_split[split].append(text_hash(text))
        self.ngrams[split].frombytes(ngram_hashes(text).tobytes())

    def write(self, out: Path) -> dict[str, Any]:
        """Write FILE and NGRAM_FILE into `out`; return their index.json entries: the files and their SHA-256
        (data_prep.verify checks them), how many validation documents are exact copies of a training one, and the
        share of the validation split's sampled sequences that occur in the training split (None without any)."""
        train = np.unique(np.frombuffer(self.by_split["train"], dtype=np.uint64))
        train_ngrams = np.unique(np.frombuffer(self.ngrams["train"], dtype=np.uint64))
        digests = {}
        for name, hashes in ((FILE, train), (NGRAM_FILE, train_ngrams)):
            data = hashes.astype("<u8").tobytes()
            atomic_write(out / name, lambda f: f.write(data))
            digests[name] = hashlib.sha256(data).hexdigest()
        val_ngrams = np.frombuffer(self.ngrams["val"], dtype=np.uint64)
        return {
            "train_documents": FILE,
            "train_ngrams": {"file": NGRAM_FILE, "words": NGRAM_WORDS, "keep_one_in": KEEP_ONE_IN},
            "hash_files_sha256": digests,
            "val_copies_of_train": int(contains(train, np.frombuffer(self.by_split["val"], dtype=np.uint64)).sum()),
            "val_ngram_share": float(contains(train_ngrams, val_ngrams).mean()) if len(val_ngrams) else None,
        }


def layout_problem(path: Path) -> str | None:
    """Why the hash file `path` is not a sorted array of distinct little-endian uint64 (its layout), else None."""
    size = path.stat().st_size
    if size % 8:
        return f"{size} bytes, not a whole number of 8-byte hashes"
    hashes = np.fromfile(path, dtype="<u8")
    return None if bool(np.all(hashes[1:] > hashes[:-1])) else "its hashes are not sorted and distinct"


def read(data: Path, name: str = FILE) -> np.ndarray | None:
    """The sorted hashes of prepared directory `data`'s file `name` (FILE or NGRAM_FILE), None without it."""
    path = data / name
    return np.fromfile(path, dtype="<u8") if path.is_file() else None


def contains(known: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """bool[len(hashes)]: which of `hashes` are in the sorted array `known`."""
    if len(known) == 0:
        return np.zeros(len(hashes), dtype=bool)
    at = np.minimum(np.searchsorted(known, hashes), len(known) - 1)
    return known[at] == hashes
