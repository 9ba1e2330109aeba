"""Memory-lean gathered-head core (heads/gathered.py's definition, MoSA §2.2) for CPU and GPUs without Triton.

Same maths as `gathered_heads_reference`: per head i, X^s = X[I]; Q, K, V = X^s W^{Q,K,V}_i (RoPE at the
original positions); A = softmax(Q K^T / sqrt(h') + M) V; Y[I] += diag(r_I) A W^O_i. What differs is what
lives in memory. A custom autograd Function processes the heads in chunks of about T / (4c) heads, so every
buffer of shape [chunk, B, c, h] (the gathered X^s, the per-head outputs diag(r) A W^O, their gradients) is
about a quarter of X, or up to MIN_CHUNK_ELEMENTS for tiny problems (CUDA_CHUNK_ELEMENTS on a GPU, where kernel
launches dominate below it), allocated once per pass and reused by every chunk, and saves for backward only the
slot indices, gates, slot positions and the rotated Q, K, V [H, B, c, h'] (h' << h). Backward re-gathers X^s
and dY[I] chunk by chunk and recomputes the c x c attention (c <= a few hundred slots); nothing of size
[B, H, c, h] is ever held whole.

Slot layout (routing/selection.py): per (sequence, head) c slots, valid ones first in ascending token
order, so M is the causal mask over slots. Optional masks for MoSAIC's padding rules (App. E.2):
`visible[B, H, c]` (keys other slots may see) and `self_only[B, H, c]` (queries that see only
themselves); every slot always sees itself, so no softmax row is empty.
"""
from __future__ import annotations

from typing import Any

import torch

from heads.rope import RotaryEmbedding


def slot_mask(c: int, visible: torch.Tensor | None, self_only: torch.Tensor | None,
              device: torch.device) -> torch.Tensor:
    """bool[..., c, c] (True = query slot j may attend key slot l): l <= j, key visible, plus the diagonal;
    a self_only query sees only itself. visible/self_only: bool[..., c] or None (no restriction)."""
    eye = torch.eye(c, dtype=torch.bool, device=device)
    allowed = torch.ones(c, c, dtype=torch.bool, device=device).tril()
    if visible is not None:
        allowed = allowed & visible[..., None, :]
    allowed = allowed | eye
    if self_only is not None:
        allowed = torch.where(self_only[..., :, None], eye, allowed)
    return allowed


CHUNK_ROWS = 0.25  # slots per sequence in one chunk of heads, as a fraction of T (measured: smaller
# chunks cost no time on CPU at Tiny scale, and the three [chunk, B, c, h] transients of backward stay < X)
MIN_CHUNK_ELEMENTS = 2**19  # ... but a chunk's [n, B*c, h] buffer may always hold this many elements (2 MiB
# in fp32): below it per-op overhead dominates (24 MoSA heads at h = 64, T = 128, B = 16: one head per chunk
# took 2x the time of 16 per chunk). It leaves the Tiny point at B = 4 as it was (8 heads per chunk either way).
CUDA_CHUNK_ELEMENTS = 2**24  # on a GPU (32 MiB in bf16; 5 such buffers live at once in backward): a GPU does 2^19
# elements' work in about a microsecond, less than one kernel launch, and each chunk launches ~70 kernels. On the
# H200, 639 heads of c = 128 at T = 4096, B = 4 ran in 80 chunks of 8 heads: 147 ms forward and backward, 72x the
# dense group at equal FLOPs (bench/results/gpu_isoflop_heads.md); this floor makes them 10 chunks of 64.


