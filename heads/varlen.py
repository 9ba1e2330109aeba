"""Packed variable-length attention, merged into another softmax by log-sum-exp: flash-attn's varlen
kernels on CUDA where flash-attn is installed, else Triton kernels of the same contract
(heads/varlen_triton.py), and a plain PyTorch implementation of it as the reference.

Packed layout (flash-attn's): q[Nq, d], k/v[Nk, d]; `Segments` cuts them into S segments with int32
offsets cu_q[S + 1], cu_k[S + 1]; query rows of segment s attend (not causally) to the key rows of
segment s only. No padding: work is sum_s |q_s| |k_s|, whatever the spread of segment sizes.

`merge_varlen` adds such an attention to a part already computed elsewhere (its output and log-sum-exp)
as ONE softmax over both key sets (MiTA Alg. 1 line 16). The kernels' log-sum-exp is not
differentiable (flash-attn's never is), so the merge cannot just combine the two parts' outputs under
autograd. Its backward
uses the identity behind ring attention instead: for a softmax over the union of key sets, the gradient
of the merged output O w.r.t. one part's logits is P (dO V^T - rowsum(dO * O)) with P = exp(S - lse),
O and lse the *merged* output and log-sum-exp. That is exactly flash-attn's backward called with the
merged O and lse (FlashAttention-2 App. B.2), so the packed part gets exact gradients from the kernels.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from heads.attention import flash_attn_interface
from heads.switch import FastPath


# The dtypes the varlen kernels (flash-attn, Triton) compute in, accumulating in fp32: fp64 inputs (gradient checks)
# take the callers' PyTorch paths, which keep their precision.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Segments:
    """Segment boundaries of a packed query/key layout (flash-attn's cu_seqlens convention)."""

    cu_q: Tensor  # [S + 1] int32, query rows of segment s are cu_q[s] .. cu_q[s+1] - 1
    cu_k: Tensor  # [S + 1] int32, likewise for key/value rows
    max_q: int  # longest query segment
    max_k: int  # longest key segment

    @staticmethod
    def from_counts(q_counts: Tensor, k_counts: Tensor) -> Segments:
        """Segments from per-segment row counts q_counts[S], k_counts[S] (one host sync for the maxima)."""
        cu_q, cu_k = (torch.nn.functional.pad(c.cumsum(0), (1, 0)).to(torch.int32) for c in (q_counts, k_counts))
        return Segments(cu_q, cu_k, int(q_counts.max()), int(k_counts.max()))


class VarlenBackend(Protocol):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, seg: Segments, scale: float) -> tuple[Tensor, Tensor]:
        """-> out[Nq, d] = softmax(q k^T * scale) v within each segment, lse[Nq] (float32, or float64
        for float64 inputs)."""
        ...

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg: Segments,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """FlashAttention-2's backward with the given out and lse: P = exp(q k^T * scale - lse),
        dv = P^T dout, dS = P (dout v^T - rowsum(dout * out)), dq = dS k * scale, dk = dS^T q * scale."""
        ...


