"""Masked attention that also returns its log-sum-exp, differentiable in both, saving only q, k, v, out, lse.

For parts of one softmax that are computed separately and merged by log-sum-exp (MiTA Alg. 1 line 16):

    S = q k^T * scale + bias, masked to -inf where not allowed;  lse = logsumexp_keys(S);
    P = exp(S - lse);  out = P v.

Autograd of the plain expression keeps S, P and their masked / scaled copies alive for backward, several
tensors of size [..., M, N] per call. The backward here recomputes S from the saved q, k (FlashAttention-2
App. B.2) and uses the merged gradient of both outputs: with dP = dout v^T and delta = rowsum(dout * out),

    dS = P * (dP - delta + dlse),  dq = dS k * scale,  dk = dS^T q * scale,  dv = P^T dout,

so what it keeps is q, k, v, out, lse and the mask. A row with no allowed key gives out = 0, lse = -inf
(and zero gradients), instead of softmax's NaN. The bias is a constant (no gradient). Queries, keys and
values may also be given as row tables plus indices (MiTA's routed groups): the gathered copies are then
not kept either, only the indices.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from heads.gathered_lean import accumulator, in_autocast_dtype


def _probabilities(q: Tensor, k: Tensor, allowed: Tensor, bias: Tensor | None, scale: float,
                   lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(P, lse) of the masked scores, softmax statistics in at least fp32; lse given: reuse it. Every pass
    over the [..., M, N] scores is in place (this is memory-bound at small d). The scores come out of the
    matmul in the inputs' dtype, as eager attention's do under autocast: in bf16 they are rounded to 8 bits
    before the fp32 softmax (flash-attn and the Triton kernels keep them in fp32), which costs accuracy where
    the logits are large and peaked (~4x SDPA's error at a logit std of 9)."""
    s = ((q * scale) @ k.transpose(-1, -2)).to(accumulator(q.dtype))
    if bias is not None:
        s += bias
    s.masked_fill_(~allowed, float("-inf"))
    if lse is None:
        m = s.amax(-1, keepdim=True)
        m = m.masked_fill_(m == float("-inf"), 0.0)  # a row without keys: exp(-inf - 0) = 0
        z = s.sub_(m).exp_().sum(-1, keepdim=True)
        s /= z.masked_fill(z == 0, 1.0)
        return s, (m + z.log()).squeeze(-1)
    finite = lse.masked_fill(lse == float("-inf"), 0.0)
    return s.sub_(finite[..., None]).exp_(), lse


def _take(t: Tensor, rows: Tensor | None) -> Tensor:
    """t[N, d] at rows[...] -> [..., d] (rows None: t itself)."""
    return t if rows is None else t.index_select(0, rows.flatten()).view(*rows.shape, t.shape[-1])


def _put(grad: Tensor, rows: Tensor | None, like: Tensor) -> Tensor:
    """The gradient of _take (after undoing a broadcast over query batch dimensions): grad[..., d] summed back
    into the rows of a zero tensor shaped like `like`."""
    shape = like.shape if rows is None else (*rows.shape, like.shape[-1])
    grad = grad.sum_to_size(shape) if grad.shape != shape else grad
    return grad if rows is None else torch.zeros_like(like).index_add_(0, rows.flatten(), grad.reshape(-1, shape[-1]))


class _AttentionLSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, bias: Tensor | None, scale: float,
                q_rows: Tensor | None, kv_rows: Tensor | None) -> tuple[Tensor, Tensor]:
        p, lse = _probabilities(_take(q, q_rows), _take(k, kv_rows), allowed, bias, scale)
        out = p.to(v.dtype) @ _take(v, kv_rows)
        ctx.save_for_backward(q, k, v, allowed, bias, out, lse, q_rows, kv_rows)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, allowed, bias, out, lse, q_rows, kv_rows = ctx.saved_tensors
        qg, kg = _take(q, q_rows), _take(k, kv_rows)  # gathered again (each copy is dropped once used)
        p, _ = _probabilities(qg, kg, allowed, bias, ctx.scale, lse)
        dp = (dout @ _take(v, kv_rows).transpose(-1, -2)).to(p.dtype)
        dv = _put(p.to(v.dtype).transpose(-1, -2) @ dout, kv_rows, v)
        delta = (dout * out).sum(-1, dtype=p.dtype) - dlse  # rowsum(dO * O) - dlse
        ds = dp.sub_(delta[..., None]).mul_(p).to(q.dtype)
        del p, dp
        dq = _put((ds @ kg).mul_(ctx.scale), q_rows, q)
        del kg
        dk = _put((ds.transpose(-1, -2) @ qg).mul_(ctx.scale), kv_rows, k)
        return dq, dk, dv, None, None, None, None, None


def attention_lse(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, bias: Tensor | None = None,
                  q_rows: Tensor | None = None, kv_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q[..., M, d], k/v[..., N, d], allowed bool broadcastable to [..., M, N], bias (constant) likewise
    -> out[..., M, d] = softmax(q k^T * scale + bias | allowed) v and lse[..., M] (fp32, fp64 for fp64).
    With q_rows[..., M] (kv_rows[..., N]) q (k and v) are [rows, d] tables and the attention runs on their rows
    at those indices, which are gathered again in backward instead of kept. Under autocast the matmuls run in
    the autocast dtype."""
    q, k, v = in_autocast_dtype(q, k, v)
    with torch.autocast(q.device.type, enabled=False):
        return _AttentionLSE.apply(q, k, v, allowed, bias, scale, q_rows, kv_rows)


def merge(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """One softmax from parts over disjoint key sets: outs[p] [..., d] with log-sum-exp lses[p] [...] (-inf:
    an empty part) -> (sum_p exp(lse_p - lse) out_p, lse = logsumexp_p lse_p) (MiTA Alg. 1 line 16).
    The parts are summed, not stacked, so autograd saves no copy of them."""
    lse = torch.stack(tuple(lses), -1)  # [..., P]
    weights = lse.softmax(-1).to(outs[0].dtype)[..., None]
    return sum(weights[..., p, :] * out for p, out in enumerate(outs)), lse.logsumexp(-1)
