"""Coverage by position: how much of what a head deserves it keeps, per part of the sequence.

A causal selection with a fixed capacity drops candidates when a head overflows; where in the
sequence it drops them decides whether the head's view is biased (earliest-first overflow drops
the end). coverage[j] = |selected ∩ deserved in part j| / |deserved in part j| over all rows, for
`parts` equal contiguous parts of the sequence (quarters by default). "Deserved" is what the
selection would keep without a capacity (its candidates), or the faithful expert-choice top-k.
"""
from __future__ import annotations

import torch

from routing.selection import Selection


def members(sel: Selection, seq_len: int) -> torch.Tensor:
    """Selection [..., c] -> bool[..., T]: True where token t is in the row's valid slots."""
    out = torch.zeros(*sel.idx.shape[:-1], seq_len + 1, dtype=torch.long, device=sel.idx.device)
    slot = torch.where(sel.valid, sel.idx, torch.full_like(sel.idx, seq_len))  # padding -> dummy column T
    return out.scatter(-1, slot, 1)[..., :seq_len].bool()


def coverage_by_position(selected: torch.Tensor, deserved: torch.Tensor, parts: int = 4) -> list[float]:
    """selected, deserved bool[..., T] -> per part of the sequence, the fraction of deserved
    (row, token) pairs that are selected (nan for a part with nothing deserved)."""
    kept = (selected & deserved).flatten(0, -2).sum(0).float()  # [T]
    wanted = deserved.flatten(0, -2).sum(0).float()
    return [(k.sum() / w.sum()).item() if w.sum() > 0 else float("nan")
            for k, w in zip(kept.tensor_split(parts), wanted.tensor_split(parts))]
