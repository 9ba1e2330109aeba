"""Command-line pieces shared by the scripts of flops/ and bench/: a parser whose --help shows the
script's whole module docstring and whose errors are one `error: ...` line (exit 2), and argparse types
that reject bad numbers before any work starts."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn, TypeVar

T = TypeVar("T")


class _OneLineErrors(argparse.ArgumentParser):
    """An ArgumentParser that reports bad arguments as one `error: ...` line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n")


def script_parser(doc: str | None, prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of a script: --help prints its module docstring `doc` as written (usage examples included)."""
    return _OneLineErrors(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def _integer(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _integer(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _integer(text, 0, "an integer >= 0")


def finite_float(text: str) -> float:
    """argparse type: a finite number (no nan, no inf)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """argparse type: "a,b,c" -> [item("a"), item("b"), item("c")]; empty or repeated entries are errors."""

    def parse(text: str) -> list[T]:
        parts = text.split(",")
        if "" in parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated values without empty entries, got {text!r}")
        values = [item(part) for part in parts]
        repeated = sorted({part for part, value in zip(parts, values) if values.count(value) > 1})
        if repeated:
            raise argparse.ArgumentTypeError(f"{', '.join(repeated)} given more than once in {text!r}")
        return values

    return parse
