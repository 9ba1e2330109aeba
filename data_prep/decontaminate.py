"""Leave out of a preparation every document that shares a 13-word sequence with given texts (`--exclude-overlap`).

The decontamination of GPT-3 (Brown et al. 2020, App. C), made before training instead of measured after it: the
texts a model will be evaluated on (held-out books, a benchmark's passages) are read, every one of their 13-word
sequences is hashed (data_prep/doc_hashes.py: lower-cased `\\w+` words), and a corpus document holding any of them
is dropped from both splits and counted in index.json (`skipped.documents_overlapping_excluded_texts`). Any shared
sequence drops the document, so a common 13-word phrase drops documents that only quote it (the count says how
many went). Inputs: `.txt` / `.txt.gz` files, taken as they are, and C4-style JSON lines (`.json(l)(.gz)`, the
"text" field), files or directories of them; a file that cannot be read is an error, not a skip.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from data_prep import c4
from data_prep.doc_hashes import NGRAM_WORDS, contains, sequence_hashes
from data_prep.documents import Corpus, Document, Skips, StrictSkips
from data_prep.errors import DataError
from data_prep.local_files import find_files
from data_prep.sources import TEXT_SUFFIXES, text_documents

COUNTED = "documents_overlapping_excluded_texts"


def excluded_sequences(paths: Sequence[str | Path]) -> np.ndarray:
    """Sorted distinct hashes of every 13-word sequence of the texts under `paths`; DataError if a path holds no
    text or a file cannot be read."""
    try:
        files = [f for p in paths for f in find_files(p, TEXT_SUFFIXES + c4.SUFFIXES, "text or JSON-lines")]
        skips = StrictSkips(consequence="nothing was prepared")
        json_lines = [f for f in files if f.name.endswith(c4.SUFFIXES)]
        texts = [f for f in files if not f.name.endswith(c4.SUFFIXES)]
        docs = [*text_documents(texts, [f.name for f in texts], skips), *c4.file_documents(json_lines, skips)]
    except DataError as err:
        raise DataError(f"--exclude-overlap: {err}") from None
    found = np.unique(np.concatenate([np.zeros(0, np.uint64), *(sequence_hashes(d.text) for d in docs)]))
    if not len(found):
        raise DataError(f"--exclude-overlap {' '.join(map(str, paths))}: no text of {NGRAM_WORDS} words or more")
    return found


def settings(paths: Sequence[str | Path], sequences: np.ndarray) -> dict[str, Any]:
    """For the preparation's settings: a resumed preparation must exclude the same sequences."""
    return {"paths": [str(Path(p).expanduser().resolve()) for p in paths], "sequences": len(sequences),
            "sha256": hashlib.sha256(sequences.astype("<u8").tobytes()).hexdigest()}


def without_overlap(corpus: Corpus, sequences: np.ndarray) -> Corpus:
    """`corpus` without the documents holding any of `sequences`, each counted in the pass's Skips."""

    def read(skips: Skips) -> Iterator[Document]:
        for doc in corpus.read(skips):
            if contains(sequences, sequence_hashes(doc.text)).any():
                skips.count(COUNTED)
                continue
            yield doc

    return dataclasses.replace(corpus, read=read)
