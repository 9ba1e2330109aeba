"""Checkpoint files: atomic writes, RNG state, checking and choosing checkpoints, rebuilding a model.

A checkpoint is Lightning's dict (state_dict, optimizer/scheduler states, loop state) plus
`config` (the full run Config as plain values, so `load_model` can rebuild the model) and `rng`
(every RNG state, so a resumed run continues exactly as an uninterrupted one).

Every reader goes through `read_checkpoint`, which turns an empty, truncated, garbled (zip CRC
mismatch) or foreign file into a one-line CheckpointError; `newest_loadable` walks a run's step
files newest first past damaged ones (data_prep.atomic.remove_temp_files clears what a killed write left). Under
DeepSpeed a checkpoint is a directory of shards: `unmark` / `mark_complete` bracket each save, `read_deepspeed` reads
its rank-0 entries, `newest_deepspeed` picks the newest complete one (lm/consolidate.py makes one file of it).
"""
from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from data_prep.atomic import atomic_write, temp_path
from heads import ConfigError
from lm.accumulation import ends_step
from lm.config import Config
from lm.config_io import from_dict
from lm.errors import NonFiniteError
from lm.model import DecoderLM, build_model
from lm.nonfinite import first_nonfinite, owner

REQUIRED = ("state_dict", "config")  # what every train_lm.py checkpoint holds (besides Lightning's own state)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message is one line naming the file and the problem."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO whose saves go through `atomic_write`."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        atomic_write(path, lambda f: torch.save(checkpoint, f))


COMPLETE = "complete"  # the file rank 0 writes into a DeepSpeed checkpoint directory once every rank's shards are
CONSOLIDATED = "consolidated_from"  # in a checkpoint lm.consolidate made of a DeepSpeed directory: that directory


def is_deepspeed_dir(path: Path) -> bool:
    """Whether `path` is a DeepSpeed checkpoint directory (DeepSpeed's `latest` file names its tag)."""
    return path.is_dir() and (path / "latest").is_file()


def unmark(trainer: L.Trainer, path: Path) -> None:
    """Before checkpoint directory `path` is saved again (DeepSpeed's last.ckpt at every save; a step directory a
    resumed run saves again), rank 0 removes the previous save's `complete` mark, and no rank writes a shard before
    the barrier: a kill during the new save then leaves an unmarked directory, never a marked one with half-written
    shards."""
    if trainer.is_global_zero and path.is_dir():
        (path / COMPLETE).unlink(missing_ok=True)
    trainer.strategy.barrier()


def mark_complete(trainer: L.Trainer, path: Path) -> None:
    """After every rank has saved checkpoint directory `path` (DeepSpeed's shards), rank 0 writes `path/complete`
    atomically. DeepSpeed's own `latest` file is no such mark: rank 0 writes it after its own shards, before the
    barrier that waits for the other ranks', so a kill in between leaves `latest` beside a missing shard."""
    trainer.strategy.barrier()
    if trainer.is_global_zero and path.is_dir():
        note = f"step {trainer.global_step}, {trainer.world_size} rank(s)\n".encode()
        atomic_write(path / COMPLETE, lambda f: f.write(note))


