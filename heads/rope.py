"""Position-aware rotary embeddings (RoPE, Su et al. 2021; MoSA App. H "Positional encodings").

Every token is rotated by the angle of its *original* position in the sequence, passed explicitly,
so a sparse head that gathers tokens X^s = X[I] rotates row i by position I_i, not by i.
Following MoSA App. H, only a fraction (default half) of each head's dimensions is rotated; the rest
passes through unchanged. Within the rotated part, dimension j is paired with j + r/2 (the
"rotate-half" layout): (x_j + i x_{j+r/2}) is multiplied by exp(i * pos * theta_j),
theta_j = base^(-2j/r), j = 0 .. r/2-1.
"""
from __future__ import annotations

import math

import torch

from routing.capacity import decimal
from routing.float32_state import Float32Buffers


class RotaryEmbedding(Float32Buffers):
    """Rotates the first `rot_dim` dims of vectors x[..., T, head_dim] by explicit positions[..., T]; the
    frequencies stay fp32 in a bf16 model."""

    def __init__(self, head_dim: int, fraction: float = 0.5, base: float = 10000.0) -> None:
        super().__init__()
        rot_dim = math.floor(decimal(fraction) * head_dim) // 2 * 2  # 0.58 x 100 is 58, not float's 57.99...
        if not 0 <= rot_dim <= head_dim:
            raise ValueError(f"rope fraction {fraction} gives rot_dim {rot_dim} outside [0, {head_dim}]")
        if not 1.0 < base < math.inf:
            raise ValueError(f"rope base must be finite and > 1, got {base}")
        self.head_dim, self.rot_dim = head_dim, rot_dim
        inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / max(rot_dim, 1))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [r/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the angles pos * theta_j, each [..., T, r/2] in `dtype` (angles in fp32)."""
        return cos_sin(positions, self.inv_freq, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [..., T, head_dim]; positions: integer tensor broadcastable to x.shape[:-1]."""
        if self.rot_dim == 0:
            return x
        cos, sin = self.cos_sin(positions, x.dtype)
        half = self.rot_dim // 2
        x1, x2, rest = x[..., :half], x[..., half:self.rot_dim], x[..., self.rot_dim:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest), dim=-1)

    def rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x rotated in place by R(θ) (forward's map, cos/sin from `cos_sin`), or by R(θ)^T = R(-θ) if `inverse`;
        for code that runs without autograd (heads/gathered_lean.py): no output tensor, no copy of the unrotated
        dims."""
        return rotate_(x, cos, sin, inverse)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles pos * theta_j (theta = inv_freq [r/2]), each [..., T, r/2] in `dtype` (angles in
    fp32)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, r/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RotaryEmbedding.rotate_ for the r = 2 * cos.shape[-1] rotated dims of x, in place (no autograd)."""
    half = cos.shape[-1]
    if half == 0:
        return x
    x1, x2 = x[..., :half], x[..., half:2 * half]
    sign = -1 if inverse else 1
    x1_old = x1.clone()
    x1.mul_(cos).addcmul_(x2, sin, value=-sign)  # x1 cos -+ x2 sin
    x2.mul_(cos).addcmul_(x1_old, sin, value=sign)  # x2 cos +- x1 sin
    return x
