"""The varlen contract of heads/varlen.py as Triton kernels (FlashAttention-2's algorithm over packed
segments), for CUDA machines without flash-attn. On CPU they run under TRITON_INTERPRET=1 (tests).

Forward (one program per segment and BLOCK_M query rows of it): online softmax over the segment's key
blocks, out = acc / l, lse = m + log l (FlashAttention-2 Alg. 1). Backward, given out and lse (which
may be those of a larger merged softmax, see heads/varlen.py): delta = rowsum(dO * O);
one program per key block accumulates dK, dV over the segment's query blocks, one per query block
accumulates dQ over its key blocks (Alg. 2, split in two so no atomics are needed):
    P = exp(Q K^T * scale - lse),  dV = P^T dO,  dS = P (dO V^T - delta),  dQ = dS K scale,  dK = dS^T Q scale.
Rows are [N, D] contiguous (row offsets in int64); D is padded to a power of two >= 16 inside the kernels
(masked).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from heads.dot_precision import dot_precision
from heads.varlen import Segments

BLOCK = 32  # rows per query / key block (tl.dot needs >= 16; `_meta` may take 16)


@triton.jit
def _segment(CU_Q, CU_K):
    """Row ranges [q0, q1) and [k0, k1) of this program's segment (grid axis 0: up to 2^31 - 1 segments, where
    axis 1 stops at 65535 and MiTA makes B * H * T / block of them)."""
    seg = tl.program_id(0)
    return tl.load(CU_Q + seg), tl.load(CU_Q + seg + 1), tl.load(CU_K + seg), tl.load(CU_K + seg + 1)


@triton.jit
def _load(X, idx, valid, d, D: tl.constexpr):
    """Rows idx (int64) of a contiguous [N, D] tensor as a [len(idx), BLOCK_D] tile, 0 where not valid."""
    return tl.load(X + idx[:, None] * D + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _store(X, idx, valid, d, D: tl.constexpr, tile):
    tl.store(X + idx[:, None] * D + d[None, :], tile.to(X.dtype.element_ty), mask=valid[:, None] & (d < D)[None, :])


@triton.jit
def _p_ds(q, k, v, do, lse, delta, rmask, cmask, scale, DOT: tl.constexpr):
    """One [M, N] tile of P = exp(Q K^T scale - lse) and dS = P (dO V^T - delta) (Alg. 2)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT) * scale
    p = tl.where(rmask[:, None] & cmask[None, :], tl.exp(s - lse[:, None]), 0.0)
    return p, p * (tl.dot(do, tl.trans(v), input_precision=DOT) - delta[:, None])


