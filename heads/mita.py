"""Causal Mixture-of-Top-k Attention (MiTA, §3.2 eqs. 5-12, Algorithm 1), for decoder LMs.

Per head, with blocks of b rows (routing/landmarks.py) and n = T // b completed blocks:
- landmark queries q~_j = average of the block's rotated queries (Alg. 1 line 2, causal pool);
- routed expert j (eqs. 5-7): the top-k keys of S_j = q~_j K^T / sqrt(h') among rows p <= e_j
  (e_j = the block's last row), K^(j) = K[I_j], V^(j) = V[I_j];
- shared expert (eqs. 8-9): landmark values v~_j = softmax(S_j) V over rows <= e_j, keys q~_j;
- routing: logits q . q~_j (Alg. 1 line 13), each query picks its top-s eligible landmarks;
- output (eqs. 10-12), one softmax over: the shared entries (q~_j, v~_j) of eligible landmarks,
  the keys of its s routed experts, and its own block's keys at rows <= t.
Landmark j is eligible for a query at row t iff block j ended before t's block starts
(j < t // b): every key it brings is at a row < t, so nothing after the query is ever visible, and
routed keys never duplicate own-block keys.

Deviations from the paper, and why:
- causality: pooling only over completed blocks, experts and landmark values over each landmark's
  prefix only, eligibility as above (the paper pools and ranks over the whole image);
- the own-block term is added (causal local attention) so rows of the first block, which have no
  eligible landmark, still have context, and each query sees its most recent tokens exactly;
- for s > 1 the routed keys are the *union* of the chosen experts (a key chosen by two experts
  counts once, as in MoBA's union of blocks); for s = 1, the paper's implemented case, this is
  exactly eq. 11's concatenation;
- the landmark count grows with T (one per b rows) instead of a fixed m = AdaptiveAvgPool size, so
  that pooling windows do not depend on the sequence length; m = T // b at the training length;
- `shared: false` drops the shared expert (the paper's "route-only" ablation, App. A). With
  k >= T, s >= T // b and shared false, MiTA is exactly dense causal attention (tested).
Projections are those of heads/dense.py (same `qkv` / `out`), so dense weights load unchanged
(MiTA App. C's algorithmic generalisation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heads.attention import attend
from heads.base import ConfigError, GroupContext, HeadOptions, register
from heads.dense import DenseHeads
from routing.landmarks import block_pool, earlier_blocks, landmark_topk, prefix_mask, route

NEG_INF = float("-inf")


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[B, H, N, X], index[B, H, ...] (values < N) -> t's rows at index, [B, H, ..., X]."""
    flat = index.flatten(2)  # [B, H, M]
    return t.gather(2, flat[..., None].expand(-1, -1, -1, t.shape[-1])).view(*index.shape, t.shape[-1])


