"""One checkpoint file from a DeepSpeed checkpoint directory (trainer.strategy=deepspeed_stage_2).

    python -m lm.consolidate runs/tiny/checkpoints/last.ckpt runs/tiny/consolidated.ckpt
    python -m lm.generate --ckpt runs/tiny/consolidated.ckpt --prompt "The"

Under DeepSpeed, Lightning saves each checkpoint as a directory of per-rank shards (ZeRO-2 partitions AdamW's fp32
master weights over the ranks; in bf16 the module's own copy is bf16). Lightning's
`convert_zero_checkpoint_to_fp32_state_dict` gathers the fp32 weights and keeps the checkpoint's own entries
(config, run record with the tokenizer, step, validation history: `KEPT`; DeepSpeed's bookkeeping and Lightning's
loop states are dropped), and the result is written atomically as one file that every reader takes (lm.generate,
lm.evaluate, lm.export_hf, lm.lm_eval, `load_model`). It holds no optimizer state, so it is no point to `--resume` from (train_lm.py refuses it in one
line): resume from the directory itself.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from data_prep.atomic import atomic_write
from data_prep.cli import OneLineParser
from lm.checkpoint import CONSOLIDATED, CheckpointError, read_checkpoint, read_deepspeed

KEPT = ("state_dict", "config", "run", "global_step", "epoch", "tokens_seen", "val_history",
        "pytorch-lightning_version")  # what readers use; DeepSpeed's bookkeeping and Lightning's loop states are dropped


def consolidate(directory: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the fp32 weights and entries of DeepSpeed checkpoint `directory` to the file `out`; returns what was
    written. One-line CheckpointError for a directory that is not a complete DeepSpeed checkpoint."""
    directory, out = Path(directory), Path(out)
    read_deepspeed(directory)  # a complete DeepSpeed checkpoint of train_lm.py, or one line
    try:
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
        import deepspeed  # noqa: F401
    except ImportError:
        raise CheckpointError("consolidating a DeepSpeed checkpoint needs DeepSpeed: "
                              "pip install -e '.[deepspeed]'") from None
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp, contextlib.redirect_stdout(sys.stderr):
        saved = convert_zero_checkpoint_to_fp32_state_dict(directory, Path(tmp) / "fp32.ckpt")
    kept = {key: value for key, value in saved.items() if key in KEPT}
    kept[CONSOLIDATED] = str(directory)
    atomic_write(out, lambda f: torch.save(kept, f))
    read_checkpoint(out)  # what every reader does: a train_lm.py checkpoint, loadable without pickled code
    return kept


def main(argv: list[str] | None = None) -> int:
    from lm.cli import check_output

    ap = OneLineParser(prog="python -m lm.consolidate",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", help="a DeepSpeed checkpoint directory (checkpoints/step<N>.ckpt or last.ckpt)")
    ap.add_argument("out", help="the checkpoint file to write")
    args = ap.parse_args(argv)
    try:
        check_output("OUT", args.out, {"DIRECTORY": args.directory})
        kept = consolidate(args.directory, args.out)
    except (ValueError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    weights = sum(t.numel() for t in kept["state_dict"].values())
    print(f"wrote {args.out}: step {kept.get('global_step')}, {weights:,} fp32 weights and buffers from "
          f"{args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
