"""Gathered heads of any number of slots on CUDA (MoSA §2.2, heads/gathered.py's definition): Triton kernels for the
gathers, projections and scatters, tiled over slots, around PyTorch's scaled_dot_product_attention (SDPA).

The fused kernels (heads/gathered_triton.py) hold a whole head per program, so they take heads up to 64 slots (128
on H100/H200); a long sequence has more, e.g. c = T / rho = 256 at T = 8192, rho = 32. Here each step works on
tiles of BLOCK_C slots, and the c x c attention between them is SDPA's:

  Q, K, V = RoPE(X[I] W^{Q,K,V}_i)          _project: one program per (sequence, head, block of slots), the gathered
                                            rows of X loaded once for all three projections; writes [H, B, c, h']
  A = softmax(Q K^T / sqrt(h') + M) V        SDPA on [H, B, c, h']: M is the causal mask over slots (valid slots come
                                            first, in token order), or MoSAIC's slot mask
  Y = sum_i scatter_{I_i}(diag(r_i) A_i W^O_i)   heads/gathered_triton._scatter over blocks of slots (fp32 atomics)

SDPA runs whichever of its kernels torch selects for the inputs (on a GPU a fused one, flash, cuDNN or memory-efficient,
for 16-bit causal heads; its math fallback, e.g. for a bf16 mask at an h' that is not a multiple of 8, keeps the
[H, B, c, c] probabilities for backward). Backward: SDPA's own; for the output, dG = dY[b, I] W^O_i (_out_grad,
gathered by index), dr = rowsum(A * dG), dA = diag(r) dG, dW^O_i = sum_b G^T dY[b, I]; for the projections, dQ, dK
rotated back by R(θ)^T, dX = scatter of dQ W^Q + dK W^K + dV W^V and dW^{Q,K,V} (heads/gathered_triton._scatter,
_weight_grad). Nothing of size [B, H, c, h] is written; saved for backward: x, the weights, the gates, the [H, B, c, h']
tensors Q, K, V and A, what SDPA keeps (its log-sum-exp [H, B, c] in the fused kernels), and with MoSAIC's identity
or ignore padding the [H, B, c, c] slot mask it is given. Both Triton steps are torch.library custom ops with fake
shapes and registered backwards, like the fused ones, so trainer.compile keeps them opaque. On CPU the kernels run under
TRITON_INTERPRET=1 (tests, fp32 and fp16).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from heads.gathered_lean import in_autocast_dtype, slot_mask, slot_positions
from heads.gathered_triton import (FWD_STAGES, MAX_TILE, _gather_project, _out_strides, _pow2, _qkv_block,
                                   _qkv_strides, _scatter_add, _slot_block, _slot_offsets, _weight_grad_into,
                                   launch_sizes)
from heads.rope import RotaryEmbedding, cos_sin, rotate_

MAX_SLOTS_PER_TILE = 64  # BLOCK_C at most; fewer where BLOCK_C x BLOCK_D would exceed the fused kernels' MAX_TILE


@triton.jit
def _project(X, IDX, POS, W, INV_FREQ, QO, KO, VO, T, H, B, C, HD: tl.constexpr, D: tl.constexpr,
             HALF: tl.constexpr, ROT: tl.constexpr, DOT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_H: tl.constexpr):
    """Q, K (rotated at the slots' positions) and V of one block of slots of head i in sequence b: [H, B, C, D]."""
    _qkv_block(X, IDX, POS, W, INV_FREQ, QO, KO, VO, T, H, B, C, tl.program_id(2) * BLOCK_C, HD, D, HALF, ROT, DOT,
               BLOCK_C, BLOCK_D, BLOCK_H)  # the fused forward's first half


@triton.jit
def _out_grad(DY, IDX, WO, DG, T, H, B, C, HD: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr,
              BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    """dG = dY[b, I] W^O_i for one block of slots (fp32 [H, B, C, D]); W^O [h, H*h'] read as W^O_i [h, h']."""
    b, i, slots, smask, base, rows = _slot_block(IDX, T, H, C, tl.program_id(2) * BLOCK_C, BLOCK_C)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    dg = _gather_project(DY, WO, rows, smask, i * D, dd, dmask, H * D, DOT, HD, BLOCK_C, BLOCK_D, BLOCK_H)
    tl.store(DG + _slot_offsets(0, i, b, H, B, C, slots)[:, None] * D + dd[None, :], dg,
             mask=smask[:, None] & dmask[None, :])


def tile_slots(d: int, dtype: torch.dtype) -> int:
    """Slots per tile for heads of width h' = d computed in `dtype`: BLOCK_C x BLOCK_D within the fused kernels'
    MAX_TILE (the tile sizes they compile within every GPU's shared memory), 16 to MAX_SLOTS_PER_TILE."""
    return max(16, min(MAX_SLOTS_PER_TILE, MAX_TILE.get(dtype, 0) // _pow2(d)))


def tiled_fits(d: int, dtype: torch.dtype) -> bool:
    """Whether these kernels take heads of width h' = d in `dtype` (any number of slots): a 16-slot tile within
    MAX_TILE (16-bit: h' <= 256, fp32: h' <= 128); never fp64, which they would sum in fp32."""
    return 16 * _pow2(d) <= MAX_TILE.get(dtype, 0)


def _tile_sizes(dtype: torch.dtype, B: int, T: int, h: int, H: int, c: int, d: int) -> dict:
    """Launch sizes with BLOCK_C = one tile (tile_slots), or the whole head where it is smaller."""
    return launch_sizes(B, T, h, H, c, d, dtype, min(tile_slots(d, dtype), _pow2(c)))


def _grid(n: dict) -> tuple[int, int, int]:
    return n["B"], n["H"], triton.cdiv(n["c"], n["consts"]["BLOCK_C"])


def _project_forward(x: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor, qkv_weight: torch.Tensor,
                     inv_freq: torch.Tensor, rot_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, h], idx [B, H, c] -> Q, K (rotated), V [H, B, c, h'] in x's dtype."""
    B, T, h = x.shape
    H, c = idx.shape[1:]
    n = _tile_sizes(x.dtype, B, T, h, H, c, qkv_weight.shape[0] // (3 * H))
    x, idx, positions, qkv_weight = (t.contiguous() for t in (x, idx, positions, qkv_weight))
    q, k, v = (x.new_empty(H, B, c, n["d"]) for _ in range(3))
    _project[_grid(n)](x, idx, positions, qkv_weight, inv_freq, q, k, v, T, H, B, c, HD=h, D=n["d"],
                       HALF=rot_dim // 2, ROT=rot_dim, num_warps=n["warps"], num_stages=FWD_STAGES, **n["consts"])
    return q, k, v


def _project_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, x: torch.Tensor, idx: torch.Tensor,
                      positions: torch.Tensor, qkv_weight: torch.Tensor, inv_freq: torch.Tensor,
                      rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients w.r.t. the rotated Q, K and V -> (dx [B, T, h], dW^QKV), in the inputs' dtypes."""
    B, T, h = x.shape
    H, c = idx.shape[1:]
    n = _tile_sizes(x.dtype, B, T, h, H, c, dq.shape[-1])
    x, idx, qkv_weight = (t.contiguous() for t in (x, idx, qkv_weight))
    dqkv = torch.stack((dq, dk, dv)).float()  # [3, H, B, c, h'] fp32
    cos, sin = cos_sin(slot_positions(positions, idx), inv_freq, torch.float32)  # [H, B, c, r/2]
    for grad in dqkv[:2]:
        rotate_(grad, cos, sin, inverse=True)  # R(θ)^T: the gradient before the rotation
    dx = torch.zeros(B * T, h, device=x.device, dtype=torch.float32)
    _scatter_add(dx, idx, dqkv, qkv_weight, _qkv_strides(n), n)
    dw = _weight_grad_into(torch.empty_like(qkv_weight), x, idx, dqkv, _qkv_strides(n), n)
    return dx.view_as(x).to(x.dtype), dw


def _gated(a: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """G = diag(r) A: fp32 [H, B, c, h'], contiguous (SDPA may return A in another memory layout)."""
    return (gate.transpose(0, 1).float()[..., None] * a.float()).contiguous()


def _output_forward(a: torch.Tensor, gate: torch.Tensor, idx: torch.Tensor, out_weight: torch.Tensor,
                    seq_len: int) -> torch.Tensor:
    """a [H, B, c, h'] (the attention outputs A), gate [B, H, c] -> y = sum_i scatter(diag(r) A W^O_i^T), fp32
    [B*T, h]."""
    H, B, c, d = a.shape
    n = _tile_sizes(out_weight.dtype, B, seq_len, out_weight.shape[0], H, c, d)
    g = _gated(a, gate)[None]  # [1, H, B, c, h']
    y = torch.zeros(B * seq_len, n["h"], device=a.device, dtype=torch.float32)
    _scatter_add(y, idx.contiguous(), g, out_weight.contiguous(), _out_strides(n), n)
    return y


def _output_backward(dy: torch.Tensor, a: torch.Tensor, gate: torch.Tensor, idx: torch.Tensor,
                     out_weight: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy [B*T, h] -> (dA [H, B, c, h'], dgate [B, H, c], dW^O), in the inputs' dtypes."""
    H, B, c, d = a.shape
    n = _tile_sizes(out_weight.dtype, B, seq_len, out_weight.shape[0], H, c, d)
    # dy is the gradient of y.to(out_weight's dtype): that cast is exact in eager mode (heads/gathered_triton._backward)
    dy, idx, out_weight = dy.to(out_weight.dtype).contiguous(), idx.contiguous(), out_weight.contiguous()
    dg = torch.empty(H, B, c, d, device=a.device, dtype=torch.float32)  # dL/dG
    _out_grad[_grid(n)](dy, idx, out_weight, dg, seq_len, H, B, c, HD=n["h"], D=d, num_warps=n["warps"],
                        **n["consts"])
    dgate = (dg * a.float()).sum(-1).transpose(0, 1)  # dL/dr_j = <A_j, dG_j>
    dwo = _weight_grad_into(torch.empty_like(out_weight), dy, idx, _gated(a, gate)[None], _out_strides(n), n)
    da = gate.transpose(0, 1)[..., None] * dg  # diag(r) dG
    # contiguous, as the fake implementations say (A itself may come from SDPA in another memory layout)
    return da.to(a.dtype).contiguous(), dgate.to(gate.dtype).contiguous(), dwo


# torch.library custom ops (as heads/gathered_triton.py's): opaque to torch.compile, with shape-only fakes.
tiled_project = torch.library.custom_op(
    "gathered::tiled_project", _project_forward, mutates_args=(),
    schema="(Tensor x, Tensor idx, Tensor positions, Tensor qkv_weight, Tensor inv_freq, int rot_dim) "
           "-> (Tensor, Tensor, Tensor)")
tiled_project_backward = torch.library.custom_op(
    "gathered::tiled_project_backward", _project_backward, mutates_args=(),
    schema="(Tensor dq, Tensor dk, Tensor dv, Tensor x, Tensor idx, Tensor positions, Tensor qkv_weight, "
           "Tensor inv_freq, int rot_dim) -> (Tensor, Tensor)")
tiled_output = torch.library.custom_op(
    "gathered::tiled_output", _output_forward, mutates_args=(),
    schema="(Tensor a, Tensor gate, Tensor idx, Tensor out_weight, int seq_len) -> Tensor")
tiled_output_backward = torch.library.custom_op(
    "gathered::tiled_output_backward", _output_backward, mutates_args=(),
    schema="(Tensor dy, Tensor a, Tensor gate, Tensor idx, Tensor out_weight, int seq_len) -> (Tensor, Tensor, Tensor)")


@tiled_project.register_fake
def _project_shapes(x: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor, qkv_weight: torch.Tensor,
                    *_: object) -> tuple[torch.Tensor, ...]:
    B, H, c = idx.shape
    return tuple(x.new_empty(H, B, c, qkv_weight.shape[0] // (3 * H)) for _ in range(3))


@tiled_project_backward.register_fake
def _project_backward_shapes(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, x: torch.Tensor,
                             idx: torch.Tensor, positions: torch.Tensor, qkv_weight: torch.Tensor,
                             *_: object) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), qkv_weight.new_empty(qkv_weight.shape)


@tiled_output.register_fake
def _output_shapes(a: torch.Tensor, gate: torch.Tensor, idx: torch.Tensor, out_weight: torch.Tensor,
                   seq_len: int) -> torch.Tensor:
    return a.new_empty(a.shape[1] * seq_len, out_weight.shape[0], dtype=torch.float32)


@tiled_output_backward.register_fake
def _output_backward_shapes(dy: torch.Tensor, a: torch.Tensor, gate: torch.Tensor, idx: torch.Tensor,
                            out_weight: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, ...]:
    return a.new_empty(a.shape), gate.new_empty(gate.shape), out_weight.new_empty(out_weight.shape)


def _save_project(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.rot_dim = inputs[5]


def _project_grads(ctx: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, idx, positions, qkv_weight, inv_freq = ctx.saved_tensors
    dx, dw = tiled_project_backward(dq, dk, dv, x, idx, positions, qkv_weight, inv_freq, ctx.rot_dim)
    return dx, None, None, dw, None, None


def _save_output(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs[:4])
    ctx.seq_len = inputs[4]


def _output_grads(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    a, gate, idx, out_weight = ctx.saved_tensors
    da, dgate, dwo = tiled_output_backward(dy, a, gate, idx, out_weight, ctx.seq_len)
    return da, dgate, None, dwo, None


tiled_project.register_autograd(_project_grads, setup_context=_save_project)
tiled_output.register_autograd(_output_grads, setup_context=_save_output)


def gathered_heads_tiled(x: torch.Tensor, positions: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor,
                         qkv_weight: torch.Tensor, out_weight: torch.Tensor, rope: RotaryEmbedding,
                         visible: torch.Tensor | None = None, self_only: torch.Tensor | None = None) -> torch.Tensor:
    """heads.gathered_lean.gathered_heads_lean's contract for heads of any number of slots (see the module
    docstring)."""
    x, gate, qkv_weight, out_weight = in_autocast_dtype(x, gate, qkv_weight, out_weight)
    B, T, h = x.shape
    with torch.autocast(x.device.type, enabled=False):
        q, k, v = tiled_project(x, idx, positions, qkv_weight, rope.inv_freq, rope.rot_dim)  # [H, B, c, h']
        mask = None  # valid slots first, in token order: M is the causal mask over slots
        if visible is not None or self_only is not None:
            mask = slot_mask(idx.shape[-1], visible, self_only, x.device).transpose(0, 1)  # [H, B, c, c]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        y = tiled_output(a, gate, idx, out_weight, T)
    return y.view(B, T, h).to(x.dtype)
