"""Whether evaluated documents are part of a checkpoint's training data (data_prep/doc_hashes.py).

A perplexity measured on training text is not a held-out number. The checkpoint records the directory it
trained on and that data's fingerprint (lm/run_dir.py); a preparation records the hashes of its training
documents' texts and a sample of the hashes of their 13-word sequences. A document is in the training data
when its text, cleaned as data_prep cleans it, equals a training document's (read a Gutenberg book with
`--format gutenberg`, as prepared, not `text`), or when at least doc_hashes.SHARE_IN_TRAINING of its sampled 13-word
sequences occur in the training text (an excerpt, an edited copy, a document quoting training text).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from data_prep import doc_hashes
from lm.run_dir import read_provenance

TRAIN_DATA_HELP = ("the checkpoint's prepared training data, to look the input up in (default: the directory the "
                   "checkpoint recorded)")


@dataclass
class Overlap:
    """The check's outcome per document i: `exact[i]` (its text is a training document's) and
    `ngrams[i]` = (sampled 13-word sequences, how many of them occur in training), or why it was not made."""

    data: str | None  # the training data directory checked against; None when not checked
    why_not: str  # why it was not checked ("" when checked)
    exact: list[bool] | None = None
    ngrams: list[tuple[int, int]] | None = None
    ngrams_why_not: str = ""  # why only exact text was checked ("" when sequences were too)
    words: int = doc_hashes.NGRAM_WORDS  # words per sequence

    def found(self, i: int) -> bool | None:
        """Whether document i is in the training data (None: not checked)."""
        if self.exact is None:
            return None
        sampled, found = self.ngrams[i] if self.ngrams is not None else (0, 0)
        return self.exact[i] or (sampled > 0 and found / sampled >= doc_hashes.SHARE_IN_TRAINING)

    def document(self, i: int) -> dict[str, Any]:
        """Document i's entries for the evaluation's JSON."""
        sampled, found = self.ngrams[i] if self.ngrams is not None else (None, None)
        return {"in_training_data": self.found(i),
                "exact_training_document": None if self.exact is None else self.exact[i],
                "sampled_ngrams": sampled, "sampled_ngrams_in_training_data": found}

    def report(self, n: int) -> dict[str, Any]:
        """For the evaluation's JSON, over all `n` documents."""
        sampled, found = (sum(col) for col in zip(*self.ngrams)) if self.ngrams else (0, 0)
        return {"checked_against": self.data, "not_checked_because": self.why_not or None,
                "ngrams_not_checked_because": self.ngrams_why_not or None, "ngram_words": self.words,
                "documents_in_training_data": None if self.exact is None else sum(map(self.found, range(n))),
                "sampled_ngrams": sampled if self.ngrams is not None else None,
                "share_of_ngrams_in_training_data": found / sampled if sampled else None}


def unusable(run: dict[str, Any], data: Path) -> str | None:
    """Why `data` cannot tell what a checkpoint with provenance `run` trained on, or None when it can."""
    if not (data / "index.json").is_file():
        return f"{data} is not a prepared directory here"
    expected = run.get("data_sha256")
    if expected is not None and read_provenance(data)["data_sha256"] != expected:
        return f"{data} is not the data the checkpoint trained on (its fingerprint differs)"
    return None


def check_train_data(run: dict[str, Any], train_data: str | Path | None) -> None:
    """A --train-data given by hand must be usable (one-line ValueError), checked before any evaluation runs; the
    recorded directory, when gone, only gives a note (training_overlap)."""
    if train_data is not None and (why := unusable(run, Path(train_data))) is not None:
        raise ValueError(f"--train-data: {why}")


def training_overlap(run: dict[str, Any], texts: Sequence[str], train_data: str | Path | None = None) -> Overlap:
    """Which of `texts` are in the training data of a checkpoint with provenance `run`: in `train_data`,
    default the directory the checkpoint recorded, which must still be that data."""
    recorded = run.get("data_path")
    data = Path(train_data) if train_data is not None else Path(recorded) if recorded else None
    if data is None:
        return Overlap(None, "the checkpoint records no training data directory (pass --train-data DIR)")
    if (why := unusable(run, data)) is not None:
        return Overlap(None, f"{why} (pass --train-data DIR)")
    known = doc_hashes.read(data)
    if known is None:
        return Overlap(None, f"{data} was prepared before data_prep recorded its training documents")
    exact = doc_hashes.contains(known, np.array([doc_hashes.text_hash(t) for t in texts], dtype=np.uint64))
    settings = json.loads((data / "index.json").read_text()).get("train_ngrams")
    sequences = doc_hashes.read(data, doc_hashes.NGRAM_FILE)
    if settings is None or sequences is None:
        return Overlap(str(data), "", exact.tolist(), None,
                       f"{data} was prepared before data_prep recorded word sequences: exact text only")
    ngrams = []
    for text in texts:
        mine = doc_hashes.ngram_hashes(text, settings["words"], settings["keep_one_in"])
        ngrams.append((len(mine), int(doc_hashes.contains(sequences, mine).sum())))
    return Overlap(str(data), "", exact.tolist(), ngrams, words=settings["words"])
