"""Causal sliding-window (local) attention heads, for the long-sequence hybrids of MoSA §3.

Query at position i attends to the `window` most recent tokens j with i - window < j <= i
(itself included). KV entries per head: min(window, T).
Fast path: blocks of `window` queries attend to their own block and the previous one, with a
[window, 2*window] band mask, so cost and memory are O(T * window) instead of O(T^2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heads.attention import attend
from heads.base import ConfigError, GroupContext, HeadOptions, register
from heads.dense import DenseHeads
from heads.kv_cache import SlotKV


@dataclass
class LocalOptions(HeadOptions):
    window: int = 256  # tokens each query sees, itself included

    def validate(self, ctx: GroupContext) -> None:
        super().validate(ctx)
        if self.window < 1:
            raise ConfigError(f"local: window must be >= 1, got {self.window}")

    def kv_per_head(self, seq_len: int) -> int:
        return min(self.window, seq_len)


@register("local")
class LocalHeads(DenseHeads):
    """Sliding-window heads: the dense heads' projections (`qkv`, `out`) with a band mask."""

    Options = LocalOptions
    options: LocalOptions

    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, positions)
        gap = positions[:, :, None] - positions[:, None, :]  # [B, T, T] i - j
        allowed = (gap >= 0) & (gap < self.options.window)  # i - window < j <= i
        heads = []
        for i in range(self.count):
            scores = q[:, i] @ k[:, i].transpose(-1, -2) / self.ctx.head_dim**0.5
            heads.append(scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[:, i])
        return self._merge(torch.stack(heads, 1))

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, positions)
        B, H, T, d = q.shape
        w = min(self.options.window, T)
        n = -(-T // w)  # blocks
        pad = n * w - T  # padded queries/keys sit after every real token: invisible to real queries

        def blocks(t: torch.Tensor) -> torch.Tensor:
            return F.pad(t, (0, 0, 0, pad)).view(B, H, n, w, d)

        qb, kb, vb = blocks(q), blocks(k), blocks(v)
        prev = lambda t: F.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :-1]  # noqa: E731  block n-1 (zeros before 0)
        kk, vv = torch.cat((prev(kb), kb), 3), torch.cat((prev(vb), vb), 3)  # [B, H, n, 2w, d]
        qi = torch.arange(w, device=x.device)[:, None] + w  # query offset within [prev | own]
        kj = torch.arange(2 * w, device=x.device)[None, :]
        band = (qi - kj >= 0) & (qi - kj < self.options.window)  # [w, 2w]
        first = torch.ones(n, 1, 2 * w, dtype=torch.bool, device=x.device)
        first[0, :, :w] = False  # block 0 has no previous block
        mask = (band & first).expand(H, n, w, 2 * w).reshape(1, H * n, w, 2 * w)
        a = attend(qb.reshape(B, H * n, w, d), kk.reshape(B, H * n, 2 * w, d), vv.reshape(B, H * n, 2 * w, d), mask=mask)
        return self._merge(a.view(B, H, n * w, d)[:, :, :T])

    def new_cache(self, batch: int, max_len: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> SlotKV:
        """A ring buffer of the last `window` tokens."""
        slots = min(self.options.window, max_len)
        return SlotKV.empty(batch, self.count, slots, self.ctx.head_dim, device, dtype, ring=True)

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: SlotKV) -> torch.Tensor:
        """Prefill (empty cache): the fast path, keeping the last `window` keys; later: one token."""
        q, k, v = self._qkv(x, positions)
        prefill = cache.fresh
        cache.write(torch.ones(k.shape[:3], dtype=torch.bool, device=x.device), k, v, positions[:, None].expand_as(k[..., 0]))
        if prefill:
            return self.forward_fast(x, positions)
        return self._merge(cache.attend(q, positions, window=self.options.window))
