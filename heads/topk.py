"""Per-query top-k attention (Gupta et al. 2021, "Memory-efficient Transformers via Top-k Attention").

Eq. 4: top-k-Attention(Q, K, V) = softmax(top-k(Q K^T / sqrt(h'))) V, where, made causal, each query
keeps the k largest scores among the keys at or before it (all of them while fewer than k exist)
and masks the rest. Projections, RoPE and output are those of heads/dense.py (same `qkv` / `out`
parameters), so a dense state dict loads unchanged and a trained dense model can be evaluated
with its heads swapped for top-k (the paper's §4.4 plug-and-play).

Fast path (§2.2): query chunking with chunk size C plus input checkpointing, as a custom autograd
Function. Forward keeps, per chunk, only the C x T score block; autograd saves Q, K, V and the
top-k scores and indices (O(T k)), never a T x T matrix; backward recomputes the softmax of each
chunk's k kept scores (the paper's pseudo-code lines 14-25, no recomputation of Q K^T), so the
attention memory is O(C T + T k) instead of O(T^2). A chunk's queries only need keys up to its end.
As in the paper's code (§5), the products do not leverage the sparsity for FLOPs: lines 7-8 and 20-25 multiply the
kept weights scattered into a zero C x T block, dense attention's cost (flops/formulas.py). Line 15's product at the
kept indices only (`out_indices`) is computed as the full C x T product dO V^T, then gathered, at line 24's cost:
gathering each query's k value rows instead would hold C k h' elements, more than the C x T block while k h' > T.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from heads.base import ConfigError, GroupContext, HeadOptions, register
from heads.dense import DenseHeads
from heads.gathered_lean import in_autocast_dtype
from heads.kv_cache import SlotKV
from routing.selection import earliest_topk


@dataclass
class TopKOptions(HeadOptions):
    """KV: every token (the default kv_per_head): any of them can be in a later query's top k."""

    k: int = 64  # keys kept per query
    chunk: int = 256  # C, queries processed at once by the fast path

    @classmethod
    def example(cls) -> dict[str, Any]:
        return {"k": 8}

    @classmethod
    def grid(cls) -> dict[str, list[Any]]:
        return {"k": [1, 2, 3, 8, 64], "chunk": [1, 3, 7, 256]}

    def validate(self, ctx: GroupContext) -> None:
        super().validate(ctx)
        if self.k < 1:
            raise ConfigError(f"topk: options.k must be >= 1, got {self.k}")
        if self.chunk < 1:
            raise ConfigError(f"topk: options.chunk must be >= 1, got {self.chunk}")

    def validate_length(self, head: str, seq_len: int) -> None:
        super().validate_length(head, seq_len)
        self.at_most(head, "k", seq_len, "every query would keep all its keys (dense attention)")


def _future(c0: int, c1: int, device: torch.device) -> torch.Tensor:
    """[c1 - c0, c1] bool: True where key row j is after query row i (c0 <= i < c1)."""
    return torch.arange(c1, device=device)[None, :] > torch.arange(c0, c1, device=device)[:, None]


