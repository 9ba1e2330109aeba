"""A one-time check that every parameter gets a gradient: a silent training failure made loud.

A parameter whose gradient is exactly zero everywhere does not train, and the loss barely shows it when
other parameters carry the model (bench/results/compat_torch211.md: compiled MoSA heads on torch 2.11 got
zero gradients for 80 steps while the validation loss stayed within 0.001 of eager's). At the first
optimizer step of a process the check names such parameters in one `warning:` line (one device sync,
once). Parameters without a gradient tensor (DeepSpeed keeps its own partitions, or the parameter is
unused) are not judged.
"""
from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lm.nonfinite import owner
from lm.sanity import warn


def zero_gradient_params(module: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters whose gradient exists and is exactly zero everywhere."""
    named = [(n, p.grad) for n, p in module.named_parameters() if p.requires_grad and p.grad is not None]
    if not named:
        return []
    zero = torch.stack([g.abs().amax() for _, g in named]).eq(0).tolist()  # one device sync
    return [n for (n, _), z in zip(named, zero) if z]


class DeadGradientCheck(L.Callback):
    """Warn once, at this process's first optimizer step, about parameters with an all-zero gradient."""

    def __init__(self) -> None:
        self.done = False

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.done:
            return
        self.done = True
        dead = zero_gradient_params(pl_module)
        if dead:
            named = ", ".join(owner(pl_module, n) for n in dead[:3]) + (f", ... ({len(dead)} in all)" if len(dead) > 3 else "")
            warn(f"step {trainer.global_step + 1}: {len(dead)} parameter tensor(s) got an all-zero gradient and will "
                 f"not train: {named}")
