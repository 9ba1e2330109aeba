"""Expert-choice token selection (MoSA §2.2): each head takes TopK(r, k) of the whole sequence.

Non-causal as published: whether token i is selected depends on the scores of the tokens after i
(they compete for the same k slots). Kept as MoSA's faithful variant, behind selection="expert_choice".
"""
from __future__ import annotations

import torch

from routing.selection import Selection


def tokens_per_head(seq_len: int, sparsity: int) -> int:
    """k = T / ρ; for sequences shorter than training, k = max(floor(T/ρ), 2) (MoSA App. F), at most T."""
    return min(seq_len, max(seq_len // sparsity, 2))


def expert_choice(scores: torch.Tensor, k: int, keep_first: bool = False) -> Selection:
    """scores[..., T] -> the k highest-scoring tokens of each row, indices sorted ascending.
    keep_first forces token 0 into every selection (it then takes one of the k slots)."""
    if keep_first:
        scores = scores.detach().clone()
        scores[..., 0] = float("inf")
    idx = scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    return Selection(idx, torch.ones_like(idx, dtype=torch.bool))
