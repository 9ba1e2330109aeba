"""Dense multi-head causal self-attention (MoSA eq. 1-2), the baseline every sparse head is matched to.

Per head i: Q_i = X W^Q_i, K_i = X W^K_i, V_i = X W^V_i (h -> h'), RoPE on Q and K at the tokens'
positions, A_i = softmax(Q_i K_i^T / sqrt(h') + M) V_i with M_jl = 0 iff pos_j >= pos_l, and the
group output sum_i A_i W^O_i (eq. 2). The projections of all heads are stored fused:
W^QKV in R^{h x 3Hh'}, W^O in R^{Hh' x h}.
"""
from __future__ import annotations

import torch
from torch import nn

from heads.attention import attend
from heads.base import GroupContext, HeadGroup, HeadOptions, register
from heads.kv_cache import SlotKV


@register("dense")
class DenseHeads(HeadGroup):
    Options = HeadOptions
    beyond_training = "attends to every token, at rotary positions never seen in training"

    def __init__(self, ctx: GroupContext, count: int, options: HeadOptions) -> None:
        super().__init__(ctx, count, options)
        self.qkv = nn.Linear(ctx.d_model, 3 * count * ctx.head_dim, bias=False)
        self.out = nn.Linear(count * ctx.head_dim, ctx.d_model, bias=False)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x[B, T, h] -> q, k, v each [B, H, T, h'], q and k rotated by positions. v is a copy, not a view of
        the fused projection's output: whatever keeps v for backward would keep all three thirds of it, while
        the rotation has already copied q and k (saves 2/3 of that output per group in training)."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.count, self.ctx.head_dim).permute(2, 0, 3, 1, 4)
        pos = positions[:, None, :]  # [B, 1, T] broadcasts over heads
        return self.rope(q, pos), self.rope(k, pos), v.contiguous() if self.rope.rot_dim else v

    def _merge(self, a: torch.Tensor) -> torch.Tensor:
        """Per-head outputs a[B, H, T, h'] -> sum_i A_i W^O_i [B, T, h] (eq. 2, as concat then W^O)."""
        B, _, T, _ = a.shape
        return self.out(a.transpose(1, 2).reshape(B, T, self.count * self.ctx.head_dim))

    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, positions)
        allowed = positions[:, :, None] >= positions[:, None, :]  # [B, T, T]: M_jl = 0 iff pos_j >= pos_l
        heads = []
        for i in range(self.count):  # one head at a time, explicit softmax
            scores = q[:, i] @ k[:, i].transpose(-1, -2) / self.ctx.head_dim**0.5  # [B, T, T]
            scores = scores.masked_fill(~allowed, float("-inf"))
            heads.append(scores.softmax(-1) @ v[:, i])  # [B, T, h']
        return self._merge(torch.stack(heads, dim=1))

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, positions)
        return self._merge(attend(q, k, v, causal=True))  # positions are increasing within a sequence

    def new_cache(self, batch: int, max_len: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> SlotKV:
        return SlotKV.empty(batch, self.count, max_len, self.ctx.head_dim, device, dtype)  # all T tokens

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: SlotKV) -> torch.Tensor:
        """Prefill (empty cache): causal attention over the chunk; later: attend to every cached key."""
        q, k, v = self._qkv(x, positions)
        prefill = cache.fresh
        cache.write(torch.ones(k.shape[:3], dtype=torch.bool, device=x.device), k, v, positions[:, None].expand(-1, self.count, -1))
        return self._merge(attend(q, k, v, causal=True) if prefill else cache.attend(q, positions))
