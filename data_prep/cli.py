"""The argument parser of every command line (data_prep, lm, flops, bench, train_lm.py, quickstart.py): bad
arguments (an invalid choice, a missing or malformed option) are one `error: ...` line on stderr with exit status 2,
not argparse's usage block; --help still prints the usage. Here, at the bottom of the entry points' imports, so
that data_prep's commands do not load torch to parse their arguments."""
from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one `error: ...` line (exit status 2); its subparsers are the same kind."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n")
