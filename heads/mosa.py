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
  what the full sequence selects for it. Variable counts are padded to the capacity. Overflow drops
  the LATEST candidates, so a head's view is biased toward the start of the sequence.
- "quota" (causal): the same candidates, but token t may join while the head's count is below the
  prefix quota q_t = min(capacity, ceil(capacity_factor * k * (t+1) / seq_len)): the capacity spread
  evenly over positions, so overflow early in the sequence cannot starve its end
  (routing/selection.py prefix_quota).
- "predictor" (causal): Mixture-of-Depths' auxiliary predictor (routing/predictor.py): a per-head
  classifier on stop-gradient x_t, trained with BCE (aux loss "mosa_predictor", weight
  `predictor_weight`) to predict membership in the expert-choice top-k of the full sequence; token t
  is a candidate iff its predictor logit exceeds that logit's running (1 - 1/ρ)-quantile, and joins
  under the prefix quota. The gate is still the router score r = σ(x W^r).
Decoding numbers tokens by their position (lm/generate.py starts at 0): the quota of a decoded token
is q at its position.
`keep_first` always selects token 0 (it then uses one of the head's slots).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from heads.base import ConfigError, GroupContext, HeadGroup, HeadOptions, register
from heads.gathered import gathered_heads_fast, gathered_heads_reference
from heads.kv_cache import SlotKV, gathered_prefill, gathered_step, one_token
from routing.capacity import prefix_quotas, slot_capacity
from routing.expert_choice import expert_choice, tokens_per_head
from routing.predictor import MembershipPredictor, predictor_loss, topk_targets
from routing.selection import Selection, earliest_first, prefix_quota
from routing.threshold import RunningQuantileThreshold

SELECTIONS = ("threshold", "quota", "predictor", "expert_choice")
QUOTA_SELECTIONS = ("quota", "predictor")  # causal selections whose overflow rule is the prefix quota


@dataclass
class MoSAOptions(HeadOptions):
    sparsity: int = 8  # ρ: each head keeps k = T/ρ tokens
    selection: str = "threshold"  # "threshold" | "quota" | "predictor" (causal) | "expert_choice" (faithful)
    keep_first: bool = False  # always select token 0
    capacity_factor: float = 1.0  # causal selections: slots per head = ceil(capacity_factor * k(seq_len))
    threshold_momentum: float = 0.02  # causal selections: EMA rate of the running quantile
    predictor_weight: float = 1.0  # predictor: weight of its BCE loss (it trains only the predictor)

    @classmethod
    def example(cls) -> dict[str, Any]:
        return {"sparsity": 4}

    @classmethod
    def grid(cls) -> dict[str, list[Any]]:
        return {"sparsity": [1, 2, 3, 4, 8, 100], "selection": ["threshold", "quota", "predictor", "expert_choice"],
                "keep_first": [False, True], "capacity_factor": [0.5, 1.0, 1.5, 3.0]}

    @property
    def causal(self) -> bool:
        return self.selection != "expert_choice"  # the paper's top-k over the whole sequence

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
        if self.predictor_weight <= 0:
            raise ConfigError(f"mosa: predictor_weight must be > 0, got {self.predictor_weight}")

    def kv_per_head(self, seq_len: int) -> int:
        k = tokens_per_head(seq_len, self.sparsity)
        if self.selection != "expert_choice":
            return min(seq_len, slot_capacity(k, self.capacity_factor))
        return k


@register("mosa")
class MoSAHeads(HeadGroup):
    Options = MoSAOptions
    beyond_training = "adds no token once its capacity slots (sized for the training length) are full"
    options: MoSAOptions

    def __init__(self, ctx: GroupContext, count: int, options: MoSAOptions) -> None:
        super().__init__(ctx, count, options)
        h, d = ctx.d_model, ctx.head_dim
        self.router = nn.Linear(h, count, bias=False)  # W^r of every head, stacked [H, h]
        self.qkv = nn.Linear(h, 3 * count * d, bias=False)  # per-head W^Q, W^K, W^V, stacked
        self.out = nn.Linear(count * d, h, bias=False)  # per-head W^O, stacked
        if options.selection == "predictor":
            self.predictor = MembershipPredictor(h, count)
        if self.causal:
            self.threshold = RunningQuantileThreshold(count, options.sparsity, options.threshold_momentum)
            self.capacity = options.kv_per_head(ctx.seq_len)
        if options.selection in QUOTA_SELECTIONS:  # q_t by position (not saved: a function of the options)
            quotas = prefix_quotas(tokens_per_head(ctx.seq_len, options.sparsity), options.capacity_factor,
                                   ctx.seq_len, self.capacity)
            self.register_buffer("quotas", torch.tensor(quotas), persistent=False)
            self.quota_list = quotas  # the same in Python ints: a selection's width is known when tracing

    def kv_entries(self, seq_len: int) -> int:
        if self.causal:
            return self.count * min(seq_len, self.capacity)
        return super().kv_entries(seq_len)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x[B, T, h] -> s = X W^r [B, H, T]; the router score is r = σ(s)."""
        return self.router(x).transpose(1, 2)

    def own_loss_parameters(self) -> list[nn.Parameter]:
        return list(self.predictor.parameters()) if self.options.selection == "predictor" else []

    def selection_scores(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """What the selection ranks or thresholds [B, H, T]: the predictor's logits z (selection
        "predictor"; they carry the gradient of its own loss only) or the router logits s, detached
        (the selection itself is not differentiated, like TopK)."""
        if self.options.selection == "predictor":
            return self.predictor(x)
        return logits.detach()

    def candidates(self, scores: torch.Tensor) -> torch.Tensor:
        """Causal selections, before capacity: bool[B, H, T], token t's decision uses its score and tau only."""
        mask = self.threshold.above(scores)
        if self.options.keep_first:
            mask[..., 0] = True
        return mask

    def quota(self, t: torch.Tensor) -> torch.Tensor:
        """Prefix quota at token positions t: q_t = min(capacity, ceil(capacity_factor * k * (t+1) / seq_len)), the
        capacity from the training length on (routing/capacity.prefix_quotas)."""
        return self.quotas[t.long().clamp(max=self.ctx.seq_len - 1)]

    def select(self, scores: torch.Tensor) -> Selection:
        """scores[B, H, T] -> per-head token indices [B, H, c] (ascending, padded) and validity."""
        if self.options.selection == "expert_choice":
            k = tokens_per_head(scores.shape[-1], self.options.sparsity)
            return expert_choice(scores, k, self.options.keep_first)
        if self.options.selection in QUOTA_SELECTIONS:
            T = scores.shape[-1]
            quota = self.quota(torch.arange(T, device=scores.device))
            return prefix_quota(self.candidates(scores), quota, self.quota_list[min(T, self.ctx.seq_len) - 1] if T else 1)
        return earliest_first(self.candidates(scores), self.capacity)

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.router_logits(x)
        scores = self.selection_scores(x, logits)
        sel = self.select(scores)
        gate = torch.sigmoid(logits.gather(-1, sel.idx)) * sel.valid  # r_I, 0 on padding
        y = gathered_heads_fast(x, positions, sel, gate, self.qkv.weight, self.out.weight, self.rope)
        self._after_forward(logits, scores, sel.valid.sum(-1))
        return y

    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """§2.2 per head: r = σ(X W^r), the selection I (option `selection`), X^s = X[I], A = softmax(Q K^T / sqrt(h')
        + M) V at RoPE positions I, diag(r_I) A W^O scattered back to I, summed over heads (eq. 3), with
        heads/gathered.py's plain reference."""
        logits = self.router_logits(x)  # [B, H, T]
        scores = self.selection_scores(x, logits)
        B, H, T = logits.shape
        quota = self.quota(torch.arange(T)).tolist() if self.options.selection in QUOTA_SELECTIONS else None
        # [B, H, T]: s > tau_i (every token at rho = 1), for the causal selections
        candidates = None if self.options.selection == "expert_choice" else self.threshold.above(scores.detach())
        index_sets: list[list[torch.Tensor]] = [[] for _ in range(B)]
        gates: list[list[torch.Tensor]] = [[] for _ in range(B)]
        for b in range(B):
            for i in range(H):
                s = scores[b, i].detach()  # [T]
                if self.options.selection == "expert_choice":
                    ranked = s.clone()
                    if self.options.keep_first:
                        ranked[0] = float("inf")
                    k = tokens_per_head(T, self.options.sparsity)
                    I = ranked.sort(descending=True, stable=True).indices[:k]  # TopK, ties to the earliest
                else:
                    above = candidates[b, i].clone()
                    if self.options.keep_first:
                        above[0] = True
                    if quota is None:
                        I = above.nonzero()[:, 0][: self.capacity]  # earliest `capacity` above threshold
                    else:  # token t joins while the head holds fewer than q_t tokens
                        kept: list[int] = []
                        for t in range(T):
                            if above[t] and len(kept) < quota[t]:
                                kept.append(t)
                        I = torch.tensor(kept, dtype=torch.long, device=x.device)
                index_sets[b].append(I)
                gates[b].append(torch.sigmoid(logits[b, i])[I])  # r^topk
        y = gathered_heads_reference(x, positions, index_sets, gates, self.qkv.weight, self.out.weight, self.rope)
        counts = torch.tensor([[len(I) for I in row] for row in index_sets], device=x.device)
        self._after_forward(logits, scores, counts)
        return y

    def new_cache(self, batch: int, max_len: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> SlotKV:
        """K/V of the selected tokens only: `capacity` slots per head (causal selections)."""
        if not self.causal:
            raise ValueError("mosa: selection 'expert_choice' is not causal and cannot be decoded incrementally")
        return SlotKV.empty(batch, self.count, min(self.capacity, max_len), self.ctx.head_dim, device, dtype)

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: SlotKV) -> torch.Tensor:
        """Prefill (empty cache): the fast path, caching the selected tokens; later: one token, which
        joins head i iff its score is above tau_i and the head has a free slot: fewer than `capacity`
        (threshold) or than the quota at the token's position (quota, predictor) tokens so far."""
        logits = self.router_logits(x)  # [B, H, T]
        scores = self.selection_scores(x, logits)
        if cache.fresh:
            sel = self.select(scores)
            gathered_prefill(cache, x, positions, sel.idx, sel.valid, self.qkv.weight, self.rope)
            return self.forward_fast(x, positions)
        one_token("mosa", x)
        slots = self.quota(positions[:, :1]) if self.options.selection in QUOTA_SELECTIONS else cache.k.shape[2]
        member = self.threshold.above(scores)[..., 0] & (cache.fill < slots)
        if self.options.keep_first:
            member |= positions[:, :1] == 0
        gate = torch.sigmoid(logits[..., 0])
        return gathered_step(cache, x, positions, member, gate, self.qkv.weight, self.out.weight, self.rope)

    def _after_forward(self, logits: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor) -> None:
        """Stats (tensors, no host sync) and the predictor's loss; in training, stage this batch's statistics for
        the running thresholds (moved after the optimizer step: commit_states). Causal selections: `fill` = selected /
        capacity, `overflow` = fraction of above-threshold candidates dropped (capacity or quota)."""
        T = logits.shape[-1]
        counts = counts.float()
        self.stats = {"selected_frac": counts.mean().detach() / T}
        if self.options.selection == "predictor":
            target = topk_targets(logits, tokens_per_head(T, self.options.sparsity))
            self.aux_losses = {"mosa_predictor": self.options.predictor_weight * predictor_loss(scores, target)}
            guess, truth = self.threshold.above(scores.detach()), target.bool()
            self.stats["predictor_acc"] = (guess == truth).float().mean()
            self.stats["predictor_recall"] = (guess & truth).sum().float() / truth.sum().clamp_min(1)
        if self.causal:
            candidates = self.candidates(scores.detach()).sum(-1).float()  # [B, H]
            self.stats["tau_mean"] = self.threshold.tau.mean().detach()
            self.stats["fill"] = counts.mean().detach() / self.capacity
            self.stats["overflow"] = 1.0 - counts.sum().detach() / candidates.sum().clamp_min(1)
            if self.updates_state:
                self.threshold.stage(scores)  # applied after the optimizer step: commit_states