@dataclass
class MiTAOptions(HeadOptions):
    block: int = 64  # b, rows pooled into one landmark query (m = T // b landmarks)
    k: int = 64  # keys gathered by each landmark (expert width)
    s: int = 1  # routed experts per query (besides the shared one)
    shared: bool = True  # include the shared (compressed) expert, eqs. 8-9

    def validate(self, ctx: GroupContext) -> None:
        super().validate(ctx)
        for name in ("block", "k", "s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"mita: options.{name} must be >= 1, got {getattr(self, name)}")


@register("mita")
class MiTAHeads(DenseHeads):
    """Causal MiTA heads: shared landmark expert + top-s routed top-k experts + own block."""

    Options = MiTAOptions

    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, positions)  # [B, H, T, h']
        T, (b, kk, s) = x.shape[1], (self.options.block, self.options.k, self.options.s)
        n, rows = T // b, torch.arange(T, device=x.device)
        scale = self.ctx.head_dim**-0.5
        ends = rows[b - 1 :: b][:n]  # [n] e_j
        landmark_sees = rows[None, :] <= ends[:, None]  # [n, T]
        eligible = torch.arange(n, device=x.device)[None, :] < (rows // b)[:, None]  # [T, n]: j < t // b
        own_block = (rows[None, :] <= rows[:, None]) & (rows[None, :] // b == rows[:, None] // b)  # [T, T]
        heads = []
        for i in range(self.count):
            qi, ki, vi = q[:, i], k[:, i], v[:, i]  # [B, T, h']
            lq = torch.stack([qi[:, j * b : (j + 1) * b].mean(1) for j in range(n)], 1) if n else qi[:, :0]
            S = (lq @ ki.transpose(-1, -2) * scale).masked_fill(~landmark_sees, NEG_INF)  # [B, n, T]
            lv = S.softmax(-1) @ vi if n else vi[:, :0]  # eq. 8: landmark values [B, n, h']
            expert = torch.zeros_like(S, dtype=torch.bool)  # eq. 7: I_j as a mask over keys
            if n:
                expert.scatter_(-1, S.topk(min(kk, T), dim=-1).indices, True)
            expert &= landmark_sees
            R = (qi @ lq.transpose(-1, -2) * scale).masked_fill(~eligible, NEG_INF)  # [B, T, n] logits
            chosen = torch.zeros_like(R, dtype=torch.bool)  # e_1(q) .. e_s(q)
            if n:
                chosen.scatter_(-1, R.topk(min(s, n), dim=-1).indices, True)
            chosen &= eligible
            routed = (chosen.double() @ expert.double()) > 0  # [B, T, T] union of chosen experts' keys
            keys_ok = routed | own_block
            shared_ok = eligible.expand_as(R) if self.options.shared else torch.zeros_like(chosen)
            scores = torch.cat((R, qi @ ki.transpose(-1, -2) * scale), -1)  # [B, T, n + T] eq. 10
            scores = scores.masked_fill(~torch.cat((shared_ok, keys_ok), -1), NEG_INF)
            heads.append(scores.softmax(-1) @ torch.cat((lv, vi), 1))
        return self.out(torch.cat(heads, dim=-1))

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, positions)  # [B, H, T, d]
        B, H, T, d = q.shape
        b, scale = self.options.block, d**-0.5
        n, nb = T // b, -(-T // b)
        dev = q.device
        lq = block_pool(q, b)  # [B, H, n, d] landmark queries
        S = (lq @ k.transpose(-1, -2) * scale).masked_fill(~prefix_mask(n, T, b, dev), NEG_INF)  # [B, H, n, T]
        idx, idx_ok = landmark_topk(S, self.options.k)  # [B, H, n, k'] routed experts (eq. 7)
        eligible = earlier_blocks(T, n, b, dev)  # [T, n]
        R = q @ lq.transpose(-1, -2) * scale  # [B, H, T, n] routing logits = shared-expert scores
        sel, sel_ok = route(R, eligible, self.options.s)  # [B, H, T, s']
        # Keys of each query's chosen experts: [B, H, T, E = s' k'], sorted so repeats are adjacent.
        E = sel.shape[-1] * idx.shape[-1]
        eok = (_rows(idx_ok, sel) & sel_ok[..., None]).view(B, H, T, E)  # [B, H, T, s', k'] -> flat
        eidx = _rows(idx, sel).view(B, H, T, E).masked_fill(~eok, T).sort(-1).values  # invalid -> T, last
        eok = eidx < T
        eok[..., 1:] &= eidx[..., 1:] != eidx[..., :-1]  # union of experts: a repeated key counts once
        eidx = eidx.clamp(max=T - 1)
        kg, vg = _rows(k, eidx), _rows(v, eidx)  # [B, H, T, E, d] batched gathers (eq. 6)
        s_exp = torch.einsum("bhtd,bhtjd->bhtj", q, kg) * scale
        # Own block, causal: query blocks of b rows against the same block's keys.
        pad = nb * b - T
        qb, kb, vb = (F.pad(z, (0, 0, 0, pad)).unflatten(2, (nb, b)) for z in (q, k, v))  # [B, H, nb, b, d]
        s_own = (qb @ kb.transpose(-1, -2) * scale).masked_fill(
            ~torch.ones(b, b, dtype=torch.bool, device=dev).tril(), NEG_INF
        )  # [B, H, nb, b, b]
        s_own = s_own.flatten(2, 3)[:, :, :T]  # [B, H, T, b]
        shared = n if self.options.shared else 0
        parts = [R.masked_fill(~eligible, NEG_INF)] if shared else []  # shared entries (eq. 9 keys q~_j)
        p = torch.cat(parts + [s_exp.masked_fill(~eok, NEG_INF), s_own], -1).softmax(-1)  # eq. 10
        p_sh, p_ex, p_own = p.split((shared, E, b), -1)
        out = torch.einsum("bhtj,bhtjd->bhtd", p_ex, vg)
        if shared:  # eq. 9 with eq. 8's landmark values (keys <= e_j)
            out = out + p_sh @ attend(lq, k, v, mask=prefix_mask(n, T, b, dev))
        own = F.pad(p_own, (0, 0, 0, pad)).unflatten(2, (nb, b)) @ vb  # [B, H, nb, b, d]
        out = out + own.flatten(2, 3)[:, :, :T]
        return self.out(out.transpose(1, 2).reshape(B, T, H * d))
