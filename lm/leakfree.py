"""Leak-free evaluation (DESIGN.md "Causality, stated once"): every prediction from its own prefix only.

The logits for position t are the last-position logits of the model run on tokens[:, :t+1] alone, so
any selection that ranks tokens over the sequence (MoSA expert choice, balanced Routing-Transformer
clusters) is recomputed on the prefix (with k = max(floor((t+1)/ρ), 2), MoSA App. F). For a causal
model this equals ordinary teacher-forced evaluation; for a leaky one it is the honest number.
Cost: sum over t of a length-(t+1) forward pass, about T/2 ordinary passes: fine for short sequences.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from lm.perplexity import perplexity


@torch.no_grad()
def leak_free_logits(model: nn.Module, tokens: torch.Tensor, positions: Iterable[int] | None = None) -> torch.Tensor:
    """tokens[B, T] -> logits[B, len(positions), V]; row j is the prediction at positions[j]
    (default: every position) computed from tokens[:, :positions[j] + 1] only. Runs in eval mode."""
    T = tokens.shape[1]
    wanted = list(range(T)) if positions is None else list(positions)
    if any(not 0 <= t < T for t in wanted):
        raise ValueError(f"leak_free_logits: positions must lie in [0, {T})")
    was_training = model.training
    model.eval()
    try:
        return torch.stack([model(tokens[:, : t + 1])[:, -1] for t in wanted], dim=1)
    finally:
        model.train(was_training)


@torch.no_grad()
def evaluate(model: nn.Module, windows: Iterable[torch.Tensor], leak_free: bool = True) -> dict[str, float]:
    """Mean next-token loss and perplexity over windows[N, T+1] (inputs = w[:, :-1], targets = w[:, 1:]),
    teacher-forced (`loss`, `ppl`) and, if leak_free, from prefixes only (`leakfree_loss`, `leakfree_ppl`)."""
    was_training = model.training
    model.eval()
    total, total_lf, count = 0.0, 0.0, 0
    try:
        for w in windows:
            inputs, targets = w[:, :-1], w[:, 1:]
            logits = model(inputs)
            total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            if leak_free:
                lf = leak_free_logits(model, inputs)
                total_lf += F.cross_entropy(lf.flatten(0, 1), targets.flatten(), reduction="sum").item()
            count += targets.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate: no windows given")
    out = {"loss": total / count, "ppl": perplexity(total / count)}
    if leak_free:
        out.update(leakfree_loss=total_lf / count, leakfree_ppl=perplexity(total_lf / count))
    return out
