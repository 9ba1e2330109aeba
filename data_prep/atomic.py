"""Atomic file writes, for prepared data and training checkpoints alike: a reader (or a run resumed after
kill -9) sees either the old file or the complete new one, never a part."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, BinaryIO, Callable

_TEMP = re.compile(r"^\..+\.tmp\d*$")


def temp_path(path: Path) -> Path:
    """Where `path` is written before its rename: `<dir>/.<name>.tmp<pid>` (one per writing process)."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def is_temp(path: Path) -> bool:
    """Whether `path` is a temporary file a killed writer left behind (`temp_path`'s names)."""
    return bool(_TEMP.match(path.name))


def remove_temp_files(directory: Path) -> list[Path]:
    """Delete the temporary files that `atomic_write` leaves in `directory` when its process is killed mid-write."""
    found = sorted(p for p in directory.iterdir() if is_temp(p)) if directory.is_dir() else []
    for path in found:
        path.unlink(missing_ok=True)
    return found


def atomic_write(path: str | Path, write: Callable[[BinaryIO], Any]) -> None:
    """Run `write(f)` on `temp_path(path)`, fsync it, then os.replace() it onto `path`, and fsync the directory
    (the rename itself durable). A hard link to the old file keeps the old bytes: a new inode is renamed over the
    name, never the old file rewritten."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # still there only if writing failed
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
