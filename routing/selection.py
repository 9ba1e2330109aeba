"""Token selections shared by the sparse heads: which tokens each head (or cluster) processes.

A `Selection` holds, per row (one head of one sequence, or one cluster), `c` slots of token indices:
the valid slots first and in ascending token order, then padding slots. Ascending order makes the
MoSA mask M_ij = 0 iff I_i >= I_j the ordinary causal mask over slots, and padding at the end means
no valid slot can see a padding slot, so one batched causal attention call handles variable counts.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Selection(NamedTuple):
    idx: torch.Tensor  # [..., c] int64 token indices; valid slots ascending, then padding (index 0)
    valid: torch.Tensor  # [..., c] bool, True on the valid slots (a prefix of the row)


def earliest_first(mask: torch.Tensor, capacity: int) -> Selection:
    """Keep the earliest `capacity` candidates of each row of mask[..., T] (overflow drops the latest).

    Causal: whether token t is kept depends only on mask[..., :t+1] (a running count), so
    autoregressive decoding can make the same decision with one counter per row."""
    T = mask.shape[-1]
    c = max(min(capacity, T), 1)
    rank = mask.long().cumsum(-1) - 1  # slot of each candidate, in token order
    keep = mask & (rank < c)
    slot = torch.where(keep, rank, torch.full_like(rank, c))  # dropped / non-candidates -> dummy slot c
    pos = torch.arange(T, device=mask.device).expand_as(rank)
    idx = torch.zeros(*mask.shape[:-1], c + 1, dtype=torch.long, device=mask.device)
    idx = idx.scatter(-1, slot, pos)[..., :c]
    count = keep.sum(-1, keepdim=True)
    valid = torch.arange(c, device=mask.device) < count
    return Selection(torch.where(valid, idx, torch.zeros_like(idx)), valid)
