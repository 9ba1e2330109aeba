"""The training progress bar: Lightning's Rich bar, described by steps rather than epochs.

A run is `trainer.max_steps` long; Lightning's own description counts epochs against `max_epochs`, which is unset,
and reads "Epoch 0/-2". Metrics show 5 significant digits (tokens/s as 16907, not 16907.105). Without the `rich`
package Lightning's default (tqdm) bar is used.
"""
from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE


class StepProgressBar(RichProgressBar):
    """The bar over the whole run's micro-batches (max_steps x accumulate_grad_batches), labelled "train". Lightning's
    total is the train loader's length, which on a resume is the remaining batches while the count continues from
    the restored position ("40/9")."""

    def __init__(self) -> None:
        super().__init__(theme=RichProgressBarTheme(metrics_format=".5g"))

    @property
    def total_train_batches(self) -> int:
        return self.trainer.max_steps * self.trainer.accumulate_grad_batches

    def _get_train_description(self, current_epoch: int) -> str:  # Lightning's hook for the bar's label
        return f"{'train':{len(self.validation_description)}}"  # padded as Lightning's: no flicker between the bars


def progress_bars(enabled: bool) -> list[L.Callback]:
    """The bar callback for a Trainer: StepProgressBar when enabled and `rich` is installed, else none (Lightning's
    default bar, or no bar when the Trainer's enable_progress_bar is False)."""
    return [StepProgressBar()] if enabled and _RICH_AVAILABLE else []
