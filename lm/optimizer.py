"""The training optimizer: AdamW (MoSA App. H trains with Adam: weight decay 0 by default, OptimConfig)."""
from __future__ import annotations

import torch
from torch import nn

from lm.config import OptimConfig


def adamw(model: nn.Module, o: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters in two groups: weight decay on those of two or more dimensions (weight
    matrices, embeddings, convolution filters and agent attention's bias tables), none on vectors (norms). The groups'
    layout is part of every checkpoint's optimizer state: changing it would stop older runs from resuming.

    torch's fused kernel (fused=True, CPU and CUDA): one pass over each parameter's tensors per step. The default
    (foreach on CUDA, a loop over parameters on CPU) makes a pass per operation: on the CPU machine the IsoFLOP Tiny
    MoSA model's 242M parameters took 22% of its training step (bench/results/resources_cpu.md), a 40M-parameter
    step 0.29 s instead of 0.052 s. A checkpoint written before 2026-12-01 resumes with its own setting (foreach or
    the loop): a resumed run continues as it would have."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), fused=True)
