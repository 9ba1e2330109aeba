"""Attention heads that each process their own subset of tokens (MoSA §2.2, shared by mosa and fixed).

Head i gets token indices I (its selection) and scores r_I, and computes
    X^s = X[I];  Q, K, V = X^s W^Q_i, X^s W^K_i, X^s W^V_i;  RoPE on Q, K at the original positions I;
    A = softmax(Q K^T / sqrt(h') + M) V with M_jl = 0 iff I_j >= I_l;
    X^o = diag(r_I) A W^O_i;  Y[I] += X^o  (unselected positions receive nothing from head i).
The group output is the sum over heads (eq. 3). Weights are stored fused like heads/dense.py:
W^QKV [3*H*h', h] (rows: q|k|v, then head, then h'), W^O [h, H*h'].
"""
from __future__ import annotations

import importlib.util

import torch

from heads.gathered_lean import compute_dtype, gathered_heads_lean
from heads.rope import RotaryEmbedding
from heads.switch import FastPath
from routing.selection import Selection

TRITON = importlib.util.find_spec("triton") is not None  # resolved at import: a constant for torch.compile
_FUSED, _WHOLE_HEAD = FastPath(), FastPath()
fused_disabled = _FUSED.disabled  # inside this block gathered_heads_fast takes the lean core on CUDA too (benchmarks)
whole_head_disabled = _WHOLE_HEAD.disabled  # inside it heads that fit on chip take the tiled kernels (benchmarks)


def gathered_heads_reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    index_sets: list[list[torch.Tensor]],
    gates: list[list[torch.Tensor]],
    qkv_weight: torch.Tensor,
    out_weight: torch.Tensor,
    rope: RotaryEmbedding,
) -> torch.Tensor:
    """Plain per-sequence, per-head loop. index_sets[b][i]: int64[k_bi] token indices of head i in
    sequence b, in any order (e.g. TopK order); gates[b][i]: float[k_bi] their scores r."""
    B, T, h = x.shape
    H = len(index_sets[0])
    d = qkv_weight.shape[0] // (3 * H)
    w_qkv, w_o = qkv_weight.view(3, H, d, h), out_weight.view(h, H, d)
    out = []
    for b in range(B):
        y = x.new_zeros(T, h)
        for i in range(H):
            I = index_sets[b][i]  # [k]
            xs = x[b, I]  # X^s [k, h]
            q, k, v = xs @ w_qkv[0, i].T, xs @ w_qkv[1, i].T, xs @ w_qkv[2, i].T  # [k, h']
            q, k = rope(q, positions[b, I]), rope(k, positions[b, I])  # rotate by original positions
            allowed = I[:, None] >= I[None, :]  # M_jl = 0 iff I_j >= I_l (not triangular in TopK order)
            scores = (q @ k.T / d**0.5).masked_fill(~allowed, float("-inf"))
            a = scores.softmax(-1) @ v  # [k, h']
            x_o = (gates[b][i][:, None] * a) @ w_o[:, i].T  # diag(r) A W^O_i  [k, h]
            y = y.index_add(0, I, x_o.to(y.dtype))  # back to the original positions
        out.append(y)
    return torch.stack(out)


def gathered_heads_fast(
    x: torch.Tensor,
    positions: torch.Tensor,
    sel: Selection,
    gate: torch.Tensor,
    qkv_weight: torch.Tensor,
    out_weight: torch.Tensor,
    rope: RotaryEmbedding,
    visible: torch.Tensor | None = None,
    self_only: torch.Tensor | None = None,
) -> torch.Tensor:
    """All heads at once. sel.idx[B, H, c] ascending over valid slots then padding (so the MoSA mask
    is the ordinary causal mask over slots), gate[B, H, c] = r on valid slots and 0 on padding;
    visible/self_only: MoSAIC's padding masks (heads/gathered_lean.slot_mask). CUDA with Triton: the fused
    kernels, forward and backward (heads/gathered_triton.py), for fp32/bf16/fp16 heads that fit on chip (c x h'
    up to 64 x 64 in 16 bits, 128 x 64 on H100/H200, 32 x 64 in fp32: `fits`); larger heads of those dtypes (h' up
    to 256 in 16 bits, 128 in fp32: `tiled_fits`) the tiled kernels around SDPA (heads/gathered_tiled.py);
    otherwise (CPU, fp64, wider heads) the memory-lean PyTorch core (heads/gathered_lean.py; on CUDA too inside
    `fused_disabled()`). None materialises nor saves anything of size [B, H, c, h]."""
    args = (x, positions, sel.idx, gate, qkv_weight, out_weight, rope, visible, self_only)
    if x.is_cuda and TRITON and _FUSED.on:
        from heads.gathered_triton import shared_memory

        d = qkv_weight.shape[0] // (3 * sel.idx.shape[1])
        core = cuda_core(sel.idx.shape[-1], d, compute_dtype(x), shared_memory(x.get_device()))
        if core == "fused":
            from heads.gathered_triton import gathered_heads_triton

            return gathered_heads_triton(*args)
        if core == "tiled":
            from heads.gathered_tiled import gathered_heads_tiled

            return gathered_heads_tiled(*args)
    return gathered_heads_lean(*args)


def cuda_core(c: int, d: int, dtype: torch.dtype, shared: int) -> str:
    """Which core runs heads of c slots of width h' = d computed in `dtype` on a CUDA GPU with Triton and `shared`
    bytes of shared memory per block: "fused" (heads/gathered_triton.fits; not inside `whole_head_disabled()`),
    "tiled" (heads/gathered_tiled.tiled_fits) or "lean"."""
    from heads.gathered_tiled import tiled_fits
    from heads.gathered_triton import fits

    if _WHOLE_HEAD.on and fits(c, d, dtype, shared):
        return "fused"
    return "tiled" if tiled_fits(d, dtype) else "lean"
