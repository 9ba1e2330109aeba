"""Deterministic train/validation split by document.

A document goes to validation iff score(id) < val_fraction, where score is a hash of its stable id
mapped to [0, 1). The split of a document therefore depends only on its id and val_fraction: not on
document order, on other documents, or on --max-docs. One exception keeps small corpora usable: if no
document scores below val_fraction, the lowest-scoring one goes to validation (and symmetrically, if
all do, the highest-scoring one goes to training); index.json records such forced documents.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from data_prep.errors import DataError


def score(doc_id: str) -> float:
    """A uniform pseudo-random number in [0, 1) fixed by the document id."""
    digest = hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8, person=b"split").digest()
    return int.from_bytes(digest, "big") / 2.0**64


@dataclass
class Splitter:
    """Assigns "train"/"val"; `observe` every document id in a first pass, then `finalize`."""

    val_fraction: float
    forced: dict[str, str] = field(default_factory=dict)
    _counts: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})
    _lowest: tuple[float, str] = (2.0, "")
    _highest: tuple[float, str] = (-1.0, "")

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise DataError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")

    def by_hash(self, doc_id: str) -> str:
        return "val" if score(doc_id) < self.val_fraction else "train"

    def observe(self, doc_id: str) -> None:
        s = score(doc_id)
        self._counts["val" if s < self.val_fraction else "train"] += 1
        self._lowest, self._highest = min(self._lowest, (s, doc_id)), max(self._highest, (s, doc_id))

    def would_force_train(self, doc_id: str) -> bool:
        """Whether `doc_id`, just observed, goes to train if the scan ends now: no document so far is
        in train by hash and this one has the highest score (so `finalize` forces it into train)."""
        return self._counts["train"] == 0 and self._highest[1] == doc_id

    def finalize(self) -> None:
        """Force one document into an empty split; fail if there are fewer than two distinct documents."""
        if self._lowest[1] == self._highest[1]:
            n = sum(self._counts.values())
            found = "found 1" if n == 1 else \
                f"found {n}, all with one id (the same text, or the pieces --exclude-overlap cut from one document)"
            raise DataError(f"need at least 2 distinct documents for a train/validation split; {found}")
        if self._counts["val"] == 0:
            self.forced[self._lowest[1]] = "val"
        if self._counts["train"] == 0:
            self.forced[self._highest[1]] = "train"

    def __call__(self, doc_id: str) -> str:
        return self.forced.get(doc_id) or self.by_hash(doc_id)
