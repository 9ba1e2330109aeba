"""Build the Lightning Trainer for a Config and run training (used by train_lm.py and quickstart.py).

Outputs under `trainer.out_dir`: `config.yaml`, `run.json`, `tokenizer.model` (lm/run_dir.py),
`tb/` (TensorBoard), `checkpoints/step<N>.ckpt` every `trainer.ckpt_every` steps and at the end (the
newest `trainer.keep_last_k`), `checkpoints/last.ckpt` (the newest), `metrics.json`.
"""
from __future__ import annotations

import logging
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
import torch
from lightning.pytorch.profilers import Profiler, PyTorchProfiler, SimpleProfiler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import OmegaConf
from torch.profiler import ProfilerActivity

from data_prep.atomic import remove_temp_files
from heads import ConfigError
from lm.accumulation import FinalStepValidates, StepTimer
from lm.checkpoint import (CONSOLIDATED, AtomicCheckpointIO, CheckpointError, StepCheckpoints, newest_deepspeed,
                           newest_loadable, read_checkpoint, read_deepspeed, set_aside_after, step_files)
from lm.config import Config, TrainerConfig
from lm.data import LMDataModule
from lm.devices import build_strategy, check_devices, check_host_memory, lightning_accelerator, resolve_precision
from lm.dead_gradients import DeadGradientCheck
from lm.errors import Interrupted
from lm.module import LMModule
from lm.nonfinite import NonFiniteGuard
from lm.plots import plot_val_curves
from lm.preemption import Preemption, received_sigterm, stop_signal
from lm.progress_bar import progress_bars
from lm.run_dir import claim, missing_tokenizer, tokenizer_sha256
from lm.run_files import read_json
from lm.step_logger import StepLogger


@rank_zero_only
def say(message: str) -> None:
    """One line to stderr, from rank 0 only."""
    print(message, file=sys.stderr)


def ckpt_dir(cfg: Config) -> Path:
    return Path(cfg.trainer.out_dir) / "checkpoints"


def tensorboard_logger(cfg: Config, resumed_step: int | None = None) -> StepLogger:
    """`<out_dir>/tb`, whose hparams.yaml holds the resolved run config; x = optimizer steps (lm/step_logger.py).
    Resumed from step S, TensorBoard purges the values an interrupted run logged at x > S (after its checkpoint),
    which the resumed run logs again (S = -1: a --resume that found no checkpoint and starts again purges all)."""
    purge = {} if resumed_step is None else {"purge_step": resumed_step + 1}
    logger = StepLogger(cfg.trainer.out_dir, name="tb", version="", default_hp_metric=False, **purge)
    logger.log_hyperparams(OmegaConf.to_container(OmegaConf.structured(cfg)))  # type: ignore[arg-type]
    return logger


def newest_checkpoint(cfg: Config, skipping: Callable[[Path, str], None]) -> tuple[Path, dict[str, Any]] | None:
    """The run's newest loadable checkpoint and its contents (under DeepSpeed, which writes directories: the newest
    complete checkpoint directory); `skipping(path, why)` for each damaged one passed over."""
    if cfg.trainer.strategy == "deepspeed_stage_2":
        return newest_deepspeed(ckpt_dir(cfg), skipping)
    return newest_loadable(ckpt_dir(cfg), skipping)


def last_finite(cfg: Config) -> Path | None:
    """The checkpoint a run stopped by the non-finite guard can resume from (all saved weights are finite)."""
    found = newest_checkpoint(cfg, lambda *_: None)
    return found[0] if found else None


class _PyTorchProfiler(PyTorchProfiler):
    """Lightning's PyTorchProfiler, with an empty report for a stage that recorded nothing (a validation of no more
    batches than the schedule skips and warms up): torch's profiler raised an AssertionError there, ending the run."""

    def _cache_functions_events(self) -> None:
        if isinstance(self.profiler, torch.profiler.profile) and self.profiler.profiler is None:  # never started
            self.function_events = None
            return
        super()._cache_functions_events()


