"""Online k-means with EMA centroids (Routing Transformer, Roy et al. 2021, §4.1; MoSA App. A).

Per head, `clusters` centroids mu [H, C, d], initialised as random unit vectors. Vectors are unit-normalised and
compared by dot product. After each optimizer step the centroids move toward the vectors whose nearest centroid
they were in that step's forward passes, a state update that uses no gradient, by one of two rules (`update`):

- "unit_mean" (ours, the default): every centroid with members takes one step toward their mean, renormalised:
  mu <- normalize(decay * mu + (1 - decay) * mean). A cluster that one token joined moves as far as one that a
  thousand joined; the centroids stay unit vectors.
- "ema_counts" (RT's released code, google-research routing_transformer/utils.py `online_kmeans`, the VQ-VAE
  EMA): exponential moving averages of each cluster's member count N and member sum S, N <- decay N + (1 - decay)
  n, S <- decay S + (1 - decay) sum (S starts at the initial centroids, N at 0), and mu = S / N~ with N~ Laplace-
  smoothed, N~ = (N + eps) / (sum_c N + C eps) * sum_c N, eps = 1e-5; no renormalisation. Busy clusters move
  slowly, rarely joined ones jump toward their few members. A cluster nothing has joined yet keeps its direction
  and grows to norm ~1/eps, so at the next step it is nearest to every vector on its side (about half of them):
  with `nearest` clusters of bounded capacity most of those get no output that step (RT trained balanced top-k
  clusters, where this cannot happen). Its similarities are computed in fp32 (fp16 overflows at 1e5). The paper
  (§4.1) writes the same update with the sums of a cluster's queries and keys, without the division.

The commitment loss ||u - mu_nearest||^2 pulls the vectors toward their centroids. With "ema_counts" it is taken,
as in RT's code, against the unnormalised centroid, so ||mu||^2 enters it: the step after a cluster grew to norm
~1e5, the loss term reads ~1e5-1e6 even at the default weight 1e-4 (one head, 4 clusters of 16 dimensions, 256
tokens, one cluster left empty for a step: 5.3e5, while the gradient it sent to the queries had norm 0.23, the
normalisation of u removing the radial part). Read a logged `routing_commitment` spike under "ema_counts" as that,
not as a diverging model.

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


UPDATES = ("unit_mean", "ema_counts")
EPSILON = 1e-5  # RT's Laplace smoothing of the EMA counts


class OnlineKMeans(StagedStatistics):
    """means[H, C, d]: the centroids, an fp32 buffer even in a bf16 model (and, for "ema_counts", the EMA counts
    ema_count[H, C] and sums ema_sum[H, C, d])."""

    def __init__(self, heads: int, clusters: int, dim: int, decay: float, update: str = "unit_mean") -> None:
        super().__init__()
        if update not in UPDATES:
            raise ValueError(f"OnlineKMeans: update must be one of {', '.join(UPDATES)}, got {update!r}")
        self.decay, self.rule = decay, update
        self.register_buffer("means", F.normalize(torch.randn(heads, clusters, dim), dim=-1))
        if update == "ema_counts":
            self.register_buffer("ema_count", torch.zeros(heads, clusters))
            self.register_buffer("ema_sum", self.means.clone())
        self.stage_into(heads, clusters, dim + 1)  # this step's cluster sums [..., :dim] and counts [..., dim]

    def similarity(self, u: torch.Tensor) -> torch.Tensor:
        """u[B, H, T, d] (unit-norm) -> dot products with the centroids [B, H, C, T], in u's dtype for unit
        centroids, in at least fp32 for "ema_counts" ones (norms up to 1/eps), autocast or not (autocast would run
        the einsum in bf16/fp16: the big norms of empty clusters then tie or overflow)."""
        if self.rule == "unit_mean":
            return torch.einsum("bhtd,hcd->bhct", u, self.means.to(u.dtype))
        dtype = torch.promote_types(u.dtype, torch.float32)
        with torch.autocast(u.device.type, enabled=False):
            return torch.einsum("bhtd,hcd->bhct", u.to(dtype), self.means.to(dtype))

    def cluster_sums(self, u: torch.Tensor, nearest: torch.Tensor) -> torch.Tensor:
        """Each cluster's sum of the vectors u[B, H, T, d] nearest to it (nearest[B, H, T]) -> [B, H, C, d], in at
        least fp32 (a bf16 sum of T vectors would round away what the EMA step moves); differentiable in u. The
        commitment loss and the centroid update both read it, so it is summed once a step."""
        B, H, T, d = u.shape
        src = u.to(torch.promote_types(u.dtype, torch.float32))
        return src.new_zeros(B, H, self.means.shape[1], d).scatter_add(2, nearest[..., None].expand_as(u), src)

    def cluster_counts(self, nearest: torch.Tensor) -> torch.Tensor:
        """nearest[B, H, T] -> how many vectors each cluster is nearest to, over the batch [H, C] (fp32)."""
        H, C, _ = self.means.shape
        clusters = (torch.arange(H, device=nearest.device)[:, None] * C + nearest).flatten()
        return torch.bincount(clusters, minlength=H * C).view(H, C).float()

    def commitment(self, sums: torch.Tensor, counts: torch.Tensor, tokens: int) -> torch.Tensor:
        """Mean squared distance of the `tokens` unit vectors u to their nearest centroids, from their cluster
        sums [B, H, C, d] and counts [H, C]: ||u - mu||^2 = 1 - 2 u·mu + ||mu||^2, and the sum of u·mu over tokens
        is that of each cluster's sum of u dotted with its centroid. Backward so keeps the indices and the sums,
        not a [B, H, T, d] tensor like (u - mu)^2; its gradient in u differs from 2 (u - mu) by 2u, which the
        normalisation that made u removes."""
        means = self.means.to(sums.dtype)  # backward reads it: `commit` moves it only after the step (module doc)
        spread = (counts.to(sums.dtype) * means.pow(2).sum(-1)).sum()  # sum over tokens of ||mu_nearest||^2
        return 1 + (spread - 2 * (sums * means).sum()) / tokens

    @torch.no_grad()
    def stage(self, sums: torch.Tensor, counts: torch.Tensor) -> None:
        """Add a forward pass's cluster sums [B, H, C, d] and counts [H, C] to `pending`."""
        d = self.means.shape[-1]
        self.pending[..., :d] += sums.detach().sum(0).to(self.pending.dtype)
        self.pending[..., d] += counts.to(self.pending.dtype)

    def update(self, staged: torch.Tensor) -> None:
        """Move the centroids by the step's cluster sums and counts, staged on every rank (module doc)."""
        d = self.means.shape[-1]
        sums, counts = staged[..., :d], staged[..., d:]
        if self.rule == "unit_mean":  # a centroid nothing joined stays
            moved = self.means * self.decay + (1 - self.decay) * sums / counts.clamp(min=1)
            self.means.copy_(torch.where(counts > 0, F.normalize(moved, dim=-1), self.means))
            return
        staged = counts.sum() > 0  # nothing staged (a skipped step): the EMAs do not decay, as if no step was taken
        count = self.ema_count * self.decay + (1 - self.decay) * counts[..., 0]
        self.ema_sum.copy_(torch.where(staged, self.ema_sum * self.decay + (1 - self.decay) * sums, self.ema_sum))
        self.ema_count.copy_(torch.where(staged, count, self.ema_count))
        total = self.ema_count.sum(-1, keepdim=True)
        smoothed = (self.ema_count + EPSILON) / (total + EPSILON * self.ema_count.shape[-1]) * total
        self.means.copy_(torch.where(staged, self.ema_sum / smoothed[..., None], self.means))  # N = 0 before a step
