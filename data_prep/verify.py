"""Check a finished preparation against its index.json, reading every byte of it once.

    python -m data_prep.verify data/c4

Training checks only the shards' sizes and format when it starts (hashing hundreds of GB at every start is not
affordable); run this after copying prepared data to another machine or disk, or when a shard is suspect. It checks
index.json's format, the tokenizer's SHA-256, the hash files the index names, and every shard: present, its size
(2 bytes per token) and its SHA-256 as the index records it. Exit status: 0 intact, 1 damaged (one line per
problem), 2 not a finished preparation.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from data_prep.errors import DataError, progress_bar, warn
from data_prep.manifest import shard_problem
from data_prep.prepare import INDEX, PROGRESS, SPLITS, incomplete
from data_prep.shards import format_problem


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
        shards = [index["splits"][split]["shards"] for split in SPLITS]
        if not all(isinstance(s, dict) and "file" in s and "tokens" in s for split in shards for s in split):
            raise ValueError("a shard entry lacks its file or tokens")
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{out / INDEX} is not a valid index ({type(err).__name__}: {err})") from None
    if problem := format_problem(index):
        raise DataError(f"{out / INDEX} {problem}")
    return index


def problems(out: Path, progress: bool = False) -> tuple[list[str], dict]:
    """Every problem of the finished preparation in `out` (empty: intact) and its index, with a bar over the shard
    bytes read. A shard without a recorded SHA-256 gets a warning: only its size can be checked."""
    index = read_index(out)
    found = incomplete(out, index)
    shards = [shard for split in SPLITS for shard in index["splits"][split]["shards"]]
    if unhashed := [shard["file"] for shard in shards if "sha256" not in shard]:
        warn(f"{len(unhashed)} shard(s) have no SHA-256 in the index ({', '.join(unhashed[:3])}"
             f"{', ...' * (len(unhashed) > 3)}): only their sizes are checked")
    with progress_bar(total=sum(2 * int(shard["tokens"]) for shard in shards), desc="verify", unit="B",
                      unit_scale=True, unit_divisor=1024, progress=progress) as bar:
        for shard in shards:
            if problem := shard_problem(out, shard, bar.update):
                found.append(f"{shard['file']}: {problem}")
    return found, index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep.verify", description=__doc__.split("\n")[0])
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
        print(f"{out}: {len(found)} problem(s); rerun the data_prep.prepare command that made it: it redoes damaged "
              "shards (a damaged tokenizer or hash file: with --overwrite)", file=sys.stderr)
        return 1
    shards = [shard for split in SPLITS for shard in index["splits"][split]["shards"]]
    print(f"{out}: intact ({len(shards)} shards, {sum(int(s['tokens']) for s in shards):,} tokens; tokenizer and "
          "hash files as index.json records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
