"""Streaming from the Hugging Face hub with `datasets` (for online users; nothing is downloaded whole).

Rows from the stream become documents as the local files' rows do (C4: c4.numbered_documents; Gutenberg: the same
header/footer stripping), so e.g. C4 documents get the same ids (and the same train/val split) whether read locally
or streamed.
"""
from __future__ import annotations

from typing import Iterator

from data_prep.errors import DataError

# --source -> (default dataset id, its config name, default split)
HUB_DATASETS = {
    "c4-hub": ("allenai/c4", "en", "train"),  # rows {"text", "timestamp", "url"}
    "gutenberg-hub": ("manu/project_gutenberg", None, "en"),  # rows {"id", "text"}: raw books with PG header/footer
}


# connection failures of the HTTP stacks under `datasets` (requests, httpx, aiohttp) and hub offline mode
_NETWORK_ERRORS = {"ConnectionError", "ConnectError", "ConnectTimeout", "ReadTimeout", "Timeout", "TimeoutException",
                   "NetworkError", "ClientConnectorError", "ServerDisconnectedError", "OfflineModeIsEnabled"}


def is_network_error(err: BaseException | None) -> bool:
    """Whether `err`, or an exception it was raised from, is a connection failure or offline mode."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (ConnectionError, TimeoutError)) or type(err).__name__ in _NETWORK_ERRORS:
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


NETWORK_HINT = "check the network and HF_DATASETS_OFFLINE/HF_HUB_OFFLINE"


def first_line(err: BaseException) -> str:
    """`err` as one short line: its type and the first line of its message (at most 200 characters)."""
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"


def _fail(action: str, err: Exception, hint: str | None) -> DataError:
    """One line for a failed load or stream; the network hint only for connection/offline errors."""
    if is_network_error(err):
        hint = NETWORK_HINT
    return DataError(f"{action} failed ({first_line(err)})" + (f"; {hint}" if hint else ""))


def stream_rows(path: str, name: str | None, split: str, data_files: str | list[str] | None = None,
                revision: str | None = None) -> Iterator[dict]:
    """Rows of `datasets.load_dataset(path, name, split=split, data_files=..., revision=..., streaming=True)`, one
    pass; `revision` (a commit sha, branch or tag of the dataset repository) pins what is streamed, None = its
    newest. Any failure, at load time or mid-stream, becomes one DataError line."""
    try:
        import datasets
    except ImportError:
        raise DataError("hub sources need the `datasets` package: pip install datasets") from None
    what = f"streaming {path}{'/' + name if name else ''}{'@' + revision if revision else ''} split {split!r}"
    try:
        stream = datasets.load_dataset(path, name, split=split, data_files=data_files, revision=revision, streaming=True)
    except Exception as err:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError, ...)
        raise _fail(what, err, "check the dataset id (--src), --hub-split, --hub-revision and --data-files") from None
    try:
        yield from stream
    except Exception as err:
        raise _fail(what, err, None) from None
