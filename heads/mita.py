"""Causal Mixture-of-Top-k Attention (MiTA, §3.2 eqs. 5-12, Algorithm 1), for decoder LMs.

Per head, with blocks of b rows (routing/landmarks.py) and n = T // b completed blocks:
- landmark queries q~_j = average of the block's rotated queries (Alg. 1 line 2, causal pool);
- routed expert j (eqs. 5-7): the top-k keys of S_j = q~_j K^T / sqrt(h') among rows p <= e_j
  (e_j = the block's last row), K^(j) = K[I_j], V^(j) = V[I_j];
- shared expert (eqs. 8-9): landmark values v~_j = softmax(S_j) V over rows <= e_j, keys q~_j;
- routing: logits q . q~_j (Alg. 1 line 13), each query picks its top-s eligible landmarks;
- output (eqs. 10-12), one softmax over: the shared entries (q~_j, v~_j) of every block that ended before
  the query's block (j < t // b; eq. 11 puts every landmark into K~), the keys of its s routed experts, and
  the keys at rows <= t of its own block (option `local_blocks` = L: of its own block and the L - 1 blocks
  before it).
Landmark j is eligible for routing from a query at row t iff block j ended before those local blocks start
(j < t // b - (L - 1)): every key it brings is at a row < t, so nothing after the query is ever visible,
and routed keys never duplicate local keys. (With L = 1 the two rules are one.)

Deviations from the paper, and why:
- causality: pooling only over completed blocks, experts and landmark values over each landmark's
  prefix only, eligibility as above (the paper pools and ranks over the whole image);
- the own-block term is added (causal local attention) so rows of the first block, which have no
  eligible landmark, still have context, and each query sees its most recent tokens exactly. With
  L = 1 (default) a query at row t sees only t mod b + 1 recent keys (the first row of a block none before
  it); `local_blocks: 2` adds the previous block, so every query sees at least its b most recent tokens
  (Gutenberg, bench/results/gutenberg_compare.md: better perplexity at equal FLOPs);
- for s > 1 the routed keys are the *union* of the chosen experts: a key chosen by two experts counts
  once. The paper implements s = 1 only (§3.2, where the union is exactly eq. 11's concatenation) and
  leaves s > 1 to a MoBA-style implementation; eq. 11 read literally would count a shared key once per
  expert holding it, weighting it by how many experts happen to overlap;
- the landmark count grows with T (one per b rows) instead of a fixed m = AdaptiveAvgPool size, so
  that pooling windows do not depend on the sequence length; m = T // b at the training length;
- `shared: false` drops the shared expert. (The paper's "route-only" ablation, Table 5 and its caption in §4.3,
  also drops its local window branch and raises k to keep each query's budget; this keeps k and the own-block
  term.) With k >= T, s >= T // b and shared false, MiTA is exactly dense causal attention (tested).
Projections are those of heads/dense.py (same `qkv` / `out`), so dense weights load unchanged
(MiTA App. C's algorithmic generalisation).

Option `variant: published` is Algorithm 1 as published, NOT causal (flagged like MoSA's expert choice; evaluate
it leak-free, lm/leakfree.py): a fixed number m = seq_len // b of landmarks (the training length's, at least 1),
Q~ = AdaptiveAvgPool(Q, m) over the whole sequence (routing.landmarks.adaptive_pool), each expert the top-k of
all T keys, landmark values over all keys, every landmark routable and shared with every query, and no local term
(option `local_blocks` is the causal variant's). With k >= T and `shared: false` it is bidirectional (non-causal)
dense attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from heads.base import ConfigError, GroupContext, HeadOptions, register
from heads.dense import DenseHeads
from heads import varlen
from heads.gathered_lean import accumulator
from heads.kv_cache import BlockKV
from heads.local import block_windows
from heads.lse_attention import attention_lse, merge
from heads.rows import flat_rows, gather_rows
from routing.landmarks import (adaptive_pool, adaptive_windows, block_pool, earlier_blocks, landmark_topk, prefix_mask,
                               published_count, route)
from routing.selection import earliest_topk

NEG_INF = float("-inf")
VARIANTS = ("causal", "published")


@dataclass
class MiTAOptions(HeadOptions):
    block: int = 64  # b, rows pooled into one landmark query (m = T // b landmarks)
    k: int = 64  # keys gathered by each landmark (expert width)
    s: int = 1  # routed experts per query (besides the shared one)
    shared: bool = True  # include the shared (compressed) expert, eqs. 8-9
    local_blocks: int = 1  # L: a query attends causally to its own block and the L - 1 before it
    variant: str = "causal"  # "causal" | "published" (Algorithm 1 over the whole sequence: NOT causal)

    @property
    def causal(self) -> bool:
        return self.variant == "causal"

    def kv_per_head(self, seq_len: int) -> int:
        """Every token (a future landmark gathers its k keys from the whole prefix) plus one landmark per completed
        block: the shared entry (q~_j, v~_j) later queries attend to (with `shared: false` q~_j is still kept, for
        routing)."""
        return seq_len + seq_len // self.block

    @classmethod
    def example(cls) -> dict[str, Any]:
        return {"block": 8, "k": 8}

    @classmethod
    def grid(cls) -> dict[str, list[Any]]:
        return {"block": [1, 2, 3, 5, 8, 16], "k": [1, 2, 5, 8, 64], "s": [1, 2, 3], "shared": [True, False],
                "local_blocks": [1, 2, 3], "variant": list(VARIANTS)}

    def validate(self, ctx: GroupContext) -> None:
        super().validate(ctx)
        if self.variant not in VARIANTS:
            raise ConfigError(f"mita: options.variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        for name in ("block", "k", "s", "local_blocks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"mita: options.{name} must be >= 1, got {getattr(self, name)}")
        if not self.causal and self.local_blocks != MiTAOptions.local_blocks:
            raise ConfigError("mita: options.local_blocks is the causal variant's local term; variant 'published' "
                              "(Algorithm 1) has none: leave local_blocks out")

    def validate_length(self, head: str, seq_len: int) -> None:
        super().validate_length(head, seq_len)
        self.at_most(head, "block", seq_len, "no block would complete, so there would be no landmarks")
        self.at_most(head, "k", seq_len, "every expert would hold all the keys")
        blocks = -(-seq_len // self.block)
        if self.local_blocks > blocks:
            raise ConfigError(f"{head}: options.local_blocks = {self.local_blocks} > the {blocks} block(s) of model.seq_len "
                              f"{seq_len}: more local blocks than the sequence has")
        if self.s > max(1, seq_len // self.block):
            raise ConfigError(f"{head}: options.s = {self.s} > the {max(1, seq_len // self.block)} landmark(s) of "
                              f"model.seq_len {seq_len}: a query cannot route to more experts than there are")


@register("mita")
class MiTAHeads(DenseHeads):
    """MiTA heads: shared landmark expert + top-s routed top-k experts + local block(s); causal unless the
    option variant is published."""

    Options = MiTAOptions
    beyond_training = "keeps every token and adds a landmark per block (its cache grows with the length)"

    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Algorithm 1 / eqs. 5-12 as the module docstring states them (causal, or over the whole sequence for
        variant published), one head at a time, experts, routing and local blocks as explicit masks over the keys."""
        q, k, v = self._qkv(x, positions)  # [B, H, T, h']
        T, (b, kk, s) = x.shape[1], (self.options.block, self.options.k, self.options.s)
        rows = torch.arange(T, device=x.device)
        scale = self.ctx.head_dim**-0.5
        if self.causal:  # landmark j pools block j and sees the keys up to the block's end e_j
            n = T // b
            starts = torch.arange(n, device=x.device) * b
            stops = starts + b
            landmark_sees = rows[None, :] < stops[:, None]  # [n, T]
            L = self.options.local_blocks
            eligible = torch.arange(n, device=x.device)[None, :] < (rows // b)[:, None] - (L - 1)  # [T, n] routing
            done = torch.arange(n, device=x.device)[None, :] < (rows // b)[:, None]  # [T, n] shared: before t's block
            local = (rows[None, :] <= rows[:, None]) & (rows[None, :] // b > rows[:, None] // b - L)  # [T, T] L blocks
        else:  # published: m fixed landmarks pooling windows over the whole sequence; everything visible, no local term
            n = published_count(self.ctx.seq_len, b)
            starts, stops = adaptive_windows(n, T, x.device)
            landmark_sees = torch.ones(n, T, dtype=torch.bool, device=x.device)
            eligible = done = torch.ones(T, n, dtype=torch.bool, device=x.device)
            local = torch.zeros(T, T, dtype=torch.bool, device=x.device)
        heads = []
        for i in range(self.count):
            qi, ki, vi = q[:, i], k[:, i], v[:, i]  # [B, T, h']
            lq = torch.stack([qi[:, starts[j] : stops[j]].mean(1) for j in range(n)], 1) if n else qi[:, :0]
            S = (lq @ ki.transpose(-1, -2) * scale).masked_fill(~landmark_sees, NEG_INF)  # [B, n, T]
            lv = S.softmax(-1) @ vi if n else vi[:, :0]  # eq. 8: landmark values [B, n, h']
            expert = torch.zeros_like(S, dtype=torch.bool)  # eq. 7: I_j as a mask over keys
            if n:
                expert.scatter_(-1, earliest_topk(S, min(kk, T))[1], True)
            expert &= landmark_sees
            logits = qi @ lq.transpose(-1, -2) * scale  # [B, T, n]: routing logits = shared scores (eqs. 9-10)
            R = logits.masked_fill(~eligible, NEG_INF)
            chosen = torch.zeros_like(R, dtype=torch.bool)  # e_1(q) .. e_s(q)
            if n:
                chosen.scatter_(-1, earliest_topk(R, min(s, n))[1], True)
            chosen &= eligible
            routed = (chosen.double() @ expert.double()) > 0  # [B, T, T] union of chosen experts' keys
            keys_ok = routed | local
            shared_ok = done.expand_as(R) if self.options.shared else torch.zeros_like(chosen)
            scores = torch.cat((logits, qi @ ki.transpose(-1, -2) * scale), -1)  # [B, T, n + T] eq. 10
            scores = scores.masked_fill(~torch.cat((shared_ok, keys_ok), -1), NEG_INF)
            heads.append(scores.softmax(-1) @ torch.cat((lv, vi), 1))
        return self.out(torch.cat(heads, dim=-1))

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Algorithm 1 made causal: landmarks and experts batched, queries grouped by routed expert
        (padded per expert) for one batched attention per expert, merged with the shared + own-block
        softmax by log-sum-exp (Alg. 1 line 16). Variant published: the same over the whole sequence, with
        the shared expert alone in place of shared + own block."""
        q, k, v = self._qkv(x, positions)  # [B, H, T, d]
        B, H, T, d = q.shape
        b, scale = self.options.block, d**-0.5
        if self.causal:
            n = T // b
            lq = block_pool(q, b)  # [B, H, n, d] landmark queries (Alg. 1 line 2)
            visible = prefix_mask(n, T, b, q.device)
            eligible = earlier_blocks(T, n, b, q.device, self.options.local_blocks)
        else:  # published: every key visible to every landmark, every landmark routable from every query
            n = published_count(self.ctx.seq_len, b)
            lq = adaptive_pool(q, n)
            visible = torch.ones(n, T, dtype=torch.bool, device=q.device)
            eligible = torch.ones(T, n, dtype=torch.bool, device=q.device)
        with torch.no_grad():  # the routing decisions are indices: no gradient, nothing saved
            S = (lq @ k.transpose(-1, -2) * scale).masked_fill(~visible, NEG_INF)  # line 4
            idx, idx_ok = landmark_topk(S, self.options.k)  # [B, H, n, k'] experts' key rows (line 6)
            sel, sel_ok = route(q @ lq.transpose(-1, -2) * scale, eligible, self.options.s)  # [B, H, T, s'] (line 13)
        lv = attention_lse(lq, k, v, visible, scale)[0] if self.options.shared and n else None  # line 9, eq. 8
        if self.causal:
            out, lse = self._shared_and_local(q, k, v, lq, lv, earlier_blocks(T, n, b, q.device), scale)
        elif lv is not None:  # line 11: the shared expert alone
            out, lse = attention_lse(q, lq, lv, eligible, scale)
        else:  # route-only: an empty part, which the routed experts' merge replaces
            out, lse = torch.zeros_like(q), q.new_full((B, H, T), NEG_INF, dtype=accumulator(q.dtype))
        if not self.causal or T > b * self.options.local_blocks:  # else no query has an eligible landmark
            # The varlen kernels take no logit offset (s' = 1 only), and their segment sizes are data-dependent
            # (host syncs): under torch.compile the static grouped layout runs instead.
            use_varlen = sel.shape[-1] == 1 and not torch.compiler.is_compiling()
            backend = varlen.cuda_backend(q) if use_varlen else None
            if backend is not None:
                out = self._routed_varlen(q, k, v, idx, idx_ok, sel[..., 0], sel_ok[..., 0], out, lse, scale, backend)
            else:
                exact = not q.is_cuda and not torch.compiler.is_compiling()  # a host sync is free on CPU
                out_e, lse_e = self._routed(q, k, v, idx, idx_ok, sel, sel_ok, scale, exact_groups=exact)
                out = merge((out, *out_e.unbind(-2)), (lse, *lse_e.unbind(-1)))[0]
        return self.out(out.transpose(1, 2).reshape(B, T, H * d))

    def new_cache(self, batch: int, max_len: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> BlockKV:
        """All T keys/values, the current block's queries, and per completed block its landmark
        query q~_j, landmark value v~_j and expert's top-k key rows I_j."""
        if not self.causal:
            raise ValueError("mita: variant 'published' is not causal and cannot be decoded incrementally")
        return BlockKV.empty(batch, self.count, max_len, self.ctx.head_dim, self.options.block, self.options.k,
                             device, dtype)

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: BlockKV) -> torch.Tensor:
        """Prefill: the full forward over the prompt. A later token at row t: one softmax over the shared entries
        (q~_j, v~_j) of the blocks before its block, the keys of its top-s routed experts (union; the landmarks
        of the blocks before its local blocks are eligible) and its local blocks' keys at rows <= t (eqs. 10-12)."""
        q, k, v = self._qkv(x, positions)  # [B, H, T, d]
        if cache.write("mita", q, k, v, positions):  # the prefill
            return self.forward(x, positions)
        t, b, scale = cache.row(), self.options.block, self.ctx.head_dim**-0.5  # t: 0-d tensor (static shapes)
        L = self.options.local_blocks
        S, n_max = cache.kv.k.shape[2], cache.landmarks.shape[2]
        eligible = torch.arange(n_max, device=x.device)[None] < t // b - (L - 1)  # [1, n_max]: before the local blocks
        done = torch.arange(n_max, device=x.device)[None] < t // b  # [1, n_max]: shared entries, before t's block
        R = q @ cache.landmarks.transpose(-1, -2) * scale  # [B, H, 1, n_max] routing logits
        sel, sel_ok = route(R, eligible, self.options.s)  # [B, H, 1, s']
        routed = gather_rows(cache.experts, sel[:, :, 0])  # [B, H, s', k'] key rows of the chosen experts
        routed = routed.masked_fill(~sel_ok[:, :, 0, :, None] | (routed < 0), S).flatten(2).sort(-1).values
        first = torch.cat((torch.ones_like(routed[..., :1], dtype=torch.bool), routed[..., 1:] != routed[..., :-1]), -1)
        own = (t // b - L + 1) * b + torch.arange(L * b, device=x.device)  # t's local blocks: rows 0..t visible
        rows = torch.cat((routed, own.expand(*routed.shape[:2], L * b)), -1).clamp(min=0, max=S - 1)  # [B, H, s'k' + Lb]
        ok = torch.cat((first & (routed < S), ((own >= 0) & (own <= t)).expand(*routed.shape[:2], L * b)), -1)
        scores = (q @ gather_rows(cache.kv.k, rows).transpose(-1, -2) * scale).masked_fill(~ok[:, :, None], NEG_INF)
        values = gather_rows(cache.kv.v, rows)  # [B, H, r, d]: only these rows, not the whole cache
        if not self.options.shared:
            return self._merge(scores.softmax(-1) @ values)
        p = torch.cat((R.masked_fill(~done, NEG_INF), scores), -1).softmax(-1)  # one softmax over both
        return self._merge(p[..., :n_max] @ cache.values + p[..., n_max:] @ values)

    def _shared_and_local(
        self, q: Tensor, k: Tensor, v: Tensor, lq: Tensor, lv: Tensor | None, done: Tensor, scale: float
    ) -> tuple[Tensor, Tensor]:
        """One softmax over the shared entries (q~_j, v~_j) of the blocks `done` [T, n] before each query's block
        and the query's local blocks (its own and
        the L - 1 before it), causally: the two parts by attention_lse, merged by log-sum-exp. Returns
        out [B, H, T, d] and its log-sum-exp [B, H, T]."""
        B, H, T, d = q.shape
        b, L = self.options.block, self.options.local_blocks
        nb, pad = -(-T // b), -(-T // b) * b - T
        qb = (F.pad(q, (0, 0, 0, pad)) if pad else q).unflatten(2, (nb, b))  # [B, H, nb, b, d]
        if L == 1:  # the own block alone: a view, no copy
            kb, vb = ((F.pad(z, (0, 0, 0, pad)) if pad else z).unflatten(2, (nb, b)) for z in (k, v))
        else:  # block i's keys: blocks i - L + 1 .. i (rows p < 0 masked), [B, H, nb, L b, d], views of one copy
            kb, vb = (block_windows(z, b, nb, L).view(B, H, nb, L * b, d) for z in (k, v))
        i = torch.arange(nb, device=q.device)[:, None, None]  # key slot c of block i is row p = (i - L + 1) b + c
        r, c = torch.arange(b, device=q.device)[:, None], torch.arange(L * b, device=q.device)[None, :]
        local = (c <= (L - 1) * b + r) & (c >= (L - 1 - i) * b)  # [nb, b, L b]: 0 <= p <= t
        out, lse = attention_lse(qb, kb, vb, local, scale)
        out, lse = out.flatten(2, 3)[:, :, :T], lse.flatten(2)[:, :, :T]
        if lv is None:
            return out, lse
        out_s, lse_s = attention_lse(q, lq, lv, done, scale)  # eq. 9: keys q~_j, values v~_j
        return merge((out, out_s), (lse, lse_s))

    def _routed(
        self, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, idx_ok: Tensor, sel: Tensor, sel_ok: Tensor, scale: float,
        exact_groups: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Each query's attention over each of its s' routed experts (eq. 5), as Alg. 1 line 14: the
        (query, expert) pairs are sorted by expert into groups of G = b rows, each group holding one
        expert's queries (an expert's last group padded), then one batched attention of every group over
        its expert's k' keys (heads/lse_attention.py: gathers the groups' queries, keys and values by index,
        again in backward, where it recomputes the scores; keeps only indices, out and lse). The layout has
        a static size, ceil(T s' / G) + n groups, whatever the routing's balance (no host sync, at most
        about twice the pairs), or with `exact_groups` (CPU, where a host sync is free) the count the
        routing needs. For s' > 1 a key held by c of the query's chosen experts gets logit - log c in each,
        so the merged softmax counts it once (the union). Returns out [B, H, T, s', d] and log-sum-exp
        [B, H, T, s'] (-inf for unused slots)."""
        B, H, T, d = q.shape
        n, kk, s = idx.shape[2], idx.shape[3], sel.shape[-1]
        P, G = T * s, self.options.block
        expert = sel.masked_fill(~sel_ok, n).flatten(2)  # [B, H, P], n = "unused" bucket
        counts = torch.zeros(B, H, n + 1, dtype=torch.long, device=q.device).scatter_add_(-1, expert, torch.ones_like(expert))
        rows = (counts[..., :n] + G - 1) // G * G  # [B, H, n] rows of expert j's groups
        ends = rows.cumsum(-1)
        NB = -(-P // G) + n  # >= sum_j ceil(count_j / G): groups needed by any routing
        if exact_groups:
            NB = max(1, int(ends[..., -1].max()) // G)
        first = F.pad(ends - rows, (0, 1), value=NB * G)  # [B, H, n + 1] first row of each expert; unused -> dump row
        order = expert.argsort(dim=-1, stable=True)
        sorted_expert = expert.gather(-1, order)
        rank = torch.arange(P, device=q.device) - (counts.cumsum(-1) - counts).gather(-1, sorted_expert)
        slot_sorted = first.gather(-1, sorted_expert) + rank.masked_fill(sorted_expert == n, 0)
        slot = torch.empty_like(slot_sorted).scatter_(-1, order, slot_sorted)  # [B, H, P] padded row of each pair
        pairs = torch.arange(P, device=q.device).expand(B, H, P)
        source = torch.zeros(B, H, NB * G + 1, dtype=torch.long, device=q.device).scatter_(-1, slot, pairs)[..., :-1]
        # source[B, H, NB * G]: the pair in each padded row (padding rows: pair 0, their results are never read)
        starts = (torch.arange(NB, device=q.device) * G).expand(B, H, NB).contiguous()
        group_expert = torch.searchsorted(ends, starts, right=True).clamp(max=n - 1)  # [B, H, NB] (unused groups: any)
        key_rows = flat_rows(gather_rows(idx, group_expert), T)  # [B, H, NB, k'] rows of [B*H*T, d] of each group's keys
        group_ok = gather_rows(idx_ok, group_expert)  # [B, H, NB, k'] valid key slots of each group's expert
        query_rows = flat_rows((source // s).unflatten(2, (NB, G)), T)  # [B, H, NB, G] each padded row's query
        bias = None
        if s > 1:
            repeats = self._repeats(idx, idx_ok, sel, sel_ok).view(B, H, P, kk)
            bias = -gather_rows(repeats.to(accumulator(q.dtype)).log(), source).unflatten(2, (NB, G))
        q2, k2, v2 = (z.reshape(B * H * T, d) for z in (q, k, v))
        out, lse = attention_lse(q2, k2, v2, group_ok[:, :, :, None], scale, bias, query_rows, key_rows)
        # out [B, H, NB, G, d], lse [B, H, NB, G]
        read = slot.clamp(max=NB * G - 1)  # unused pairs read any row; their lse is masked below
        out = gather_rows(out.flatten(2, 3), read).view(B, H, T, s, d)
        lse = lse.flatten(2).gather(-1, read).view(B, H, T, s)
        return out, lse.masked_fill(~sel_ok, NEG_INF)

    @staticmethod
    def _routed_varlen(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, idx_ok: Tensor, sel: Tensor, sel_ok: Tensor,
                       out: Tensor, lse: Tensor, scale: float, backend: varlen.VarlenBackend) -> Tensor:
        """s = 1, Alg. 1 lines 14-16 without padding: one segment per (sequence, head, expert) holding the
        queries routed to it (sel[B, H, T]) and its valid key rows (idx[B, H, n, k'] where idx_ok), one
        varlen attention over all segments, merged into the shared + own-block softmax (out, lse)."""
        B, H, T, d = q.shape
        n = idx.shape[2]
        segment = flat_rows(sel, n).flatten()  # [B H T] each query's expert, numbered over (b, h, j)
        rows = sel_ok.flatten().nonzero()[:, 0]  # queries with a routed expert (rows of block 0 have none)
        expert = segment[rows]
        rows = rows[expert.argsort(stable=True)]  # grouped by expert
        key_rows = flat_rows(idx, T)[idx_ok]  # [Nk] valid key rows of each expert, in segment order
        seg = varlen.Segments.from_counts(expert.bincount(minlength=B * H * n), idx_ok.sum(-1).flatten())
        q2, k2, v2 = (z.reshape(B * H * T, d) for z in (q, k, v))
        merged = varlen.merge_varlen(out.reshape(B * H * T, d), lse.flatten(), q2[rows], k2[key_rows], v2[key_rows],
                                     rows, seg, scale, backend)
        return merged.view(B, H, T, d)

    @staticmethod
    def _repeats(idx: Tensor, idx_ok: Tensor, sel: Tensor, sel_ok: Tensor) -> Tensor:
        """[B, H, T, s', k']: in how many of query t's chosen experts the key in slot (r, c) is (>= 1)."""
        B, H, n, kk = idx.shape
        T = sel.shape[2]
        member = torch.zeros(B, H, n, T + 1, dtype=torch.long, device=idx.device).scatter_(-1, idx.masked_fill(~idx_ok, T), 1)
        holds = member.gather(-1, idx.flatten(2)[:, :, None].expand(-1, -1, n, -1))  # [B, H, n(j'), n*k'] j' holds key (j, c)
        holds = holds.view(B, H, n, n, kk).flatten(2, 3)  # row j' * n + j
        pair = sel[..., :, None] * n + sel[..., None, :]  # [B, H, T, s'(r'), s'(r)]
        counted = gather_rows(holds, pair) * sel_ok[..., :, None, None]  # [B, H, T, r', r, k']
        return counted.sum(3).clamp_min(1)
