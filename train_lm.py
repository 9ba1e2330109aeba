"""Train a decoder LM: python train_lm.py --config configs/X.yaml [section.key=value ...] [--resume [PATH]]

Overrides are OmegaConf dotlist entries (e.g. model.n_layers=4 trainer.max_steps=100 data.path=data/c4).
--resume continues from the newest checkpoint in <trainer.out_dir>/checkpoints (or PATH) with the same data order,
RNG, optimizer and scheduler state, after checking that config, tokenizer and data are the run's own.
A trainer.out_dir that already holds a run is refused unless --resume or --overwrite (delete it, start
again) is given (lm/run_dir.py). Config and data errors print one line and exit with status 2;
a NaN/inf loss or gradient stops the run with one line naming the step and the last finite checkpoint, exit status 3.
"""
from __future__ import annotations

import argparse
import sys

from heads import ConfigError
from lm.config import load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="YAML file (configs/*.yaml)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", nargs="?", const="last", default=None, metavar="PATH",
                      help="continue from the newest checkpoint of trainer.out_dir, or from PATH")
    mode.add_argument("--overwrite", action="store_true",
                      help="delete the run already in trainer.out_dir (checkpoints, logs, metrics) and start again")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.n_layers=4")
    args = parser.parse_args(argv)
    from lm.errors import DataError, NonFiniteError  # after argument parsing: --help stays fast

    try:
        cfg = load_config(args.config, *args.overrides)
        from lm.train import train

        train(cfg, resume=args.resume, overwrite=args.overwrite)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NonFiniteError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
