"""Project Gutenberg books: strip the PG header and licence footer, one book = one document.

Header/footer markers vary between editions, e.g.
    *** START OF THIS PROJECT GUTENBERG EBOOK PRIDE AND PREJUDICE ***
    ***START OF THE PROJECT GUTENBERG EBOOK JANE EYRE***
    *** START OF THIS PROJECT GUTENBERG EBOOK THE AUTOBIOGRAPHY OF BENJAMIN
    FRANKLIN ***                                    (title wrapped onto a second line)
    *END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*...   (1990s editions, end of the header)
The body is the text between the last START marker before the first END marker and that END marker,
minus the closing "End of (the) Project Gutenberg EBook of <title>, by <author>" line(s) and minus a first
paragraph that is PG's production credit, not the book (most books open with one):
    Produced by Judith Boss.  HTML version by Al Haines.
    Transcribed from the 1897 Service & Paton edition by David Price, email ccx074@pglaf.org
    This etext was created by Judith Boss, of Omaha, Nebraska, from the ...
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Iterator

from data_prep.documents import Document, Skips, text_rows
from data_prep.local_files import normalize_newlines, read_text

SUFFIXES = (".txt", ".txt.gz")
_START = re.compile(
    r"^\*{3} *START OF (?:THE |THIS )?PROJECT GUTENBERG E-?(?:BOOK|TEXT)(?:[^*]{0,300}\*{3})?[^\n]*"
    r"|^\*END\*THE SMALL PRINT[^\n]*",
    re.IGNORECASE | re.MULTILINE,
)
_END = re.compile(r"^\*{3} *END OF (?:THE |THIS )?PROJECT GUTENBERG", re.IGNORECASE | re.MULTILINE)
_TRAILER = re.compile(r"^[ \t]*End of (?:the |this )?Project Gutenberg", re.IGNORECASE | re.MULTILINE)
_TRAILER_WINDOW = 1000  # the closing "End of the Project Gutenberg EBook of ..." sits in the last lines
_PARAGRAPH = re.compile(r"\A\s*\S.*?(?=\n[ \t]*\n|\Z)", re.DOTALL)  # the first paragraph, up to a blank line
_CREDIT_CHARS = 1000  # a credit is a few lines (the longest among the shared books: 468 characters)
_CREDIT = re.compile(r"\A\s*(?:Produced|Transcribed|Prepared) (?:by|from)\b"
                     r"|Project Gutenberg|Distributed Proofreading|pgdp\.net|\be-?text\b", re.IGNORECASE)


def strip_credit(body: str) -> str:
    """`body` without its first paragraph when that paragraph is PG's production credit: a few lines that open with
    "Produced by" / "Transcribed from" or name Project Gutenberg, its proofreaders or the etext."""
    first = _PARAGRAPH.match(body)
    credit = first is not None and len(first.group()) <= _CREDIT_CHARS and _CREDIT.search(first.group())
    return body[first.end():] if credit else body


def strip_gutenberg(text: str) -> tuple[str, tuple[str, ...]]:
    """(body, missing): the book without PG header/footer, and which of the markers ("START", "END") were
    not found. Without markers the whole text is returned (already-clean text passes through unchanged)."""
    text = normalize_newlines(text)
    end_match = _END.search(text)
    end = end_match.start() if end_match else len(text)
    starts = [m for m in _START.finditer(text, 0, end) if m.end() <= end]
    start = starts[-1].end() if starts else 0
    body = strip_credit(text[start:end]) if starts else text[start:end]
    trailers = list(_TRAILER.finditer(body, max(0, len(body) - _TRAILER_WINDOW)))
    if trailers:
        body = body[: trailers[-1].start()]
    missing = tuple(marker for marker, found in (("START", starts), ("END", end_match)) if not found)
    return body.strip("\n").rstrip(), missing


def book_id(name: str) -> str:
    """A stable document id: the file's path relative to --src without .txt/.txt.gz
    (e.g. "pg1342_pride_and_prejudice", or "Austen, Jane/Persuasion" in an author/title layout)."""
    for suffix in (".gz", ".txt"):
        name = name.removesuffix(suffix)
    return name


_KEPT = {"START": "kept everything before the END marker (the PG header may remain)",
         "END": "kept everything after the START marker (the PG licence may remain)"}


def _book(doc_id: str, name: str, text: str, skips: Skips) -> Document | None:
    body, missing = strip_gutenberg(text)
    if len(missing) == 2:
        skips.count("gutenberg_files_without_markers")
        skips.warn_once(f"{name}: no Project Gutenberg START/END markers; kept the whole text")
    elif missing:
        skips.count(f"gutenberg_files_without_{missing[0].lower()}_marker")
        skips.warn_once(f"{name}: no Project Gutenberg {missing[0]} marker; {_KEPT[missing[0]]}")
    if not body.strip():
        skips.skip_file(name, "empty", "nothing between the Project Gutenberg markers")
        return None
    return Document(doc_id, body)


def file_documents(files: Iterable[Path], names: list[str], skips: Skips) -> Iterator[Document]:
    """One document per book file (.txt or .txt.gz, UTF-8); `names` are the paths relative to --src."""
    for path, name in zip(files, names):
        text = read_text(path, skips)
        if text is not None and (doc := _book(book_id(name), name, text, skips)) is not None:
            yield doc


def row_documents(rows: Iterable[dict], skips: Skips) -> Iterator[Document]:
    """One document per hub row {"id", "text"} (manu/project_gutenberg); ids become "pg-hub:<id>" (the row's
    number from 0 without an id); rows without text are counted and reported by documents.text_rows."""
    for n, row, text in text_rows(enumerate(rows, 1), skips, "rows: row"):
        row_id = row.get("id", n - 1)
        if (doc := _book(f"pg-hub:{row_id}", f"row {row_id}", text, skips)) is not None:
            yield doc
