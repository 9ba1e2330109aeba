"""Causal MoSA selection: a per-head threshold on the router logit with a fixed capacity.

In the spirit of Mixture-of-Depths' causal sampling: token t is selected for head h iff
    (a) its router logit s_th = x_t . W^r_h exceeds the head's threshold tau_h, and
    (b) fewer than `capacity` earlier tokens of the sequence were selected (earliest-first overflow).
tau_h is state, not a function of the current sequence: a running estimate of the (1 - 1/ρ)
quantile of head h's router logits, updated (EMA over training batches, after the forward pass that
used the old value) so that on average a 1/ρ fraction of tokens passes. The decision for token t is
therefore computable from x_t, tau and a counter, exactly what autoregressive decoding has; the
training-time selection is the decoding-time selection. A threshold on the logit is a threshold on
the sigmoid score r = σ(s), since σ is monotone.
"""
from __future__ import annotations

import math

import torch

from routing.distributed import all_gather_cat
from routing.float32_state import Float32Buffers


class RunningQuantileThreshold(Float32Buffers):
    """tau[H]: EMA of the batch (1 - fraction)-quantile of each head's router logits (fp32 even in a bf16 model)."""

    def __init__(self, heads: int, fraction: float, momentum: float) -> None:
        super().__init__()
        self.fraction, self.momentum = fraction, momentum
        self.register_buffer("tau", torch.zeros(heads))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))

    def above(self, logits: torch.Tensor) -> torch.Tensor:
        """logits[B, H, T] -> bool[B, H, T]: s_th > tau_h."""
        return logits > self.tau[:, None]

    @torch.no_grad()
    def update(self, logits: torch.Tensor) -> None:
        """Move tau toward this batch's (1 - fraction)-quantile per head (first call: set it). Under
        DDP/DeepSpeed the quantile is of the global batch (every rank's logits gathered)."""
        per_head = logits.detach().transpose(0, 1).reshape(logits.shape[1], -1).float()  # [H, B*T]
        per_head = all_gather_cat(per_head, dim=1)  # [H, ranks*B*T]
        n = per_head.shape[1]
        rank = min(max(math.ceil((1.0 - self.fraction) * n), 1), n)
        q = per_head.kthvalue(rank, dim=1).values.to(self.tau.dtype)
        self.tau.copy_(torch.where(self.initialized, self.tau.lerp(q, self.momentum), q))  # no host sync
        self.initialized.fill_(True)