class StepCheckpoints(L.Callback):
    """`step<N>.ckpt` every `every` optimizer steps, and `last.ckpt` pointing at the newest one; only
    the newest `keep` step checkpoints are kept (0: all).

    At a step that also validates, the checkpoint is written after the validation, so it carries
    that validation's result and a resumed run does not repeat it. `last.ckpt` is an atomic hard
    link to the step file (no second write), except for DeepSpeed, whose checkpoints are directories.
    Under gradient accumulation a checkpoint is written only after the micro-batch that ends its step. A SIGTERM
    also checkpoints the step it stops at (lm/preemption.py).
    """

    def __init__(self, dirpath: str | Path, every: int, val_every: int, link_last: bool = True, keep: int = 0,
                 final_in_fit: bool = False) -> None:
        self.dirpath, self.every, self.val_every, self.link_last = Path(dirpath), every, val_every, link_last
        self.keep, self.final_in_fit = keep, final_in_fit
        self.saved_step: int | None = None  # step of the newest checkpoint written by this process

    def validates(self, trainer: L.Trainer) -> bool:
        """Whether the step just taken is validated inside fit, before anything checkpoints it: every `val_every`
        steps, and the last one when `final_in_fit` (lm.accumulation.FinalStepValidates, under DeepSpeed)."""
        step = trainer.global_step
        return step % self.val_every == 0 or (self.final_in_fit and step >= trainer.max_steps)

    def save(self, trainer: L.Trainer) -> None:
        check_weights(trainer)
        step_path = self.dirpath / f"step{trainer.global_step:07d}.ckpt"
        last = self.dirpath / "last.ckpt"
        for path in [step_path] if self.link_last else [step_path, last]:
            unmark(trainer, path)
            trainer.save_checkpoint(path, weights_only=False)
            mark_complete(trainer, path)
        if self.link_last and trainer.is_global_zero:
            tmp = temp_path(last)
            tmp.unlink(missing_ok=True)
            os.link(step_path, tmp)
            os.replace(tmp, last)
        if self.keep and trainer.is_global_zero:
            for old in step_files(self.dirpath)[self.keep:]:  # last.ckpt is a link of its own (or a copy): unaffected
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        self.saved_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if ends_step(trainer, batch_idx) and trainer.global_step % self.every == 0 and not self.validates(trainer):
            self.save(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        if trainer.state.fn == "fit" and not trainer.sanity_checking and (step % self.every == 0
                                                                          or step >= trainer.max_steps):
            self.save(trainer)


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (torch CPU/CUDA, numpy, python), as plain values. CUDA: the generator
    of this process's own device, where the process uses CUDA (a CPU run on a GPU machine leaves CUDA unstarted: no
    context, no GPU memory). Only rank 0 writes the checkpoint, and every rank restores it: the ranks' streams are one
    (seed_everything gives them one seed, and they draw alike), each on its own device."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else [],
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]  # before 2026-11-29: a list, every device's state as rank 0 saw them, its own first
    if len(cuda) and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda[0] if isinstance(cuda, list) else cuda)  # into this process's device
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate(state["python"])


def check_weights(trainer: L.Trainer) -> None:
    """Refuse to checkpoint NaN/inf weights (lm/nonfinite.py guards the updates; this guards the files)."""
    module = trainer.lightning_module
    bad = first_nonfinite([(n, p.detach()) for n, p in module.named_parameters()])
    if bad is not None:
        raise NonFiniteError(f"non-finite weights after step {trainer.global_step} in {owner(module, bad)}; "
                             "not checkpointed (lower optim.lr)")


def read_torch_file(path: str | Path, what: str, map_location: str | torch.device = "cpu",
                    mmap: bool = False) -> Any:
    """Load a file written by torch.save (tensors and plain containers only, no pickled code), or raise a
    one-line CheckpointError naming `what` and the file: missing, empty, truncated, garbled (zip CRC
    mismatch) or foreign."""
    path = Path(path)
    if is_deepspeed_dir(path):
        raise CheckpointError(f"{what} {path} is a DeepSpeed checkpoint directory: make one file of it first, "
                              f"python -m lm.consolidate {path} OUT.ckpt")
    if path.is_dir():
        raise CheckpointError(f"{what} {path} is a directory, not a file (a run's checkpoints are "
                              f"checkpoints/step<N>.ckpt and checkpoints/last.ckpt inside it)")
    if not path.is_file():
        raise CheckpointError(f"{what} {path} not found")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{what} {path} is empty")
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()  # reads every record and checks its CRC-32
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise CheckpointError(f"{what} {path} is truncated or not a torch file ({err})") from None
    if damaged is not None:
        raise CheckpointError(f"{what} {path} is damaged (CRC mismatch in {damaged})")
    try:
        return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as err:  # torch's message: a paragraph of advice, the refused global in its middle
        refused = re.search(r"WeightsUnpickler error: ([^\n]*?)(\. |$)", str(err), re.M)
        raise CheckpointError(f"{what} {path} holds Python objects that only running code can load "
                              f"({refused.group(1) if refused else type(err).__name__}), not only tensors and plain "
                              "values as train_lm.py's checkpoints do; it is not read") from None
    except (RuntimeError, EOFError, ValueError) as err:
        raise CheckpointError(f"{what} {path} cannot be loaded ({(str(err).splitlines() or [''])[0]})") from None