def build_profiler(t: TrainerConfig) -> Profiler | None:
    """`trainer.profiler`, written to `<out_dir>/profile`: `simple` = Lightning's SimpleProfiler (wall time per
    training hook, whole run); `pytorch` = its PyTorchProfiler with the default schedule (skip 1 step, warm up
    1, record 3): per-operator CPU (and CUDA) time and memory as a table, and a trace for TensorBoard's profile
    plugin or Perfetto / chrome://tracing. CUDA is recorded, and the table sorted by CUDA time, only when the run
    trains on CUDA (Lightning's default does both whenever a GPU exists: a CPU run's table was then sorted by zeros)."""
    if t.profiler is None:
        return None
    out = Path(t.out_dir) / "profile"
    if t.profiler == "simple":
        return SimpleProfiler(dirpath=out, filename="simple")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if lightning_accelerator(t) == "cuda" else [])
    return _PyTorchProfiler(dirpath=out, filename="pytorch", profile_memory=True, activities=activities)


class _NoAdverts(logging.Filter):
    """Drops Lightning's "💡 Tip: ... try installing litlogger / litmodels" lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip")


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoAdverts())
# Lightning 2.6's own pytree helper on torch >= 2.13: a deprecation of torch's API that Lightning uses, not ours
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
# DeepSpeed: our configure_gradient_clipping finds no gradients there and does nothing; the engine clips at
# gradient_clipping = optim.grad_clip (deepspeed_config), as this warning advises, and its norm is logged (lm/module.py)
warnings.filterwarnings("ignore", message=r"Since DeepSpeed handles gradient clipping internally")


def model_line(cfg: Config, module: L.LightningModule) -> str:
    """One line on the model, instead of Lightning's model summary (whose FLOPs column reads 0 without an example
    input; App. C's counts: python -m flops.isoflop, flops.model)."""
    m = cfg.model
    mixes = dict.fromkeys(m.mix_text(layer) for layer in range(m.n_layers))
    params = sum(p.numel() for p in module.parameters())
    return (f"model: {params:,} parameters; {m.n_layers} layers, d_model {m.d_model}, heads per layer "
            f"{' | '.join(mixes)} (head_dim {m.head_dim}); T = {m.seq_len}")


def validates_in_fit(cfg: Config) -> bool:
    """Whether the last step is validated inside fit (lm.accumulation.FinalStepValidates): under DeepSpeed, whose
    engine a `trainer.validate` after fit replaces; elsewhere `fit_and_finish` validates it after fit, if need be."""
    return cfg.trainer.strategy == "deepspeed_stage_2"


def build_trainer(cfg: Config, checkpoints: StepCheckpoints, strategy: Any, resumed_step: int | None = None) -> L.Trainer:
    """The Lightning Trainer of a run; `strategy` from build_strategy(cfg), after check_devices; `resumed_step`:
    the step of the checkpoint it continues from (TensorBoard purges what was logged after it)."""
    t = cfg.trainer
    deepspeed = t.strategy == "deepspeed_stage_2"
    timer = [] if t.max_minutes is None else [StepTimer(timedelta(minutes=t.max_minutes), interval="step")]
    logger = tensorboard_logger(cfg, resumed_step)
    trainer = L.Trainer(
        accelerator=lightning_accelerator(t), devices=t.devices, num_nodes=t.num_nodes, strategy=strategy,
        precision=resolve_precision(t),  # type: ignore[arg-type]
        max_steps=t.max_steps, accumulate_grad_batches=t.accumulate_grad_batches,
        val_check_interval=t.val_every * t.accumulate_grad_batches,  # counted in (micro-)batches
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0, log_every_n_steps=t.log_every,
        deterministic=t.deterministic,  # torch.use_deterministic_algorithms; the fused kernels follow it
        enable_progress_bar=sys.stderr.isatty(),  # no bar frames in log files (the validation lines remain)
        gradient_clip_val=cfg.optim.grad_clip, gradient_clip_algorithm="norm",
        logger=logger, profiler=build_profiler(t),
        # the guard runs first: a bad update is dropped or stops the run before anything is saved; Preemption
        # after the checkpoints: it saves a step only if they did not
        callbacks=[NonFiniteGuard(t.max_bad_steps, lambda: last_finite(cfg), deepspeed=deepspeed,
                                  engine_skips=deepspeed and not resolve_precision(t).startswith("16")),
                   DeadGradientCheck(), checkpoints,
                   Preemption(checkpoints), *timer,
                   *([FinalStepValidates()] if validates_in_fit(cfg) else []), *progress_bars(sys.stderr.isatty())],
        enable_checkpointing=False, default_root_dir=t.out_dir, enable_model_summary=False,  # lm.train.model_line
        use_distributed_sampler=False,  # the loaders split over ranks themselves (lm/data.py), each window once
        # DeepSpeed writes its own sharded checkpoint directories.
        plugins=None if deepspeed else [AtomicCheckpointIO()],
    )
    logger.trainer = trainer
    return trainer


