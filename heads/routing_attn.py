"""Routing Transformer attention (Roy et al. 2021) as MoSA's content-based baseline (App. A, App. C).

Per head: shared query/key projection (W^Q = W^K, so queries and keys fall in the same clusters), value
projection, all T tokens projected (cost 6hh'T incl. W^O). The shared queries are layer-normed without
scale or bias (RT Alg. 1: Q <- LayerNorm(Q), K <- LayerNorm(K); option `layer_norm`, default true); their
unit-normalised directions u are clustered by online k-means (routing/kmeans.py) into ρ clusters; each
cluster attends within itself, causally (a member sees the members at or before its own position, itself
included), with RoPE at original positions. A token's head output is the mean of its outputs over the
clusters it belongs to (0 if none). Auxiliary loss: commitment `commitment * ||u - mu_nearest||^2`. KV entries
per head ("nearest"): every token a cluster admitted, at most min(T, ρ x ceil(capacity_factor * k)) (a token joins
one cluster; any future token may route to any cluster); decoding caches each cluster's members, ρ x
min(ceil(capacity_factor * k), T) slots per head (a cluster may take every token). "topk": T.

Logits follow RT's released code (google-research routing_transformer/utils.py), where the paper is silent:
- with the layer norm, LN(q)·LN(k) unscaled: the code scales q by 1/sqrt(h') *before* the layer norm, which
  removes the scaling, so the logits span ±h' (without it: the usual q·k / sqrt(h'));
- a token attends to itself (the causal mask includes the diagonal), although with Q = K its own logit is the
  largest. Reformer's shared-QK rule (no attention to itself unless nothing else is visible), which this head
  used before, cost perplexity in every comparison we ran (docs/mosa.md, "Not done / caveats").

Cluster assignment (option `assignment`):
- "topk": balanced clusters of k = T/ρ tokens, each cluster taking the k tokens most similar to its
  centroid (the Routing Transformer's training-time rule). Ranks tokens over the whole sequence, so
  NOT causal (like expert choice); opt-in, flagged by the causality check.
- "nearest" (default, causal): each token joins its nearest centroid; each cluster keeps its earliest
  ceil(capacity_factor * k) members (earliest-first overflow). Decidable per token from its query,
  the centroids and a counter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heads.attention import attend
from heads.base import ConfigError, GroupContext, HeadGroup, HeadOptions, register
from heads.kv_cache import SlotKV, one_token
from heads.layer_norm import layer_norm
from heads.rows import gather_rows
from routing.capacity import slot_capacity
from routing.expert_choice import expert_choice, tokens_per_head
from routing.kmeans import UPDATES, OnlineKMeans
from routing.selection import Selection, earliest_first

ASSIGNMENTS = ("nearest", "topk")


def admitted(seq_len: int, clusters: int, capacity: int) -> int:
    """Tokens a head's nearest clusters can hold of a length-T sequence: each token joins one cluster, each
    cluster at most `capacity`: min(T, ρ x capacity)."""
    return min(seq_len, clusters * capacity)


@dataclass
class RoutingOptions(HeadOptions):
    sparsity: int = 8  # ρ clusters of k = T/ρ tokens per head
    assignment: str = "nearest"  # "nearest" (causal) | "topk" (balanced, as published, non-causal)
    capacity_factor: float = 1.0  # nearest: slots per cluster = ceil(capacity_factor * k)
    decay: float = 0.999  # EMA decay of the centroids
    commitment: float = 1e-4  # weight of the commitment loss: RT's beta. RT's released code (utils.py,
    # clustered_local_attention_helper) adds the shared Q = K's loss once as q's and once as k's: 2e-4 matches it
    layer_norm: bool = True  # RT Alg. 1: LayerNorm (no scale, bias) on the shared Q = K; false = raw projections
    centroids: str = "unit_mean"  # k-means update: "unit_mean" (ours) | "ema_counts" (RT's code; routing/kmeans.py)

    @classmethod
    def example(cls) -> dict[str, Any]:
        return {"sparsity": 4}

    @classmethod
    def grid(cls) -> dict[str, list[Any]]:
        return {"sparsity": [1, 2, 3, 4, 8], "assignment": ["nearest", "topk"], "capacity_factor": [0.5, 1.0, 2.0],
                "layer_norm": [True, False], "centroids": list(UPDATES)}

    @property
    def causal(self) -> bool:
        return self.assignment != "topk"  # RT's balanced clusters of k tokens over the whole sequence

    def kv_per_head(self, seq_len: int) -> int:
        """nearest: the tokens the clusters admit (`admitted`), the most entries the cache can hold; it allocates
        ρ x min(capacity, max_len) slots, more at capacity_factor > 1, as each cluster may fill (bench/resources.py
        reports both); topk: T (not decodable; a future query may fall into any cluster)."""
        if self.assignment == "topk":
            return seq_len
        return admitted(seq_len, self.sparsity, slot_capacity(tokens_per_head(seq_len, self.sparsity),
                                                              self.capacity_factor))

    def validate(self, ctx: GroupContext) -> None:
        super().validate(ctx)
        if self.sparsity < 1:
            raise ConfigError(f"routing: sparsity must be an integer >= 1, got {self.sparsity}")
        if self.assignment not in ASSIGNMENTS:
            raise ConfigError(f"routing: assignment must be one of {', '.join(ASSIGNMENTS)}, got {self.assignment!r}")
        if self.capacity_factor <= 0 or not 0 <= self.decay < 1 or self.commitment < 0:
            raise ConfigError("routing: need capacity_factor > 0, decay in [0, 1), commitment >= 0")
        if self.centroids not in UPDATES:
            raise ConfigError(f"routing: centroids must be one of {', '.join(UPDATES)}, got {self.centroids!r}")


@register("routing")
class RoutingHeads(HeadGroup):
    Options = RoutingOptions
    options: RoutingOptions
    beyond_training = "adds no token to a cluster once its capacity slots (sized for the training length) are full"

    def __init__(self, ctx: GroupContext, count: int, options: RoutingOptions) -> None:
        super().__init__(ctx, count, options)
        self.qv = nn.Linear(ctx.d_model, 2 * count * ctx.head_dim, bias=False)  # W^Q = W^K, and W^V
        self.out = nn.Linear(count * ctx.head_dim, ctx.d_model, bias=False)
        self.kmeans = OnlineKMeans(count, options.sparsity, ctx.head_dim, options.decay, options.centroids)
        self.capacity = slot_capacity(tokens_per_head(ctx.seq_len, options.sparsity), options.capacity_factor)
        self.scale = 1.0 if options.layer_norm else ctx.head_dim**-0.5  # logit = scale * q·k (see the docstring)

    def kv_entries(self, seq_len: int) -> int:
        if self.causal:  # the capacity is the training length's, as in the cache
            return self.count * admitted(seq_len, self.options.sparsity, self.capacity)
        return super().kv_entries(seq_len)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x[B, T, h] -> q(=k) = LayerNorm(x W^Q) (or x W^Q without `layer_norm`), v [B, H, T, h'],
        u = normalize(q) and its similarities to the centroids [B, H, C, T]."""
        B, T, _ = x.shape
        q, v = self.qv(x).view(B, T, 2, self.count, self.ctx.head_dim).permute(2, 0, 3, 1, 4)
        q, v = q.contiguous(), v.contiguous()  # whatever keeps q (layer norm, normalize) keeps q only, not v too
        if self.options.layer_norm:
            q = layer_norm(q)  # RT Alg. 1, scale and bias disabled; backward keeps the output, which normalize keeps
        u = F.normalize(q, dim=-1)
        return q, v, u, self.kmeans.similarity(u.detach())

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Selection]:
        """q, v, u as `_project`, each token's nearest centroid [B, H, T] and the clusters' Selection [B, H, C, c]."""
        q, v, u, sim = self._project(x)
        nearest = sim.argmax(2)
        if self.options.assignment == "topk":
            sel = expert_choice(sim, tokens_per_head(x.shape[1], self.options.sparsity))
        else:
            members = nearest[:, :, None, :] == torch.arange(self.options.sparsity, device=x.device)[:, None]
            sel = earliest_first(members, self.capacity)
        return q, v, u, nearest, sel

    def _finish(self, a_sum: torch.Tensor, counts: torch.Tensor, u: torch.Tensor, nearest: torch.Tensor) -> torch.Tensor:
        """a_sum[B, H, T, h'] summed cluster outputs, counts[B, H, T] memberships -> y[B, T, h]; aux loss, EMA."""
        B, H, T, d = a_sum.shape
        a = a_sum / counts.clamp(min=1)[..., None]  # mean over the clusters a token belongs to
        sums, sizes = self.kmeans.cluster_sums(u, nearest), self.kmeans.cluster_counts(nearest)
        self.aux_losses = {"routing_commitment": self.options.commitment * self.kmeans.commitment(sums, sizes, B * H * T)}
        self.stats = {"routed_frac": (counts > 0).float().mean().detach()}
        if self.updates_state:
            self.kmeans.stage(sums, sizes)  # applied after the optimizer step: commit_states
        return self.out(a.transpose(1, 2).reshape(B, T, H * d))

    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, v, u, nearest, sel = self._route(x)
        B, H, C, _ = sel.idx.shape
        T, d = x.shape[1], self.ctx.head_dim
        a_sum, counts = x.new_zeros(B, H, T, d), x.new_zeros(B, H, T)
        for b in range(B):
            for i in range(H):
                for c in range(C):
                    I = sel.idx[b, i, c][sel.valid[b, i, c]]  # cluster members
                    if not len(I):  # an empty cluster contributes nothing
                        continue
                    qc = self.rope(q[b, i, I], positions[b, I])  # shared Q = K
                    allowed = I[:, None] >= I[None, :]  # M_jl = 0 iff I_j >= I_l: earlier members and itself
                    scores = (qc @ qc.T * self.scale).masked_fill(~allowed, float("-inf"))
                    a_sum[b, i] = a_sum[b, i].index_add(0, I, (scores.softmax(-1) @ v[b, i, I]).to(x.dtype))
                    counts[b, i] = counts[b, i].index_add(0, I, torch.ones_like(I, dtype=x.dtype))
        return self._finish(a_sum, counts, u, nearest)

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._fast(x, positions)

    def _fast(self, x: torch.Tensor, positions: torch.Tensor, cache: SlotKV | None = None) -> torch.Tensor:
        """The batched path; with `cache` (prefill) it also stores every cluster's members, their rotated keys
        being the rotated shared queries it attends with."""
        q, v, u, nearest, sel = self._route(x)
        B, H, C, c = sel.idx.shape
        T, d = x.shape[1], self.ctx.head_dim
        flat = sel.idx.reshape(B, H, C * c)  # every slot of every cluster
        pos = positions[:, None, :].expand(B, H, T).gather(2, flat)
        qs, vs = self.rope(gather_rows(q, flat), pos), gather_rows(v, flat)  # [B, H, C*c, d]; nothing kept for backward
        if cache is not None:
            cache.write(sel.valid.reshape(B, H * C, c), qs.view(B, H * C, c, d), vs.view(B, H * C, c, d), pos.view(B, H * C, c))
        a = attend(qs.view(B, H * C, c, d), qs.view(B, H * C, c, d), vs.view(B, H * C, c, d), causal=True,
                   scale=self.scale)  # slots ascending, padding last
        a = a.view(B, H, C * c, d) * sel.valid.reshape(B, H, C * c, 1)
        a_sum = a.new_zeros(B, H, T, d).scatter_add(2, flat[..., None].expand(-1, -1, -1, d), a)
        counts = a.new_zeros(B, H, T).scatter_add(2, flat, sel.valid.reshape(B, H, C * c).to(a.dtype))
        return self._finish(a_sum, counts, u, nearest)

    def new_cache(self, batch: int, max_len: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> SlotKV:
        """Each cluster's members ("nearest" only): rows [B, H * ρ] (head i's cluster c at row i * ρ + c) of
        min(capacity, max_len) slots, keys rotated (the shared Q = K)."""
        if not self.causal:
            raise ValueError("routing: assignment 'topk' is not causal and cannot be decoded incrementally")
        return SlotKV.empty(batch, self.count * self.options.sparsity, min(self.capacity, max_len), self.ctx.head_dim,
                            device, dtype)

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: SlotKV) -> torch.Tensor:
        """Prefill (empty cache): the fast path, caching every cluster's members; later: one token, which joins
        its nearest cluster if that holds fewer than `capacity` members, and attends to the members so far."""
        if cache.fresh:
            return self._fast(x, positions, cache)
        one_token("routing", x)
        q, v, _, sim = self._project(x)  # [B, H, 1, d], sim [B, H, C, 1]
        B, H, _, d = q.shape
        C, S = self.options.sparsity, cache.k.shape[2]
        rows = torch.arange(H, device=x.device) * C + sim[..., 0].argmax(2)  # [B, H]: the token's nearest cluster
        member = cache.fill.gather(1, rows) < self.capacity  # [B, H]: earliest-first capacity (S < capacity: the
        # write below refuses a member past the S slots max_len allowed, "KV cache full")
        keep = torch.zeros(B, H * C, 1, dtype=torch.bool, device=x.device).scatter(1, rows[..., None], member[..., None])
        pos = positions[:, None, :1].expand(B, H, 1)
        k = self.rope(q, pos)
        cache.write(keep, k.repeat_interleave(C, 1), v.repeat_interleave(C, 1), pos.repeat_interleave(C, 1))
        at = rows[..., None, None].expand(B, H, S, d)
        kpos = cache.pos.gather(1, rows[..., None].expand(B, H, S))[:, :, None]  # [B, H, 1, S]
        mask = (kpos >= 0) & (kpos <= pos[..., None])
        a = attend(k, cache.k.gather(1, at), cache.v.gather(1, at), mask=mask | ~mask.any(-1, keepdim=True),
                   scale=self.scale)
        a = a * member[..., None, None]  # a token its full cluster did not admit has no output
        return self.out(a.transpose(1, 2).reshape(B, 1, H * d))
