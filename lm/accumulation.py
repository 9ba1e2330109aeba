"""Gradient accumulation (`trainer.accumulate_grad_batches` = A): Lightning runs A micro-batches of
`data.batch_size` per device, backward after each (the loss divided by A), then one optimizer step.

Everything that acts "per step" acts once per step: the step checkpoints and the time limit
(`StepTimer`) after the micro-batch that ends it (`ends_step`), the head statistics on its first
micro-batch (`micro_index` 0). So no checkpoint ever holds a half-accumulated step, and a resumed run
continues in step with the data order (lm/data.py). Stateful heads (MoSA's running threshold, Routing's
k-means centroids) stage every micro-batch's statistics and move once per step, after it (heads/base.py).
`FinalStepValidates` (DeepSpeed) stops fit after the micro-batch that ends step max_steps, so that Lightning
validates that step inside fit.
"""
from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Timer


def micro_index(trainer: L.Trainer, batch_idx: int) -> int:
    """The place of training batch `batch_idx` (counted over the whole run) in its optimizer step: 0 .. A-1."""
    return batch_idx % trainer.accumulate_grad_batches


def ends_step(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether training batch `batch_idx` is the last micro-batch of its optimizer step."""
    return micro_index(trainer, batch_idx) == trainer.accumulate_grad_batches - 1


class StepTimer(Timer):
    """Lightning's Timer (`trainer.max_minutes`, checked after training batches), checked only after a
    micro-batch that ended an optimizer step."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if ends_step(trainer, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class FinalStepValidates(L.Callback):
    """Stop fit after the micro-batch that ends step `max_steps` (`trainer.should_stop`), so that Lightning validates
    that step inside fit, as it does when its Timer stops a run, instead of a `trainer.validate` after it. Used under
    DeepSpeed, where that call builds a second, inference-only engine whose checkpoint save then fails (bf16: its dummy
    optimizer has no state_dict) or writes a directory DeepSpeed's zero_to_fp32 cannot read (fp32: no param_shapes)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if ends_step(trainer, batch_idx) and trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True