class ChunkedTopKAttention(torch.autograd.Function):
    """q, k, v [B, H, T, d] -> [B, H, T, d]: causal top-k attention, `chunk` queries at a time."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk: int, chunk: int) -> torch.Tensor:
        B, H, T, d = q.shape
        kk, scale = min(topk, T), d**-0.5
        out = q.new_empty(B, H, T, v.shape[-1])
        top_s = q.new_full((B, H, T, kk), float("-inf"))  # padded slots stay -inf (weight 0)
        top_i = torch.zeros(B, H, T, kk, dtype=torch.long, device=q.device)
        for c0 in range(0, T, chunk):
            c1 = min(c0 + chunk, T)
            s = q[:, :, c0:c1] @ k[:, :, :c1].transpose(-1, -2) * scale  # [B, H, C, c1]
            s.masked_fill_(_future(c0, c1, q.device), float("-inf"))
            vals, idx = earliest_topk(s, min(kk, c1))  # [B, H, C, k'], k' <= k
            del s
            top_s[:, :, c0:c1, : idx.shape[-1]], top_i[:, :, c0:c1, : idx.shape[-1]] = vals, idx
            p = torch.zeros(B, H, c1 - c0, c1, dtype=q.dtype, device=q.device)
            p.scatter_add_(-1, idx, vals.softmax(-1))  # dense C x c1 weights (masked picks add 0)
            out[:, :, c0:c1] = p @ v[:, :, :c1]
        ctx.save_for_backward(q, k, v, top_s, top_i)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out: torch.Tensor):
        q, k, v, top_s, top_i = ctx.saved_tensors
        B, H, T, d = q.shape
        scale = d**-0.5
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for c0 in range(0, T, ctx.chunk):
            c1 = min(c0 + ctx.chunk, T)
            idx, do = top_i[:, :, c0:c1], d_out[:, :, c0:c1]  # [B, H, C, k], [B, H, C, d]
            p = top_s[:, :, c0:c1].softmax(-1)  # recomputed activation (pseudo-code line 18)
            dp = (do @ v[:, :, :c1].transpose(-1, -2)).gather(-1, idx)  # line 15
            ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale  # softmax backward, line 19
            dense = torch.zeros(B, H, c1 - c0, c1, dtype=q.dtype, device=q.device)
            dv[:, :, :c1] += dense.scatter_add_(-1, idx, p).transpose(-1, -2) @ do  # lines 20-21
            dense.zero_().scatter_add_(-1, idx, ds)  # line 23
            dq[:, :, c0:c1] = dense @ k[:, :, :c1]  # line 24
            dk[:, :, :c1] += dense.transpose(-1, -2) @ q[:, :, c0:c1]  # line 25
        return dq, dk, dv, None, None


def chunked_topk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk: int, chunk: int) -> torch.Tensor:
    """ChunkedTopKAttention in the autocast dtype with autocast off inside, so that its in-place scatters see one
    dtype whatever the device's autocast policy (CUDA's returns softmax in fp32, CPU's in bf16)."""
    q, k, v = in_autocast_dtype(q, k, v)
    with torch.autocast(q.device.type, enabled=False):
        return ChunkedTopKAttention.apply(q, k, v, topk, chunk)


@register("topk")
class TopKHeads(DenseHeads):
    """Dense heads (same weights) whose softmax keeps only each query's k best causal keys."""

    Options = TopKOptions
    beyond_training = "keeps its top k of every cached token, at rotary positions never seen in training"

    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, positions)  # [B, H, T, h']
        allowed = positions[:, :, None] >= positions[:, None, :]  # [B, T, T] causal
        kk = min(self.options.k, x.shape[1])
        heads = []
        for i in range(self.count):
            scores = q[:, i] @ k[:, i].transpose(-1, -2) / self.ctx.head_dim**0.5  # [B, T, T]
            scores = scores.masked_fill(~allowed, float("-inf"))
            kept = torch.zeros_like(allowed).scatter(-1, earliest_topk(scores, kk)[1], True)
            heads.append(scores.masked_fill(~(kept & allowed), float("-inf")).softmax(-1) @ v[:, i])
        return self.out(torch.cat(heads, dim=-1))

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self._qkv(x, positions)
        a = chunked_topk(q, k, v, self.options.k, self.options.chunk)
        return self.out(a.transpose(1, 2).reshape(B, T, self.count * self.ctx.head_dim))

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: SlotKV) -> torch.Tensor:
        """Decoding (cache from DenseHeads.new_cache, all T keys): the prefill runs the chunked path;
        each later query keeps its k best scores among the cached keys at positions <= its own."""
        B, T, _ = x.shape
        q, k, v = self._qkv(x, positions)
        prefill = cache.fresh
        cache.write(torch.ones(k.shape[:3], dtype=torch.bool, device=x.device), k, v, positions[:, None].expand(-1, self.count, -1))
        if prefill:
            a = chunked_topk(q, k, v, self.options.k, self.options.chunk)
        else:
            kpos = cache.pos[:, :, None, :]  # [B, H, 1, S]: every slot, empty ones (pos -1) masked
            visible = (kpos >= 0) & (kpos <= positions[:, None, :, None])  # [B, H, T, S]
            scores = (q @ cache.k.transpose(-1, -2) / self.ctx.head_dim**0.5).masked_fill(~visible, float("-inf"))
            top, idx = earliest_topk(scores, min(self.options.k, scores.shape[-1]))  # masked keys get weight 0
            weights = top.softmax(-1).to(scores.dtype)  # (CUDA autocast's softmax returns fp32)
            a = torch.zeros_like(scores).scatter_add_(-1, idx, weights) @ cache.v
        return self.out(a.transpose(1, 2).reshape(B, T, self.count * self.ctx.head_dim))
