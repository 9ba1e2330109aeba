"""The error types entry points turn into one line and an exit status (no Lightning import, so a bad
config is reported before the slow imports)."""
from __future__ import annotations

import signal

from data_prep.errors import DataError  # one error type for bad data, from raw input to prepared shards

__all__ = ["DataError", "Interrupted", "NonFiniteError"]


class NonFiniteError(RuntimeError):
    """Training produced a NaN/inf loss, gradient, buffer or validation loss; the message is one line."""


class Interrupted(RuntimeError):
    """A training run stopped by SIGTERM or SIGINT before trainer.max_steps (after an optimizer step,
    lm/preemption.py); the message is one line naming the step reached, `signum` the signal (exit 128 + it)."""

    def __init__(self, message: str, signum: int = signal.SIGTERM) -> None:
        super().__init__(message)
        self.signum = signum
