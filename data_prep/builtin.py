"""Offline fallback corpus: Python's own documentation, shipped with every CPython install.

`pydoc_data.topics.topics` maps ~80 help topics (e.g. "assignment", "for", "typesstring") to their
reference-manual text (~0.5 MB of English prose and code). One topic = one document, id = topic name.
"""
from __future__ import annotations

from typing import Iterator

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


def documents(skips: Skips) -> Iterator[Document]:
    for name, text in sorted(topics().items()):
        if text.strip():
            yield Document(f"pydoc:{name}", normalize_newlines(text))
        else:
            skips.count("empty_documents")
