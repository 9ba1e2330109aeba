"""Fused forward of the gathered-head core (heads/gathered.py, MoSA §2.2) as one Triton kernel, for CUDA.

One program per (sequence b, head i), all on chip: load the c selected rows X[b, I] by index in h-chunks,
project them with head i's W^Q, W^K, W^V (fp32 accumulation), rotate q and k at the original positions
(RoPE rotate-half: the partner half is a second projection with permuted weight rows, so no register
shuffles are needed), masked causal softmax over the c <= 256 slots, diag(r) A, project with W^O_i and
atomically add the rows into an fp32 Y[b, I]. Only the rotated Q, K, V [H, B, c, h'] are written for
backward (h' << h); nothing of size [B, H, c, h] exists. The backward is the memory-lean PyTorch one
(heads/gathered_lean.py, GatheredHeads.backward), which recomputes the gathers chunk by chunk; a fused
backward kernel is not written.
Y's fp32 atomic adds make the summation order, not the result up to rounding, vary from run to run.
On CPU the kernel runs under TRITON_INTERPRET=1 (tests, fp32).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from heads.gathered_lean import gathered_heads_lean
from heads.rope import RotaryEmbedding

BLOCK_H = 32  # columns of X / W per projection step


@triton.jit
def _project(X, W, rows, smask, wrow, HD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_H: tl.constexpr):
    """X[rows] @ W[wrow]^T: [BLOCK_C, BLOCK_D] (fp32), W rows given per output column (wrow < 0: zero)."""
    acc = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    for h0 in range(0, HD, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        hmask = hh < HD
        xs = tl.load(X + rows[:, None] * HD + hh[None, :], mask=smask[:, None] & hmask[None, :], other=0.0)
        w = tl.load(W + wrow[None, :] * HD + hh[:, None], mask=(wrow >= 0)[None, :] & hmask[:, None], other=0.0)
        acc += tl.dot(xs.to(tl.float32), w.to(tl.float32))
    return acc


@triton.jit
def _gathered_fwd(X, IDX, GATE, POS, W, WO, VIS, SELF, INV_FREQ, Y, QO, KO, VO,
                  T, H, B, C, scale,
                  HD: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr,
                  HAS_VIS: tl.constexpr, HAS_SELF: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    b = tl.program_id(0)
    i = tl.program_id(1)
    slots = tl.arange(0, BLOCK_C)
    smask = slots < C
    base = (b * H + i) * C  # row of this (sequence, head) in [B, H, C] tensors
    idx = tl.load(IDX + base + slots, mask=smask, other=0)
    rows = b * T + idx  # rows of X viewed as [B*T, h]
    gate = tl.load(GATE + base + slots, mask=smask, other=0.0).to(tl.float32)
    pos = tl.load(POS + rows, mask=smask, other=0).to(tl.float32)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    # RoPE rotate-half: out_j = q_j cos - q_{j+half} sin (j < half), q_j cos + q_{j-half} sin (half <= j < rot)
    partner = tl.where(dd < HALF, dd + HALF, tl.where(dd < ROT, dd - HALF, dd))
    inv = tl.load(INV_FREQ + tl.where(dd < HALF, dd, dd - HALF), mask=dd < ROT, other=0.0)
    ang = pos[:, None] * inv[None, :]
    cos = tl.where((dd < ROT)[None, :], tl.cos(ang), 1.0)
    sin = tl.where((dd < HALF)[None, :], -tl.sin(ang), tl.where((dd < ROT)[None, :], tl.sin(ang), 0.0))
    own = tl.where(dmask, dd, -1)
    other = tl.where(dmask & (dd < ROT), partner, -1)
    q = _project(X, W, rows, smask, i * D + own, HD, BLOCK_C, BLOCK_D, BLOCK_H) * cos
    q += _project(X, W, rows, smask, tl.where(other >= 0, i * D + other, -1), HD, BLOCK_C, BLOCK_D, BLOCK_H) * sin
    k = _project(X, W, rows, smask, tl.where(own >= 0, (H + i) * D + own, -1), HD, BLOCK_C, BLOCK_D, BLOCK_H) * cos
    k += _project(X, W, rows, smask, tl.where(other >= 0, (H + i) * D + other, -1), HD, BLOCK_C, BLOCK_D, BLOCK_H) * sin
    v = _project(X, W, rows, smask, tl.where(own >= 0, (2 * H + i) * D + own, -1), HD, BLOCK_C, BLOCK_D, BLOCK_H)
    out = ((i * B + b) * C + slots)[:, None] * D + dd[None, :]  # [H, B, C, D] layout
    omask = smask[:, None] & dmask[None, :]
    tl.store(QO + out, q.to(QO.dtype.element_ty), mask=omask)
    tl.store(KO + out, k.to(KO.dtype.element_ty), mask=omask)
    tl.store(VO + out, v.to(VO.dtype.element_ty), mask=omask)
    # masked softmax over slots: key l <= query j, key visible, always the diagonal; self_only: diagonal only
    diag = slots[:, None] == slots[None, :]
    allowed = (slots[None, :] <= slots[:, None]) & smask[None, :]
    if HAS_VIS:
        allowed &= (tl.load(VIS + base + slots, mask=smask, other=0) != 0)[None, :]
    allowed |= diag
    if HAS_SELF:
        allowed = tl.where((tl.load(SELF + base + slots, mask=smask, other=0) != 0)[:, None], diag, allowed)
    s = tl.where(allowed, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
    p = tl.exp(s - tl.max(s, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    a = tl.dot(p, v) * gate[:, None]  # diag(r) A  [C, D]
    for h0 in range(0, HD, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        hmask = hh < HD
        wo = tl.load(WO + hh[None, :] * (H * D) + i * D + dd[:, None], mask=dmask[:, None] & hmask[None, :], other=0.0)
        tl.atomic_add(Y + rows[:, None] * HD + hh[None, :], tl.dot(a, wo.to(tl.float32)),
                      mask=smask[:, None] & hmask[None, :])


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs >= 16


def triton_forward(x: torch.Tensor, gate: torch.Tensor, qkv_weight: torch.Tensor, out_weight: torch.Tensor,
                   idx: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, visible: torch.Tensor | None,
                   self_only: torch.Tensor | None, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """heads.gathered_lean.lean_forward's contract with the fused kernel (`mask` is rebuilt on chip)."""
    B, T, h = x.shape
    H, c = idx.shape[1:]
    d = qkv_weight.shape[0] // (3 * H)
    y = torch.zeros(B * T, h, device=x.device, dtype=torch.float32)
    q, k, v = (x.new_empty(H, B, c, d) for _ in range(3))
    vis = visible.contiguous() if visible is not None else idx  # placeholder pointer when unused
    so = self_only.contiguous() if self_only is not None else idx
    _gathered_fwd[(B, H)](
        x.contiguous(), idx.contiguous(), gate.contiguous(), positions.contiguous(), qkv_weight.contiguous(),
        out_weight.contiguous(), vis, so, rope.inv_freq, y, q, k, v, T, H, B, c, d**-0.5,
        HD=h, D=d, HALF=rope.rot_dim // 2, ROT=rope.rot_dim, HAS_VIS=visible is not None,
        HAS_SELF=self_only is not None, BLOCK_C=_pow2(c), BLOCK_D=_pow2(d), BLOCK_H=BLOCK_H,
    )
    return y, q, k, v


gathered_heads_triton = functools.partial(gathered_heads_lean, forward_impl=triton_forward)
