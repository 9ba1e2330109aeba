"""Streaming from the Hugging Face hub with `datasets` (for online users; nothing is downloaded whole).

Rows from the stream go through the same `row_documents` functions as the local files, so e.g.
C4 documents get the same ids (and the same train/val split) whether read locally or streamed.
"""
from __future__ import annotations

from typing import Iterator

from data_prep.errors import DataError

# --source -> (default dataset id, its config name, default split)
HUB_DATASETS = {
    "c4-hub": ("allenai/c4", "en", "train"),  # rows {"text", "timestamp", "url"}
    "gutenberg-hub": ("manu/project_gutenberg", None, "en"),  # rows {"id", "text"}: raw books with PG header/footer
}


def _fail(action: str, err: Exception) -> DataError:
    first_line = (str(err).strip().splitlines() or [""])[0][:200]
    return DataError(f"{action} failed ({type(err).__name__}: {first_line}); "
                     "check the network, HF_DATASETS_OFFLINE/HF_HUB_OFFLINE and the dataset/split names")


def stream_rows(path: str, name: str | None, split: str, data_files: str | list[str] | None = None) -> Iterator[dict]:
    """Rows of `datasets.load_dataset(path, name, split=split, data_files=..., streaming=True)`, one pass.
    Any failure, at load time or mid-stream, becomes one DataError line."""
    try:
        import datasets
    except ImportError:
        raise DataError("hub sources need the `datasets` package: pip install datasets") from None
    what = f"streaming {path}{'/' + name if name else ''} split {split!r}"
    try:
        stream = datasets.load_dataset(path, name, split=split, data_files=data_files, streaming=True)
    except Exception as err:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError, ...)
        raise _fail(what, err) from None
    try:
        yield from stream
    except Exception as err:
        raise _fail(what, err) from None
