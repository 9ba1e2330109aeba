"""What every reader yields (Document), what every source is (Corpus), and the skip ledger."""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

from data_prep.errors import DataError, warn


COUNT_NAMES = {"rows_without_text": 'rows without a string "text" field', "broken_json_lines": "broken JSON lines",
               "documents_overlapping_excluded_texts": "documents left out by --exclude-overlap",
               "documents_cut_around_excluded_texts": "documents cut by --exclude-overlap"}


class Document(NamedTuple):
    """One training document. `id` is stable across runs and orderings (it decides the split)."""

    id: str
    text: str


@dataclass
class Skips:
    """What a pass over a corpus dropped: whole files (name -> reason) and counted items
    (e.g. broken JSON lines). Each distinct warning is printed once, even over several passes."""

    files: dict[str, str] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    _warned: set[str] = field(default_factory=set)

    def warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warn(message)

    def skip_file(self, name: str, reason: str, detail: str = "") -> None:
        """Record a file left out; `reason` is a short category, `detail` only goes into the warning."""
        self.files[name] = reason
        self.warn_once(f"skipped {name}: {reason}{f' ({detail})' if detail else ''}")

    def count(self, what: str, n: int = 1, where: str = "") -> None:
        """Count `n` items left out under `what`; `where` names them for StrictSkips' error."""
        self.counts[what] += n

    def lose(self, name: str, what: str, n: int, problem: str, kept: str) -> None:
        """Count `n` items of file `name` left out under `what` (the rest of the file is kept) and warn once:
        '<name>: <problem><kept>'."""
        self.count(what, n)
        self.warn_once(f"{name}: {problem}{kept}")

    def meet(self, name: str, problem: str) -> None:
        """A reader meets a problem mid-file (e.g. 'broken JSON line 2'): nothing yet, the reader counts it and
        reports the file's total with `lose` at its end (StrictSkips stops here, at the first)."""

    def describe_counts(self) -> str:
        """The counted items for an error line, e.g. '; 100 rows without a string "text" field', or ''."""
        return "".join(f"; {n} {COUNT_NAMES.get(what, what.replace('_', ' '))}"
                       for what, n in sorted(self.counts.items()))

    def new_pass(self) -> "Skips":
        """An empty ledger for the next pass over the same corpus, sharing the warnings already shown."""
        return Skips(_warned=self._warned)

    def summary(self) -> dict:
        """For index.json: skipped files by reason, plus the counted items."""
        reasons = Counter(self.files.values())
        return {"skipped_files": len(self.files), "skipped_files_by_reason": dict(sorted(reasons.items())),
                **dict(sorted(self.counts.items()))}


@dataclass
class StrictSkips(Skips):
    """A skip ledger for inputs that must be read whole (an evaluation's text, texts to exclude): a file it would
    skip (undecodable, empty, unreadable) or part of a file it would leave out (a truncated stream, broken JSON
    lines, rows without text) is a DataError, its message ending in `consequence`."""

    consequence: str = "nothing was done"

    def skip_file(self, name: str, reason: str, detail: str = "") -> None:
        raise DataError(f"{name}: {reason}{f' ({detail})' if detail else ''}; {self.consequence}")

    def lose(self, name: str, what: str, n: int, problem: str, kept: str) -> None:
        raise DataError(f"{name}: {problem}; {self.consequence}")

    def meet(self, name: str, problem: str) -> None:
        self.lose(name, "", 1, problem, "")

    def count(self, what: str, n: int = 1, where: str = "") -> None:
        if what == "rows_without_text":
            raise DataError(f"{where or 'a row'} has no string \"text\" field; {self.consequence}")
        super().count(what, n, where)


def text_rows(rows: Iterable[tuple[int, dict]], skips: Skips, where: str) -> Iterator[tuple[int, dict, str]]:
    """(number, row, text) per row with a non-empty string "text"; the others are counted (`where` and the
    number name the row in an error of StrictSkips: where="a.jsonl: line" gives "a.jsonl: line 7"), and rows
    without text are reported once per file or stream, like broken JSON lines: a misnamed field is no empty
    document (also when the reader stops early)."""
    missing, first = 0, 0
    try:
        for n, row in rows:
            text = row.get("text")
            if not isinstance(text, str):
                skips.count("rows_without_text", where=f"{where} {n}")
                missing, first = missing + 1, first or n
            elif not text.strip():
                skips.count("empty_documents")
            else:
                yield n, row, text
    finally:
        if missing:
            name, unit = where.split(": ", 1)
            skips.warn_once(f"{name}: {missing} row(s) without a string \"text\" field, first at {unit} {first} "
                            "(skipped)")


@dataclass
class Corpus:
    """A re-readable document source: each `read(skips)` is a fresh pass in the same order."""

    kind: str  # the --source name
    sources: list[str]  # file names or hub dataset ids, recorded in index.json
    read: Callable[[Skips], Iterator[Document]]
    size_hint: int | None = None  # number of documents or files, for progress bars (None = unknown)
    files: list[Path] = field(default_factory=list)  # input files on disk, hashed into index.json: a local source's
    # (in `sources` order), or a hub source's local --data-files
    input_names: list[str] | None = None  # their names in index.json's inputs (None: `sources`)
    opened: set[Path] = field(default_factory=set)  # those of `files` a pass has begun to read (all of them unless
    # --max-docs stops early; a hub source's: all): the ones whose SHA-256 index.json records (data_prep/manifest.py)

    def first(self, n: int | None) -> Corpus:
        """The first `n` documents of every pass (all of them for None): --max-docs. The source's reader is closed
        after them, so what it reports at its end (broken lines, rows without text) covers the part it read."""
        if n is None:
            return self

        def read(skips: Skips) -> Iterator[Document]:
            docs = self.read(skips)
            try:
                yield from itertools.islice(docs, n)
            finally:
                getattr(docs, "close", lambda: None)()

        return replace(self, read=read, size_hint=min(self.size_hint, n) if self.size_hint else n)
