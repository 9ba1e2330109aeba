"""Activation checkpointing (`trainer.activation_checkpointing`): a block keeps only its input for backward
and recomputes its forward pass there (torch.utils.checkpoint, non-reentrant), trading about one more
forward pass of compute for the activations of every block.

A replayed forward pass must take the decisions the original took. RNG draws (MoSAIC's training
priorities) are replayed by torch.utils.checkpoint itself. Head state moved by training batches (MoSA's
running thresholds, Routing's k-means centroids) only moves after the optimizer step (heads/base.py), so the
replay reads what the original read; it runs under `heads.base.frozen_state` so that it does not stage the
batch's statistics a second time.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from heads.base import frozen_state


def checkpointed(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """fn(*args), keeping only the inputs for backward and replaying it there."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: (nullcontext(), frozen_state()))
