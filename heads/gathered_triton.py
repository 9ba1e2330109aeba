"""Fused Triton kernels of the gathered-head core (heads/gathered.py, MoSA §2.2), forward and backward, for CUDA.

Same maths as `gathered_heads_reference`; four kernels, and none writes anything of size [B, H, c, h]: the
only per-head tensors in memory are [H, B, c, h'] (h' << h), like the rotated Q, K, V the backward needs.

  _attn_fwd     one program per (sequence b, head i): gather the c selected rows X[b, I] by index (h in
                chunks, each chunk loaded once for all three projections), project with head i's W^Q, W^K,
                W^V (fp32 accumulation), RoPE at the original positions, masked causal softmax over the c
                slots, G = diag(r) A. Writes Q, K, V (rotated) and G.
  _scatter      OUT[b, I_i] += sum_t U_{t,i} W_{t,i} for every head i, one program per (b, i) looping over
                the column blocks of h (its U tiles then come from L1 after the first block; tiles of slots,
                heads/gathered_tiled.py: a program per (b, column block, i)):
                Y = sum_i scatter(G_i W^O_i^T) in the forward, dX = sum_i scatter(dQ_i W^Q_i + dK_i W^K_i +
                dV_i W^V_i) in the backward (fp32 atomic adds).
  _attn_bwd     one program per (b, i): recompute P from the saved Q, K; dG = dY[b, I] W^O_i (gathered by
                index); dr = rowsum(A * dG); dA = diag(r) dG; dV = P^T dA; dS = P * (dA V^T - rowsum(...));
                dQ = dS K, dK = dS^T Q, rotated back by R(θ)^T = R(-θ). Writes dQ, dK, dV, dr and G.
  _weight_grad  one program per (head i, block of up to 128 columns, term t; weight_grad_columns):
                dW_{t,i} = sum_b U_{t,i,b}^T SRC[b, I_{i,b}]:
                dW^{Q,K,V} from (dQ, dK, dV) and X, dW^O from (G, dY). Each program owns its output block.

Forward and backward are torch.library custom ops (`gathered::fused_forward`, `gathered::fused_backward`) with
shape-only fake implementations and a registered backward, so torch.compile(fullgraph=True) (trainer.compile)
keeps each as one opaque op instead of tracing into the launches.

RoPE's rotate-half pairs column j with j ± r/2: the kernels take the partner column from the tile in registers
(tl.gather along h'), for the rotation in the forward and its transpose in the backward.

Determinism: the only atomics are _scatter's. By default it runs one program per (b, head) (or per column block), so
the order in which heads add into a row of Y or dX varies between runs (results agree up to fp32 rounding); its adds
are relaxed atomics (on sm_90 bare REDG reductions; Triton's default acq_rel put a fence and an L1 invalidation
around every add instruction until 2026-11-30). Under torch.use_deterministic_algorithms(True)
(trainer.deterministic) it runs one program per (b, column block) that walks the heads in order, with a barrier
between heads and acq_rel adds, so every row receives its terms in the same order: bitwise reproducible. (Within one
head a token holds at most one slot with a non-zero term; padding slots add exact zeros.) Everything else is
deterministic in both modes.
On CPU the kernels run under TRITON_INTERPRET=1 (tests, fp32).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from heads.dot_precision import dot_precision
from heads.gathered_lean import in_autocast_dtype
from heads.rope import RotaryEmbedding
from heads.switch import FastPath

BLOCK_H = 32  # columns of X / W (model width h) per step or per program
# One program holds a whole head: its c x c scores and c x h' tiles, so the head size is capped by shared memory and
# registers. Compiled for sm_80 and sm_90 (bench/triton_aot.py, bench/results/triton_aot_sm90.md): at BLOCK_C x BLOCK_D
# = 64 x 64 (c <= 64 at h' = 64) the 16-bit kernels use up to 80 KB of shared memory; at 128 x 64 (c = 128, e.g.
# rho = 8 at T = 1024) the backward needs 192 KB: within H100's 227 KB per block, not A100's 163 KB (WIDE_SLOTS).
# In fp32 the backward already spills ~45 KB per thread at 64 x 64 (0.6 KB at 32 x 64), so fp32 heads stop at half the
# tile. The c x c tiles (scores, P, dS) count too: at h' = 16 the bf16 backward needs 320 KB at c = 256 (`fits` bounds
# BLOCK_C x max(BLOCK_C, BLOCK_D)). Larger heads take the tiled path (heads/gathered_tiled.py), in tiles of MAX_TILE.
MAX_TILE = {torch.bfloat16: 64 * 64, torch.float16: 64 * 64, torch.float32: 32 * 64}
# GPUs with at least WIDE_SHARED bytes of shared memory per block (H100, H200, B200) also take 16-bit heads of up to
# WIDE_SLOTS slots at h' <= WIDE_HEAD_DIM: 96-192 KB in the backward on sm_90 (216 KB on sm_100), spilling at most
# 144 B per thread. Wider heads of 128 slots need 320 KB (h' = 128), and 64 x 128 tiles spill ~1 KB per thread.
WIDE_SHARED, WIDE_SLOTS, WIDE_HEAD_DIM = 227 * 1024, 128, 64
# The forward's loop over h loads a block of X and three of W^QKV per step: two pipeline stages (Triton's default is 3)
# keep about as many bytes in flight as three did with one W block, and its shared memory within sm_89's 99 KB per
# block (fp32 at c = 16, h' = 128: 58 KB, 108 KB with three stages).
FWD_STAGES = 2
# The tiled path's scatter and weight-gradient loops over blocks of slots (heads/gathered_tiled.py) prefetch one block
# ahead: the default three stages took the tiled backward's scatter to 176 KB of shared memory on sm_90 (bf16, h' = 64),
# more than an A100 has.
TILE_STAGES = tl.constexpr(2)
_COLUMN_LOOP = FastPath()
column_loop_disabled = _COLUMN_LOOP.disabled  # inside it _scatter runs a program per column block, as before 2026-12-01
# (benchmarks: bench.heads' mosa-column-grid variant times that grid against the column loop on a GPU)


@triton.jit
def _gather_project(SRC, W, rows, smask, col0, dd, dmask, w_h_stride, DOT: tl.constexpr, HD: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    """SRC[rows] @ W_sel: [BLOCK_C, BLOCK_D] fp32, where output column n < D reads W[col0 + n + h * w_h_stride]
    (columns beyond dmask: zero). Consecutive columns are adjacent in W, so the tile loads as vectors (a column index
    computed by tl.where had hidden that: one 2-byte load per element). SRC and W share one dtype: the dots take the
    tiles as stored (_project_qkv)."""
    acc = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    for h0 in range(0, HD, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        hmask = hh < HD
        xs = tl.load(SRC + rows[:, None] * HD + hh[None, :], mask=smask[:, None] & hmask[None, :], other=0.0)
        w = tl.load(W + col0 + dd[None, :] + hh[:, None] * w_h_stride, mask=dmask[None, :] & hmask[:, None], other=0.0)
        acc += tl.dot(xs, w, input_precision=DOT)
    return acc


@triton.jit
def _rope_tables(POS, INV_FREQ, rows, smask, dd, HALF: tl.constexpr, ROT: tl.constexpr):
    """(cos, sin, partner) with rope(x)_j = x_j cos_j + x_partner(j) sin_j (rotate-half, heads/rope.py):
    partner(j) = j + r/2 and sin_j = -sin(θ_j) for j < r/2; j - r/2 and +sin for r/2 <= j < r; j, cos 1, sin 0
    beyond. Its transpose R(θ)^T: x_j cos_j - x_partner(j) sin_j."""
    pos = tl.load(POS + rows, mask=smask, other=0).to(tl.float32)
    partner = tl.where(dd < HALF, dd + HALF, tl.where(dd < ROT, dd - HALF, dd))
    inv = tl.load(INV_FREQ + tl.where(dd < HALF, dd, dd - HALF), mask=dd < ROT, other=0.0)
    ang = pos[:, None] * inv[None, :]
    cos = tl.where((dd < ROT)[None, :], tl.cos(ang), 1.0)
    sin = tl.where((dd < HALF)[None, :], -tl.sin(ang), tl.where((dd < ROT)[None, :], tl.sin(ang), 0.0))
    return cos, sin, partner


@triton.jit
def _probs(q, k, slots, smask, VIS, SELF, base, scale, DOT: tl.constexpr, HAS_VIS: tl.constexpr,
           HAS_SELF: tl.constexpr):
    """P = masked softmax(q k^T * scale) over slots: key l <= query j and visible, always the diagonal;
    a self_only query sees only itself (heads/gathered_lean.slot_mask)."""
    diag = slots[:, None] == slots[None, :]
    allowed = (slots[None, :] <= slots[:, None]) & smask[None, :]
    if HAS_VIS:
        allowed &= (tl.load(VIS + base + slots, mask=smask, other=0) != 0)[None, :]
    allowed |= diag
    if HAS_SELF:
        allowed = tl.where((tl.load(SELF + base + slots, mask=smask, other=0) != 0)[:, None], diag, allowed)
    s = tl.where(allowed, tl.dot(q, tl.trans(k), input_precision=DOT) * scale, float("-inf"))
    p = tl.exp(s - tl.max(s, 1)[:, None])
    return p / tl.sum(p, 1)[:, None]


@triton.jit
def _slot_rows(IDX, b, i, T, H, C, slots, smask):
    """The rows b*T + I_{b,i}[slots] of the [B*T, h] inputs that slots of head i in sequence b gather (int64: IDX
    is)."""
    return b * T + tl.load(IDX + (b * H + i) * C + slots, mask=smask, other=0)


@triton.jit
def _slot_offsets(t, i, b, H, B, C, slots):
    """The rows of slots of (term t, head i, sequence b) in a [TERMS, H, B, C, ...] tensor, in int64: H*B*C*h' passes
    2^31 at large sizes (B = 256, H = 1200, c = 128, h' = 64), where int32 offsets would wrap."""
    return ((t * H + i) * B + b).to(tl.int64) * C + slots


@triton.jit
def _slot_block(IDX, T, H, C, first, BLOCK_C: tl.constexpr):
    """(b, i) = program_id(0, 1); slots = first .. first + BLOCK_C - 1 of that head, their valid mask, the offset of
    the head's row in [B, H, C] tensors and the rows of the [B*T, h] inputs the slots gather."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    slots = first + tl.arange(0, BLOCK_C)
    smask = slots < C
    return b, i, slots, smask, (b * H + i) * C, _slot_rows(IDX, b, i, T, H, C, slots, smask)


@triton.jit
def _head_program(IDX, POS, INV_FREQ, T, H, C, first, D: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's (sequence b, head i) and its slots: slot ids and valid mask, the offset of the head's
    row in [B, H, C] tensors, the rows of the [B*T, h] inputs they gather, the h' columns and their mask, and the
    RoPE tables at the slots' positions. The slots are first .. first + BLOCK_C - 1 (the whole head from 0 in the
    fused kernels; one tile of it in heads/gathered_tiled.py)."""
    b, i, slots, smask, base, rows = _slot_block(IDX, T, H, C, first, BLOCK_C)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    cos, sin, partner = _rope_tables(POS, INV_FREQ, rows, smask, dd, HALF, ROT)
    return b, i, slots, smask, base, rows, dd, dmask, cos, sin, partner


@triton.jit
def _project_qkv(X, W, rows, smask, i, H, dd, dmask, DOT: tl.constexpr, HD: tl.constexpr, D: tl.constexpr,
                 BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    """X[rows] @ W^Q_i^T, @ W^K_i^T, @ W^V_i^T: three [BLOCK_C, BLOCK_D] fp32 tiles (zero beyond h'), each gathered
    block of X loaded once. W^QKV [3*H*h', h] is row-major by (q|k|v, head, h'): W^Q_i's rows start at i*h'.
    X and W share one dtype (in_autocast_dtype), so the dots take them as stored: 16-bit tiles run the tensor cores'
    16-bit MMA with fp32 accumulation, whose products are exact, as TF32 products of the same values upcast would be
    (bf16's 8 and fp16's 11 significant bits fit in TF32's 11), at twice the TF32 rate on A100/H100 (sm_90 PTX:
    m16n8k16 bf16 MMAs where fp32 tiles took twice as many m16n8k8 TF32 ones, bench/results/triton_aot_sm90.md)."""
    q = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    k = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    v = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    wrow = (i * D + dd)[None, :] * HD
    for h0 in range(0, HD, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        hmask = hh < HD
        xs = tl.load(X + rows[:, None] * HD + hh[None, :], mask=smask[:, None] & hmask[None, :], other=0.0)
        wq = W + wrow + hh[:, None]  # [BLOCK_H, BLOCK_D]: W^Q_i^T
        wmask = dmask[None, :] & hmask[:, None]
        q += tl.dot(xs, tl.load(wq, mask=wmask, other=0.0), input_precision=DOT)
        k += tl.dot(xs, tl.load(wq + H * D * HD, mask=wmask, other=0.0), input_precision=DOT)
        v += tl.dot(xs, tl.load(wq + 2 * H * D * HD, mask=wmask, other=0.0), input_precision=DOT)
    return q, k, v


@triton.jit
def _rotate(x, cos, sin, partner, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """RoPE of a tile x [BLOCK_C, BLOCK_D], x_j cos_j + x_partner(j) sin_j (_rope_tables), the partner columns
    gathered from x itself in registers; with -sin, its transpose R(θ)^T (partner is an involution and
    sin_partner(j) = -sin_j)."""
    return x * cos + tl.gather(x, tl.broadcast_to(partner[None, :], (BLOCK_C, BLOCK_D)), 1) * sin


@triton.jit
def _qkv_block(X, IDX, POS, W, INV_FREQ, QO, KO, VO, T, H, B, C, first, HD: tl.constexpr, D: tl.constexpr,
               HALF: tl.constexpr, ROT: tl.constexpr, DOT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_H: tl.constexpr):
    """This program's slots first .. first + BLOCK_C - 1 (_head_program) projected and rotated: stores Q, K (rotated)
    and V ([H, B, C, D], QO's dtype) and returns the slots, their mask and row offset, the [H, B, C, D] offsets of
    the tiles and their mask, and the tiles q, k, v as stored (rounded to QO's dtype, held in fp32): the forward
    attends on exactly the values _attn_bwd reloads, so the backward differentiates the forward that ran (in bf16,
    unrounded tiles moved the probabilities by 0.2-0.5% rel. RMS between the two), as the tiled path's SDPA does."""
    b, i, slots, smask, base, rows, dd, dmask, cos, sin, partner = _head_program(
        IDX, POS, INV_FREQ, T, H, C, first, D, HALF, ROT, BLOCK_C, BLOCK_D)
    q, k, v = _project_qkv(X, W, rows, smask, i, H, dd, dmask, DOT, HD, D, BLOCK_C, BLOCK_D, BLOCK_H)
    q = _rotate(q, cos, sin, partner, BLOCK_C, BLOCK_D)
    k = _rotate(k, cos, sin, partner, BLOCK_C, BLOCK_D)
    out = _slot_offsets(0, i, b, H, B, C, slots)[:, None] * D + dd[None, :]  # [H, B, C, D] layout
    omask = smask[:, None] & dmask[None, :]
    q, k, v = q.to(QO.dtype.element_ty), k.to(KO.dtype.element_ty), v.to(VO.dtype.element_ty)
    tl.store(QO + out, q, mask=omask)
    tl.store(KO + out, k, mask=omask)
    tl.store(VO + out, v, mask=omask)
    return slots, smask, base, out, omask, q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)


@triton.jit
def _attn_fwd(X, IDX, GATE, POS, W, VIS, SELF, INV_FREQ, QO, KO, VO, GO, T, H, B, C, scale,
              HD: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr, DOT: tl.constexpr,
              HAS_VIS: tl.constexpr, HAS_SELF: tl.constexpr,
              BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    slots, smask, base, out, omask, q, k, v = _qkv_block(
        X, IDX, POS, W, INV_FREQ, QO, KO, VO, T, H, B, C, 0, HD, D, HALF, ROT, DOT, BLOCK_C, BLOCK_D, BLOCK_H)
    gate = tl.load(GATE + base + slots, mask=smask, other=0.0).to(tl.float32)
    p = _probs(q, k, slots, smask, VIS, SELF, base, scale, DOT, HAS_VIS, HAS_SELF)
    tl.store(GO + out, tl.dot(p, v, input_precision=DOT) * gate[:, None], mask=omask)  # G = diag(r) A


@triton.jit
def _scatter_tile(OUT, IDX, U, W, b, i, c0, hh, hmask, dd, dmask, T, H, B, C, w_term_stride,
                  w_head_stride, w_d_stride, w_h_stride, HD: tl.constexpr, D: tl.constexpr, TERMS: tl.constexpr,
                  DOT: tl.constexpr, SEM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr):
    """_scatter's adds of head i's slots c0 .. c0 + BLOCK_C - 1 in sequence b to the columns hh."""
    slots = c0 + tl.arange(0, BLOCK_C)
    smask = slots < C
    rows = _slot_rows(IDX, b, i, T, H, C, slots, smask)
    acc = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
    for t in tl.static_range(TERMS):
        u = tl.load(U + _slot_offsets(t, i, b, H, B, C, slots)[:, None] * D + dd[None, :],
                    mask=smask[:, None] & dmask[None, :], other=0.0)
        w = tl.load(W + t * w_term_stride + i * w_head_stride + dd[:, None] * w_d_stride + hh[None, :] * w_h_stride,
                    mask=dmask[:, None] & hmask[None, :], other=0.0)
        acc += tl.dot(u, w.to(tl.float32), input_precision=DOT)
    tl.atomic_add(OUT + rows[:, None] * HD + hh[None, :], acc, mask=smask[:, None] & hmask[None, :], sem=SEM)


@triton.jit
def _scatter(OUT, IDX, U, W, T, H, B, C, heads_per_program, w_term_stride, w_head_stride,
             w_d_stride, w_h_stride, HD: tl.constexpr, D: tl.constexpr, TERMS: tl.constexpr, DOT: tl.constexpr,
             SEM: tl.constexpr, TILED: tl.constexpr, COLUMN_LOOP: tl.constexpr, BLOCK_C: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    """OUT[b*T + I_{b,i}, cols] += sum_t U[t, i, b] @ W_{t,i}[:, cols] for heads [g*n, (g+1)*n) in order: all C slots in
    one block, or, if TILED (heads/gathered_tiled.py), in blocks of BLOCK_C. If COLUMN_LOOP (whole heads only), the
    program loops over every column block of h: its loads of the head's U tiles after the first block hit its SM's L1;
    else it adds to column block program_id(1) alone. U: fp32 [TERMS, H, B, C, D]; W_{t,i}[d, col] at
    W + t*w_term_stride + i*w_head_stride + d*w_d_stride + col*w_h_stride. SEM: the adds' memory order
    (_scatter_add)."""
    b = tl.program_id(0)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = hh < HD
    first = tl.program_id(2) * heads_per_program
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    for i in range(first, tl.minimum(first + heads_per_program, H)):
        if TILED:
            for c0 in tl.range(0, C, BLOCK_C, num_stages=TILE_STAGES):
                _scatter_tile(OUT, IDX, U, W, b, i, c0, hh, hmask, dd, dmask, T, H, B, C, w_term_stride,
                              w_head_stride, w_d_stride, w_h_stride, HD, D, TERMS, DOT, SEM, BLOCK_C, BLOCK_H)
        elif COLUMN_LOOP:  # not software-pipelined (num_stages=1): its async copies to shared memory would bypass L1,
            for h0 in tl.range(0, HD, BLOCK_H, num_stages=1):  # and a whole head's U tiles took c = 128 to 328 KB
                cols = h0 + tl.arange(0, BLOCK_H)
                _scatter_tile(OUT, IDX, U, W, b, i, 0, cols, cols < HD, dd, dmask, T, H, B, C, w_term_stride,
                              w_head_stride, w_d_stride, w_h_stride, HD, D, TERMS, DOT, SEM, BLOCK_C, BLOCK_H)
        else:
            _scatter_tile(OUT, IDX, U, W, b, i, 0, hh, hmask, dd, dmask, T, H, B, C, w_term_stride,
                          w_head_stride, w_d_stride, w_h_stride, HD, D, TERMS, DOT, SEM, BLOCK_C, BLOCK_H)
        tl.debug_barrier()  # this head's adds land before the next head's (the deterministic order)


@triton.jit
def _attn_bwd(DY, IDX, GATE, POS, WO, Q, K, V, VIS, SELF, INV_FREQ, DQKV, GO, DGATE, T, H, B, C, scale,
              HD: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr, DOT: tl.constexpr,
              HAS_VIS: tl.constexpr, HAS_SELF: tl.constexpr,
              BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    b, i, slots, smask, base, rows, dd, dmask, cos, sin, partner = _head_program(
        IDX, POS, INV_FREQ, T, H, C, 0, D, HALF, ROT, BLOCK_C, BLOCK_D)
    gate = tl.load(GATE + base + slots, mask=smask, other=0.0).to(tl.float32)
    rowoff = _slot_offsets(0, i, b, H, B, C, slots)[:, None] * D
    omask = smask[:, None] & dmask[None, :]
    q = tl.load(Q + rowoff + dd[None, :], mask=omask, other=0.0).to(tl.float32)  # rotated, as saved
    k = tl.load(K + rowoff + dd[None, :], mask=omask, other=0.0).to(tl.float32)
    v = tl.load(V + rowoff + dd[None, :], mask=omask, other=0.0).to(tl.float32)
    p = _probs(q, k, slots, smask, VIS, SELF, base, scale, DOT, HAS_VIS, HAS_SELF)
    a = tl.dot(p, v, input_precision=DOT)
    # dG = dY[b, I] W^O_i: W^O [h, H*h'], column i*h' + d of row c at c*H*h' + i*h' + d
    dg = _gather_project(DY, WO, rows, smask, i * D, dd, dmask, H * D, DOT, HD, BLOCK_C, BLOCK_D, BLOCK_H)
    tl.store(DGATE + base + slots, tl.sum(a * dg, 1), mask=smask)  # dL/dr_j = <A_j, dG_j>
    tl.store(GO + rowoff + dd[None, :], a * gate[:, None], mask=omask)  # G for dW^O
    da = dg * gate[:, None]
    dv = tl.dot(tl.trans(p), da, input_precision=DOT)
    dp = tl.dot(da, tl.trans(v), input_precision=DOT)
    ds = p * (dp - tl.sum(dp * p, 1)[:, None]) * scale
    # R(θ)^T of the gradients w.r.t. the rotated q and k
    dq = _rotate(tl.dot(ds, k, input_precision=DOT), cos, -sin, partner, BLOCK_C, BLOCK_D)
    dk = _rotate(tl.dot(tl.trans(ds), q, input_precision=DOT), cos, -sin, partner, BLOCK_C, BLOCK_D)
    tl.store(DQKV + rowoff + dd[None, :], dq, mask=omask)  # DQKV [3, H, B, C, D]
    tl.store(DQKV + _slot_offsets(1, i, b, H, B, C, slots)[:, None] * D + dd[None, :], dk, mask=omask)
    tl.store(DQKV + _slot_offsets(2, i, b, H, B, C, slots)[:, None] * D + dd[None, :], dv, mask=omask)


@triton.jit
def _weight_grad_tile(SRC, IDX, U, b, i, t, c0, hh, hmask, dd, dmask, T, H, B, C, HD: tl.constexpr,
                      D: tl.constexpr, DOT: tl.constexpr, BLOCK_C: tl.constexpr):
    """U[t, i, b]^T @ SRC[b*T + I_{b,i}, cols] over head i's slots c0 .. c0 + BLOCK_C - 1: [BLOCK_D, BLOCK_H] fp32."""
    slots = c0 + tl.arange(0, BLOCK_C)
    smask = slots < C
    rows = _slot_rows(IDX, b, i, T, H, C, slots, smask)
    src = tl.load(SRC + rows[:, None] * HD + hh[None, :], mask=smask[:, None] & hmask[None, :], other=0.0)
    u = tl.load(U + _slot_offsets(t, i, b, H, B, C, slots)[:, None] * D + dd[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    return tl.dot(tl.trans(u), src.to(tl.float32), input_precision=DOT)


@triton.jit
def _weight_grad(SRC, IDX, U, OUT, T, H, B, C, o_term_stride, o_head_stride, o_d_stride, o_h_stride,
                 HD: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr, TILED: tl.constexpr, BLOCK_C: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    """OUT_{t,i}[d, cols] = sum_b U[t, i, b]^T @ SRC[b*T + I_{b,i}, cols] (sequences in order, each in one block of
    slots or, if TILED, in blocks of BLOCK_C; no atomics)."""
    i = tl.program_id(0)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = hh < HD
    t = tl.program_id(2)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    acc = tl.zeros([BLOCK_D, BLOCK_H], dtype=tl.float32)
    for b in range(0, B):
        if TILED:
            for c0 in tl.range(0, C, BLOCK_C, num_stages=TILE_STAGES):
                acc += _weight_grad_tile(SRC, IDX, U, b, i, t, c0, hh, hmask, dd, dmask, T, H, B, C, HD, D, DOT,
                                         BLOCK_C)
        else:
            acc += _weight_grad_tile(SRC, IDX, U, b, i, t, 0, hh, hmask, dd, dmask, T, H, B, C, HD, D, DOT,
                                     BLOCK_C)
    tl.store(OUT + t * o_term_stride + i * o_head_stride + dd[:, None] * o_d_stride + hh[None, :] * o_h_stride,
             acc.to(OUT.dtype.element_ty), mask=dmask[:, None] & hmask[None, :])


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs >= 16


def fits(c: int, d: int, dtype: torch.dtype, shared: int = 0) -> bool:
    """Whether the kernels take heads of c slots and width h' = d computed in `dtype` on a GPU with `shared` bytes
    of shared memory per block (opt-in): their c x h' tiles and their c x c ones (scores, P, dS) within
    MAX_TILE[dtype], BLOCK_C x max(BLOCK_C, BLOCK_D) (a narrow head's c x c tiles grew past it: c = 256 at h' = 16
    in bf16 needs 320 KB of shared memory in the backward), or, in 16 bits on a GPU with WIDE_SHARED, up to
    WIDE_SLOTS slots of h' <= WIDE_HEAD_DIM; never fp64, which they would sum in fp32."""
    C, D = _pow2(c), _pow2(d)
    if C * max(C, D) <= MAX_TILE.get(dtype, 0):
        return True
    wide = shared >= WIDE_SHARED and dtype in (torch.bfloat16, torch.float16)
    return wide and C <= WIDE_SLOTS and D <= WIDE_HEAD_DIM


@torch.compiler.assume_constant_result  # torch.compile (fullgraph) calls it while tracing and keeps the number
def shared_memory(device: int) -> int:
    """Shared memory per block (bytes) a kernel may opt into on CUDA device `device`, as Triton's driver reports it."""
    return _device_shared_memory(device)


@functools.cache
def _device_shared_memory(device: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]


def _sizes(x: torch.Tensor, idx: torch.Tensor, qkv_weight: torch.Tensor) -> dict:
    B, T, h = x.shape
    H, c = idx.shape[1:]
    return launch_sizes(B, T, h, H, c, qkv_weight.shape[0] // (3 * H), x.dtype, _pow2(c))


def launch_sizes(B: int, T: int, h: int, H: int, c: int, d: int, dtype: torch.dtype, block_c: int) -> dict:
    """Sizes and launch constants of heads of c slots of width d computed in `dtype`, BLOCK_C = block_c slots per
    block (the whole head in the fused kernels, a tile in heads/gathered_tiled.py)."""
    # bf16/fp16 inputs (autocast): TF32 dots of the fp32 intermediates (Q, K, P, dS), never rounded back to 16 bits
    consts = dict(BLOCK_C=block_c, BLOCK_D=_pow2(d), BLOCK_H=BLOCK_H, DOT=dot_precision(dtype))
    return dict(B=B, T=T, h=h, H=H, c=c, d=d, consts=consts, warps=8 if block_c > 64 else 4, tiled=block_c < c)


def _scatter_add(out: torch.Tensor, idx: torch.Tensor, u: torch.Tensor, w: torch.Tensor, strides: tuple[int, ...],
                 n: dict) -> None:
    """out[B*T, h] += scatter over heads of u[t, i] @ W_{t,i} (see _scatter); one program per (sequence, head) over
    every column block for whole heads (the fused kernels), one per (sequence, column block, head) for tiles of slots
    (heads/gathered_tiled.py) and inside `column_loop_disabled()`, or, when torch's deterministic mode is on, one per
    (sequence, column block) walking all heads in order. The adds are relaxed atomics (a sum whose order is free needs
    no memory ordering; Triton's default, acq_rel, fences every add), except in deterministic mode, which keeps acq_rel
    so that each head's adds are ordered before the next head's."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    loop = _COLUMN_LOOP.on and not deterministic and not n["tiled"]
    per_program = n["H"] if deterministic else 1
    grid = (n["B"], 1 if loop else triton.cdiv(n["h"], BLOCK_H), triton.cdiv(n["H"], per_program))
    _scatter[grid](out, idx, u, w, n["T"], n["H"], n["B"], n["c"], per_program, *strides,
                   HD=n["h"], D=n["d"], TERMS=u.shape[0], SEM="acq_rel" if deterministic else "relaxed",
                   TILED=n["tiled"], COLUMN_LOOP=loop, **n["consts"])


def weight_grad_columns(block_d: int) -> int:
    """Columns of h per _weight_grad program: its [BLOCK_D, columns] fp32 accumulator up to 64 x 64 (128 columns at
    most, BLOCK_H at least). Each program reads every U tile of its head once, so wider blocks read them fewer times:
    8 times at h = 512, h' = 64, where blocks of BLOCK_H read them 16 times (shared memory on sm_90: 56 KB for the
    tiled bf16 backward at h' = 64, 44 KB before; 113 KB for the fused one at c = 128, 89 KB before)."""
    return max(BLOCK_H, min(128, 64 * 64 // block_d))


def _weight_grad_into(out: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, u: torch.Tensor,
                      strides: tuple[int, ...], n: dict) -> torch.Tensor:
    cols = weight_grad_columns(n["consts"]["BLOCK_D"])
    grid = (n["H"], triton.cdiv(n["h"], cols), u.shape[0])
    _weight_grad[grid](src, idx, u, out, n["T"], n["H"], n["B"], n["c"], *strides,
                       HD=n["h"], D=n["d"], TILED=n["tiled"], **{**n["consts"], "BLOCK_H": cols})
    return out


def _qkv_strides(n: dict) -> tuple[int, ...]:
    """(term, head, h', column) strides of W^QKV [3*H*h', h] (row (t*H + i)*h' + d)."""
    return n["H"] * n["d"] * n["h"], n["d"] * n["h"], n["h"], 1


def _out_strides(n: dict) -> tuple[int, ...]:
    """(term, head, h', column) strides of W^O [h, H*h'] read as W^O_i^T [h', h]."""
    return 0, n["d"], 1, n["H"] * n["d"]


def _head_args(n: dict, idx: torch.Tensor, inv_freq: torch.Tensor, rot_dim: int, visible: torch.Tensor | None,
               self_only: torch.Tensor | None) -> dict:
    """Launch arguments _attn_fwd and _attn_bwd share: sizes, RoPE, MoSAIC's masks, block sizes."""
    return dict(VIS=visible.contiguous() if visible is not None else idx,  # placeholder pointer when unused
                SELF=self_only.contiguous() if self_only is not None else idx,
                HAS_VIS=visible is not None, HAS_SELF=self_only is not None, INV_FREQ=inv_freq,
                T=n["T"], H=n["H"], B=n["B"], C=n["c"], scale=n["d"] ** -0.5, HD=n["h"], D=n["d"],
                HALF=rot_dim // 2, ROT=rot_dim, num_warps=n["warps"], **n["consts"])


def _forward(x: torch.Tensor, gate: torch.Tensor, qkv_weight: torch.Tensor, out_weight: torch.Tensor,
             idx: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rot_dim: int,
             visible: torch.Tensor | None, self_only: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """y fp32 [B*T, h] and the rotated Q, K, V [H, B, c, h'] (x's dtype, saved for backward)."""
    n = _sizes(x, idx, qkv_weight)
    x, idx, qkv_weight, out_weight = (t.contiguous() for t in (x, idx, qkv_weight, out_weight))
    q, k, v = (x.new_empty(n["H"], n["B"], n["c"], n["d"]) for _ in range(3))
    g = torch.empty(1, n["H"], n["B"], n["c"], n["d"], device=x.device, dtype=torch.float32)
    _attn_fwd[(n["B"], n["H"])](x, idx, gate.contiguous(), positions.contiguous(), qkv_weight, QO=q, KO=k, VO=v, GO=g,
                                num_stages=FWD_STAGES, **_head_args(n, idx, inv_freq, rot_dim, visible, self_only))
    y = torch.zeros(n["B"] * n["T"], n["h"], device=x.device, dtype=torch.float32)
    _scatter_add(y, idx, g, out_weight, _out_strides(n), n)
    return y, q, k, v


def _backward(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, qkv_weight: torch.Tensor, out_weight: torch.Tensor,
              idx: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rot_dim: int,
              visible: torch.Tensor | None, self_only: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """dy [B*T, h] -> (dx [B, T, h], dgate [B, H, c], dW^QKV, dW^O) in the inputs' dtypes."""
    n = _sizes(x, idx, qkv_weight)
    # dy is the gradient of y.to(x.dtype) (gathered_heads_triton): in eager mode its values are x.dtype's, so this cast
    # is exact (under torch.compile inductor may pass on an unrounded fp32 value; the cast rounds it as eager would),
    # and dG = dY[b, I] W^O_i runs on stored 16-bit tiles, like the forward's projections
    dy = dy.to(x.dtype)
    x, idx, qkv_weight, out_weight, dy = (t.contiguous() for t in (x, idx, qkv_weight, out_weight, dy))
    f32 = dict(device=x.device, dtype=torch.float32)
    dqkv = torch.empty(3, n["H"], n["B"], n["c"], n["d"], **f32)
    g = torch.empty(1, n["H"], n["B"], n["c"], n["d"], **f32)
    dgate = torch.empty(n["B"], n["H"], n["c"], **f32)
    _attn_bwd[(n["B"], n["H"])](dy, idx, gate.contiguous(), positions.contiguous(), out_weight, q, k, v, DQKV=dqkv,
                                GO=g, DGATE=dgate, **_head_args(n, idx, inv_freq, rot_dim, visible, self_only))
    dx = torch.zeros(n["B"] * n["T"], n["h"], **f32)
    _scatter_add(dx, idx, dqkv, qkv_weight, _qkv_strides(n), n)
    dw = _weight_grad_into(torch.empty_like(qkv_weight), x, idx, dqkv, _qkv_strides(n), n)
    dwo = _weight_grad_into(torch.empty_like(out_weight), dy, idx, g, _out_strides(n), n)
    return dx.view_as(x).to(x.dtype), dgate.to(gate.dtype), dw, dwo


# Registered as torch.library custom ops: torch.compile (fullgraph) sees each as one opaque op with a fake
# (shape-only) implementation and a registered backward, instead of tracing into the kernel launches.
_ARGS = ("Tensor x, Tensor gate, Tensor qkv_weight, Tensor out_weight, Tensor idx, Tensor positions, "
         "Tensor inv_freq, int rot_dim, Tensor? visible, Tensor? self_only")
fused_forward = torch.library.custom_op("gathered::fused_forward", _forward, mutates_args=(),
                                        schema=f"({_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")
fused_backward = torch.library.custom_op("gathered::fused_backward", _backward, mutates_args=(),
                                         schema=f"(Tensor dy, {_ARGS}, Tensor q, Tensor k, Tensor v) "
                                                "-> (Tensor, Tensor, Tensor, Tensor)")


@fused_forward.register_fake
def _forward_shapes(x: torch.Tensor, gate: torch.Tensor, qkv_weight: torch.Tensor, out_weight: torch.Tensor,
                    idx: torch.Tensor, *_: object) -> tuple[torch.Tensor, ...]:
    B, T, h = x.shape
    H, c = idx.shape[1:]
    q_shape = (H, B, c, qkv_weight.shape[0] // (3 * H))
    return x.new_empty(B * T, h, dtype=torch.float32), *(x.new_empty(q_shape) for _ in range(3))


@fused_backward.register_fake
def _backward_shapes(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, qkv_weight: torch.Tensor,
                     out_weight: torch.Tensor, *_: object) -> tuple[torch.Tensor, ...]:
    return torch.empty_like(x), torch.empty_like(gate), torch.empty_like(qkv_weight), torch.empty_like(out_weight)


def _save(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.mark_non_differentiable(*output[1:])  # Q, K, V are outputs only so that backward gets them
    ctx.save_for_backward(*inputs[:7], inputs[8], inputs[9], *output[1:])
    ctx.rot_dim = inputs[7]


def _grads(ctx: Any, dy: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, gate, w, wo, idx, positions, inv_freq, visible, self_only, q, k, v = ctx.saved_tensors
    dx, dgate, dw, dwo = fused_backward(dy, x, gate, w, wo, idx, positions, inv_freq, ctx.rot_dim, visible, self_only,
                                        q, k, v)
    return dx, dgate, dw, dwo, None, None, None, None, None, None


fused_forward.register_autograd(_grads, setup_context=_save)


def gathered_heads_triton(x: torch.Tensor, positions: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor,
                          qkv_weight: torch.Tensor, out_weight: torch.Tensor, rope: RotaryEmbedding,
                          visible: torch.Tensor | None = None, self_only: torch.Tensor | None = None) -> torch.Tensor:
    """heads.gathered_lean.gathered_heads_lean's contract, by the fused kernels."""
    x, gate, qkv_weight, out_weight = in_autocast_dtype(x, gate, qkv_weight, out_weight)
    with torch.autocast(x.device.type, enabled=False):
        y = fused_forward(x, gate, qkv_weight, out_weight, idx, positions, rope.inv_freq, rope.rot_dim, visible,
                          self_only)[0]
    return y.view(x.shape).to(x.dtype)