class ResumePoint(NamedTuple):
    path: str  # the checkpoint file (or DeepSpeed directory)
    step: int  # its optimizer step


def resume_path(cfg: Config, resume: str | None) -> ResumePoint | None:
    """`resume="last"` (--resume) -> the newest loadable checkpoint of this run (under DeepSpeed: the newest
    complete checkpoint directory), saying which damaged ones it passed over (None, i.e. a fresh start, if there is
    none yet); a path (--resume-from PATH) -> that path,
    which must load (under DeepSpeed, a complete checkpoint directory: `read_deepspeed`). The checkpoint's model
    config, compression section (present or not), tokenizer and trainer.accumulate_grad_batches must equal this run's.
    Other data with the same tokenizer is allowed (continued pretraining)."""
    if resume is None:
        return None
    flag = "--resume" if resume == "last" else "--resume-from"

    def skipping(path: Path, why: str) -> None:
        say(f"warning: --resume: skipping {path.name}: {why}")

    deepspeed = cfg.trainer.strategy == "deepspeed_stage_2"  # DeepSpeed writes directories
    if resume == "last":
        found = newest_checkpoint(cfg, skipping)
        if found is None:
            other = [p for p in step_files(ckpt_dir(cfg)) if p.is_dir() != deepspeed]  # the other strategy's kind
            if other:  # (it used to start from scratch, then fail to write over the first same-named step)
                raise ConfigError(
                    f"--resume: {ckpt_dir(cfg)} holds DeepSpeed checkpoint directories ({other[0].name}, ...), which "
                    f"trainer.strategy={cfg.trainer.strategy} cannot load: resume with "
                    "trainer.strategy=deepspeed_stage_2"
                    if not deepspeed else
                    f"--resume: {ckpt_dir(cfg)} holds checkpoint files ({other[0].name}, ...) of another strategy, and "
                    "DeepSpeed loads only its own checkpoint directories: resume with the strategy that wrote them")
            kind = "complete DeepSpeed" if deepspeed else "loadable"
            say(f"--resume: no {kind} checkpoint in {ckpt_dir(cfg)} yet; starting from scratch")
            return None
        path, ckpt = found
    else:
        path = Path(resume)
        if path.is_dir() and not deepspeed:
            raise ConfigError(f"{flag}: {path} is a directory, not a .ckpt file (only DeepSpeed writes "
                              f"checkpoints as directories; this run's trainer.strategy is "
                              f"{cfg.trainer.strategy}); give a .ckpt file")
        if path.is_file() and deepspeed:
            raise ConfigError(f"{flag}: {path} is a checkpoint file, and DeepSpeed (trainer.strategy="
                              "deepspeed_stage_2) loads only its own checkpoint directories: resume with the strategy "
                              "that wrote it")
        try:  # a DeepSpeed directory: its entries besides the shards, for the checks below
            ckpt = read_deepspeed(path) if path.is_dir() else read_checkpoint(path)
        except CheckpointError as err:
            raise ConfigError(f"{flag}: {err}") from None
    if CONSOLIDATED in ckpt:
        raise ConfigError(f"{flag}: {path} holds weights only (lm.consolidate made it of the DeepSpeed checkpoint "
                          f"{ckpt[CONSOLIDATED]}, without optimizer state): resume from that directory")
    compressed, here = ckpt["config"].get("compression") is not None, cfg.compression is not None
    if compressed != here:
        raise ConfigError(f"{flag}: {path} is {'a compressed' if compressed else 'a plain'} model's checkpoint and this "
                          f"run trains {'a compressed' if here else 'a plain'} one (python -m lm.compressed_training for "
                          "a config with a compression section, train_lm.py for one without)")
    saved_tokenizer = (ckpt.get("run") or {}).get("tokenizer_sha256")
    current = tokenizer_sha256(Path(cfg.data.path).resolve())  # None: shards without their tokenizer, not checkable
    if saved_tokenizer and current and saved_tokenizer != current:
        raise ConfigError(f"{flag}: {path} was trained with another tokenizer (sha256 {saved_tokenizer[:12]}; data.path "
                          f"{cfg.data.path} has {str(current)[:12]}): its token ids mean other text")
    saved = ckpt["config"]["model"]
    current = OmegaConf.to_container(OmegaConf.structured(cfg.model))
    differ = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))  # type: ignore[union-attr]
    if differ:
        raise ConfigError(f"{flag}: {path} was trained with different model.{', model.'.join(differ)}")
    accumulate = ckpt["config"]["trainer"].get("accumulate_grad_batches", 1)
    if accumulate != cfg.trainer.accumulate_grad_batches:  # lm/run_dir.py: RESUMABLE
        raise ConfigError(f"{flag}: {path} was trained with trainer.accumulate_grad_batches={accumulate}, which "
                          f"cannot change on resume")
    say(f"{flag}: continuing from {path}")
    return ResumePoint(str(path), int(ckpt.get("global_step", 0)))


