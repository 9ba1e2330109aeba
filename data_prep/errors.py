"""The one error type of data preparation, and warnings that do not break a tqdm progress bar."""
from __future__ import annotations

import sys

from tqdm import tqdm


class DataError(ValueError):
    """Bad input to data preparation; the message is one line saying what is wrong and what to do."""


def warn(message: str) -> None:
    """Print one warning line to stderr (above any running progress bar)."""
    tqdm.write(f"warning: {message}", file=sys.stderr)
