"""TensorBoard whose x axis is the optimizer step a value belongs to, counted from 1.

Lightning passes its loggers its own index: during training and in validations within fit, the 0-based index of
the step in progress (the values of the N-th step, and the validation after it, at x = N-1), but in a
validation on its own (trainer.validate: `trainer.validate_first`, the final validation) the number of steps taken (x =
N). So validations after the same number of steps landed one apart, and `train/tokens_seen` at x = N-1 read N
steps' tokens. Here every scalar is written at the trainer's step count when it is logged: x = N for the N-th
step's training values, for the validation after N steps (as on the console, in `stepN.ckpt` and in
metrics.json's history) and for the head statistics of the N-th step's forward pass (lm/module.py). An untrained
model's validation (`validate_first`) sits at x = 0. Values are flushed as they are logged, and a run resumed
from step S purges what was logged at x > S (lm.train.tensorboard_logger), so that TensorBoard shows every step
once after a kill and a resume.
"""
from __future__ import annotations

from collections.abc import Mapping

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger


class StepLogger(TensorBoardLogger):
    """A TensorBoardLogger writing scalars at `trainer.global_step` (module docstring); `trainer` is set once
    the Trainer exists (lm.train.build_trainer)."""

    trainer: L.Trainer | None = None

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics, step if self.trainer is None else self.trainer.global_step)
        self.experiment.flush()  # on disk at once: a run killed after its checkpoint keeps the values up to it