class TorchVarlen:
    """The varlen contract in plain PyTorch, one segment at a time: readable, any device and dtype."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, seg: Segments, scale: float) -> tuple[Tensor, Tensor]:
        acc = torch.promote_types(q.dtype, torch.float32)
        out, lse = torch.zeros_like(q), q.new_full(q.shape[:1], float("-inf"), dtype=acc)
        for (q0, q1), (k0, k1) in _bounds(seg):
            s = q[q0:q1] @ k[k0:k1].T * scale  # [|q_s|, |k_s|]
            out[q0:q1] = s.softmax(-1) @ v[k0:k1]
            lse[q0:q1] = s.to(acc).logsumexp(-1)
        return out, lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg: Segments,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (dout * out).sum(-1)  # [Nq] rowsum(dO * O)
        for (q0, q1), (k0, k1) in _bounds(seg):
            p = (q[q0:q1] @ k[k0:k1].T * scale - lse[q0:q1, None]).exp().to(q.dtype)  # [|q_s|, |k_s|]
            ds = p * (dout[q0:q1] @ v[k0:k1].T - delta[q0:q1, None])
            dv[k0:k1] = p.T @ dout[q0:q1]
            dq[q0:q1] = ds @ k[k0:k1] * scale
            dk[k0:k1] = ds.T @ q[q0:q1] * scale
        return dq, dk, dv


def _bounds(seg: Segments) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    cq, ck = seg.cu_q.tolist(), seg.cu_k.tolist()
    return [((cq[s], cq[s + 1]), (ck[s], ck[s + 1])) for s in range(len(cq) - 1)]


class FlashVarlen:
    """flash-attn (>= 2.7) varlen kernels, with the packed rows as one head: q[N, 1, d]."""

    def __init__(self, interface: Any) -> None:
        self.fa = interface  # flash_attn.flash_attn_interface

    def forward(self, q: Tensor, k: Tensor, v: Tensor, seg: Segments, scale: float) -> tuple[Tensor, Tensor]:
        out, lse, _, _ = self.fa._flash_attn_varlen_forward(
            q[:, None], k[:, None], v[:, None], seg.cu_q, seg.cu_k, seg.max_q, seg.max_k,
            dropout_p=0.0, softmax_scale=scale, causal=False,
        )
        lse = lse[0]  # [heads, Nq] -> [Nq]; a row whose key segment is empty gets +inf from flash-attn, -inf here
        return out[:, 0], lse.masked_fill(lse == float("inf"), float("-inf"))

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg: Segments,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = torch.empty_like(q[:, None]), torch.empty_like(k[:, None]), torch.empty_like(v[:, None])
        self.fa._flash_attn_varlen_backward(
            dout[:, None].contiguous(), q[:, None], k[:, None], v[:, None], out[:, None].contiguous(),
            lse[None].contiguous(), dq, dk, dv, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k,
            dropout_p=0.0, softmax_scale=scale, causal=False, window_size_left=-1, window_size_right=-1,
            softcap=0.0, alibi_slopes=None, deterministic=torch.are_deterministic_algorithms_enabled(),
        )
        return dq[:, 0], dk[:, 0], dv[:, 0]


_KERNELS = FastPath()
disabled = _KERNELS.disabled  # inside it cuda_backend gives None, so callers take their padded path (benchmarks)


def cuda_backend(q: Tensor) -> VarlenBackend | None:
    """The varlen kernels for q's device: flash-attn where it can run, else the Triton kernels on any
    CUDA device; None on CPU, for fp64 (callers keep their padded PyTorch path there) or inside `disabled()`."""
    if not q.is_cuda or not _KERNELS.on or q.dtype not in KERNEL_DTYPES:
        return None
    return flash_backend(q) or _triton_backend()


@functools.cache
def _triton_backend() -> VarlenBackend | None:
    try:
        from heads.varlen_triton import TritonVarlen
    except ImportError:
        return None
    return TritonVarlen()


def flash_version(fa: Any) -> tuple[int, int]:
    """(major, minor) of the flash_attn package whose interface module is `fa`; (0, 0) if unknown."""
    package = sys.modules.get(getattr(fa, "__name__", "").partition(".")[0])
    major, minor = (getattr(package, "__version__", "0.0").split(".") + ["0"])[:2]
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else (0, 0)


def flash_backend(q: Tensor) -> FlashVarlen | None:
    """flash-attn's varlen kernels if they can run on q (CUDA, fp16/bf16, head dim a multiple of 8 up
    to 256, flash-attn >= 2.7 installed: FlashVarlen calls its private varlen functions, whose
    arguments and results changed in 2.7), else None."""
    fa = flash_attn_interface()
    d = q.shape[-1]
    if fa is None or flash_version(fa) < (2, 7) or not q.is_cuda:
        return None
    if q.dtype not in (torch.float16, torch.bfloat16) or d % 8 or d > 256:
        return None
    return FlashVarlen(fa)


class _MergeVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out_a: Tensor, lse_a: Tensor, q: Tensor, k: Tensor, v: Tensor, rows: Tensor,
                seg: Segments, scale: float, backend: VarlenBackend) -> Tensor:
        out_b, lse_b = backend.forward(q, k, v, seg, scale)
        acc, lse_in_dtype = torch.promote_types(out_a.dtype, torch.float32), lse_a.dtype
        lse_a = lse_a.to(acc)
        lse_a_rows = lse_a[rows]
        lse_rows = torch.logaddexp(lse_a_rows, lse_b.to(acc))  # merged log-sum-exp of the packed rows
        lse = lse_a.index_put((rows,), lse_rows)
        w_a, w_b = (lse_a_rows - lse_rows).exp()[:, None], (lse_b - lse_rows).exp()[:, None]
        out = out_a.index_put((rows,), (w_a * out_a[rows].to(acc) + w_b * out_b.to(acc)).to(out_a.dtype))
        ctx.save_for_backward(out_a, lse_a, q, k, v, rows, out, lse)
        ctx.seg, ctx.scale, ctx.backend, ctx.lse_dtype = seg, scale, backend, lse_in_dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        out_a, lse_a, q, k, v, rows, out, lse = ctx.saved_tensors
        w_a = (lse_a - lse).exp()  # part A's share of the merged softmax, [N], in the accumulation dtype
        d_out_a = (w_a[:, None] * dout).to(out_a.dtype)
        d_lse_a = w_a * (dout.to(w_a.dtype) * (out_a - out).to(w_a.dtype)).sum(-1)  # d O / d lse_a = w_a (O_a - O)
        dq, dk, dv = ctx.backend.backward(dout[rows].to(q.dtype), q, k, v, out[rows], lse[rows], ctx.seg, ctx.scale)
        return d_out_a, d_lse_a.to(ctx.lse_dtype), dq, dk, dv, None, None, None, None


def merge_varlen(out_a: Tensor, lse_a: Tensor, q: Tensor, k: Tensor, v: Tensor, rows: Tensor, seg: Segments,
                 scale: float, backend: VarlenBackend) -> Tensor:
    """One softmax over part A and a packed varlen part. out_a[N, d], lse_a[N]: part A's normalised
    output and log-sum-exp per row; q[Nq, d] packed queries, query r belonging to row rows[r] (rows
    distinct); k/v[Nk, d] packed keys cut by `seg`. Rows not in `rows` keep out_a. Returns [N, d];
    differentiable w.r.t. out_a, lse_a, q, k, v."""
    return _MergeVarlen.apply(out_a, lse_a, q, k, v, rows, seg, scale, backend)