def read_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", mmap: bool = True) -> dict[str, Any]:
    """Load a train_lm.py checkpoint (`read_torch_file`), or raise a one-line CheckpointError for an unreadable
    or foreign file."""
    ckpt = read_torch_file(path, "checkpoint", map_location, mmap)
    missing = [k for k in REQUIRED if not isinstance(ckpt, dict) or not isinstance(ckpt.get(k), dict)]
    if missing:
        raise CheckpointError(f"{path} is not a train_lm.py checkpoint (no {', '.join(missing)} mapping)")
    return ckpt


def read_deepspeed(path: str | Path) -> dict[str, Any]:
    """The entries of DeepSpeed checkpoint directory `path` besides its sharded weights and optimizer (what Lightning
    hands DeepSpeed as client state: config, run record, global_step, loop states), from the rank-0 model-states
    file of the tag `latest` names (memory-mapped); a one-line CheckpointError for a directory that is no complete
    DeepSpeed checkpoint of train_lm.py (no `latest`, no `complete` mark: an interrupted save)."""
    path = Path(path)
    if not is_deepspeed_dir(path):
        raise CheckpointError(f"{path} is not a DeepSpeed checkpoint directory (no 'latest' file in it)")
    if not (path / COMPLETE).is_file():
        raise CheckpointError(f"{path} is an incomplete DeepSpeed checkpoint (no '{COMPLETE}' file: its save was "
                              "interrupted); take an earlier one")
    states = path / (path / "latest").read_text().strip() / "mp_rank_00_model_states.pt"  # ZeRO-2's name
    ckpt = read_torch_file(states, "DeepSpeed checkpoint", mmap=True)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("config"), dict):
        raise CheckpointError(f"{path} is not a train_lm.py checkpoint (no config mapping in {states.name})")
    return ckpt


def step_number(path: Path) -> int | None:
    """N of a checkpoint named step<N>.ckpt (a file, or a DeepSpeed directory), else None (last.ckpt)."""
    digits = path.name.removeprefix("step").removesuffix(".ckpt")
    return int(digits) if digits.isdigit() else None


def step_files(directory: Path) -> list[Path]:
    """The `step<N>.ckpt` checkpoints of a run, newest (largest N) first."""
    steps = [p for p in directory.glob("step*.ckpt") if step_number(p) is not None]
    return sorted(steps, key=step_number, reverse=True)  # type: ignore[arg-type]


def set_aside_after(directory: Path, step: int, source: Path) -> list[Path]:
    """Move the step checkpoints after `step` (and then last.ckpt, which is the newest of them) into
    `directory/abandoned-after-step<step>/`: a --resume-from that rewinds starts another timeline, whose --resume
    and keep_last_k pruning must not take the old one's later files for its own. last.ckpt stays when it is the
    resumed checkpoint `source` (a kill between writing a step file and linking it leaves it older). Returns their
    new paths."""
    newer = [p for p in step_files(directory) if step_number(p) > step]  # type: ignore[operator]
    if not newer:
        return []
    last = directory / "last.ckpt"  # the newest step's link, copy or (DeepSpeed) directory: the old timeline's
    if last.exists() and not (source.exists() and os.path.samefile(last, source)):
        newer.append(last)
    dest = directory / f"abandoned-after-step{step:07d}"
    dest.mkdir(exist_ok=True)
    moved = []
    for path in newer:
        target = dest / path.name
        if target.is_dir():  # set aside by an earlier rewind to the same step
            shutil.rmtree(target)
        os.replace(path, target)
        moved.append(target)
    return moved


