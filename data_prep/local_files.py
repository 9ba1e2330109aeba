"""Finding input files and reading them as clean text (UTF-8, LF line endings)."""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path

from data_prep.documents import Skips
from data_prep.errors import DataError


NUL_SHARE = 0.1  # more NUL characters than this share of a file: UTF-16 without a BOM (English: ~50%) or binary;
# a stray NUL in text is kept, like any other character (the tokenizer is lossless)


def find_files(src: str | Path, suffixes: tuple[str, ...], what: str, exclude: Path | None = None) -> list[Path]:
    """`src` itself if it is a matching file, else every matching file under it (recursive) but outside `exclude`
    (a preparation's own output folder inside its --src: its index.json is no C4 input), sorted by relative path
    so the document order never depends on the file system."""
    root = Path(src).expanduser()
    if not root.exists():
        raise DataError(f"{root}: no such file or directory")
    if root.is_file():
        files = [root] if root.name.endswith(suffixes) else []
    else:
        skip = exclude.expanduser().resolve() if exclude is not None else None
        files = sorted((p for p in root.rglob("*") if p.is_file() and p.name.endswith(suffixes)
                        and not (skip is not None and p.resolve().is_relative_to(skip))),
                       key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(f"{root}: no {what} files ({', '.join('*' + s for s in suffixes)}) found")
    return files


def normalize_newlines(text: str) -> str:
    """CRLF and lone CR -> LF."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped if the name ends in .gz."""
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return f.read()
    return path.read_bytes()


def read_text(path: Path, skips: Skips) -> str | None:
    """A file's text (UTF-8, optional BOM, newlines normalised), or None after recording why it was skipped:
    unreadable (corrupt gzip / I/O error), undecodable (not UTF-8, or mostly NULs) or empty (only whitespace)."""
    try:
        raw = read_bytes(path)
    except (OSError, EOFError, zlib.error) as err:
        skips.skip_file(path.name, "unreadable", f"{type(err).__name__}: {err}")
        return None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        skips.skip_file(path.name, "undecodable", f"not UTF-8: byte {err.start}")
        return None
    if (nuls := text.count("\x00")) > NUL_SHARE * len(text):  # valid UTF-8, but not text
        share = f"{nuls / len(text):.0%}"
        skips.skip_file(path.name, "undecodable", f"{share} NUL characters: UTF-16 without a BOM, or binary")
        return None
    if not text.strip():
        skips.skip_file(path.name, "empty")
        return None
    return normalize_newlines(text)