@contextmanager
def sigterm_interrupts(trainer: L.Trainer, finish: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Around trainer.fit / trainer.validate: a SIGTERM becomes Interrupted, rather than a run that looks finished.
    Training stops after a step, checkpointed (lm/preemption.py); a signal that came after the last step's check,
    or during a validation (which runs to its end), is agreed on by the ranks once the call has ended, and
    `finish()` (checkpointing what that call completed) runs before the stop."""
    try:
        yield
    except SIGTERMException:
        pass  # the agreed stop after a step, already checkpointed (or Lightning's own, before Preemption took over)
    else:
        if not trainer.strategy.reduce_boolean_decision(received_sigterm(trainer), all=False):
            return
        finish()
    signum = stop_signal(trainer)
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signum.name
    raise Interrupted(f"stopped by {name} at step {trainer.global_step} of {trainer.max_steps}; continue from the "
                      "newest checkpoint with --resume", signum)


def start_run(cfg: Config, data: LMDataModule, make_module: Callable[[Config], L.LightningModule], resume: str | None,
              overwrite: bool) -> tuple[L.LightningModule, L.Trainer, StepCheckpoints, str | None]:
    """What every training entry point does before fitting: check the data and the devices (one-line errors before
    any Lightning set-up, and before the run directory is claimed; so is a --resume-from checkpoint), claim
    trainer.out_dir (lm/run_dir.py), remove temp files an interrupted write left, find the checkpoint to resume from
    (a --resume-from that rewinds sets the abandoned steps' checkpoints aside), seed, build the module (one model
    line) and the Trainer (TensorBoard drops what an interrupted run logged after the checkpoint). Returns (module, trainer, its StepCheckpoints,
    the checkpoint path or None)."""
    data.check()
    check_devices(cfg.trainer)
    check_host_memory(cfg)
    strategy = build_strategy(cfg)  # a start refused by these checks leaves trainer.out_dir unclaimed
    # so does a --resume-from checkpoint that is missing or does not fit (claim rewrites the run's config and record)
    point = resume_path(cfg, resume) if resume != "last" else None
    claim(cfg, resume is not None, overwrite)
    if rank_zero_only.rank == 0:
        for path in remove_temp_files(ckpt_dir(cfg)) + remove_temp_files(Path(cfg.trainer.out_dir)):
            say(f"warning: removed {path}, left by an interrupted write")
    if resume == "last":  # the newest checkpoint of the claimed directory
        point = resume_path(cfg, resume)
    if point is not None and resume != "last" and rank_zero_only.rank == 0:
        moved = set_aside_after(ckpt_dir(cfg), point.step, Path(point.path))
        if moved:
            say(f"--resume-from: moved the checkpoints of steps after {point.step} ({', '.join(p.name for p in moved)}), "
                f"a timeline this run abandons, to {moved[0].parent}")
    L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    module = make_module(cfg)
    say(model_line(cfg, module))
    if (note := missing_tokenizer(Path(cfg.data.path).resolve())) is not None:  # after every check that can refuse
        say(f"warning: {note}")
    t = cfg.trainer
    checkpoints = StepCheckpoints(ckpt_dir(cfg), t.ckpt_every, t.val_every, link_last=t.strategy != "deepspeed_stage_2",
                                  keep=t.keep_last_k, final_in_fit=validates_in_fit(cfg))
    # --resume without a checkpoint yet starts again: TensorBoard drops everything the killed run logged (step >= 0)
    resumed = point.step if point is not None else (-1 if resume is not None else None)
    trainer = build_trainer(cfg, checkpoints, strategy, resumed)
    return module, trainer, checkpoints, None if point is None else point.path


@contextmanager
def process_group_released() -> Iterator[None]:
    """Within: a training entry point's work; on the way out, the default process group it created (Lightning's
    DDP or DeepSpeed set-up) is destroyed, not one the caller made before (e.g. under torchrun). Left to the
    interpreter's exit, a gloo group now and then aborts a finished run ('terminate called without an active
    exception', exit status -6 instead of 0)."""
    distributed = torch.distributed.is_available()
    ours = distributed and not torch.distributed.is_initialized()
    try:
        yield
    finally:
        if ours and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def fit_and_finish(trainer: L.Trainer, module: LMModule, data: L.LightningDataModule, checkpoints: StepCheckpoints,
                   ckpt: str | None) -> None:
    """Fit to trainer.max_steps from `ckpt` (None: from scratch, after validating the untrained model if
    trainer.validate_first), validate the last step unless that is done (under DeepSpeed it is, inside fit:
    `validates_in_fit`), and checkpoint it (again after that validation, so that the checkpoint carries its
    result)."""
    def save_unsaved() -> None:
        if checkpoints.saved_step != trainer.global_step:
            checkpoints.save(trainer)

    if module.cfg.trainer.validate_first and ckpt is None:
        with sigterm_interrupts(trainer):
            trainer.validate(module, datamodule=data, verbose=False)

    with sigterm_interrupts(trainer, save_unsaved):
        trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    final_validation = not module.val_history or module.val_history[-1]["step"] != trainer.global_step
    if final_validation and checkpoints.final_in_fit:  # resumed from a checkpoint of the last step without it
        say(f"warning: step {trainer.global_step} is not validated: under DeepSpeed it is only inside fit (a "
            "trainer.validate after fit would replace the engine that saves the checkpoint)")
        final_validation = False
    if final_validation:
        with sigterm_interrupts(trainer, lambda: checkpoints.save(trainer)):  # the checkpoint then carries it
            trainer.validate(module, datamodule=data, verbose=False)
        checkpoints.save(trainer)
    else:
        save_unsaved()


