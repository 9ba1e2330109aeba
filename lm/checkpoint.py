"""Checkpoint files: atomic writes, RNG state, and rebuilding a model from a checkpoint.

A checkpoint is Lightning's dict (state_dict, optimizer/scheduler states, loop state) plus
`config` (the full run Config as plain values, so `load_model` can rebuild the model) and `rng`
(every RNG state, so a resumed run continues exactly as an uninterrupted one).
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lm.config import Config, from_dict
from lm.model import DecoderLM, build_model


def atomic_write(path: str | Path, write: Callable[[BinaryIO], Any]) -> None:
    """Run `write(f)` on `<dir>/.<name>.tmp<pid>`, fsync it, then os.replace() it onto `path`: a reader
    (or a resumed run after kill -9) sees either the old file or the complete new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # still there only if writing failed
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO whose saves go through `atomic_write`."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        atomic_write(path, lambda f: torch.save(checkpoint, f))


class StepCheckpoints(L.Callback):
    """`step<N>.ckpt` every `every` optimizer steps, and `last.ckpt` pointing at the newest one; only
    the newest `keep` step checkpoints are kept (0: all).

    At a step that also validates, the checkpoint is written after the validation, so it carries
    that validation's result and a resumed run does not repeat it. `last.ckpt` is an atomic hard
    link to the step file (no second write), except for DeepSpeed, whose checkpoints are directories.
    """

    def __init__(self, dirpath: str | Path, every: int, val_every: int, link_last: bool = True, keep: int = 0) -> None:
        self.dirpath, self.every, self.val_every, self.link_last = Path(dirpath), every, val_every, link_last
        self.keep = keep
        self.saved_step: int | None = None  # step of the newest checkpoint written by this process

    def save(self, trainer: L.Trainer) -> None:
        step_path = self.dirpath / f"step{trainer.global_step:07d}.ckpt"
        last = self.dirpath / "last.ckpt"
        trainer.save_checkpoint(step_path, weights_only=False)
        if not self.link_last:
            trainer.save_checkpoint(last, weights_only=False)
        elif trainer.is_global_zero:
            tmp = last.with_name(f".{last.name}.tmp{os.getpid()}")
            tmp.unlink(missing_ok=True)
            os.link(step_path, tmp)
            os.replace(tmp, last)
        if self.keep and trainer.is_global_zero:
            steps = sorted(self.dirpath.glob("step*.ckpt"), key=lambda p: int(p.stem.removeprefix("step")))
            for old in steps[: -self.keep]:  # last.ckpt is a link of its own (or a copy): unaffected
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        self.saved_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step % self.every == 0 and step % self.val_every != 0:
            self.save(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking and trainer.global_step % self.every == 0:
            self.save(trainer)


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (torch CPU/CUDA, numpy, python), as plain values."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate(state["python"])


def load_model(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[DecoderLM, Config]:
    """Rebuild the model saved in a training checkpoint and load its weights (e.g. for lm/generate.py)."""
    ckpt = torch.load(path, map_location=map_location, weights_only=False)
    cfg = from_dict(ckpt["config"])
    model = build_model(cfg.model)
    prefix = "model."
    model.load_state_dict({k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)})
    return model, cfg
