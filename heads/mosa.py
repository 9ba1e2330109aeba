"""Mixture of Sparse Attention heads (MoSA, Piękos et al. 2025, §2.2).

Each head i has a router W^r_i in R^h and scores every token, r = σ(X W^r_i) (sigmoid, non-competitive);
it keeps k = T/ρ tokens I (k = max(floor(T/ρ), 2) for short sequences, App. F) and runs ordinary
attention on X^s = X[I] only, with RoPE at the original positions I (App. H), the mask
M_jl = 0 iff I_j >= I_l, output rows scaled by their router scores (diag(r) A W^O, the router's
gradient path) and scattered back to positions I (heads/gathered.py). The group sums its heads (eq. 3).

Token selection (option `selection`):
- "expert_choice": TopK(r, k) over the whole sequence, exactly as published. NOT causal: token i's
  selection depends on the scores of later tokens (the causality check flags it; evaluate it with
  lm/leakfree.py). Opt-in only.
- "threshold" (default, causal): token t joins head i iff its router logit exceeds the head's running
  (1 - 1/ρ)-quantile threshold and fewer than `capacity` earlier tokens joined (routing/threshold.py);
  capacity = ceil(capacity_factor * k(seq_len)), fixed by the training length so a prefix selects
  what the full sequence selects for it. Variable counts are padded to the capacity.
`keep_first` always selects token 0 (it then uses one of the head's slots).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from heads.base import ConfigError, GroupContext, HeadGroup, HeadOptions, register
from heads.gathered import gathered_heads_fast, gathered_heads_reference
from heads.kv_cache import SlotKV, gathered_prefill, gathered_step
from routing.expert_choice import expert_choice, tokens_per_head
from routing.selection import Selection, earliest_first
from routing.threshold import RunningQuantileThreshold

SELECTIONS = ("threshold", "expert_choice")


@dataclass
class MoSAOptions(HeadOptions):
    sparsity: int = 8  # ρ: each head keeps k = T/ρ tokens
    selection: str = "threshold"  # "threshold" (causal) | "expert_choice" (faithful, non-causal)
    keep_first: bool = False  # always select token 0
    capacity_factor: float = 1.0  # threshold: slots per head = ceil(capacity_factor * k(seq_len))
    threshold_momentum: float = 0.02  # threshold: EMA rate of the running quantile

    def validate(self, ctx: GroupContext) -> None:
        super().validate(ctx)
        if self.sparsity < 1:
            raise ConfigError(f"mosa: sparsity must be an integer >= 1, got {self.sparsity}")
        if self.selection not in SELECTIONS:
            raise ConfigError(f"mosa: selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if self.capacity_factor <= 0:
            raise ConfigError(f"mosa: capacity_factor must be > 0, got {self.capacity_factor}")
        if not 0 < self.threshold_momentum <= 1:
            raise ConfigError(f"mosa: threshold_momentum must be in (0, 1], got {self.threshold_momentum}")

    def kv_per_head(self, seq_len: int) -> int:
        k = tokens_per_head(seq_len, self.sparsity)
        if self.selection == "threshold":
            return min(seq_len, math.ceil(self.capacity_factor * k))
        return k


@register("mosa")
class MoSAHeads(HeadGroup):
    Options = MoSAOptions
    options: MoSAOptions

    def __init__(self, ctx: GroupContext, count: int, options: MoSAOptions) -> None:
        super().__init__(ctx, count, options)
        h, d = ctx.d_model, ctx.head_dim
        self.router = nn.Linear(h, count, bias=False)  # W^r of every head, stacked [H, h]
        self.qkv = nn.Linear(h, 3 * count * d, bias=False)  # per-head W^Q, W^K, W^V, stacked
        self.out = nn.Linear(count * d, h, bias=False)  # per-head W^O, stacked
        if options.selection == "threshold":
            self.threshold = RunningQuantileThreshold(count, 1.0 / options.sparsity, options.threshold_momentum)
            self.capacity = options.kv_per_head(ctx.seq_len)

    @property
    def causal(self) -> bool:
        return self.options.selection != "expert_choice"

    def kv_entries(self, seq_len: int) -> int:
        if self.options.selection == "threshold":
            return self.count * min(seq_len, self.capacity)
        return super().kv_entries(seq_len)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x[B, T, h] -> s = X W^r [B, H, T]; the router score is r = σ(s)."""
        return self.router(x).transpose(1, 2)

    def candidates(self, logits: torch.Tensor) -> torch.Tensor:
        """Threshold selection, before capacity: bool[B, H, T], token t's decision uses s_t and tau only."""
        mask = self.threshold.above(logits)
        if self.options.keep_first:
            mask[..., 0] = True
        return mask

    def select(self, logits: torch.Tensor) -> Selection:
        """logits[B, H, T] -> per-head token indices [B, H, c] (ascending, padded) and validity."""
        if self.options.selection == "expert_choice":
            k = tokens_per_head(logits.shape[-1], self.options.sparsity)
            return expert_choice(logits.detach(), k, self.options.keep_first)
        return earliest_first(self.candidates(logits.detach()), self.capacity)

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.router_logits(x)
        sel = self.select(logits)
        gate = torch.sigmoid(logits.gather(-1, sel.idx)) * sel.valid  # r_I, 0 on padding
        y = gathered_heads_fast(x, positions, sel, gate, self.qkv.weight, self.out.weight, self.rope)
        self._after_forward(logits, sel.valid.sum(-1))
        return y

    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.router_logits(x)  # [B, H, T]
        B, H, T = logits.shape
        index_sets: list[list[torch.Tensor]] = [[] for _ in range(B)]
        gates: list[list[torch.Tensor]] = [[] for _ in range(B)]
        for b in range(B):
            for i in range(H):
                s = logits[b, i]  # [T]
                if self.options.selection == "expert_choice":
                    scores = s.detach().clone()
                    if self.options.keep_first:
                        scores[0] = float("inf")
                    I = torch.topk(scores, tokens_per_head(T, self.options.sparsity)).indices  # TopK order
                else:
                    above = s.detach() > self.threshold.tau[i]
                    if self.options.keep_first:
                        above[0] = True
                    I = above.nonzero()[:, 0][: self.capacity]  # earliest `capacity` above threshold
                index_sets[b].append(I)
                gates[b].append(torch.sigmoid(s)[I])  # r^topk
        y = gathered_heads_reference(x, positions, index_sets, gates, self.qkv.weight, self.out.weight, self.rope)
        counts = torch.tensor([[len(I) for I in row] for row in index_sets], device=x.device)
        self._after_forward(logits, counts)
        return y

    def new_cache(self, batch: int, max_len: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> SlotKV:
        """K/V of the selected tokens only: `capacity` slots per head (threshold selection)."""
        if not self.causal:
            raise ValueError("mosa: selection 'expert_choice' is not causal and cannot be decoded incrementally")
        return SlotKV.empty(batch, self.count, min(self.capacity, max_len), self.ctx.head_dim, device, dtype)

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: SlotKV) -> torch.Tensor:
        """Prefill (empty cache): the fast path, caching the selected tokens; later: one token, which
        joins head i iff its logit is above tau_i and the head has a free slot (earliest_first)."""
        logits = self.router_logits(x)  # [B, H, T]
        if cache.fresh:
            sel = self.select(logits)
            gathered_prefill(cache, x, positions, sel.idx, sel.valid, self.qkv.weight, self.rope)
            return self.forward_fast(x, positions)
        member = self.threshold.above(logits)[..., 0] & (cache.fill < cache.k.shape[2])
        if self.options.keep_first:
            member |= positions[:, :1] == 0
        gate = torch.sigmoid(logits[..., 0])
        return gathered_step(cache, x, positions, member, gate, self.qkv.weight, self.out.weight, self.rope)

    def _after_forward(self, logits: torch.Tensor, counts: torch.Tensor) -> None:
        """Stats (tensors, no host sync); in training, move the running thresholds using this batch
        (used from the next pass). Threshold selection: `fill` = selected / capacity, `overflow` =
        fraction of above-threshold candidates dropped because the head was full."""
        T = logits.shape[-1]
        counts = counts.float()
        self.stats = {"selected_frac": counts.mean().detach() / T}
        if self.options.selection == "threshold":
            candidates = self.candidates(logits.detach()).sum(-1).float()  # [B, H]
            self.stats["tau_mean"] = self.threshold.tau.mean().detach()
            self.stats["fill"] = counts.mean().detach() / self.capacity
            self.stats["overflow"] = 1.0 - counts.sum().detach() / candidates.sum().clamp_min(1)
            if self.training:
                self.threshold.update(logits)
