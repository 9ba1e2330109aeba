"""Whether evaluated documents are part of a checkpoint's training data (exact text; data_prep/doc_hashes.py).

A perplexity measured on training text is not a held-out number. The checkpoint records the directory it
trained on and that data's fingerprint (lm/run_dir.py); a preparation records the hashes of its training
documents' texts. A document is found when its text, cleaned as data_prep cleans it, equals a training
document's: read a Gutenberg book with `--format gutenberg` (as prepared), not `text`, for it to be found.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from data_prep import doc_hashes
from lm.run_dir import read_provenance


@dataclass
class Overlap:
    """The check's outcome: `found[i]` for document i, or why it could not be made."""

    data: str | None  # the training data directory checked against; None when not checked
    why_not: str  # why it was not checked ("" when checked)
    found: list[bool] | None = None

    def report(self) -> dict[str, Any]:
        """For the evaluation's JSON."""
        return {"checked_against": self.data, "not_checked_because": self.why_not or None,
                "documents_in_training_data": None if self.found is None else sum(self.found)}


def training_overlap(run: dict[str, Any], hashes: Sequence[int], train_data: str | Path | None = None) -> Overlap:
    """Which documents (by `doc_hashes.text_hash`) are in the training data of a checkpoint with provenance
    `run`: in `train_data`, default the directory the checkpoint recorded, which must still be that data."""
    recorded = run.get("data_path")
    data = Path(train_data) if train_data is not None else Path(recorded) if recorded else None
    if data is None:
        return Overlap(None, "the checkpoint records no training data directory (pass --train-data DIR)")
    if not (data / "index.json").is_file():
        return Overlap(None, f"{data} is not a prepared directory here (pass --train-data DIR)")
    expected = run.get("data_sha256")
    if expected is not None and read_provenance(data)["data_sha256"] != expected:
        return Overlap(None, f"{data} is not the data the checkpoint trained on (its fingerprint differs)")
    known = doc_hashes.read(data)
    if known is None:
        return Overlap(None, f"{data} was prepared before data_prep recorded its training documents")
    return Overlap(str(data), "", doc_hashes.contains(known, np.array(hashes, dtype=np.uint64)).tolist())
