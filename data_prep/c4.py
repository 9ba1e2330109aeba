"""C4 (allenai/c4 format): JSON lines {"text", "timestamp", "url"}, one document per line.

The same `numbered_documents` turns rows into documents for local *.json.gz files (`file_documents`) and for
`datasets` streaming of allenai/c4 (`row_documents`), so both routes give identical documents and splits.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
import zlib
from pathlib import Path
from typing import Iterable, Iterator

from data_prep.documents import Document, Skips, text_rows
from data_prep.errors import warn
from data_prep.local_files import normalize_newlines

SUFFIXES = (".json.gz", ".jsonl.gz", ".json", ".jsonl")


def text_id(text: str) -> str:
    """A stable document id from the text itself (C4 urls may be missing): "sha1:<hex>"."""
    return "sha1:" + hashlib.sha1(text.encode("utf-8")).hexdigest()


def parse_row(line: bytes) -> dict | None:
    """The JSON object on one line, or None if the line is broken: bad JSON, bad UTF-8, not an object,
    or a "text" that cannot be UTF-8 encoded (an escaped lone surrogate such as "\\ud83d")."""
    try:
        row = json.loads(line)
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            row["text"].encode("utf-8")
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, UnicodeEncodeError
        return None
    return row if isinstance(row, dict) else None


def file_rows(path: Path, skips: Skips) -> Iterator[tuple[int, dict]]:
    """The JSON objects of one JSON-lines file (.gz or plain), each with its line number. Broken lines (see
    `parse_row`) are skipped and counted (`Skips.meet`: StrictSkips stops at the first), also in the part read when
    the reader stops early (--max-docs closes it); a corrupt gzip stream ends the file with a warning."""
    broken = first_broken = rows = 0
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = parse_row(line)
                if row is None:
                    skips.meet(path.name, f"broken JSON line {line_no}")  # StrictSkips: here, not after later rows
                    broken, first_broken = broken + 1, first_broken or line_no
                    continue
                rows += 1
                yield line_no, row
    except (OSError, EOFError, zlib.error) as err:
        if rows == 0:
            skips.skip_file(path.name, "unreadable", f"{type(err).__name__}: {err}")
        else:
            skips.lose(path.name, "truncated_files", 1, f"{type(err).__name__}: {err}",
                       f"; kept the {rows} rows before it")
    finally:
        if broken:
            skips.lose(path.name, "broken_json_lines", broken,
                       f"{broken} broken JSON line(s), first at line {first_broken}", " (skipped)")
    if rows == 0 and path.name not in skips.files:
        skips.skip_file(path.name, "empty" if not broken else "no valid JSON lines")


def row_documents(rows: Iterable[dict], skips: Skips) -> Iterator[Document]:
    """One document per row of a stream (`datasets` streaming): `numbered_documents`, rows counted from 1."""
    return numbered_documents(enumerate(rows, 1), skips, "rows: JSON row")


def numbered_documents(rows: Iterable[tuple[int, dict]], skips: Skips, where: str) -> Iterator[Document]:
    """One document per (number, row) with a non-empty string "text" (newlines normalised; the others counted
    and reported by documents.text_rows)."""
    for _, _, text in text_rows(rows, skips, where):
        text = normalize_newlines(text)
        yield Document(text_id(text), text)


def check_splits(names: list[str]) -> None:
    """Warn when the input files hold more than one of allenai/c4's splits (c4-train.* and c4-validation.*, e.g.
    --src at a whole checkout): they all become one corpus, which this preparation splits by document hash."""
    splits = sorted({m[1] for name in names if (m := re.search(r"c4-(train|validation)\.", name))})
    if len(splits) > 1:
        warn(f"--src holds allenai/c4's {' and '.join(splits)} files: both are read as one corpus and split by "
             "document hash, so the official validation documents are trained on; point --src at one split's folder")


def file_documents(files: Iterable[Path], skips: Skips) -> Iterator[Document]:
    for path in files:
        yield from numbered_documents(file_rows(path, skips), skips, f"{path.name}: line")
