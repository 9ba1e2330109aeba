"""Causal sliding-window (local) attention heads, for the long-sequence hybrids of MoSA §3.

Query at position i attends to the `window` most recent tokens j with i - window < j <= i
(itself included). KV entries per head: min(window, T).
Fast path: with flash-attn (CUDA, 16-bit) its sliding-window kernel (`window_size`), which computes only the
band; elsewhere `window_blocks`: blocks of `window` queries attend to their own block and the previous one
(`band_layout`), with a [window, 2*window] band mask, so cost and memory are O(T * window) instead of O(T^2); a
window near T takes the masked causal square instead, which scores fewer keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from heads.attention import attend, flash_usable, sliding_window
from heads.base import ConfigError, GroupContext, HeadOptions, register
from heads.dense import DenseHeads
from heads.kv_cache import SlotKV, one_token


def band_layout(T: int, window: int, blocks: int = 2) -> tuple[int, int]:
    """(block, key blocks) for window_blocks: blocks of b = ceil(window / (blocks - 1)) rows, each attending to its
    own and the `blocks - 1` before it, which hold every key within `window`; a query scores
    blocks * b ~ window * blocks / (blocks - 1) keys. Fewer key blocks where the sequence has fewer; one block of T
    rows (the whole causal square, masked) where that scores fewer keys, as for a window near or past T (200 of
    T = 256: 2.6x the formula's FLOPs in blocks, 1.2x so); window 1: blocks of one row, each its own key.
    The default 2 (2 window keys): 3 (1.5 window) was 4% faster for a group of 8 local heads at T = 1024,
    window 256, h = 512 on CPU (the attention alone 1.2x), but kept 15% more memory at its peak (the gradients of
    the blocks' keys and values, [nb, blocks * b] rows: 1.5x), so it is not the default."""
    if window <= 1:
        return 1, 1
    block = -(-window // (blocks - 1))
    nb = -(-T // block)
    blocks = min(blocks, nb)
    if T * T <= nb * block * blocks * block:
        return T, 1
    return block, blocks


def window_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int,
                  window: int, blocks: int = 2) -> tuple[torch.Tensor, ...]:
    """Banded attention in blocks: q, k, v [B, H, T, d] -> queries qb[B*H, nb, block, d] (nb = ceil(T /
    block), padded rows at the end), keys/values kb, vb[B*H, nb, blocks*block, d] of the `blocks - 1` previous
    and the own block (zeros before row 0), and the band mask [nb, block, blocks*block]: key row p is visible to
    query row t iff p >= 0 and t - window < p <= t. Needs window <= (blocks - 1) * block + 1 (no key beyond the
    blocks taken) or a single block (block >= T). kb and vb are overlapping views of one copy of k and v each
    (`block_windows`), so that what keeps them for backward keeps T rows per sequence, not blocks*T. The mask has no
    batch or head dimension, so SDPA broadcasts it (a [B*H*nb, block, blocks*block] copy would be materialised, and
    kept as a float bias for backward)."""
    B, H, T, d = q.shape
    nb = -(-T // block)
    pad = nb * block - T  # padded query/key rows sit after every real row: invisible to real queries
    qb = (F.pad(q, (0, 0, 0, pad)) if pad else q).reshape(B * H, nb, block, d)  # F.pad copies, even for pad 0
    t = torch.arange(nb * block, device=q.device).view(nb, block, 1)  # query rows
    lead = (blocks - 1) * block
    p = torch.arange(-lead, nb * block, device=q.device).unfold(0, blocks * block, block)[:nb, None, :]  # key rows
    kb, vb = (block_windows(z, block, nb, blocks) for z in (k, v))
    return qb, kb, vb, (p >= 0) & (p <= t) & (p > t - window)


def block_windows(x: torch.Tensor, block: int, nb: int, blocks: int = 2) -> torch.Tensor:
    """x[B, H, T, d] -> [B*H, nb, blocks*block, d], window i of each sequence = its blocks i - blocks + 1 .. i, as
    overlapping views of one [(blocks - 1)*block + B*H*nb*block, d] copy: zero blocks, then every sequence padded to
    nb blocks. One stride spans the batch, head and block dimensions, so SDPA and matmul read the windows in place
    (zero blocks per sequence would break that and cost a copy in every forward and backward pass: 5% slower). A
    sequence's blocks before its block 0 are thus the previous sequence's last blocks, to be hidden by the caller's
    mask (key row p >= 0): their finite keys and values get weight exactly 0, a non-finite one does not (0 * NaN):
    a sequence gone NaN/inf spoils the next sequence of its batch on this path (local, agent, MiTA); training stops
    or skips such a step anyway (lm/nonfinite.py)."""
    B, H, T, d = x.shape
    lead = (blocks - 1) * block
    rows = x.new_zeros(lead + B * H * nb * block, d)
    rows[lead:].view(B, H, nb * block, d)[:, :, :T] = x
    return rows.unfold(0, blocks * block, block).transpose(-1, -2).view(B * H, nb, blocks * block, d)


@dataclass
class LocalOptions(HeadOptions):
    window: int = 256  # tokens each query sees, itself included

    @classmethod
    def example(cls) -> dict[str, Any]:
        return {"window": 8}

    @classmethod
    def grid(cls) -> dict[str, list[Any]]:
        return {"window": [1, 2, 3, 7, 16, 200]}

    def validate(self, ctx: GroupContext) -> None:
        super().validate(ctx)
        if self.window < 1:
            raise ConfigError(f"local: window must be >= 1, got {self.window}")

    def validate_length(self, head: str, seq_len: int) -> None:
        super().validate_length(head, seq_len)
        self.at_most(head, "window", seq_len, "every query would see all its keys (dense attention)")

    def kv_per_head(self, seq_len: int) -> int:
        return min(self.window, seq_len)


@register("local")
class LocalHeads(DenseHeads):
    """Sliding-window heads: the dense heads' projections (`qkv`, `out`) with a band mask."""

    Options = LocalOptions
    beyond_training = "keeps attending to its last `window` tokens"
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
        return self._merge(self._banded(*self._qkv(x, positions)))

    def _banded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Sliding-window attention over q, k, v [B, H, T, h'] -> [B, H, T, h']: flash-attn's own window where it
        runs (CUDA, 16-bit), else in blocks (band_layout)."""
        if flash_usable(q):
            return sliding_window(q, k, v, self.options.window)
        B, H, T, d = q.shape
        block, blocks = band_layout(T, self.options.window)
        qb, kb, vb, band = window_blocks(q, k, v, block, self.options.window, blocks)
        return attend(qb, kb, vb, mask=band).view(B, H, -1, d)[:, :, :T]

    def new_cache(self, batch: int, max_len: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> SlotKV:
        """A ring buffer of the last `window` tokens; for max_len < window, max_len plain slots (a ring that short
        would overwrite keys still inside the window; full, they refuse the next token)."""
        window = self.options.window
        return SlotKV.empty(batch, self.count, min(window, max_len), self.ctx.head_dim, device, dtype,
                            ring=max_len >= window)

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: SlotKV) -> torch.Tensor:
        """Prefill (empty cache): the fast path, keeping the last `window` keys; later: one token."""
        q, k, v = self._qkv(x, positions)
        prefill = cache.fresh
        if not prefill:  # a chunk written at once would overwrite ring slots its earlier queries still need
            one_token("local", x)
        cache.write(torch.ones(k.shape[:3], dtype=torch.bool, device=x.device), k, v, positions[:, None].expand_as(k[..., 0]))
        return self._merge(self._banded(q, k, v) if prefill else cache.attend(q, positions, window=self.options.window))
