"""Buffers that stay in fp32 when a model is cast to 16 bits (Lightning's `bf16-true` / `16-true` call
`module.to(torch.bfloat16)`, which converts floating buffers too).

Running statistics updated by small EMA steps cannot live in bf16 (8 bits of mantissa): MoSA's threshold moves by
momentum * (q - tau) = 0.02 * (q - tau), below half a bf16 step at |tau| ~ 2 unless |q - tau| > 0.4, and k-means'
mu * 0.999 rounds back to mu. RoPE's frequencies in bf16 are off by up to 0.4%, a phase error of 0.2 rad at
position 1000 that changes when the model is later run in fp32. Device moves and fp64 casts apply as usual.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

HALF = (torch.bfloat16, torch.float16)


class Float32Buffers(nn.Module):
    """Mixin: this module's own floating buffers are never converted to a 16-bit dtype (kept in fp32)."""

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        """Registered in fp32 also when created in 16 bits: a model built under a 16-bit default dtype (Hugging Face's
        `from_pretrained(dtype=torch.bfloat16)`) would otherwise load its fp32 checkpoint state rounded."""
        super().register_buffer(name, tensor.float() if tensor is not None and tensor.dtype in HALF else tensor,
                                persistent)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        before = {name: buf for name, buf in self._buffers.items() if buf is not None and buf.is_floating_point()}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype in HALF:  # cast from the original, not from the rounded copy
                self._buffers[name] = old.to(device=new.device, dtype=torch.float32)
        return self
