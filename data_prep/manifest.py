"""What a preparation was made from, and whether what it wrote is still intact.

- Inputs: every local input file's name (relative to --src) and size, and the SHA-256 of each file the
  preparation read (all of them, unless --max-docs stopped it early: the first documents of a large local C4
  need not hash the rest of it), recorded in progress.json and index.json. A rerun hashes the files the
  record hashed; over changed inputs (a file added, removed, resized, or a hashed one edited) it is refused
  with one line naming them: the split, the tokenizer sample and every shard depend on the inputs, so the
  only correct redo is a fresh one (`--overwrite`).
- Shards: each finished shard's SHA-256 is recorded with its token count. A rerun re-checks every
  shard (present, size, hash); the first damaged one and those after it in its split are redone.
Hub sources have no local files to hash; their settings (dataset id, split, data_files) identify them.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Collection

from data_prep.errors import progress_bar

CHUNK = 1 << 20


def sha256_file(path: Path, on_block: Callable[[int], object] = lambda n: None) -> str:
    """The file's SHA-256; `on_block(n)` is called after each block of n bytes (for a progress bar)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
            on_block(len(block))
    return digest.hexdigest()


def input_manifest(files: list[Path], names: list[str], hashed: Collection[Path],
                   progress: bool = False) -> dict[str, dict]:
    """{name: {"bytes"[, "sha256"]}} for the corpus' local input files, the SHA-256 for those in `hashed`, with a
    bar over their bytes if `progress`."""
    sizes = [path.stat().st_size for path in files]
    with progress_bar(total=sum(size for path, size in zip(files, sizes) if path in hashed), desc="hash", unit="B",
                      unit_scale=True, unit_divisor=1024, progress=progress and bool(hashed)) as bar:
        return {name: {"bytes": size, **({"sha256": sha256_file(path, bar.update)} if path in hashed else {})}
                for path, name, size in zip(files, names, sizes)}


def as_recorded(files: list[Path], names: list[str], recorded: dict[str, dict], progress: bool = False) -> dict:
    """The inputs now, in the form of an earlier record: every file's size, the SHA-256 of those it hashed."""
    hashed = {path for path, name in zip(files, names) if "sha256" in recorded.get(name, {})}
    return input_manifest(files, names, hashed, progress)


def input_changes(old: dict[str, dict], new: dict[str, dict]) -> str:
    """'' if equal, else e.g. '1 added (c.txt), 1 removed (a.txt), 1 changed (b.txt)'."""
    added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
    changed = sorted(k for k in set(old) & set(new) if old[k] != new[k])
    parts = [f"{len(names)} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
             for what, names in (("added", added), ("removed", removed), ("changed", changed)) if names]
    return ", ".join(parts)


def shard_problem(out: Path, shard: dict, on_block: Callable[[int], object] = lambda n: None) -> str | None:
    """Why a finished shard cannot be used (missing, wrong size, hash mismatch), or None; `on_block` as in
    sha256_file."""
    path = out / shard["file"]
    if not path.is_file():
        return "missing"
    if path.stat().st_size != 2 * shard["tokens"]:
        return f"{path.stat().st_size} bytes, expected {2 * shard['tokens']}"
    if "sha256" in shard and sha256_file(path, on_block) != shard["sha256"]:
        return "SHA-256 mismatch"
    return None


def intact_prefix(out: Path, shards: list[dict]) -> tuple[list[dict], str | None]:
    """The finished shards before the first damaged one, and a note on that one (None if all intact)."""
    for i, shard in enumerate(shards):
        problem = shard_problem(out, shard)
        if problem is not None:
            return shards[:i], f"{shard['file']}: {problem}"
    return shards, None
