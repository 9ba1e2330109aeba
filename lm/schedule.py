"""Learning-rate schedule: MoSA App. H's linear warmup, then a cosine decay to a floor (ours: the paper states no
decay; min_lr_ratio = 1 keeps the peak rate after the warmup).

factor(s) = (s + 1) / W                                            for s < W
          = r + (1 - r) * (1 + cos(pi * min(1, (s - W) / (S - W)))) / 2   otherwise,
with W = optim.warmup_steps, S = trainer.max_steps, r = optim.min_lr_ratio; lr(s) = optim.lr * factor(s).
"""
from __future__ import annotations

import math


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
