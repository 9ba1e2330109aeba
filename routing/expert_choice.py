"""Expert-choice token selection (MoSA §2.2): each head takes TopK(r, k) of the whole sequence.

Non-causal as published: whether token i is selected depends on the scores of the tokens after i
(they compete for the same k slots). Kept as MoSA's faithful variant, behind selection="expert_choice".
"""
from __future__ import annotations

import torch

from routing.selection import Selection, earliest_topk


def tokens_per_head(seq_len: int, sparsity: float) -> int:
    """k = T / ρ; for sequences shorter than training, k = max(floor(T/ρ), 2) (MoSA App. F), at most T."""
    return min(seq_len, max(seq_len // sparsity, 2))


def expert_choice(scores: torch.Tensor, k: int, keep_first: bool = False) -> Selection:
    """scores[..., T] -> the k highest-scoring tokens of each row, indices sorted ascending; equal scores go to the
    earliest tokens (a stable sort: topk breaks ties by its kernel's layout, so a row's selection could depend on
    the rows batched beside it, e.g. repeated tokens' equal scores in the first layer). Scores equal only up to
    rounding, as the Routing head's normalised queries of repeated tokens, which vectorised kernels round by their
    place in memory, can still order differently from batch to batch: those selections are not causal anyway.
    keep_first forces token 0 into every selection (it then takes one of the k slots)."""
    if keep_first:
        scores = scores.detach().clone()
        scores[..., 0] = float("inf")
    idx = earliest_topk(scores, k)[1].sort(dim=-1).values
    return Selection(idx, torch.ones_like(idx, dtype=torch.bool))
