"""Layer normalisation without scale or bias whose backward reads its output, not its input.

y = (x - mean(x)) / sqrt(var(x) + eps) over the last dimension, as F.layer_norm(x, x.shape[-1:]). torch's kernel
keeps x for backward; here the output is kept instead (Apex's `memory_efficient` LayerNorm), with the [..., 1]
mean and rstd = 1 / sqrt(var(x) + eps): backward rebuilds x = y / rstd + mean (exact up to rounding) and runs
torch's own fused backward, dL/dx = rstd * (g - mean(g) - y * mean(g * y)) for g = dL/dy. So when the next
operation keeps y anyway (the Routing Transformer's normalize of the shared queries, heads/routing_attn.py), x
is not kept at all. Statistics are taken in at least fp32; y has x's dtype.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

EPS = 1e-5  # F.layer_norm's default


class _OutputLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y, mean, rstd = torch.native_layer_norm(xf, xf.shape[-1:], None, None, EPS)
        y = y.to(x.dtype)
        ctx.save_for_backward(y, mean, rstd)
        ctx.dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        y, mean, rstd = ctx.saved_tensors
        x = torch.addcdiv(mean, y.to(mean.dtype), rstd)  # the input, rebuilt: y / rstd + mean
        dx, _, _ = torch.ops.aten.native_layer_norm_backward(g.to(mean.dtype), x, x.shape[-1:], mean, rstd, None,
                                                            None, [True, False, False])
        return dx.to(ctx.dtype)


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """x[..., d] -> its layer norm without scale or bias (F.layer_norm(x, (d,))), backward keeping the output.
    Under torch.compile it is F.layer_norm: the compiler chooses what backward keeps itself, and torch 2.11's
    dynamo (the GPU image's) traced this Function followed by F.normalize into a zero gradient."""
    if torch.compiler.is_compiling():
        return F.layer_norm(x, x.shape[-1:])
    return _OutputLayerNorm.apply(x)
