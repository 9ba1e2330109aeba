"""Train a decoder LM: python train_lm.py --config configs/X.yaml [--resume | --resume-from PATH | --overwrite] [section.key=value ...]

Overrides are OmegaConf dotlist entries (e.g. model.n_layers=4 trainer.max_steps=100 data.path=data/c4), anywhere
on the line. --resume continues from the newest checkpoint in <trainer.out_dir>/checkpoints (--resume-from PATH:
from PATH) with the same data order, RNG, optimizer and scheduler state, after checking that config, tokenizer
and data are the run's own. A trainer.out_dir that already holds a run is refused unless --resume or --overwrite
(delete it, start again) is given (lm/run_dir.py). Config and data errors print one line and exit with status 2;
a NaN/inf loss or gradient stops the run with one line naming the step and the last finite checkpoint, exit status 3;
SIGTERM stops it after the current optimizer step (on every rank), checkpointing that step, with one line
naming the step, exit status 143 (lm/preemption.py); Ctrl-C the same, exit status 130 (a second one aborts).
A config with a compression section trains with python -m lm.compressed_training instead.
"""
from __future__ import annotations

import sys

from lm.cli import exit_status, resume_of, training_parser
from lm.config_io import load_config


def main(argv: list[str] | None = None) -> int:
    parser = training_parser(__doc__.split("\n")[0], "YAML file (configs/*.yaml)", "model.n_layers=4")
    args = parser.parse_intermixed_args(argv)

    def run() -> None:
        cfg = load_config(args.config, *args.overrides)
        from lm.train import train  # after argument parsing: --help stays fast

        train(cfg, resume=resume_of(args), overwrite=args.overwrite)

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