@triton.jit
def _fwd(Q, K, V, O, LSE, CU_Q, CU_K, scale, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
         BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    q0, q1, k0, k1 = _segment(CU_Q, CU_K)
    start = q0 + tl.program_id(1) * BLOCK_M
    if start < q1:
        rows, d = start + tl.arange(0, BLOCK_M).to(tl.int64), tl.arange(0, BLOCK_D)
        rmask = rows < q1
        q = _load(Q, rows, rmask, d, D)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(k0, k1, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
            cmask = cols < k1
            k, v = _load(K, cols, cmask, d, D), _load(V, cols, cmask, d, D)
            s = tl.where(cmask[None, :], tl.dot(q, tl.trans(k), input_precision=DOT) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT)
            m_i = m_new
        _store(O, rows, rmask, d, D, acc / tl.where(l_i > 0, l_i, 1.0)[:, None])
        tl.store(LSE + rows, m_i + tl.log(l_i), mask=rmask)


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    q0, q1, k0, k1 = _segment(CU_Q, CU_K)
    start = k0 + tl.program_id(1) * BLOCK_N
    if start < k1:
        cols, d = start + tl.arange(0, BLOCK_N).to(tl.int64), tl.arange(0, BLOCK_D)
        cmask = cols < k1
        k, v = _load(K, cols, cmask, d, D), _load(V, cols, cmask, d, D)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for m0 in range(q0, q1, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
            rmask = rows < q1
            q, do = _load(Q, rows, rmask, d, D), _load(DO, rows, rmask, d, D)
            lse, delta = tl.load(LSE + rows, mask=rmask, other=0.0), tl.load(DELTA + rows, mask=rmask, other=0.0)
            p, ds = _p_ds(q, k, v, do, lse, delta, rmask, cmask, scale, DOT)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT)
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT)
        _store(DK, cols, cmask, d, D, dk * scale)
        _store(DV, cols, cmask, d, D, dv)


@triton.jit
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    q0, q1, k0, k1 = _segment(CU_Q, CU_K)
    start = q0 + tl.program_id(1) * BLOCK_M
    if start < q1:
        rows, d = start + tl.arange(0, BLOCK_M).to(tl.int64), tl.arange(0, BLOCK_D)
        rmask = rows < q1
        q, do = _load(Q, rows, rmask, d, D), _load(DO, rows, rmask, d, D)
        lse, delta = tl.load(LSE + rows, mask=rmask, other=0.0), tl.load(DELTA + rows, mask=rmask, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(k0, k1, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
            cmask = cols < k1
            k, v = _load(K, cols, cmask, d, D), _load(V, cols, cmask, d, D)
            _, ds = _p_ds(q, k, v, do, lse, delta, rmask, cmask, scale, DOT)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT)
        _store(DQ, rows, rmask, d, D, dq * scale)


def _meta(q: Tensor) -> dict:
    """Sizes and launch options. Exact fp32 dots (no tensor cores) at h' > 64 take blocks of 16 rows and 8 warps: with
    32 rows and 4 warps the backward's dK/dV kernel spilled 17 KB of registers per thread, and with 8 warps it needed
    104 KB of shared memory, over the 99 KB of sm_89 (ptxas: bench/triton_aot.py); 16 rows: 51 KB, no spills. Any
    h' > 128 takes 16 rows too: at h' = 256, fp32 inputs with TF32 allowed needed 164-192 KB with 32 (over the A100's
    163 KB), bf16 98 KB (sm_89's limit)."""
    D, dot = q.shape[-1], dot_precision(q.dtype)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    wide_exact = dot == "ieee" and BLOCK_D > 64
    block = 16 if wide_exact or BLOCK_D > 128 else BLOCK
    return dict(D=D, BLOCK_D=BLOCK_D, BLOCK_M=block, BLOCK_N=block, DOT=dot, num_warps=8 if wide_exact else 4)


class TritonVarlen:
    """heads/varlen.VarlenBackend on the Triton kernels above (any float dtype; accumulation in fp32; fp32 inputs get
    exact fp32 dots unless torch allows TF32: heads/dot_precision.py)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, seg: Segments, scale: float) -> tuple[Tensor, Tensor]:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        lse = torch.full(q.shape[:1], float("-inf"), dtype=torch.float32, device=q.device)
        S = seg.cu_q.numel() - 1
        if S and seg.max_q:
            meta = _meta(q)
            _fwd[(S, triton.cdiv(seg.max_q, meta["BLOCK_M"]))](q, k, v, out, lse, seg.cu_q, seg.cu_k, scale, **meta)
        return out, lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg: Segments,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)  # [Nq] rowsum(dO * O)
        lse = lse.float().contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        S, meta = seg.cu_q.numel() - 1, _meta(q)
        if S and seg.max_k:
            _bwd_dkdv[(S, triton.cdiv(seg.max_k, meta["BLOCK_N"]))](q, k, v, dout, lse, delta, dk, dv, seg.cu_q,
                                                                    seg.cu_k, scale, **meta)
        if S and seg.max_q:
            _bwd_dq[(S, triton.cdiv(seg.max_q, meta["BLOCK_M"]))](q, k, v, dout, lse, delta, dq, seg.cu_q, seg.cu_k,
                                                                  scale, **meta)
        return dq, dk, dv
