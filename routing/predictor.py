"""Learned causal membership predictor (Mixture-of-Depths, Raposo et al. 2024, §3.5 "Sampling").

Expert choice (MoSA §2.2) keeps the k = T/ρ tokens with the highest router scores of the WHOLE
sequence, which a decoder cannot know at step t. As in Mixture-of-Depths' auxiliary predictor, a
small classifier on x_t alone, z_t = x_t · w^p_i + b_i per head i, is trained with binary
cross-entropy to predict whether token t is in head i's expert-choice top-k of the full sequence:
    L_pred = mean_t,i BCE(σ(z_ti), 1[t ∈ TopK(s_i, k)]),
with a stop-gradient on x and on the router logits s, so the predictor's loss never reaches the LM's
parameters (and lm/module.py clips the predictor's gradient apart from the LM's; DeepSpeed clips all together).
Its decision uses only x_t, so training-time and decoding-time selections are identical.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from routing.expert_choice import expert_choice


class MembershipPredictor(nn.Module):
    """z[B, H, T] = stopgrad(x) W^p + b: per-head logit of "token t is in the top-k of the sequence"."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x[B, T, h] -> z[B, H, T] (x is detached: the predictor does not train the model)."""
        return self.proj(x.detach()).transpose(1, 2)


def topk_targets(router_logits: torch.Tensor, k: int) -> torch.Tensor:
    """1.0 where token t is in its row's expert-choice top-k of router_logits[..., T], else 0.0."""
    sel = expert_choice(router_logits.detach(), k)
    return torch.zeros_like(router_logits, dtype=torch.float).scatter(-1, sel.idx, 1.0)


def predictor_loss(z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """L_pred: mean binary cross-entropy of the predictor logits z against the top-k membership."""
    return F.binary_cross_entropy_with_logits(z.float(), targets)
