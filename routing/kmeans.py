"""Online k-means with EMA centroids (Routing Transformer, Roy et al. 2021, §4.1; MoSA App. A).

Per head, `clusters` unit-norm centroids mu [H, C, d]. Vectors are unit-normalised and compared by dot
product. After each training forward pass every centroid moves toward the mean of the vectors whose
nearest centroid it is: mu <- normalize(decay * mu + (1 - decay) * mean), a state update that uses no
gradient. The commitment loss ||u - mu_nearest||^2 pulls the vectors toward their centroids.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from routing.distributed import all_reduce_sum
from routing.float32_state import Float32Buffers


class OnlineKMeans(Float32Buffers):
    """means[H, C, d]: the centroids, an fp32 buffer even in a bf16 model."""

    def __init__(self, heads: int, clusters: int, dim: int, decay: float) -> None:
        super().__init__()
        self.decay = decay
        self.register_buffer("means", F.normalize(torch.randn(heads, clusters, dim), dim=-1))

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
        means = self.means.to(sums.dtype, copy=True)  # a copy: update() moves the buffer before backward reads it
        return 2 - 2 * (sums * means).sum() / tokens

    @torch.no_grad()
    def update(self, sums: torch.Tensor, nearest: torch.Tensor) -> None:
        """EMA step of every centroid toward the mean of the vectors nearest to it, from their cluster sums
        [B, H, C, d] and nearest[B, H, T] (over the global batch under DDP/DeepSpeed: sums and counts are
        all-reduced before the step)."""
        H, C = self.means.shape[:2]
        clusters = (torch.arange(H, device=nearest.device)[:, None] * C + nearest).flatten()
        counts = all_reduce_sum(torch.bincount(clusters, minlength=H * C).view(H, C, 1).float())
        sums = all_reduce_sum(sums.detach().float().sum(0))  # [H, C, d]
        moved = self.means * self.decay + (1 - self.decay) * sums / counts.clamp(min=1)
        self.means.copy_(torch.where(counts > 0, F.normalize(moved, dim=-1), self.means))
