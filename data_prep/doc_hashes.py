"""Which texts a preparation put into training: 64-bit hashes of every training document's text.

`train_documents.u64` (little-endian uint64, sorted, distinct) holds blake2b-64 of the UTF-8 text of every
document the training split holds, exactly as it was tokenised (after the source's cleaning, e.g. Gutenberg's
header and licence stripped). lm/evaluate.py looks documents up in it to say when a "held-out" perplexity is
measured on training text; `prepare` also counts the validation documents whose text is an exact copy of a
training document (index.json: val_copies_of_train), which make the validation loss optimistic.
An exact-text check: a document that differs by one character, or an excerpt, is not found.
"""
from __future__ import annotations

import hashlib
from array import array
from pathlib import Path

import numpy as np

from data_prep.shards import write_atomic

FILE = "train_documents.u64"


def text_hash(text: str) -> int:
    """The 64-bit hash a document's text is recorded under (a text wrongly found among 10^9 documents: p ~ 5e-11)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=b"document").digest(), "little")


class SplitHashes:
    """Collects the text hashes of one pass's documents by split; `write` stores the training ones."""

    def __init__(self) -> None:
        self.by_split: dict[str, array] = {"train": array("Q"), "val": array("Q")}

    def add(self, split: str, text: str) -> None:
        self.by_split[split].append(text_hash(text))

    def write(self, out: Path) -> int:
        """Write FILE into `out`; return how many validation documents are exact copies of a training one."""
        train = np.unique(np.frombuffer(self.by_split["train"], dtype=np.uint64))
        write_atomic(out / FILE, train.astype("<u8").tobytes())
        return int(contains(train, np.frombuffer(self.by_split["val"], dtype=np.uint64)).sum())


def read(data: Path) -> np.ndarray | None:
    """The sorted training-text hashes of prepared directory `data`, None if it has no FILE."""
    path = data / FILE
    return np.fromfile(path, dtype="<u8") if path.is_file() else None


def contains(known: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """bool[len(hashes)]: which of `hashes` are in the sorted array `known`."""
    if len(known) == 0:
        return np.zeros(len(hashes), dtype=bool)
    at = np.minimum(np.searchsorted(known, hashes), len(known) - 1)
    return known[at] == hashes
