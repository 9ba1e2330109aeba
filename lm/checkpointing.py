"""Activation checkpointing (`trainer.activation_checkpointing`): a block keeps only its input for backward
and recomputes its forward pass there (torch.utils.checkpoint, non-reentrant), trading about one more
forward pass of compute for the activations of every block.

A replayed forward pass must take the decisions the original took. RNG draws (MoSAIC's training
priorities) are replayed by torch.utils.checkpoint itself. Head state moved by training batches (MoSA's
running thresholds, Routing's k-means centroids; heads/base.py) was already moved by the original pass,
so the replay runs on a snapshot of the block's buffers taken before it, under `heads.base.frozen_state`
(no second update, no second collective under DDP), and the buffers are put back afterwards.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from heads.base import frozen_state


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.clone() for name, b in module.named_buffers()}


def _load(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(values[name])


def _replay_contexts(module: nn.Module) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """(around the forward pass: snapshot the buffers, around its replay: run on that snapshot, frozen)."""
    before: dict[str, torch.Tensor] = {}

    @contextmanager
    def forward() -> Iterator[None]:
        before.update(_buffers(module))
        yield

    @contextmanager
    def replay() -> Iterator[None]:
        now = _buffers(module)
        _load(module, before)
        try:
            with frozen_state():
                yield
        finally:
            _load(module, now)

    return forward(), replay()


def checkpointed(module: nn.Module, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """fn(*args) (a pass of `module`), keeping only the inputs for backward and replaying it there."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=partial(_replay_contexts, module))
