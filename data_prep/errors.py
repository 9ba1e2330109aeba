"""The one error type of data preparation, progress bars, and warnings that do not break them."""
from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class DataError(ValueError):
    """Bad data, raw or prepared (data preparation's input, a training run's shards); the message is one line saying
    what is wrong and what to do."""


def warn(message: str) -> None:
    """Print one warning line to stderr (above any running progress bar)."""
    tqdm.write(f"warning: {message}", file=sys.stderr)


def progress_bar(iterable: Any = None, *, progress: bool, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr, or a silent pass-through when `progress` is False (--no-progress)."""
    return tqdm(iterable, disable=not progress, dynamic_ncols=True, **kwargs)
