"""The precision of tl.dot in this repository's Triton kernels (heads/gathered_triton.py, heads/varlen_triton.py):
the one torch.matmul would use for the same inputs."""
from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision in a kernel whose inputs are `dtype`: "ieee" (exact fp32 products) for fp32 inputs
    unless torch allows TF32 (torch.set_float32_matmul_precision("high" or "medium")), as torch.matmul; "tf32"
    (Triton's NVIDIA default) otherwise: 16-bit operands ignore it, and the fp32 intermediates of 16-bit inputs
    (autocast) are finer in TF32 than the 16 bits they came from. TF32 is read from the per-backend setting
    (torch.backends.cuda.matmul.fp32_precision), which every way of allowing it sets: the global getter raises once
    the per-backend API was used."""
    if dtype != torch.float32:
        return "tf32"
    return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "ieee"
