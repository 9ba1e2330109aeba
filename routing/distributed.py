"""Batch statistics of head state reduced over data-parallel ranks (DDP, DeepSpeed).

A state update that uses batch statistics (MoSA's running threshold, the Routing Transformer's
k-means centroids) must see the global batch, not one rank's slice: otherwise each rank's state
drifts apart and DDP's broadcast of rank 0's buffers makes the run differ from one process with the
same micro-batches. The statistics are staged in the forward passes and summed over the ranks once per
optimizer step, at the commit (heads/base.py). The helpers are identities outside an initialised process
group of size > 1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    """Ranks of the default process group (1 when not distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over all ranks (a new tensor; x is left as it is)."""
    if world_size() == 1:
        return x
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out

