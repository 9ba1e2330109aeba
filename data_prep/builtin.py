"""Offline fallback corpus: Python's own documentation, shipped with every CPython install.

`pydoc_data.topics.topics` maps ~80 help topics (e.g. "assignment", "for", "typesstring") to their
reference-manual text (~0.5 MB of English prose and code). One topic = one document, id = topic name.
Many topics are sections of others ("try" of "compound", "attribute-access" of "specialnames"): a topic whose
every 13-word sequence occurs in a larger topic is left out (counted as `sections`), so that no text is both in
training (the larger topic) and in validation (its section), and none is trained on twice.
"""
from __future__ import annotations

from typing import Iterator

from data_prep.doc_hashes import sequence_hashes
from data_prep.documents import Document, Skips
from data_prep.errors import DataError
from data_prep.local_files import normalize_newlines

NAME = "pydoc_data.topics"


def topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics as table
    except ImportError:  # some distributions strip pydoc_data
        raise DataError(f"--source builtin: this Python install has no {NAME} module") from None
    return table


def sections(table: dict[str, str]) -> set[str]:
    """The topics whose 13-word sequences (data_prep.doc_hashes) all occur in one larger topic."""
    seqs = {name: set(sequence_hashes(text).tolist()) for name, text in table.items()}
    return {name for name, mine in seqs.items()
            if mine and any(len(other) > len(mine) and mine <= other for other in seqs.values())}


def documents(skips: Skips) -> Iterator[Document]:
    table = topics()
    inside = sections(table)
    for name, text in sorted(table.items()):
        if not text.strip():
            skips.count("empty_documents")
        elif name in inside:
            skips.count("sections")
        else:
            yield Document(f"pydoc:{name}", normalize_newlines(text))