def train(cfg: Config, resume: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Train to `trainer.max_steps` (continuing from a checkpoint if `resume`), validate and checkpoint the final
    step (fit_and_finish), and return the metrics written to metrics.json. The run directory must be new, or this
    run's (`resume`), or given up (`overwrite`): lm/run_dir.py. A config with a compression section is refused
    (lm/compressed_training.py trains those)."""
    if cfg.compression is not None:
        raise ConfigError("compression: this config adds compression layers, which train_lm.py does not train; "
                          "use python -m lm.compressed_training --config CONFIG")
    data = LMDataModule(cfg.data, cfg.model, cfg.trainer.seed)
    with process_group_released():
        module, trainer, checkpoints, ckpt = start_run(cfg, data, LMModule, resume, overwrite)
        fit_and_finish(trainer, module, data, checkpoints, ckpt)
    return finish_run(cfg, trainer, module)


def finish_run(cfg: Config, trainer: L.Trainer, module: LMModule) -> dict[str, Any]:
    """What every training entry point does after fitting: draw the validation curve (val_curve.png, from two
    validations on), print one line naming the run's outputs, and return the metrics written to metrics.json (the
    file's: a --resume of a finished run trains no step, and the module's own would read NaN loss and tokens/s).
    The profiler is closed first: the hooks of the last checkpoint's save had started torch's profiler again, left
    running until garbage collection closed it, in the middle of another profiled run of the same process (a
    segfault)."""
    trainer.profiler.teardown(stage=None)
    out = Path(cfg.trainer.out_dir)
    curve = None
    if trainer.is_global_zero:
        curve = plot_val_curves({"": module.val_history}, out / "val_curve.png", title=out.name)
    rank_zero_info(
        f"outputs: TensorBoard `tensorboard --logdir {out / 'tb'}` | checkpoint {ckpt_dir(cfg) / 'last.ckpt'} | "
        f"metrics {out / 'metrics.json'}" + (f" | curve {curve}" if curve else "")
    )
    return read_json(out / "metrics.json", module.metrics())
