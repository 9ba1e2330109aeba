"""The CPU quickstart (`make quickstart`): prepare a Gutenberg subset, train a small dense LM for a few
minutes, print the validation perplexity as it falls, and leave TensorBoard logs and a checkpoint.

    python quickstart.py [--shared ../shared/data] [--fresh] [section.key=value ...]

Data: the first 14 books (by file name) of <shared>/gutenberg, SentencePiece vocabulary of
model.vocab_size; two of them hash into validation (Treasure Island, A Modest Proposal). Without
<shared>/gutenberg it runs offline on Python's own documentation, which ships with CPython
(data_prep's `builtin` source; ~89k training tokens, so training stops at 90 steps; a fifth of the topics
hash into validation, ~8k tokens, none of whose text is in training, and validation takes as many batches of windows
as fit in them without overlap: 1 of the config's 8). Model and schedule:
configs/quickstart.yaml (overrides as in train_lm.py). A rerun continues an interrupted run (or just
reports a finished one); --fresh retrains (deleting only the run's own outputs, as train_lm.py --overwrite)
and prepares the data again if its settings changed (e.g. model.vocab_size).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

from data_prep.cli import OneLineParser
from heads import ConfigError
from lm.cli import status_of
from lm.config import Config
from lm.config_io import load_config
from lm.sanity import val_batches_that_fit

ROOT = Path(__file__).resolve().parent
CONFIG = ROOT / "configs" / "quickstart.yaml"
BOOKS = 14
VAL_FRACTION = 0.1
BUILTIN_VAL_FRACTION = 0.2  # the builtin corpus is small: 0.1 would leave ~1.5k validation tokens (4 topics)
BUILTIN_STEPS = 90  # the builtin corpus has ~89k training tokens: ~4 epochs, before overfitting sets in
# Errors of lm.train and data_prep name train_lm.py's and data_prep's flags; quickstart's own equivalents.
OWN_FLAGS = ((r"with --resume\b", "by running the quickstart again"), (r"--resume\b", "resuming"), (r"--overwrite\b", "--fresh"), (r"^--out\b", "data.path"),
             (r"another --out\b", "another data.path"))


def in_own_flags(message: str) -> str:
    """`message` naming quickstart's flags and overrides instead of train_lm.py's and data_prep's."""
    for pattern, own in OWN_FLAGS:
        message = re.sub(pattern, own, message)
    return message


def prepare_data(cfg: Config, shared: Path, overwrite: bool) -> None:
    """Prepare the quickstart corpus and point cfg.data.path (and the run directory) at it; `overwrite`
    replaces a preparation with other settings."""
    from data_prep.prepare import prepare

    gutenberg = shared / "gutenberg"
    vocab = cfg.model.vocab_size
    if gutenberg.is_dir():
        print(f"data: the first {BOOKS} Gutenberg books of {gutenberg}, vocab {vocab} -> {cfg.data.path}")
        prepare("gutenberg", str(gutenberg), cfg.data.path, vocab_size=vocab, max_docs=BOOKS,
                val_fraction=VAL_FRACTION, overwrite=overwrite, progress=False)
    else:
        cfg.data.path += "-builtin"
        cfg.trainer.out_dir += "-builtin"
        cfg.trainer.max_steps = min(cfg.trainer.max_steps, BUILTIN_STEPS)
        print(f"data: {gutenberg} not found, so training offline on Python's own documentation "
              f"(pydoc_data, shipped with CPython; small, so at most {BUILTIN_STEPS} steps) -> {cfg.data.path}")
        index = prepare("builtin", None, cfg.data.path, vocab_size=vocab, val_fraction=BUILTIN_VAL_FRACTION,
                        overwrite=overwrite, progress=False)
        fit = val_batches_that_fit(cfg.data, cfg.model, index["splits"]["val"]["tokens"])
        cfg.data.val_batches = max(1, min(cfg.data.val_batches, fit))


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "data",
                        help="directory holding gutenberg/ (default ../shared/data)")
    parser.add_argument("--fresh", action="store_true", help="delete an earlier quickstart run's outputs and retrain; "
                        "prepare the data again if its settings changed")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of configs/quickstart.yaml")
    args = parser.parse_intermixed_args(argv)
    from lm.errors import DataError, Interrupted, NonFiniteError

    try:
        cfg = load_config(CONFIG, *args.overrides)
        prepare_data(cfg, args.shared, overwrite=args.fresh)
        from lm.run_dir import holds_run
        from lm.train import train

        # continue the run in the directory, if any (--resume), or --overwrite it
        resume = "last" if holds_run(Path(cfg.trainer.out_dir)) and not args.fresh else None
        metrics = train(cfg, resume=resume, overwrite=args.fresh)
    except (ConfigError, DataError, NonFiniteError, Interrupted) as err:
        print(f"error: {in_own_flags(str(err))}", file=sys.stderr)
        return status_of(err)  # as train_lm.py's
    out = Path(cfg.trainer.out_dir)
    print("\nvalidation perplexity during training:")
    for h in metrics["history"]:
        print(f"  step {h['step']:5d}  {h['tokens_seen'] / 1e6:6.2f}M tokens  val loss {h['val_loss']:.3f}  "
              f"ppl {h['val_ppl']:9.2f}")
    speed = metrics["tokens_per_s"]
    print(f"\nquickstart done in {(time.perf_counter() - start) / 60:.1f} min: {metrics['params'] / 1e6:.2f}M params"
          + ("" if math.isnan(speed) else f", {speed:,.0f} training tokens/s"))
    print(f"  TensorBoard: tensorboard --logdir {out / 'tb'}")
    print(f"  checkpoint:  {out / 'checkpoints' / 'last.ckpt'}")
    print(f"  metrics:     {out / 'metrics.json'}")
    print(f"  val curve:   {out / 'val_curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
