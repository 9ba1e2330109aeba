"""Per-head key/value slots for autoregressive decoding (used by each head type's forward_cached).

A SlotKV holds, for B sequences and H heads, S slots of (key, value, position): k, v[B, H, S, d],
pos[B, H, S] (-1 = empty) and fill[B, H] (slots written so far). Heads write only the tokens they keep
(a dense head all of them, a sparse head only its selected tokens; a ring buffer keeps the last S), so
the bytes allocated here are the real cache of the head type, next to the analytic KV count
(MoSA Table 2). `entries()` counts the key/value entries actually stored, `capacity()` the slots
allocated: a MoSA head that selected 12 tokens fills 12 of its slots, whatever its capacity. Keys are stored already rotated by their original positions (heads/rope.py).

A decoding step (one token) reads no host-side counter and has static shapes: it writes its slot by
index and attends over all S slots under a position mask, so it compiles into one graph that serves every
step (lm/generate.decode_step). Only eager writes check for overflow (a host sync); a compiled step relies
on the heads' capacity rules, which never add an entry to a full head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from heads.attention import attend
from heads.gathered_lean import heads_per_chunk
from routing.landmarks import block_ends, landmark_topk, prefix_mask


def one_token(head: str, x: torch.Tensor) -> None:
    """After the prefill, heads whose cached state advances token by token (selection counters, ring buffers,
    blocks) decode one token per call: x[B, T, ...] (the call's input or positions) with T = 1. One-line error
    otherwise."""
    if x.shape[1] != 1:
        raise ValueError(f"{head}: decoding takes one token per call after the prefill, got {x.shape[1]}")


@dataclass
class SlotKV:
    k: torch.Tensor  # [B, H, S, d]
    v: torch.Tensor  # [B, H, S, d]
    pos: torch.Tensor  # [B, H, S] int32 original position of the token in each slot, -1 = empty
    fill: torch.Tensor  # [B, H] slots written so far (for a ring buffer it keeps counting)
    ring: bool = False  # True: slot = fill % S, overwriting the oldest entry
    fresh: bool = True  # nothing written yet: the next call is the prefill
    rows: int = 0  # host-side bound on the slots in use, >= min(fill.max(), S) (exact when every token is kept
    # and nothing was compiled); it spares eager writes the overflow check while the cache cannot be full

    @classmethod
    def empty(cls, batch: int, heads: int, slots: int, dim: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32, ring: bool = False) -> SlotKV:
        k, v = (torch.zeros(batch, heads, slots, dim, device=device, dtype=dtype) for _ in range(2))
        pos = torch.full((batch, heads, slots), -1, dtype=torch.int32, device=device)
        return cls(k, v, pos, torch.zeros(batch, heads, dtype=torch.long, device=device), ring)

    @property
    def batch(self) -> int:
        """Sequences the cache is for."""
        return self.k.shape[0]

    def nbytes(self) -> int:
        """Bytes allocated for keys, values, their positions and the fill counters."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos, self.fill))

    def entries(self) -> int:
        """Key/value entries stored, over sequences and heads (a ring buffer holds at most its slots)."""
        return int(self.fill.clamp(max=self.k.shape[2]).sum())

    def capacity(self) -> int:
        """Key/value slots allocated, over sequences and heads."""
        return self.pos.numel()

    def write(self, keep: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Append the kept entries in order: keep[B, H, T] bool, k/v[B, H, T, d], pos[B, H, T].
        Eager, the host syncs only to check for overflow, and only when `rows` says the cache may be full;
        under torch.compile nothing is checked and `rows` becomes S (a store, not a read: no guard)."""
        S, T = self.k.shape[2], keep.shape[-1]
        if torch.compiler.is_compiling():
            self.rows = S
        else:
            if not self.ring and self.rows + T > S and bool((keep & (self.fill[..., None] + keep.cumsum(-1) > S)).any()):
                raise RuntimeError(f"KV cache full: {S} slots per head")
            self.rows = min(self.rows + T, S)
        if T == 1:
            self._write_one(keep, k, v, pos)
        else:
            self._write_many(keep, k, v, pos)
        self.fill += keep.sum(-1)  # a ring buffer keeps counting past S: the next slot is fill % S
        self.fresh = False

    def _write_many(self, keep: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Several entries per row (the prefill): scatter the kept ones by index."""
        S = self.k.shape[2]
        rank = keep.long().cumsum(-1) - 1  # order of each kept entry within this write
        if self.ring:  # only the last S kept entries can survive
            keep = keep & (keep.sum(-1, keepdim=True) - 1 - rank < S)
        b, h, t = keep.nonzero(as_tuple=True)
        s = (self.fill[..., None] + rank)[b, h, t] % S
        for cache, new in ((self.k, k), (self.v, v), (self.pos, pos)):  # in the cache's dtype (bf16 k, v under autocast)
            cache[b, h, s] = new[b, h, t].to(cache.dtype)

    def _write_one(self, keep: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """One entry per row (a decoding step), without index lists or host syncs: every row writes its next
        slot; a row that keeps nothing writes back what that slot holds. index_put_ at (b, h, slot), which
        inductor updates in place (scatter_ there copied the whole cache twice per step; an index_copy_ into
        a flat view was miscompiled by torch 2.11's inductor)."""
        B, H, S = self.pos.shape
        slot = self.fill % S if self.ring else self.fill.clamp(max=S - 1)  # [B, H]
        at = (torch.arange(B, device=slot.device)[:, None].expand(B, H), torch.arange(H, device=slot.device).expand(B, H), slot)
        for cache, new in ((self.k, k), (self.v, v), (self.pos, pos)):  # [B, H, S(, d)] and [B, H, 1(, d)]
            extra = (1,) * (cache.dim() - 3)
            old = cache.gather(2, slot.view(B, H, 1, *extra).expand(B, H, 1, *cache.shape[3:]))  # the slot's entry
            cache.index_put_(at, torch.where(keep.view(B, H, 1, *extra), new.to(cache.dtype), old)[:, :, 0])

    def attend(self, q: torch.Tensor, qpos: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """q[B, H, Tq, d] at positions qpos[B, Tq] over the cached keys at positions <= qpos (and
        > qpos - window when given) -> [B, H, Tq, d]. Queries that see no key get zeros. Every slot
        takes part (empty ones have pos -1 and are masked): static shapes, no host-side counter."""
        kpos = self.pos[:, :, None, :]  # [B, H, 1, S]
        qp = qpos[:, None, :, None]  # [B, 1, Tq, 1]
        mask = (kpos >= 0) & (kpos <= qp)
        if window is not None:
            mask = mask & (kpos > qp - window)
        seen = mask.any(-1, keepdim=True)
        out = attend(q, self.k, self.v, mask=mask | ~seen)  # no all-masked rows
        return out * seen


def when(pred: torch.Tensor, then: Callable[..., tuple], otherwise: Callable[..., tuple],
         operands: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """then(*operands) if pred else otherwise(*operands), for a 0-d bool tensor: torch.cond under torch.compile
    (both branches in the graph, no host sync; operands must not alias), a Python branch eagerly."""
    if torch.compiler.is_compiling():
        return torch.cond(pred, then, otherwise, operands)
    return then(*operands) if bool(pred) else otherwise(*operands)


class AroundSlots:
    """A cache built around the SlotKV `kv` of the tokens it keeps: nothing written yet and the batch are kv's."""

    kv: SlotKV

    @property
    def fresh(self) -> bool:
        return self.kv.fresh

    @property
    def batch(self) -> int:
        return self.kv.batch


@dataclass
class BlockKV(AroundSlots):
    """Decoding cache of the causal block-landmark heads (heads/agent.py, heads/mita.py): every
    token's key/value (`kv`, as dense), the rotated queries of the current incomplete block, and per
    completed block j its landmark / agent query q~_j = mean of the block's queries, its value
    v~_j = softmax(q~_j K^T / sqrt(h')) V over rows <= e_j, and (MiTA) its expert's top-k key rows
    (-1 = none: a young landmark saw fewer than k keys). Rows are slot indices (all tokens kept, so every
    sequence and head holds the same number: kv.fill). A decoding step is static like SlotKV's: the block a
    token completes is built under `when` (torch.cond when compiled)."""

    kv: SlotKV
    queries: torch.Tensor  # [B, H, b, d] rotated queries of the current block, at slot row % b
    landmarks: torch.Tensor  # [B, H, n_max, d] q~_j of the completed blocks
    values: torch.Tensor  # [B, H, n_max, d] v~_j (its own buffer: torch.cond refuses aliased operands)
    experts: torch.Tensor | None = None  # [B, H, n_max, k'] int64 key rows of expert j, -1 = unused
    aggregation_bias: Callable[[torch.Tensor], torch.Tensor] | None = None  # distances e_j - p -> [H, ...] (agent B1)

    @classmethod
    def empty(cls, batch: int, heads: int, max_len: int, dim: int, block: int, topk: int | None = None,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> BlockKV:
        n_max = max_len // block
        landmarks, values = (torch.zeros(batch, heads, n_max, dim, device=device, dtype=dtype) for _ in range(2))
        experts = (torch.full((batch, heads, n_max, min(topk, max_len)), -1, dtype=torch.long, device=device)
                   if topk is not None else None)
        return cls(SlotKV.empty(batch, heads, max_len, dim, device, dtype),
                   torch.zeros(batch, heads, block, dim, device=device, dtype=dtype), landmarks, values, experts)

    @property
    def topk(self) -> int | None:
        """k' of MiTA's experts, None for agents."""
        return None if self.experts is None else self.experts.shape[-1]

    def row(self) -> torch.Tensor:
        """0-d tensor: the row of the last token written (no host sync)."""
        return self.kv.fill[0, 0] - 1

    def blocks(self) -> int:
        """Completed blocks so far (a host sync)."""
        return min(int(self.kv.fill[0, 0]) // self.queries.shape[2], self.landmarks.shape[2])

    def entries(self) -> int:
        """Token keys/values stored plus one (q~_j, v~_j) pair per completed block, over sequences and heads."""
        return self.kv.entries() + self.blocks() * self.landmarks.shape[0] * self.landmarks.shape[1]

    def capacity(self) -> int:
        return self.kv.capacity() + self.landmarks.shape[:3].numel()

    def nbytes(self) -> int:
        extra = [self.queries, self.landmarks, self.values] + ([self.experts] if self.experts is not None else [])
        return self.kv.nbytes() + sum(t.numel() * t.element_size() for t in extra)

    def write(self, head: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> bool:
        """Append rotated q, k and v [B, H, T, d] (positions[B, T]): the prompt into a fresh cache, then one
        token per call (`one_token`, named for `head`); build the state of every block this completes. True for the
        prefill, whose outputs are the head's full forward pass over the prompt."""
        fresh = self.kv.fresh
        if not fresh:
            one_token(head, positions)  # [B, T]: T must be 1
        self.kv.write(torch.ones(k.shape[:3], dtype=torch.bool, device=k.device), k, v,
                      positions[:, None].expand(-1, k.shape[1], -1))
        if fresh:
            self._prefill(q)
        else:
            self._step(q)
        return fresh

    def _prefill(self, q: torch.Tensor) -> None:
        """The prompt's m = T // b complete blocks at once, from their queries and the prompt's keys."""
        b, T = self.queries.shape[2], q.shape[2]
        m = T // b
        if m:
            lq = q[:, :, : m * b].unflatten(2, (m, b)).mean(3)  # [B, H, m, d] (MiTA Alg. 1 line 2)
            d = block_ends(m, b, q.device)[:, None] - torch.arange(T, device=q.device)  # [m, T]: e_j - p
            lv, experts = summaries(lq, prefix_mask(m, T, b, q.device), self.kv.k[:, :, :T], self.kv.v[:, :, :T], self.topk,
                                    None if self.aggregation_bias is None else self.aggregation_bias(d))
            self.landmarks[:, :, :m], self.values[:, :, :m] = lq, lv
            if experts is not None:
                self.experts[:, :, :m, : experts.shape[-1]] = experts
        self.queries[:, :, : T - m * b] = q[:, :, m * b :]

    def _step(self, q: torch.Tensor) -> None:
        """One token at row r: store its query at slot r % b; if it ends block j = (r + 1) / b - 1, build that
        block's landmark over the rows <= r (static shapes: every slot, later rows masked)."""
        b, n_max = self.queries.shape[2], self.landmarks.shape[2]
        r = self.row()
        self.queries.index_copy_(2, (r % b).view(1), q.to(self.queries.dtype))
        if n_max == 0:  # max_len < b: no block ever completes
            return
        j = ((r + 1) // b - 1).clamp(0, n_max - 1).view(1)
        state = (self.landmarks, self.values) + ((self.experts,) if self.experts is not None else ())
        topk = self.topk

        def complete(queries: torch.Tensor, K: torch.Tensor, V: torch.Tensor, r: torch.Tensor, j: torch.Tensor,
                     *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
            lq = queries.mean(2, keepdim=True)  # [B, H, 1, d]
            d = r - torch.arange(K.shape[2], device=K.device)[None]  # [1, S]: e_j - p
            bias = None if self.aggregation_bias is None else self.aggregation_bias(d)
            lv, experts = summaries(lq, d >= 0, K, V, topk, bias)
            return (lq, lv) + ((experts,) if experts is not None else ())

        def unchanged(queries: torch.Tensor, K: torch.Tensor, V: torch.Tensor, r: torch.Tensor, j: torch.Tensor,
                      *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(t.index_select(2, j) for t in state)

        new = when((r + 1) % b == 0, complete, unchanged, (self.queries, self.kv.k, self.kv.v, r, j) + state)
        for t, row in zip(state, new):
            t.index_copy_(2, j, row.to(t.dtype))


def summaries(lq: torch.Tensor, sees: torch.Tensor, K: torch.Tensor, V: torch.Tensor, topk: int | None,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Landmarks lq[B, H, m, d] over keys K, V [B, H, N, d] where sees[m, N]: their values
    softmax(q~ K^T / sqrt(h') + bias) V (bias[H, m, N]: the agents' B1) and (MiTA eq. 7, topk given) their
    experts' top-k key rows, -1 = none."""
    S = lq @ K.transpose(-1, -2) * lq.shape[-1] ** -0.5
    S = (S if bias is None else S + bias).masked_fill(~sees, float("-inf"))
    experts = None
    if topk is not None:
        idx, ok = landmark_topk(S, topk)
        experts = idx.masked_fill(~ok, -1)
    return S.softmax(-1) @ V, experts


def gathered_prefill(cache: SlotKV, x: torch.Tensor, positions: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor,
                     qkv_weight: torch.Tensor, rope: torch.nn.Module) -> None:
    """Cache the keys/values of heads that each process their own tokens (heads/gathered.py layout:
    W^QKV [3*H*h', h]): idx[B, H, c] token indices per head, keep[B, H, c] the slots to store. The prefill's
    attention (heads/gathered.gathered_heads_fast) projects these tokens again: its fused kernels return no K/V,
    and the second projection costs 2/3 of the gathered tokens' W^QKV matmul, once per prompt. The gathered
    X^s is formed for a chunk of heads at a time (heads/gathered_lean.heads_per_chunk, as the lean core does):
    whole, [B, H, c, h] is H c / T times X (8.6x at the IsoFLOP Tiny point: 276 heads of 32 slots, T = 1024)."""
    B, T, h = x.shape
    H, c = idx.shape[1:]
    w = qkv_weight.view(3, H, -1, h)
    step = heads_per_chunk(H, c, T, B * c * h, x.device.type)
    ks, vs = [], []
    for h0 in range(0, H, step):
        s = slice(h0, h0 + step)
        flat = idx[:, s].reshape(B, -1)
        xs = x.gather(1, flat[..., None].expand(-1, -1, h)).view(B, -1, c, h)  # X^s of this chunk [B, n, c, h]
        ks.append(torch.einsum("bnch,ndh->bncd", xs, w[1, s]))
        vs.append(torch.einsum("bnch,ndh->bncd", xs, w[2, s]))
    pos = positions.gather(1, idx.reshape(B, H * c)).view(B, H, c)
    cache.write(keep, rope(torch.cat(ks, 1), pos), torch.cat(vs, 1), pos)


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
