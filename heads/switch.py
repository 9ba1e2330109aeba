"""A fast path's on/off switch: off inside `with switch.disabled():`, so that a benchmark or a test can run the
fallback on the same device and inputs (heads/varlen.py's kernels, heads/gathered.py's fused kernels)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator


class FastPath:
    """`on` unless inside `disabled()` (nested blocks restore what they found)."""

    def __init__(self) -> None:
        self.on = True

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        before, self.on = self.on, False
        try:
            yield
        finally:
            self.on = before