def slot_positions(positions: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """positions[B, T], idx[B, H, c] -> the original positions of the slots, head-major [H, B, c] (where RoPE rotates
    them)."""
    B, H, c = idx.shape
    return positions.gather(1, idx.reshape(B, -1)).view(B, H, c).transpose(0, 1)


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype Y and dX are summed in over heads: fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 ones."""
    return torch.promote_types(dtype, torch.float32)


def heads_per_chunk(heads: int, slots: int, seq_len: int, head_elements: int, device: str = "cpu") -> int:
    """Heads processed together: their c slots per sequence add up to at most CHUNK_ROWS * T, or their
    buffers (`head_elements` = B * c * h each) to at most MIN_CHUNK_ELEMENTS (CUDA_CHUNK_ELEMENTS on a CUDA
    `device`), whichever allows more (>= 1)."""
    by_rows = int(CHUNK_ROWS * seq_len) // max(slots, 1)
    floor = CUDA_CHUNK_ELEMENTS if device == "cuda" else MIN_CHUNK_ELEMENTS
    return max(1, min(heads, max(by_rows, floor // max(head_elements, 1))))


class _Plan:
    """Index bookkeeping shared by forward and backward, in head-major layout [H, B, c]."""

    def __init__(self, x: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> None:
        B, T, _ = x.shape
        self.B, self.T, self.H, self.c = B, T, idx.shape[1], idx.shape[2]
        offsets = torch.arange(B, device=idx.device)[:, None, None] * T
        self.flat = (idx + offsets).transpose(0, 1).reshape(self.H, B * self.c)  # rows of x.view(B*T, h)
        self.pos = slot_positions(positions, idx)  # [H, B, c]
        self.step = heads_per_chunk(self.H, self.c, T, B * self.c * x.shape[-1], x.device.type)
        self._mask = mask.transpose(0, 1) if mask.dim() == 4 else mask  # [H, B, c, c] (MoSAIC) or [c, c]

    def mask(self, heads: slice) -> torch.Tensor:
        """The slot mask of a chunk of heads (heads/gathered_lean.slot_mask), broadcastable to [n, B, c, c]."""
        return self._mask[heads] if self._mask.dim() == 4 else self._mask

    def chunks(self) -> range:
        return range(0, self.H, self.step)

    def workspace(self, like: torch.Tensor) -> torch.Tensor:
        """One chunk's [step, B*c, h] buffer, reused by every chunk (fresh multi-MB allocations page-fault)."""
        return like.new_empty(self.step, self.B * self.c, like.shape[-1])

    def gather(self, rows: torch.Tensor, heads: slice, out: torch.Tensor) -> torch.Tensor:
        """rows[B*T, h] -> the slots of a chunk of heads [n, B*c, h], written into the workspace `out`."""
        flat = self.flat[heads]
        buf = out[: flat.shape[0]]
        torch.index_select(rows, 0, flat.reshape(-1), out=buf.view(-1, rows.shape[-1]))
        return buf


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v [n, B, c, d], allowed [n|1, B|1, c, c] -> (P, A = P V), P = masked softmax(q k^T / sqrt(d))."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return p, p @ v


def lean_forward(x: torch.Tensor, gate: torch.Tensor, qkv_weight: torch.Tensor, out_weight: torch.Tensor,
                 idx: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                 mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The forward in chunks of heads: y ([B*T, h], in the accumulator dtype) and the rotated Q, K and V
    [H, B, c, h'] for backward."""
    B, T, h = x.shape
    plan = _Plan(x, idx, positions, mask)
    H, c = plan.H, plan.c
    d = qkv_weight.shape[0] // (3 * H)
    w = qkv_weight.view(3, H, d, h)
    wo = out_weight.view(h, H, d)
    xf = x.reshape(B * T, h)
    gate_h = gate.transpose(0, 1)  # [H, B, c]
    q_all, k_all, v_all = (x.new_empty(H, B, c, d) for _ in range(3))
    y = torch.zeros(B * T, h, device=x.device, dtype=accumulator(x.dtype))
    xs_buf, out_buf = plan.workspace(xf), plan.workspace(xf)
    for h0 in plan.chunks():
        s = slice(h0, h0 + plan.step)
        xs = plan.gather(xf, s, xs_buf)  # X^s of this chunk of heads [n, B*c, h]
        n = xs.shape[0]
        q, k, v = q_all[s], k_all[s], v_all[s]  # [n, B, c, d], written in place
        for j, t in enumerate((q, k, v)):
            torch.bmm(xs, w[j, s].transpose(1, 2), out=t.view(n, B * c, d))
        cos, sin = rope.cos_sin(plan.pos[s], x.dtype)
        rope.rotate_(q, cos, sin)
        rope.rotate_(k, cos, sin)
        _, a = _attention(q, k, v, plan.mask(s))
        a = a.mul_(gate_h[s, ..., None]).view(n, B * c, d)  # diag(r) A
        x_o = torch.bmm(a, wo[:, s].permute(1, 2, 0), out=out_buf[:n])  # [n, B*c, h]
        y.index_add_(0, plan.flat[s].reshape(-1), x_o.reshape(-1, h).to(y.dtype))
    return y, q_all, k_all, v_all


def lean_backward(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, qkv_weight: torch.Tensor,
                  out_weight: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                  mask: torch.Tensor, q_all: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                  needs: tuple[bool, ...]) -> tuple:
    """The backward in chunks of heads, recomputing the gathers and the c x c attention:
    (dx [B, T, h], dgate [B, H, c], dW^QKV, dW^O), None where `needs` says no."""
    B, T, h = x.shape
    plan = _Plan(x, idx, positions, mask)
    H, c = plan.H, plan.c
    d = q_all.shape[-1]
    w = qkv_weight.view(3, H, d, h)
    wo = out_weight.view(h, H, d)
    xf, dyf = x.reshape(B * T, h), dy.reshape(B * T, h).to(x.dtype).contiguous()  # (a broadcast dy gathers slowly)
    gate_h = gate.transpose(0, 1)
    need_x, need_gate, need_w, need_wo = needs
    dx = torch.zeros(B * T, h, device=x.device, dtype=accumulator(x.dtype)) if need_x else None
    dgate = torch.zeros(H, B, c, device=x.device, dtype=gate.dtype) if need_gate else None
    dw = torch.empty_like(qkv_weight).view(3, H, d, h) if need_w else None  # every head's slice is written
    dwo = torch.empty_like(out_weight).view(h, H, d) if need_wo else None
    scale = d**-0.5
    dy_buf, xs_buf, dxs_buf = plan.workspace(xf), plan.workspace(xf), plan.workspace(xf)
    for h0 in plan.chunks():
        s = slice(h0, h0 + plan.step)
        q, k, v = q_all[s], k_all[s], v_all[s]
        n = q.shape[0]
        p, a = _attention(q, k, v, plan.mask(s))  # recomputed, c x c per head
        dyg = plan.gather(dyf, s, dy_buf)  # dY at the slots [n, B*c, h]
        g = torch.bmm(dyg, wo[:, s].permute(1, 0, 2)).view(n, B, c, d)  # dL/d(diag(r) A)
        if need_gate:
            dgate[s] = (a * g).sum(-1)
        if need_wo:
            ga = (a * gate_h[s, ..., None]).view(n, B * c, d)
            dwo[:, s] = torch.bmm(dyg.transpose(1, 2), ga).transpose(0, 1)
        da = g * gate_h[s, ..., None]
        dp = da @ v.transpose(-1, -2)
        dv = p.transpose(-1, -2) @ da
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        cos, sin = rope.cos_sin(plan.pos[s], q.dtype)
        dq = rope.rotate_(ds @ k, cos, sin, inverse=True)  # R(θ)^T: the gradient before the rotation
        dk = rope.rotate_(ds.transpose(-1, -2) @ q, cos, sin, inverse=True)
        dq, dk, dv = (t.reshape(n, B * c, d) for t in (dq, dk, dv))
        if need_w:
            xs = plan.gather(xf, s, xs_buf)
            for j, dt in enumerate((dq, dk, dv)):
                torch.bmm(dt.transpose(1, 2), xs, out=dw[j, s])
        if need_x:
            dxs = torch.bmm(dq, w[0, s], out=dxs_buf[:n]).baddbmm_(dk, w[1, s]).baddbmm_(dv, w[2, s])
            dx.index_add_(0, plan.flat[s].reshape(-1), dxs.reshape(-1, h).to(dx.dtype))
    return (dx.view(B, T, h).to(x.dtype) if need_x else None, dgate.transpose(0, 1) if need_gate else None,
            dw.view_as(qkv_weight) if need_w else None, dwo.view_as(out_weight) if need_wo else None)


class GatheredHeads(torch.autograd.Function):
    """y = sum_i scatter_{I_i}(diag(r_i) A_i W^O_i) by lean_forward / lean_backward; saved: x, the weights,
    indices, gates, the slot mask and the rotated Q, K, V [H, B, c, h']."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate: torch.Tensor, qkv_weight: torch.Tensor, out_weight: torch.Tensor,
                idx: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, visible: torch.Tensor | None,
                self_only: torch.Tensor | None) -> torch.Tensor:
        mask = slot_mask(idx.shape[-1], visible, self_only, x.device)
        y, q_all, k_all, v_all = lean_forward(x, gate, qkv_weight, out_weight, idx, positions, rope, mask)
        ctx.save_for_backward(x, gate, qkv_weight, out_weight, idx, positions, mask, q_all, k_all, v_all)
        ctx.rope = rope
        # A fresh tensor under torch.compile: torch 2.11's dynamo gives an output that an in-place op made
        # inside forward the wrong gradient edge (zero gradients; pytorch#180642; 2.13 is fine).
        return y.view(x.shape).to(x.dtype, copy=torch.compiler.is_compiling())

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, gate, qkv_weight, out_weight, idx, positions, mask, q, k, v = ctx.saved_tensors
        grads = lean_backward(dy, x, gate, qkv_weight, out_weight, idx, positions, ctx.rope, mask, q, k, v,
                              tuple(ctx.needs_input_grad[:4]))
        return (*grads, None, None, None, None, None)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the gathered core computes in for input x: the autocast dtype under autocast, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def in_autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in the compute dtype (the gathered core then runs with autocast off: its matmuls in that
    dtype, accumulation into Y in fp32)."""
    dtype = compute_dtype(tensors[0])
    return tuple(t.to(dtype) for t in tensors)


def gathered_heads_lean(x: torch.Tensor, positions: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor,
                        qkv_weight: torch.Tensor, out_weight: torch.Tensor, rope: RotaryEmbedding,
                        visible: torch.Tensor | None = None, self_only: torch.Tensor | None = None) -> torch.Tensor:
    """x[B, T, h], idx/gate[B, H, c] -> y[B, T, h] (see the module docstring)."""
    x, gate, qkv_weight, out_weight = in_autocast_dtype(x, gate, qkv_weight, out_weight)
    with torch.autocast(x.device.type, enabled=False):
        return GatheredHeads.apply(x, gate, qkv_weight, out_weight, idx, positions, rope, visible, self_only)
