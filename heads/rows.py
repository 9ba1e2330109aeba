"""Row gathers over a [B, H] batch of tables: one index_select on the flattened [B*H*N, X] table.

index_select copies whole rows and keeps only the index for backward (index_add of the gradient), where
`gather` with an expanded [B, H, ..., X] index keeps that index and its whole input.
"""
from __future__ import annotations

import torch


def flat_rows(index: torch.Tensor, N: int) -> torch.Tensor:
    """index[B, H, ...] (rows < N of sequence b, head h) -> the same rows of the [B*H*N, ...] table."""
    B, H = index.shape[:2]
    offsets = torch.arange(B * H, device=index.device).view(B, H, *[1] * (index.dim() - 2)) * N
    return index + offsets


def gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[B, H, N, X], index[B, H, ...] (values < N) -> t's rows at index, [B, H, ..., X]."""
    B, H, N, X = t.shape
    return t.reshape(B * H * N, X).index_select(0, flat_rows(index, N).flatten()).view(*index.shape, X)
