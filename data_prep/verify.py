"""Check a finished preparation against its index.json, reading every byte of it once.

    python -m data_prep.verify data/c4

Training checks only the shards' sizes and format when it starts (hashing hundreds of GB at every start is not
affordable); run this after copying prepared data to another machine or disk, or when a shard is suspect. It checks
index.json itself (format, shard entries, each split's token total), the tokenizer's SHA-256, the two hash files of
the training text (their SHA-256 where the index records it, since 2026-11-30; else their layout: sorted, distinct
8-byte hashes), and every shard: present, its size (2 bytes per token) and its SHA-256. Exit status: 0 intact,
1 damaged (one line per problem), 2 not a finished preparation (or an index this version cannot read).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from data_prep.cli import OneLineParser
from data_prep.doc_hashes import layout_problem
from data_prep.errors import DataError, progress_bar, warn
from data_prep.manifest import sha256_file, shard_problem
from data_prep.prepare import INDEX, PROGRESS, SPLITS, hash_file_names, incomplete
from data_prep.shards import SHARD_NAME, format_problem


def _index_problem(index: Any) -> str | None:
    """What makes `index` unreadable as a finished preparation's index.json (its structure), else None."""
    splits = index.get("splits") if isinstance(index, dict) else None
    if not isinstance(splits, dict) or not all(isinstance(splits.get(s), dict) for s in SPLITS):
        return "no train and val splits"
    for split in SPLITS:
        shards = index["splits"][split].get("shards")
        if not isinstance(shards, list):
            return f"{split}: no shard list"
        for shard in shards:
            file, tokens = (shard.get("file"), shard.get("tokens")) if isinstance(shard, dict) else (None, None)
            if not (isinstance(file, str) and SHARD_NAME.match(file) and file.startswith(split)
                    and type(tokens) is int and tokens > 0):
                return (f"{split}: a shard entry's file {file!r} is not a {split}_NNNNN.bin name or its tokens {tokens!r} "
                        "are not a positive integer")
    ngrams = index.get("train_ngrams") or {}
    names = [index.get("train_documents"), ngrams.get("file") if isinstance(ngrams, dict) else 0]  # 0: not a name
    if not all(name is None or (isinstance(name, str) and name and "/" not in name) for name in names):
        return "its hash files (train_documents, train_ngrams.file) are not file names"
    return None


def read_index(out: Path) -> dict:
    """The finished preparation's index.json in `out`; DataError naming what is wrong if there is none."""
    if not out.is_dir():
        raise DataError(f"{out} is not a directory")
    if not (out / INDEX).is_file():
        unfinished = " (its progress.json says a preparation was interrupted: rerun its command)" * (
            out / PROGRESS).is_file()
        raise DataError(f"{out} holds no {INDEX}: not a finished preparation{unfinished}")
    try:
        index = json.loads((out / INDEX).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{out / INDEX} is not a valid index ({type(err).__name__}: {err})") from None
    if problem := _index_problem(index):
        raise DataError(f"{out / INDEX} is not a valid index ({problem})")
    if problem := format_problem(index):
        raise DataError(f"{out / INDEX} {problem}")
    return index


def _hash_file_problems(out: Path, index: dict) -> list[str]:
    """Damaged hash files (missing ones are incomplete()'s): SHA-256 against the index where recorded, else layout."""
    recorded = index.get("hash_files_sha256") or {}
    found = []
    for name in hash_file_names(index):
        path = out / name
        if not path.is_file():
            continue
        if name in recorded:
            problem = "SHA-256 mismatch" if sha256_file(path) != recorded[name] else None
        else:
            problem = layout_problem(path)
        if problem:
            found.append(f"{name}: {problem}")
    return found


def problems(out: Path, progress: bool = False) -> tuple[list[str], dict]:
    """Every problem of the finished preparation in `out` (empty: intact) and its index, with a bar over the shard
    bytes read. A shard without a recorded SHA-256 gets a warning: only its size can be checked."""
    index = read_index(out)
    found = incomplete(out, index) + _hash_file_problems(out, index)
    for split in SPLITS:
        entry = index["splits"][split]
        total = sum(shard["tokens"] for shard in entry["shards"])
        if entry.get("tokens") != total:
            found.append(f"index.json: the {split} split records {entry.get('tokens')} tokens, its shards {total}")
    if not index["splits"]["train"]["shards"]:
        found.append("index.json lists no training shard")
    shards = [shard for split in SPLITS for shard in index["splits"][split]["shards"]]
    if unhashed := [shard["file"] for shard in shards if "sha256" not in shard]:
        warn(f"{len(unhashed)} shard(s) have no SHA-256 in the index ({', '.join(unhashed[:3])}"
             f"{', ...' * (len(unhashed) > 3)}): only their sizes are checked")
    with progress_bar(total=sum(2 * shard["tokens"] for shard in shards), desc="verify", unit="B",
                      unit_scale=True, unit_divisor=1024, progress=progress) as bar:
        for shard in shards:
            if problem := shard_problem(out, shard, bar.update):
                found.append(f"{shard['file']}: {problem}")
    return found, index


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m data_prep.verify", description=__doc__.split("\n")[0])
    parser.add_argument("out", help="the prepared directory (data_prep.prepare's --out)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        found, index = problems(out, progress=not args.no_progress and sys.stderr.isatty())
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for problem in found:
        print(f"damaged: {problem}", file=sys.stderr)
    if found:
        print(f"{out}: {len(found)} problem(s); copy the damaged files again from where it was prepared, or rerun its "
              "data_prep.prepare command there (it redoes damaged shards; a damaged tokenizer or hash file with "
              "--overwrite)", file=sys.stderr)
        return 1
    shards = [shard for split in SPLITS for shard in index["splits"][split]["shards"]]
    print(f"{out}: intact ({len(shards)} shards, {sum(s['tokens'] for s in shards):,} tokens; tokenizer and "
          "hash files as index.json records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
