"""Activation memory of the fused Q/K/V projection (heads/dense.py `_qkv`, shared by every type built on dense
heads, and Routing's Q/V projection): what a group keeps for backward must not include the [B, T, 3Hh'] projection output itself, only the
rotated q, k and a copy of v (measured with rope_fraction 0.5 at T = 1024, batch 4, h = 512: 5 dense heads keep
46.6 -> 36.6 MiB, 8 MiTA heads 116.9 -> 92.9, 9 agent heads 118.1 -> 100.1, parameters included; time unchanged)."""
from __future__ import annotations

import pytest
import torch

from heads import REGISTRY
from heads.dense import DenseHeads
from tests.head_checks import make_group, tiny_options

# type -> its fused projection: every type built on dense heads (`qkv`), and Routing's shared Q = K and V (`qv`,
# whose slots were gathered with `gather`, which keeps its whole input: 103.6 -> 92.3 MiB for 12 heads at T = 1024)
PROJECTIONS = {**{name: "qkv" for name, cls in REGISTRY.items() if issubclass(cls, DenseHeads)}, "routing": "qv"}


def test_the_types_built_on_dense_heads_are_checked() -> None:
    assert {"dense", "agent", "mita", "topk", "local", "routing"} <= set(PROJECTIONS)


@pytest.mark.parametrize("head_type", sorted(PROJECTIONS))
def test_the_fused_projection_output_is_not_kept(head_type: str) -> None:
    T = 64
    group = make_group(head_type, tiny_options(head_type), T, count=3, head_dim=8, d_model=32)
    projected, kept = [], set()  # the output itself is held here, so its memory cannot be reused by another tensor
    getattr(group, PROJECTIONS[head_type]).register_forward_hook(lambda module, args, out: projected.append(out))

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.add(t.untyped_storage().data_ptr())
        return t

    x = torch.randn(2, T, 32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        group(x, torch.arange(T).expand(2, T))
    assert len(projected) == 1 and projected[0].untyped_storage().data_ptr() not in kept
