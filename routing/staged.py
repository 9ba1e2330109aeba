"""Head state moved by batch statistics, staged in the forward passes and applied once per optimizer step.

A training forward pass adds its statistics to the non-persistent `pending` buffer (the subclass's `stage`); after
the optimizer step `commit` sums `pending` over the data-parallel ranks (routing/distributed.py) and the subclass's
`update` moves the state from it, outside any compiled graph (heads/base.py says why). `commit(keep=False)` drops
what was staged (a skipped step, lm/nonfinite.py). `heads.commit_states(model)` commits every such module.
The buffers stay fp32 in a 16-bit model (routing/float32_state.py).
"""
from __future__ import annotations

import torch

from routing.distributed import all_reduce_sum
from routing.float32_state import Float32Buffers


class StagedStatistics(Float32Buffers):
    """Base of MoSA's running threshold (routing/threshold.py) and the k-means centroids (routing/kmeans.py)."""

    def stage_into(self, *shape: int) -> None:
        """Register `pending` [shape]: the statistics staged since the last commit (empty between steps, not saved)."""
        self.register_buffer("pending", torch.zeros(*shape), persistent=False)

    def update(self, staged: torch.Tensor) -> None:
        """Move the state from `staged`, this step's `pending` summed over every rank."""
        raise NotImplementedError

    @torch.no_grad()
    def commit(self, keep: bool = True) -> None:
        """Apply what was staged since the last commit (every rank calls this once per optimizer step; keep=False,
        which every rank of a skipped step passes, drops it instead) and empty `pending`."""
        if keep:
            self.update(all_reduce_sum(self.pending))
        self.pending.zero_()
