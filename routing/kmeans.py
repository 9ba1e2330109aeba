"""Online k-means with EMA centroids (Routing Transformer, Roy et al. 2021, §4.1; MoSA App. A).

Per head, `clusters` unit-norm centroids mu [H, C, d]. Vectors are unit-normalised and compared by dot
product. After each optimizer step every centroid moves toward the mean of the vectors whose nearest centroid
it was in that step's forward passes: mu <- normalize(decay * mu + (1 - decay) * mean), a state update that uses
no gradient. The commitment loss ||u - mu_nearest||^2 pulls the vectors toward their centroids.

The update is staged, not applied, in the forward pass (`stage` adds the step's cluster sums and counts to the
`pending` buffer) and applied by `commit` after the optimizer step (routing/staged.py), outside any compiled graph,
for two reasons. (1) The commitment loss's backward reads the centroids. Moved in place inside a compiled
forward, they were read moved: AOTAutograd's partitioner recomputes the centroids' copy in backward from the
buffer the forward already overwrote (pytorch/pytorch#197039, open), a silently wrong gradient (max |error|
2.6e-3 on a 2-head toy, torch 2.11 and 2.13, eager vs aot_eager). (2) With gradient accumulation the
micro-batches of a step all use the same centroids and their statistics add up to one EMA step, as one batch of
their size would (before, every micro-batch moved the centroids). Under DDP / DeepSpeed the staged sums and
counts are all-reduced at the commit, once per step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from routing.staged import StagedStatistics


class OnlineKMeans(StagedStatistics):
    """means[H, C, d]: the centroids, an fp32 buffer even in a bf16 model."""

    def __init__(self, heads: int, clusters: int, dim: int, decay: float) -> None:
        super().__init__()
        self.decay = decay
        self.register_buffer("means", F.normalize(torch.randn(heads, clusters, dim), dim=-1))
        self.stage_into(heads, clusters, dim + 1)  # this step's cluster sums [..., :dim] and counts [..., dim]

    def similarity(self, u: torch.Tensor) -> torch.Tensor:
        """u[B, H, T, d] (unit-norm) -> dot products with the centroids [B, H, C, T]."""
        return torch.einsum("bhtd,hcd->bhct", u, self.means.to(u.dtype))

    def cluster_sums(self, u: torch.Tensor, nearest: torch.Tensor) -> torch.Tensor:
        """Each cluster's sum of the vectors u[B, H, T, d] nearest to it (nearest[B, H, T]) -> [B, H, C, d], in at
        least fp32 (a bf16 sum of T vectors would round away what the EMA step moves); differentiable in u. The
        commitment loss and the centroid update both read it, so it is summed once a step."""
        B, H, T, d = u.shape
        src = u.to(torch.promote_types(u.dtype, torch.float32))
        return src.new_zeros(B, H, self.means.shape[1], d).scatter_add(2, nearest[..., None].expand_as(u), src)

    def commitment(self, sums: torch.Tensor, tokens: int) -> torch.Tensor:
        """Mean squared distance of the `tokens` unit vectors u to their nearest centroids, from their cluster
        sums [B, H, C, d]: ||u - mu||^2 = 2 - 2 u·mu, and the sum of u·mu over tokens is that of each cluster's sum
        of u dotted with its centroid. Backward so keeps the indices and the sums, not a [B, H, T, d] tensor like
        (u - mu)^2; its gradient in u differs from 2 (u - mu) by 2u, which the normalisation that made u removes."""
        means = self.means.to(sums.dtype)  # backward reads it: `commit` moves it only after the step (module doc)
        return 2 - 2 * (sums * means).sum() / tokens

    @torch.no_grad()
    def stage(self, sums: torch.Tensor, nearest: torch.Tensor) -> None:
        """Add a forward pass's cluster sums [B, H, C, d] and its nearest[B, H, T] counts to `pending`."""
        H, C, d = self.means.shape
        clusters = (torch.arange(H, device=nearest.device)[:, None] * C + nearest).flatten()
        self.pending[..., :d] += sums.detach().sum(0).to(self.pending.dtype)
        self.pending[..., d] += torch.bincount(clusters, minlength=H * C).view(H, C).to(self.pending.dtype)

    def update(self, staged: torch.Tensor) -> None:
        """EMA step of every centroid toward the mean of the vectors the step staged for it on every rank. A
        centroid nothing joined stays."""
        d = self.means.shape[-1]
        sums, counts = staged[..., :d], staged[..., d:]
        moved = self.means * self.decay + (1 - self.decay) * sums / counts.clamp(min=1)
        self.means.copy_(torch.where(counts > 0, F.normalize(moved, dim=-1), self.means))
