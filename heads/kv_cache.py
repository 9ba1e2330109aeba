"""Per-head key/value slots for autoregressive decoding (used by each head type's forward_cached).

A SlotKV holds, for B sequences and H heads, S slots of (key, value, position): k, v[B, H, S, d],
pos[B, H, S] (-1 = empty) and fill[B, H] (slots written so far). Heads write only the tokens they keep
(a dense head all of them, a sparse head only its selected tokens; a ring buffer keeps the last S), so
the bytes allocated here are the real cache of the head type, next to the analytic KV count
(MoSA Table 2). Keys are stored already rotated by their original positions (heads/rope.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from heads.attention import attend


@dataclass
class SlotKV:
    k: torch.Tensor  # [B, H, S, d]
    v: torch.Tensor  # [B, H, S, d]
    pos: torch.Tensor  # [B, H, S] int32 original position of the token in each slot, -1 = empty
    fill: torch.Tensor  # [B, H] slots written so far (for a ring buffer it keeps counting)
    ring: bool = False  # True: slot = fill % S, overwriting the oldest entry
    fresh: bool = True  # nothing written yet: the next call is the prefill

    @classmethod
    def empty(cls, batch: int, heads: int, slots: int, dim: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32, ring: bool = False) -> SlotKV:
        kv = torch.zeros(2, batch, heads, slots, dim, device=device, dtype=dtype)
        pos = torch.full((batch, heads, slots), -1, dtype=torch.int32, device=device)
        return cls(kv[0], kv[1], pos, torch.zeros(batch, heads, dtype=torch.long, device=device), ring)

    def nbytes(self) -> int:
        """Bytes allocated for keys, values, their positions and the fill counters."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos, self.fill))

    def write(self, keep: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Append the kept entries in order: keep[B, H, T] bool, k/v[B, H, T, d], pos[B, H, T]."""
        S = self.k.shape[2]
        rank = keep.long().cumsum(-1) - 1  # order of each kept entry within this write
        written = keep.sum(-1)
        if self.ring:  # only the last S kept entries can survive
            keep = keep & (keep.sum(-1, keepdim=True) - 1 - rank < S)
        slot = self.fill[..., None] + rank
        if not self.ring and bool((keep & (slot >= S)).any()):
            raise RuntimeError(f"KV cache full: {S} slots per head")
        b, h, t = keep.nonzero(as_tuple=True)
        s = slot[b, h, t] % S
        self.k[b, h, s], self.v[b, h, s], self.pos[b, h, s] = k[b, h, t], v[b, h, t], pos[b, h, t].to(self.pos.dtype)
        self.fill += written  # a ring buffer keeps counting past S: the next slot is fill % S
        self.fresh = False

    def attend(self, q: torch.Tensor, qpos: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """q[B, H, Tq, d] at positions qpos[B, Tq] over the cached keys at positions <= qpos (and
        > qpos - window when given) -> [B, H, Tq, d]. Queries that see no key get zeros."""
        n = int(self.fill.max().clamp(max=self.k.shape[2]))
        if n == 0:
            return torch.zeros_like(q)
        kpos = self.pos[:, :, None, :n]  # [B, H, 1, n]
        qp = qpos[:, None, :, None]  # [B, 1, Tq, 1]
        mask = (kpos >= 0) & (kpos <= qp)
        if window is not None:
            mask = mask & (kpos > qp - window)
        seen = mask.any(-1, keepdim=True)
        out = attend(q, self.k[:, :, :n], self.v[:, :, :n], mask=mask | ~seen)  # no all-masked rows
        return out * seen


def gathered_prefill(cache: SlotKV, x: torch.Tensor, positions: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor,
                     qkv_weight: torch.Tensor, rope: torch.nn.Module) -> None:
    """Cache the keys/values of heads that each process their own tokens (heads/gathered.py layout:
    W^QKV [3*H*h', h]): idx[B, H, c] token indices per head, keep[B, H, c] the slots to store."""
    B, T, h = x.shape
    H, c = idx.shape[1:]
    w = qkv_weight.view(3, H, -1, h)
    flat = idx.reshape(B, H * c)
    xs = x.gather(1, flat[..., None].expand(-1, -1, h)).view(B, H, c, h)
    pos = positions.gather(1, flat).view(B, H, c)
    k = rope(torch.einsum("bnch,ndh->bncd", xs, w[1]), pos)
    cache.write(keep, k, torch.einsum("bnch,ndh->bncd", xs, w[2]), pos)


def gathered_step(cache: SlotKV, x: torch.Tensor, positions: torch.Tensor, member: torch.Tensor, gate: torch.Tensor,
                  qkv_weight: torch.Tensor, out_weight: torch.Tensor, rope: torch.nn.Module) -> torch.Tensor:
    """One decoding step of such heads: x[B, 1, h] joins the heads where member[B, H]; those heads
    store its K/V and attend from it over their cached tokens; output sum_i gate_i member_i A_i W^O_i."""
    B, _, h = x.shape
    H = member.shape[1]
    pos = positions[:, None, :1].expand(B, H, 1)
    q, k, v = torch.nn.functional.linear(x, qkv_weight).view(B, 3, H, 1, -1).unbind(1)  # each [B, H, 1, h']
    cache.write(member[..., None], rope(k, pos), v, pos)
    a = cache.attend(rope(q, pos), positions[:, :1])  # [B, H, 1, h']
    a = a * (gate * member)[..., None, None]  # diag(r) A; heads the token did not join give 0
    return torch.nn.functional.linear(a.reshape(B, 1, -1), out_weight)  # sum_i A_i W^O_i
