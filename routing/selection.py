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


def earliest_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the min(k, n) largest scores of each row of scores[..., n], largest first, equal scores
    to the earliest index (torch.topk alone breaks ties by its kernel's layout, which depends on the tensor's shape
    and on the rows batched beside it). Two topk passes: the k-th score, then a tie-free key over positions
    (n < 2^23)."""
    n = scores.shape[-1]
    k = min(k, n)  # all n where k > n
    kth = scores.topk(k, dim=-1).values[..., -1:]  # the k-th largest score of each row
    order = torch.arange(n, 0, -1, device=scores.device, dtype=torch.float32)  # n .. 1: the earlier, the larger
    key = torch.where(scores > kth, order + n, torch.where(scores == kth, order, 0.0))  # distinct where nonzero
    idx = key.topk(k, dim=-1).indices  # every score above the k-th, then the earliest equal to it: the k kept
    ranked = scores.gather(-1, idx).sort(dim=-1, descending=True, stable=True)  # k wide (a full stable sort of n
    return ranked.values, idx.gather(-1, ranked.indices)  # was 3x slower at n = 1024, k = 16 on CPU)


def earliest_first(mask: torch.Tensor, capacity: int) -> Selection:
    """Keep the earliest `capacity` candidates of each row of mask[..., T] (overflow drops the latest).

    Causal: whether token t is kept depends only on mask[..., :t+1] (a running count), so
    autoregressive decoding can make the same decision with one counter per row."""
    c = max(min(capacity, mask.shape[-1]), 1)
    m = mask.long().cumsum(-1)
    return pack(mask & (m <= c), m.clamp(max=c), c)  # the first c candidates; kept so far = min(m, c)


def prefix_quota(mask: torch.Tensor, quota: torch.Tensor, slots: int) -> Selection:
    """Keep candidate t of each row of mask[..., T] iff fewer than quota[t] earlier tokens were kept; `slots` =
    quota[-1] as a Python int (the selection's width: read out of the tensor it would be a data-dependent size,
    which torch.compile cannot trace into the gathered core's chunking).

    quota[T] is non-decreasing and >= 1 (capacity spread over positions), so the kept count obeys
    c_t = min(c_{t-1} + m_t, q_t) (c_{t-1} <= q_{t-1} <= q_t), whose closed form
    c_t = M_t + min(0, min_{s<=t} (q_s - M_s)) with M = cumsum(m) is one cumsum and one cummin.
    Causal: c_t depends on mask[..., :t+1] only (decoding keeps one counter per row)."""
    m = mask.long().cumsum(-1)
    slack = (quota.to(m) - m).cummin(-1).values.clamp(max=0)
    count = m + slack
    kept = mask & (count > torch.nn.functional.pad(count, (1, 0))[..., :-1])
    return pack(kept, count, slots)


def pack(keep: torch.Tensor, count: torch.Tensor, capacity: int) -> Selection:
    """keep[..., T] (at most `capacity` True per row) and count[..., T], keep's running sum (the selections
    above have it already) -> Selection with `capacity` slots (at least 1): the kept tokens ascending, then
    padding."""
    T = keep.shape[-1]
    c = max(capacity, 1)
    rank = count - 1  # slot of each kept token, in token order
    slot = torch.where(keep, rank, torch.full_like(rank, c))  # others -> dummy slot c
    pos = torch.arange(T, device=keep.device).expand_as(rank)
    idx = torch.zeros(*keep.shape[:-1], c + 1, dtype=torch.long, device=keep.device)
    idx = idx.scatter(-1, slot, pos)[..., :c]
    valid = torch.arange(c, device=keep.device) < count[..., -1:]
    return Selection(torch.where(valid, idx, torch.zeros_like(idx)), valid)
