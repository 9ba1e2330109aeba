"""Causal MoSA selection: a per-head threshold on the router logit with a fixed capacity.

In the spirit of Mixture-of-Depths' causal sampling: token t is selected for head h iff
    (a) its router logit s_th = x_t . W^r_h exceeds the head's threshold tau_h, and
    (b) fewer than `capacity` earlier tokens of the sequence were selected (earliest-first overflow).
tau_h is state, not a function of the current sequence: a running estimate of the (1 - 1/ρ)
quantile of head h's router logits, so that on average a 1/ρ fraction of tokens passes. The decision for
token t is therefore computable from x_t, tau and a counter, exactly what autoregressive decoding has; the
training-time selection is the decoding-time selection. A threshold on the logit is a threshold on
the sigmoid score r = σ(s), since σ is monotone.

The update is staged like the k-means centroids' (routing/kmeans.py): each training forward pass adds its
micro-batch's per-head quantile to `pending` (`stage`), and after the optimizer step `commit` moves tau by one
EMA step toward the mean of the quantiles staged since the last commit, over all ranks (routing/staged.py). So every micro-batch
of a step selects with the same tau; DDP / DeepSpeed over R ranks equals one process accumulating the same R
micro-batches (the mean of micro-batch quantiles, not the quantile of their union: one would need every logit
of the step; the two differ by the sampling error of a quantile of B*T logits); and the forward pass runs no
collective (one all-reduce of H + 1 numbers per step, at the commit).
"""
from __future__ import annotations

import math

import torch

from routing.capacity import decimal
from routing.staged import StagedStatistics


class RunningQuantileThreshold(StagedStatistics):
    """tau[H]: EMA over optimizer steps of each head's (1 - 1/sparsity)-quantile of its router logits (fp32 even
    in a bf16 model)."""

    def __init__(self, heads: int, sparsity: float, momentum: float) -> None:
        super().__init__()
        self.sparsity, self.momentum = sparsity, momentum
        rho = decimal(sparsity)  # ρ = p / q exactly, so that the quantile's rank is integer arithmetic (and traceable)
        self._rho_p, self._rho_q = rho.numerator, rho.denominator
        self.register_buffer("tau", torch.zeros(heads))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        self.stage_into(heads + 1)  # this step's sum of micro-batch quantiles [:heads] and their count [heads]

    def above(self, logits: torch.Tensor) -> torch.Tensor:
        """logits[B, H, T] -> bool[B, H, T]: s_th > tau_h; every token at ρ = 1, whose (1 - 1)-quantile,
        the running mean of batch minima, would drop the tokens below it."""
        if self.sparsity <= 1:
            return torch.ones_like(logits, dtype=torch.bool)
        return logits > self.tau[:, None]

    @torch.no_grad()
    def stage(self, logits: torch.Tensor) -> None:
        """Add this micro-batch's (1 - 1/ρ)-quantile of each head's logits[B, H, T] to `pending`: the midpoint
        between the order statistic of that rank and the next larger logit. `> tau` then keeps the same tokens of the
        batch as `> statistic`, but tau equals none of the logits it came from: after a commit that sets tau (the
        first, or momentum 1) no token's decision hinges on the last bit of its logit, which a one-token decoding
        step computes in another order than the full pass. When no logit is larger (the statistic is the maximum:
        tied top logits, e.g. a frequent token type's in the first layer), the midpoint with the next smaller one,
        so that the tied tokens pass (capacity caps them) instead of none; statistic - 1 when all are equal."""
        per_head = logits.detach().transpose(0, 1).reshape(logits.shape[1], -1).float()  # [H, B*T]
        n = per_head.shape[1]
        rank = min(max(n - n * self._rho_q // self._rho_p, 1), n)  # ceil((1 - 1/ρ) n) = n - floor(n q / p)
        top = per_head.topk(n - rank + 1, dim=1, sorted=False).values  # [H, n - rank + 1]: every logit >= the statistic
        stat = top.amin(1)  # [H]: the rank-th smallest (kthvalue, at half its time on CPU)
        larger = top.masked_fill(top <= stat[:, None], math.inf).amin(1)  # [H], inf: none larger (all are in top)
        smaller = per_head.masked_fill(per_head >= stat[:, None], -math.inf).amax(1)  # [H], -inf: none smaller
        below = torch.where(smaller.isfinite(), smaller + (stat - smaller) / 2, stat - 1)
        cut = torch.where(larger.isfinite(), stat + (larger - stat) / 2, below)
        self.pending[:-1] += cut.to(self.pending.dtype)
        self.pending[-1] += 1

    def update(self, staged: torch.Tensor) -> None:
        """One EMA step of tau toward the mean of the step's micro-batch quantiles on every rank (the first step
        sets tau). Nothing staged: tau stays."""
        count = staged[-1]
        mean = staged[:-1] / count.clamp(min=1)
        moved = torch.where(self.initialized, self.tau.lerp(mean, self.momentum), mean)
        self.tau.copy_(torch.where(count > 0, moved, self.tau))  # no host sync
        self.initialized.logical_or_(count > 0)
