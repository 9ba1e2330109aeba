"""Command-line arguments the training entry points share (train_lm.py, lm.compressed_training): the
config, how to treat a run already in trainer.out_dir, and dotted overrides anywhere on the line; and the
output-path check and the missing-extra line of the evaluation entry points. No Lightning import, so --help and
bad arguments stay fast."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from data_prep.cli import OneLineParser


def training_parser(description: str, config_help: str, override_example: str) -> argparse.ArgumentParser:
    """--config FILE, one of --resume | --resume-from PATH | --overwrite, and overrides; parse with
    `parse_intermixed_args`, so overrides may stand before, between and after the options."""
    parser = OneLineParser(description=description)
    parser.add_argument("--config", required=True, help=config_help)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue from the newest loadable checkpoint of trainer.out_dir (a fresh start if none)")
    mode.add_argument("--resume-from", metavar="PATH", help="continue from this checkpoint")
    mode.add_argument("--overwrite", action="store_true",
                      help="delete the run already in trainer.out_dir (checkpoints, logs, metrics) and start again")
    parser.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {override_example}")
    return parser


def resume_of(args: argparse.Namespace) -> str | None:
    """The `resume` argument of lm.train.train: "last" (--resume), a checkpoint path (--resume-from) or None."""
    if args.resume_from is not None:
        return args.resume_from
    return "last" if args.resume else None


def exit_status(run: Callable[[], Any]) -> int:
    """Run a training entry point's work: 0; a config or data error: one `error:` line on stderr, 2; a diverged
    run (lm/nonfinite.py): one line naming the step and the last finite checkpoint, 3; a run stopped by SIGTERM or
    Ctrl-C before its last step: one line, 143 or 130 (128 + the signal, as a shell reports a process it killed)."""
    from heads import ConfigError
    from lm.errors import DataError, Interrupted, NonFiniteError

    try:
        run()
    except (ConfigError, DataError, NonFiniteError, Interrupted) as err:
        print(f"error: {err}", file=sys.stderr)
        return status_of(err)
    return 0


def status_of(err: Exception) -> int:
    """The exit status of an entry point's one-line error: 3 diverged, 128 + the signal (143 SIGTERM, 130 SIGINT)
    stopped, 2 bad input (anything else)."""
    from lm.errors import Interrupted, NonFiniteError

    return 3 if isinstance(err, NonFiniteError) else 128 + err.signum if isinstance(err, Interrupted) else 2


def check_output(option: str, path: str | None, inputs: dict[str, str | None] | None = None) -> None:
    """A one-line ValueError unless `path` (None: not given) can be written, checked before the work that writes it:
    its directory must exist, it must not be a directory itself, nor any of the command's `inputs` ({option: path},
    e.g. the checkpoint; a hard link of one counts as the same file)."""
    if path is None:
        return
    target = Path(path)
    if not target.resolve().parent.is_dir():
        raise ValueError(f"{option} {path}: directory {target.resolve().parent} does not exist")
    if target.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a file name")
    for name, given in (inputs or {}).items():
        if given is not None and target.exists() and Path(given).exists() and target.samefile(given):
            raise ValueError(f"{option} {path} is {name} {given}: writing it would destroy that input; give another file")


def check_png(option: str, path: str | None, inputs: dict[str, str | None] | None = None) -> None:
    """`check_output`, and a plot's file name must end in .png (matplotlib picks the format by it)."""
    check_output(option, path, inputs)
    if path is not None and Path(path).suffix.lower() != ".png":
        raise ValueError(f"{option} {path}: the plot is a PNG; give a file name ending in .png")


def exit_without_eval_extra(entry: str, package: str, err: ImportError) -> NoReturn:
    """`python -m <entry>` run without `package` of the eval extra (the GPU image has no lm-eval): one line naming
    the extra, exit status 2, instead of the import's traceback."""
    print(f"error: {entry} needs {package}, from the eval extra (pip install -e '.[eval]'): {err}", file=sys.stderr)
    raise SystemExit(2)
