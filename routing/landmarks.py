"""Causal landmarks: block-average pooling, each landmark's top-k keys, and query-to-landmark routing.

Shared by heads/mita.py (MiTA, Algorithm 1 made causal) and heads/agent.py (agent tokens = pooled Q).
The sequence index is split into blocks of `block` tokens; landmark j is the average of the
(already rotated) queries of block j, rows jb .. jb+b-1 (MiTA Alg. 1 line 2 with a causal pool:
only *completed* blocks give a landmark, so n = T // b and a trailing partial block gives none).
Landmark j is complete at row e_j = (j+1)b - 1 and only ever looks at keys at rows <= e_j.
Layout: x[B, H, T, d]; landmarks [B, H, n, d]. Rows are assumed to be in increasing position order
(as for every causal head).
The papers' own, non-causal pooling (variant "published" of both heads) is `adaptive_pool`: n landmarks
averaging n windows that cover the whole sequence (MiTA Alg. 1 line 2, AdaptiveAvgPool; agent attention's
A = Pooling(Q)), so every landmark may hold tokens after any given query.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from routing.selection import earliest_topk


def block_pool(x: torch.Tensor, block: int) -> torch.Tensor:
    """x[B, H, T, d] -> [B, H, T // block, d], the mean of each completed block (MiTA Alg. 1 line 2)."""
    n = x.shape[-2] // block
    return x[..., : n * block, :].unflatten(-2, (n, block)).mean(-2)


def adaptive_windows(n: int, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] first and [n] one-past-last rows of AdaptiveAvgPool's n windows over T rows: floor(jT / n) and
    ceil((j+1)T / n) (PyTorch's rule; windows overlap when n does not divide T, and repeat rows when n > T)."""
    j = torch.arange(n, device=device)
    return j * T // n, -(-(j + 1) * T // n)


def published_count(seq_len: int, block: int) -> int:
    """The fixed number of landmarks (agents) of the published variants: the training length's seq_len // block, at
    least 1, whatever length they then run at (the papers fix m, resp. n)."""
    return max(1, seq_len // block)


def adaptive_pool(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[B, H, T, d] -> [B, H, n, d], the means over `adaptive_windows(n, T)` (MiTA Alg. 1 line 2 as published:
    the windows cover the whole sequence, future rows included)."""
    B, H, T, d = x.shape
    return F.adaptive_avg_pool1d(x.reshape(B * H, T, d).transpose(1, 2), n).transpose(1, 2).reshape(B, H, n, d)


def block_ends(n: int, block: int, device: torch.device) -> torch.Tensor:
    """[n] row index of the last token of each completed block: e_j = (j+1) * block - 1."""
    return torch.arange(1, n + 1, device=device) * block - 1


def prefix_mask(n: int, T: int, block: int, device: torch.device) -> torch.Tensor:
    """[n, T] bool: key row p is visible to landmark j iff p <= e_j (its block has ended by then)."""
    return torch.arange(T, device=device)[None, :] <= block_ends(n, block, device)[:, None]


def distance_buckets(d: torch.Tensor, buckets: int, max_distance: int) -> torch.Tensor:
    """Bucket of a token distance d >= 0 (negative d, only ever masked out, counts as 0), T5-style (Raffel et al.
    2020, relative position buckets): d itself below `buckets` // 2, then log-spaced up to max_distance, the last
    bucket beyond. Used by the agent biases (heads/agent.py)."""
    d = d.clamp(min=0)
    exact = buckets // 2
    if exact == 0:
        return torch.zeros_like(d)
    span = math.log(max(max_distance, exact + 1) / exact)
    far = exact + (torch.log(d.clamp(min=exact).double() / exact) / span * (buckets - exact)).long()
    return torch.where(d < exact, d, far.clamp(max=buckets - 1))


def signed_distance_buckets(d: torch.Tensor, buckets: int, max_distance: int) -> torch.Tensor:
    """Bucket of a signed token distance, T5's bidirectional rule: `buckets` // 2 buckets of distance_buckets
    for d >= 0, as many after them for d < 0 (a key or query after the agent). For the published agent biases."""
    half = buckets // 2
    return distance_buckets(d.abs(), half, max_distance) + half * (d < 0)


def earlier_blocks(T: int, n: int, block: int, device: torch.device, local_blocks: int = 1) -> torch.Tensor:
    """[T, n] bool: landmark j is eligible for query row t iff block j ended before the query's
    `local_blocks` most recent blocks (its own and the ones before it) start, j < t // block - (local_blocks - 1),
    so its keys never overlap the keys the query attends to locally."""
    rows = torch.arange(T, device=device) // block - (local_blocks - 1)
    return torch.arange(n, device=device)[None, :] < rows[:, None]


def landmark_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MiTA eq. 7 made causal. scores[B, H, n, T] (future keys already -inf) -> the rows of each
    landmark's min(k, T) best keys, idx[B, H, n, k'], and valid[B, H, n, k'] (False where a young
    landmark has fewer than k visible keys and top-k had to pick a masked one). Equal scores go to the earliest key
    (`earliest_topk`): prefill, the full pass and the decoding cache score rows of different widths."""
    top, idx = earliest_topk(scores, min(k, scores.shape[-1]))
    return idx, top > float("-inf")


def route(logits: torch.Tensor, eligible: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MiTA's e_1(q) .. e_s(q): each query's top-s landmarks among the eligible ones.
    logits[B, H, T, n] (q . q~_j), eligible[T, n] -> sel[B, H, T, s'] landmark indices and
    valid[B, H, T, s'] (False where a query has fewer than s eligible landmarks), s' = min(s, n). Equal logits
    go to the earliest landmark (`earliest_topk`), so the one-token decoding step, whose logits row has another
    shape, routes as the full pass does."""
    top, sel = earliest_topk(logits.masked_fill(~eligible, float("-inf")), s)
    return sel, top > float("-inf")