def newest_loadable(directory: Path, skipped: Callable[[Path, str], None]) -> tuple[Path, dict[str, Any]] | None:
    """(path, contents) of the newest checkpoint of a run that `read_checkpoint` accepts: step files newest
    first (a kill may land between writing one and linking last.ckpt), then last.ckpt; `skipped(path, why)`
    for each damaged one passed over. None if the run has none."""
    for path in [*step_files(directory), directory / "last.ckpt"]:
        if not path.is_file():
            continue
        try:
            return path, read_checkpoint(path)
        except CheckpointError as err:
            skipped(path, str(err))
    return None


def newest_deepspeed(directory: Path, skipped: Callable[[Path, str], None]) -> tuple[Path, dict[str, Any]] | None:
    """(path, entries) of the newest complete DeepSpeed checkpoint of a run that `read_deepspeed` accepts: its
    `step<N>.ckpt` directories newest first, then last.ckpt, the first holding the `complete` file written once every
    rank's shards are (`mark_complete`) and a readable rank-0 file; `skipped(path, why)` for each one passed over.
    None if the run has none."""
    for path in [*step_files(directory), directory / "last.ckpt"]:
        if not path.is_dir():
            continue
        try:
            return path, read_deepspeed(path)
        except CheckpointError as err:
            skipped(path, str(err))
    return None


def load_model(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[DecoderLM, Config]:
    """Rebuild the model saved in a training checkpoint and load its weights (e.g. for lm/generate.py)."""
    return model_from_checkpoint(read_checkpoint(path, map_location, mmap=False), path)


def model_from_checkpoint(ckpt: dict[str, Any], path: str | Path = "checkpoint") -> tuple[DecoderLM, Config]:
    """The model and config of a checkpoint already read from `path` with `read_checkpoint`; a CheckpointError for
    a compressed model's (lm/compressed_training.py), which is another model."""
    cfg = from_dict(ckpt["config"])
    if cfg.compression is not None:
        raise CheckpointError(f"{path} is a compressed model's checkpoint (lm.compressed_training): evaluate it with "
                              "python -m lm.compressed_evaluate, sample from it with python -m lm.compressed_generate")
    model = build_model(cfg.model)
    load_weights(model, ckpt, path)
    return model, cfg


def check_finite(model: torch.nn.Module, path: str | Path) -> None:
    """A one-line CheckpointError if a loaded model holds NaN/inf values (a diverged run's checkpoint): every sample
    and score from it would be NaN or garbage."""
    bad = first_nonfinite(list(model.state_dict().items()))
    if bad is not None:
        raise CheckpointError(f"{path}: {owner(model, bad)} holds NaN/inf values (a diverged run's checkpoint); use an "
                              "earlier one")


def load_weights(model: torch.nn.Module, ckpt: dict[str, Any], path: str | Path = "checkpoint") -> None:
    """The checkpoint's model weights into `model`; weights that do not fit its config (missing, extra or misshapen
    tensors) are a one-line CheckpointError naming the first problem, not load_state_dict's paragraph."""
    try:
        model.load_state_dict(model_weights(ckpt))
    except RuntimeError as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        problem = (f"its weights do not fit its model config ({lines[1][:200]})"
                   if lines[0].startswith("Error(s) in loading state_dict") and len(lines) > 1 else lines[0].split(". ")[0])
        raise CheckpointError(f"{path}: incompatible checkpoint: {problem}") from None


def model_weights(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's own state dict in a training checkpoint (the LightningModule's `model.` entries, prefix removed)."""
    prefix = "model."
    return {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
