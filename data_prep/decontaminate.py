"""Cut out of a preparation the text it shares with given texts (`--exclude-overlap`), as GPT-3 did.

The decontamination of GPT-3 (Brown et al. 2020, App. C), made before training instead of measured after it: the
texts a model will be evaluated on (held-out books, a benchmark's passages) are read and every one of their
13-word sequences is hashed (data_prep/doc_hashes.py: lower-cased `\\w+` words). In a corpus document, each
sequence found there is removed with a window of WINDOW = 200 characters on either side (overlapping windows
merge), which cuts the document into pieces; pieces under MIN_PIECE = 200 characters are discarded, and a
document cut into more than MAX_PIECES = 10 pieces is dropped whole (GPT-3's numbers; the pieces are counted
before the short ones are discarded). The pieces go on as documents of the source document's split (its id),
so a book that quotes an evaluation text keeps everything but the quote: GPT-3 first dropped every document
with a single shared sequence, which it found penalised long documents such as books. index.json counts the
documents cut (`skipped.documents_cut_around_excluded_texts`) and those dropped whole or left with no piece
(`skipped.documents_overlapping_excluded_texts`); both are warned. lm-eval's Janitor, which implements the
same rule, counts shared sequences instead of pieces, so a 23-word quote (11 overlapping sequences) drops a
whole book there. --max-docs counts the source documents, before the cut.
Inputs: `.txt` / `.txt.gz` files, taken as they are, and C4-style JSON lines (`.json(l)(.gz)`, the
"text" field), files or directories of them; a file that cannot be read is an error, not a skip.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from data_prep import c4
from data_prep.doc_hashes import NGRAM_WORDS, contains, sequence_hashes, word_spans
from data_prep.documents import Corpus, Document, Skips, StrictSkips
from data_prep.errors import DataError
from data_prep.local_files import find_files
from data_prep.sources import TEXT_SUFFIXES, text_documents

DROPPED = "documents_overlapping_excluded_texts"  # dropped whole: too many pieces, or none long enough
CUT = "documents_cut_around_excluded_texts"
WINDOW = 200  # characters removed on either side of a shared sequence
MIN_PIECE = 200  # characters: shorter pieces are discarded
MAX_PIECES = 10  # a document cut into more pieces is dropped whole


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


def pieces(text: str, shared: np.ndarray) -> list[str]:
    """`text` without its shared 13-word sequences (shared: bool per sequence, in `sequence_hashes` order) and
    WINDOW characters either side: the pieces of MIN_PIECE characters or more, none if it fell into more than
    MAX_PIECES pieces (module docstring)."""
    spans, first = word_spans(text), np.flatnonzero(shared)  # sequence i holds words i .. i + 12
    starts = np.maximum(spans[first, 0] - WINDOW, 0)
    ends = spans[first + NGRAM_WORDS - 1, 1] + WINDOW  # both ascending with i
    cuts: list[tuple[int, int]] = []  # merged windows
    for a, b in zip(starts.tolist(), ends.tolist()):
        if cuts and a <= cuts[-1][1]:
            cuts[-1] = (cuts[-1][0], b)
        else:
            cuts.append((a, b))
    bounds = [0, *(x for cut in cuts for x in cut), len(text)]
    found = [text[a:b] for a, b in zip(bounds[::2], bounds[1::2]) if a < b]
    return [] if len(found) > MAX_PIECES else [p for p in found if len(p) >= MIN_PIECE]


def report(skips: Skips) -> str | None:
    """The warning for what a pass cut and left out (None if nothing)."""
    parts = []
    if skips.counts[CUT]:
        parts.append(f"cut the text shared with the excluded texts ({NGRAM_WORDS}-word sequences, {WINDOW} characters "
                     f"either side) out of {skips.counts[CUT]:,} documents")
    if skips.counts[DROPPED]:
        parts.append(f"left out {skips.counts[DROPPED]:,} documents sharing them (cut into more than {MAX_PIECES} "
                     "pieces, or nothing left)")
    return "--exclude-overlap: " + "; ".join(parts) if parts else None


def without_overlap(corpus: Corpus, sequences: np.ndarray) -> Corpus:
    """`corpus` with every document's text shared with `sequences` cut out (`pieces`), each document cut or
    dropped counted in the pass's Skips."""

    def read(skips: Skips) -> Iterator[Document]:
        for doc in corpus.read(skips):
            shared = contains(sequences, sequence_hashes(doc.text))
            if not shared.any():
                yield doc
                continue
            kept = pieces(doc.text, shared)
            skips.count(CUT if kept else DROPPED)
            yield from (Document(doc.id, piece) for piece in kept)

    return dataclasses.replace(corpus, read=read)
