"""The training optimizer: AdamW (MoSA App. H trains with Adam: weight decay 0 by default, OptimConfig)."""
from __future__ import annotations

import torch
from torch import nn

from lm.config import OptimConfig


def adamw(model: nn.Module, o: OptimConfig, fused: bool = True) -> torch.optim.AdamW:
    """AdamW over the trainable parameters in two groups: weight decay on those of two or more dimensions (weight
    matrices, embeddings, convolution filters and agent attention's bias tables), none on vectors (norms, biases). The
    groups' layout is part of every checkpoint's optimizer state: changing it would stop older runs from resuming.

    `fused`: torch's fused kernel (CPU and CUDA), one pass over each parameter's tensors per step, where the default
    (foreach on CUDA, a loop over parameters on CPU) makes a pass per operation. On the CPU machine, one thread: a
    40M-parameter step took 0.052 s instead of 0.29 s, and in a profile of the IsoFLOP Tiny MoSA model's training step
    (242M parameters, batch 2, 2026-12-01) the default's step was 22% of the whole. On fp32 parameters the two agree to
    rounding; on bf16 ones (trainer.precision bf16-true) the fused kernel computes in fp32 and rounds once per step,
    where the default rounded after every operation. Not under a GradScaler (16-mixed: LMModule.configure_optimizers):
    Lightning leaves a fused optimizer's gradients scaled until its step, so the clipping would see them scaled.
    A checkpoint of an optimizer without the fused kernel (all before 2026-12-01) resumes with its own param groups,
    so with its own kernel: the run continues as it would have."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), fused=fused)
