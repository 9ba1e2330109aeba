"""Fixed strided sparse heads (MoSA App. A, after Child et al. 2019): the special case of MoSA with
I = [0, ρ, 2ρ, ...] and r = 1. Every head attends among the tokens at positions that are multiples
of ρ; only those tokens are projected (W^Q, W^K, W^V, W^O), and only they receive an output.

k = ceil(T/ρ) (= T/ρ when ρ divides T): all multiples of ρ below T. Counting them this way (rather
than App. F's max(floor(T/ρ), 2)) keeps the pattern a function of position alone, so a prefix sees
exactly the selection the full sequence makes for it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from heads.base import ConfigError, GroupContext, HeadGroup, HeadOptions, register
from heads.gathered import gathered_heads_fast, gathered_heads_reference
from heads.kv_cache import SlotKV, gathered_prefill, gathered_step, one_token
from routing.selection import Selection, earliest_first


@dataclass
class FixedOptions(HeadOptions):
    sparsity: int = 8  # ρ: stride of the selected positions

    @classmethod
    def example(cls) -> dict[str, Any]:
        return {"sparsity": 4}

    @classmethod
    def grid(cls) -> dict[str, list[Any]]:
        return {"sparsity": [1, 2, 3, 5, 8, 64]}

    def validate(self, ctx: GroupContext) -> None:
        super().validate(ctx)
        if self.sparsity < 1:
            raise ConfigError(f"fixed: sparsity must be an integer >= 1, got {self.sparsity}")

    def kv_per_head(self, seq_len: int) -> int:
        return math.ceil(seq_len / self.sparsity)


@register("fixed")
class FixedHeads(HeadGroup):
    Options = FixedOptions
    beyond_training = "keeps adding every rho-th token (its cache grows with the length)"
    options: FixedOptions

    def __init__(self, ctx: GroupContext, count: int, options: FixedOptions) -> None:
        super().__init__(ctx, count, options)
        self.qkv = nn.Linear(ctx.d_model, 3 * count * ctx.head_dim, bias=False)
        self.out = nn.Linear(count * ctx.head_dim, ctx.d_model, bias=False)

    def select(self, positions: torch.Tensor) -> Selection:
        """positions[B, T] (consecutive in each row, as every caller passes them) -> the tokens whose position is a
        multiple of ρ, ascending, the same for every head: [B, H, ceil(T/ρ)] (I = [0, ρ, 2ρ, ...] for positions
        0..T-1; a window starting elsewhere holds fewer, padded), so the full pass and decoding (which tests each
        new position) agree wherever the window starts."""
        B, T = positions.shape
        sel = earliest_first((positions % self.options.sparsity == 0)[:, None], self.options.kv_per_head(T))
        return Selection(sel.idx.expand(B, self.count, -1), sel.valid.expand(B, self.count, -1))

    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        I = [torch.nonzero(positions[b] % self.options.sparsity == 0).flatten() for b in range(B)]
        index_sets = [[I[b]] * self.count for b in range(B)]
        gates = [[torch.ones(len(I[b]), device=x.device, dtype=x.dtype)] * self.count for b in range(B)]  # r = 1
        return gathered_heads_reference(x, positions, index_sets, gates, self.qkv.weight, self.out.weight, self.rope)

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        sel = self.select(positions)
        gate = sel.valid.to(x.dtype)  # r = 1, 0 on padding
        return gathered_heads_fast(x, positions, sel, gate, self.qkv.weight, self.out.weight, self.rope)

    def new_cache(self, batch: int, max_len: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> SlotKV:
        """K/V of the strided tokens only: ceil(max_len / ρ) slots per head."""
        return SlotKV.empty(batch, self.count, self.options.kv_per_head(max_len), self.ctx.head_dim, device, dtype)

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: SlotKV) -> torch.Tensor:
        """Prefill (empty cache, positions from 0): the fast path, caching the strided tokens; later: one
        token, which joins every head iff its position is a multiple of ρ."""
        B = x.shape[0]
        if cache.fresh:
            sel = self.select(positions)
            gathered_prefill(cache, x, positions, sel.idx, sel.valid, self.qkv.weight, self.rope)
            return self.forward_fast(x, positions)
        one_token("fixed", x)
        member = (positions[:, :1] % self.options.sparsity == 0).expand(B, self.count)
        ones = torch.ones(member.shape, device=x.device, dtype=x.dtype)  # r = 1
        return gathered_step(cache, x, positions, member, ones, self.qkv.weight, self.out.weight, self.rope)
