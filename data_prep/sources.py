"""--source name -> Corpus (a re-readable, deterministic stream of Documents)."""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Iterable, Iterator

from data_prep import builtin, c4, gutenberg
from data_prep.documents import Corpus, Document, Skips
from data_prep.errors import DataError
from data_prep.hub import HUB_DATASETS, stream_rows
from data_prep.local_files import find_files, read_text

LOCAL = ("gutenberg", "c4", "text")
SOURCES = (*LOCAL, "builtin", *HUB_DATASETS)
TEXT_SUFFIXES = (".txt", ".txt.gz")


def text_documents(files: Iterable[Path], names: list[str], skips: Skips) -> Iterator[Document]:
    """Plain text files, one document each; id = path relative to --src (`names`)."""
    for path, name in zip(files, names):
        text = read_text(path, skips)
        if text is not None:
            yield Document(name, text)


def noting(files: list[Path], opened: set[Path]) -> Iterator[Path]:
    """`files` in order, each added to `opened` when a reader takes it: a pass that --max-docs stops takes no more."""
    for path in files:
        opened.add(path)
        yield path


def open_source(kind: str, src: str | None = None, hub_split: str | None = None,
                data_files: str | list[str] | None = None, hub_config: str | None = None,
                exclude: Path | None = None, hub_revision: str | None = None) -> Corpus:
    """Check the input exists (DataError otherwise) and return its Corpus.
    Local sources read --src (a directory, searched recursively but outside `exclude`, or one file); hub sources stream
    the dataset id in --src (default per source, see hub.HUB_DATASETS) with its config `hub_config` (default:
    the default dataset's, e.g. allenai/c4's "en"; none for another id, such as a generic "json") at `hub_revision`
    (None: the newest); builtin ignores --src."""
    if kind not in SOURCES:
        raise DataError(f"--source {kind!r}: choose one of {', '.join(SOURCES)}")
    if kind not in HUB_DATASETS:
        given = [flag for flag, value in (("--hub-split", hub_split), ("--data-files", data_files),
                                          ("--hub-config", hub_config), ("--hub-revision", hub_revision)) if value]
        if given:
            raise DataError(f"{', '.join(given)}: only for hub sources ({', '.join(HUB_DATASETS)}), not --source {kind}")
    if kind in LOCAL:
        if not src:
            raise DataError(f"--source {kind} needs --src DIR (a directory of input files)")
        root = Path(src).expanduser()
        suffixes, what = {"gutenberg": (gutenberg.SUFFIXES, "Gutenberg book"), "c4": (c4.SUFFIXES, "C4 JSON-lines"),
                          "text": (TEXT_SUFFIXES, "text")}[kind]
        files = find_files(root, suffixes, what, exclude)
        names = [p.name if root.is_file() else p.relative_to(root).as_posix() for p in files]  # ids of books/texts
        if kind == "c4":
            c4.check_splits(names)
        opened: set[Path] = set()
        reader = {"gutenberg": partial(gutenberg.file_documents, names=names), "c4": c4.file_documents,
                  "text": partial(text_documents, names=names)}[kind]
        return Corpus(kind, names, lambda skips: reader(noting(files, opened), skips=skips),
                      size_hint=len(files) if kind != "c4" else None, files=files, opened=opened)
    if kind == "builtin":
        if src:
            raise DataError("--src does not apply to --source builtin (Python's own documentation, offline)")
        count = len(builtin.topics())
        return Corpus(kind, [builtin.NAME], builtin.documents, size_hint=count)
    default_path, default_name, default_split = HUB_DATASETS[kind]
    path = src or default_path
    name = hub_config if hub_config is not None else (default_name if path == default_path else None)
    split = hub_split or default_split
    rows = partial(stream_rows, path, name, split, data_files, hub_revision)
    to_documents = c4.row_documents if kind == "c4-hub" else gutenberg.row_documents
    label = (f"{path}{'/' + name if name else ''}{'@' + hub_revision if hub_revision else ''}:{split}"
             + (f" data_files={data_files}" if data_files else ""))
    given = [Path(f).expanduser() for f in ([data_files] if isinstance(data_files, str) else data_files or [])]
    local = given if given and all(p.is_file() for p in given) else []  # patterns, URLs: nothing to hash here
    return Corpus(kind, [label], lambda skips: to_documents(rows(), skips), files=local,
                  input_names=[str(p) for p in local], opened=set(local))  # datasets reads them: all are hashed
