"""Causal agent attention (Han et al. 2024, "Agent Attention", §4.1, eq. 3), for decoder LMs.

Paper (vision, non-causal): agents A = Pooling(Q) (n tokens); agent aggregation V_A = softmax(A K^T + B1) V
over all N tokens; agent broadcast O = softmax(Q A^T + B2) V_A (eq. 5, agent biases B1, B2); the module adds a
depthwise conv DWC(V) (eq. 6).

Here, made causal, per head:
- agent j = average of the (rotated) queries of block j, rows jb .. jb+b-1, for completed blocks only
  (n = T // b); it is complete at row e_j = (j+1)b - 1 (routing/landmarks.py);
- agent aggregation: V_A_j = softmax(A_j K^T / sqrt(h') + B1_j + M) V, keys at rows <= e_j only;
- agent broadcast + local window, one softmax: a query at row t attends to the agents with e_j <= t
  (keys A_j, values V_A_j, + B2) and to the keys t-w < p <= t (keys K_p, values V_p).
Using agent j at t = e_j is causal: A_j and V_A_j are built from rows <= e_j = t only.

Deviations from the paper, and why:
- causal masks in both steps and agents only from completed blocks (the paper pools the whole image,
  which would let every token see the future);
- the agent count grows with T (one per b tokens) instead of a fixed n: a fixed count would make the
  pooling windows depend on the sequence length. The price: aggregation and broadcast cost 8h'T^2/b FLOPs,
  quadratic in T where the paper's fixed n makes them linear (§4.1), b / 2 times fewer than dense's 4h'T^2;
The next two are choices, not forced by causality:
- positions come from RoPE (heads/rope.py), rotating Q and K at their positions before pooling, so an agent's
  scores are the mean of its block's query scores; averaging b rotated queries scales rotary frequency theta by
  |sin(b theta / 2) / (b sin(theta / 2))|, so agents keep mostly the low frequencies' position information.
  Eq. 5's agent biases are option `bias` = number of buckets > 0: B1[j, p] (agent j over key p) and B2[t, j]
  (query t over agent j) are learned per head as functions of the token distances e_j - p and t - e_j, in
  T5-style log buckets up to the training length (routing.landmarks.distance_buckets), added inside the two
  softmaxes. The paper builds each bias from three learned components over the image grid (its appendix); a
  function of the causal distance is our 1-D reading. They start at 0 (plain agent attention); with one bucket
  B1 is a constant (no effect under softmax) and B2 a learned offset between agents and the window;
- the local detail that the rank-n agent path loses (the role of eq. 6's DWC(V)) comes from a causal local
  window merged into the broadcast softmax (agents and window share one probability mass), which also gives
  the rows before the first completed block context. Eq. 6's DWC(V) itself, made causal, is option `dwc`
  = K > 0: a depthwise convolution over V of the K most recent tokens (rows t-K+1 .. t; the paper's 3 x 3
  image kernel, k = 3, becomes K taps along the sequence), added to each head's output before W^O. In a DecoderLM
  its taps start N(0, init_std) and its bias 0, like every other weight (lm/model.py).
Projections are those of heads/dense.py (same `qkv` / `out`), so dense weights load unchanged (with `dwc` or
`bias`, the convolution's taps and bias and the agent-bias tables come on top).

Option `variant: published` is eq. 6 as published, NOT causal (flagged like MoSA's expert choice; evaluate it
leak-free, lm/leakfree.py): a fixed number n = seq_len // b of agents (the training length's, at least 1, as the
paper fixes n), A = AdaptiveAvgPool(Q) over the whole sequence (routing.landmarks.adaptive_pool), aggregation
over every key, broadcast to every query, no local window (option `window` is the causal variant's); `dwc: K`
is centred (rows t - (K-1)//2 .. t + K//2, the paper's 3 x 3 kernel read along the sequence) and `bias: N` takes
the signed distances to an agent's last row in T5's bidirectional buckets (N // 2 per direction).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heads.attention import attend
from heads.base import ConfigError, GroupContext, HeadOptions, register
from heads.dense import DenseHeads
from heads.kv_cache import BlockKV
from heads.local import window_blocks
from routing.landmarks import (adaptive_pool, adaptive_windows, block_ends, block_pool, distance_buckets, prefix_mask,
                               published_count, signed_distance_buckets)

VARIANTS = ("causal", "published")


@dataclass
class AgentOptions(HeadOptions):
    block: int = 64  # b, tokens pooled into one agent
    window: int = 64  # w, causal local window (keys t-w < p <= t), 1 <= w <= b
    dwc: int = 0  # K: taps of the causal depthwise convolution over V added to the output (eq. 6's DWC); 0 = none
    bias: int = 0  # distance buckets of the agent biases B1, B2 (eq. 5), learned per head; 0 = none
    variant: str = "causal"  # "causal" | "published" (eq. 6 over the whole sequence: NOT causal)

    @property
    def causal(self) -> bool:
        return self.variant == "causal"

    def kv_per_head(self, seq_len: int) -> int:
        """Every token (a future agent aggregates over its whole prefix) plus one (A_j, V_A_j) key-value pair per
        completed block, which every later query attends to."""
        return seq_len + seq_len // self.block

    @classmethod
    def example(cls) -> dict[str, Any]:
        return {"block": 8, "window": 8, "dwc": 3, "bias": 4}

    @classmethod
    def grid(cls) -> dict[str, list[Any]]:
        # window 64, the default, is the only one variant published accepts (it has no window)
        return {"block": [1, 2, 3, 5, 8, 16], "window": [1, 2, 3, 5, 8, 16, 64], "dwc": [0, 1, 3, 4],
                "bias": [0, 1, 4, 5], "variant": list(VARIANTS)}

    def validate(self, ctx: GroupContext) -> None:
        super().validate(ctx)
        if self.variant not in VARIANTS:
            raise ConfigError(f"agent: options.variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        if self.block < 1:
            raise ConfigError(f"agent: options.block must be >= 1, got {self.block}")
        if not self.causal:
            if self.window != AgentOptions.window:
                raise ConfigError("agent: options.window is the causal variant's local window; variant 'published' "
                                  "(eq. 6) has none: leave window out")
        elif not 1 <= self.window <= self.block:
            raise ConfigError(f"agent: options.window must be in [1, block={self.block}], got {self.window}")
        if self.dwc < 0:
            raise ConfigError(f"agent: options.dwc must be >= 0 (0 = no convolution), got {self.dwc}")
        if self.bias < 0:
            raise ConfigError(f"agent: options.bias must be >= 0 (0 = no agent biases), got {self.bias}")

    def validate_length(self, head: str, seq_len: int) -> None:
        super().validate_length(head, seq_len)
        self.at_most(head, "block", seq_len, "no block would complete, so there would be no agents")
        self.at_most(head, "dwc", seq_len, "the convolution's taps past the sequence are weights no token ever uses")
        self.at_most(head, "bias", seq_len, "more distance buckets than distances: weights no pair ever uses")


@register("agent")
class AgentHeads(DenseHeads):
    """Agent attention heads: pooled-block agents plus a local window, one softmax; causal unless the option
    variant is published (eq. 6 over the whole sequence)."""

    Options = AgentOptions
    beyond_training = "keeps every token and adds an agent per block (its cache grows with the length)"
    options: AgentOptions

    def __init__(self, ctx: GroupContext, count: int, options: AgentOptions) -> None:
        super().__init__(ctx, count, options)
        channels = count * ctx.head_dim
        if options.dwc:  # one K-tap filter and a bias per (head, channel), as a depthwise Conv1d
            self.dwc = nn.Conv1d(channels, channels, options.dwc, groups=channels)
        if options.bias:  # [B1; B2] per head and distance bucket; zero: training starts from plain agent attention
            self.agent_bias = nn.Parameter(torch.zeros(2, count, options.bias))

    def _bias(self, which: int, d: torch.Tensor) -> torch.Tensor:
        """Agent bias B1 (which = 0: agent j over key p, d = e_j - p) or B2 (which = 1: query t over agent j,
        d = t - e_j) of every head at the token distances d[...] -> [H, ...] (routing.landmarks.distance_buckets;
        signed_distance_buckets for the published variant, where d < 0 is visible)."""
        buckets = distance_buckets if self.causal else signed_distance_buckets
        return self.agent_bias[which][:, buckets(d, self.options.bias, self.ctx.seq_len)]

    def _biased(self, which: int, d: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The additive mask of one softmax -> [H, ...visible.shape]: the agent bias at the distances d (the first
        d.shape[-1] columns, the agents'; 0 on the columns after them, the window's) where `visible`, else -inf."""
        bias = self._bias(which, d)
        return F.pad(bias, (0, visible.shape[-1] - bias.shape[-1])).masked_fill(~visible, float("-inf"))

    def _dwc_lead(self) -> int:
        """Rows before t that DWC's first tap reads: K - 1 (causal: rows t-K+1 .. t), (K - 1) // 2 (published: the
        kernel centred, rows t - (K-1)//2 .. t + K//2)."""
        return self.options.dwc - 1 if self.causal else (self.options.dwc - 1) // 2

    def _dwc(self, v: torch.Tensor) -> torch.Tensor:
        """DWC(V): v[B, H, T, h'] -> [B, H, T, h'], row t = bias + sum_i w_i * v[t - lead + i] over the rows in
        0 .. T-1 (zero-padded: F.conv1d's cross-correlation; lead = `_dwc_lead`, K - 1 when causal)."""
        B, H, T, d = v.shape
        lead = self._dwc_lead()
        y = self.dwc(F.pad(v.permute(0, 1, 3, 2).reshape(B, H * d, T), (lead, self.options.dwc - 1 - lead)))
        return y.view(B, H, d, T).permute(0, 1, 3, 2)

    def _dwc_reference(self, vi: torch.Tensor, i: int) -> torch.Tensor:
        """Head i's DWC, tap by tap: vi[B, T, h'] -> bias + sum_j w_j * v[t - (lead - j)] (rows in 0 .. T-1)."""
        K, d = self.options.dwc, self.ctx.head_dim
        w, bias = self.dwc.weight[i * d : (i + 1) * d, 0], self.dwc.bias[i * d : (i + 1) * d]  # [h', K], [h']
        out = bias.expand_as(vi).clone()
        T = vi.shape[1]
        lead = self._dwc_lead()
        for j in range(K):
            shift = lead - j  # tap j reads the row `shift` tokens back (ahead if < 0), where one exists
            if 0 <= shift < T:
                out[:, shift:] += w[:, j] * vi[:, : T - shift]
            elif -T < shift < 0:
                out[:, :shift] += w[:, j] * vi[:, -shift:]
        return out

    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Eq. 6 as the module docstring states it: pooled agents A, aggregation V_A = softmax(A K^T + B1 + M) V, then
        one softmax of each query over the agents (+ B2) and its local window (causal), or over all agents with no
        window (variant published), plus DWC(V); one head and one agent at a time, with explicit masks."""
        q, k, v = self._qkv(x, positions)  # [B, H, T, h']
        T, b, w = x.shape[1], self.options.block, self.options.window
        rows = torch.arange(T, device=x.device)
        if self.causal:  # agent j pools block j, rows jb .. (j+1)b - 1, and aggregates over the keys up to its end
            n = T // b
            starts = torch.arange(n, device=x.device) * b
            stops = keys_to = starts + b
            agent_visible = stops[None, :] - 1 <= rows[:, None]  # [T, n]: agent j complete at t
            local = (rows[None, :] <= rows[:, None]) & (rows[None, :] > rows[:, None] - w)  # [T, T]
        else:  # published: seq_len // b agents pooling windows over the whole sequence, every key, every query
            n = published_count(self.ctx.seq_len, b)
            starts, stops = adaptive_windows(n, T, x.device)
            keys_to = torch.full_like(stops, T)
            agent_visible = torch.ones(T, n, dtype=torch.bool, device=x.device)
            local = torch.zeros(T, T, dtype=torch.bool, device=x.device)  # no window
        ends = stops - 1  # [n] e_j, an agent's position (its window's last row) for the biases
        scale = self.ctx.head_dim**-0.5
        heads = []
        for i in range(self.count):
            qi, ki, vi = q[:, i], k[:, i], v[:, i]  # [B, T, h']
            agents, agent_values = [], []
            for j in range(n):  # agent aggregation, one agent at a time
                a = qi[:, starts[j] : stops[j]].mean(1)  # [B, h'] pooled queries of agent j's window
                s = torch.einsum("bd,btd->bt", a, ki[:, : keys_to[j]]) * scale  # causal: keys <= e_j
                if self.options.bias:  # + B1[j, p], by the distance e_j - p
                    s = s + self._bias(0, ends[j] - torch.arange(keys_to[j], device=x.device))[i]
                agents.append(a)
                agent_values.append(torch.einsum("bt,btd->bd", s.softmax(-1), vi[:, : keys_to[j]]))
            A = torch.stack(agents, 1) if n else qi[:, :0]  # [B, n, h']
            VA = torch.stack(agent_values, 1) if n else vi[:, :0]
            scores = torch.cat((qi @ A.transpose(-1, -2), qi @ ki.transpose(-1, -2)), -1) * scale  # [B, T, n+T]
            if self.options.bias:  # + B2[t, j] on the agent columns, by the distance t - e_j
                scores = scores + F.pad(self._bias(1, rows[:, None] - ends[None, :])[i], (0, T))
            scores = scores.masked_fill(~torch.cat((agent_visible, local), -1), float("-inf"))
            head = scores.softmax(-1) @ torch.cat((VA, vi), 1)  # broadcast + local, one softmax
            heads.append(head + self._dwc_reference(vi, i) if self.options.dwc else head)
        return self.out(torch.cat(heads, dim=-1))

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, positions)  # [B, H, T, h']
        if not self.causal:
            out = self._published(q, k, v)
            return self._merge(out + self._dwc(v) if self.options.dwc else out)
        B, H, T, d = q.shape
        b, w = self.options.block, self.options.window
        n = T // b
        A = block_pool(q, b)  # [B, H, n, d]
        ends, seen = block_ends(n, b, q.device), prefix_mask(n, T, b, q.device)  # [n], [n, T]: keys <= e_j
        if self.options.bias:  # + B1 [H, n, T]
            seen = self._biased(0, ends[:, None] - torch.arange(T, device=q.device), seen)
        VA = attend(A, k, v, mask=seen)  # agent aggregation
        # Query blocks of b rows; keys = all agents + the previous and own block (window w <= b).
        qb, kb, vb, band = window_blocks(q, k, v, b, w)  # [B*H, nb, b, d], [B*H, nb, 2b, d], [nb, b, 2b]
        nb = qb.shape[1]
        keys = torch.cat((A.flatten(0, 1)[:, None].expand(-1, nb, n, d), kb), 2)  # [B*H, nb, n + 2b, d]
        values = torch.cat((VA.flatten(0, 1)[:, None].expand(-1, nb, n, d), vb), 2)
        rows = torch.arange(nb * b, device=q.device).view(nb, b, 1)
        visible = torch.cat((ends <= rows, band), -1)  # [nb, b, n + 2b]: agents done by t, the window
        if self.options.bias:  # + B2 on the agent columns: a [nb, b, n + 2b] mask per head, shared by the batch
            heads = (B, H * nb, -1, d)  # [B, H*nb, ., d]: the mask [H*nb, b, n + 2b] broadcasts over B
            mask = self._biased(1, rows - ends, visible).flatten(0, 1)
            out = attend(qb.reshape(heads), keys.reshape(heads), values.reshape(heads), mask=mask)
        else:
            out = attend(qb, keys, values, mask=visible)
        out = out.reshape(B, H, nb * b, d)[:, :, :T]  # [B, H, T, d]
        return self._merge(out + self._dwc(v) if self.options.dwc else out)

    def _published(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Eq. 5 over the whole sequence (variant published): q, k, v [B, H, T, h'] -> [B, H, T, h']."""
        T = q.shape[2]
        n = published_count(self.ctx.seq_len, self.options.block)
        A = adaptive_pool(q, n)  # [B, H, n, h']
        rows, ends = torch.arange(T, device=q.device), adaptive_windows(n, T, q.device)[1] - 1
        b1 = b2 = None
        if self.options.bias:  # additive [H, n, T] and [H, T, n]
            b1, b2 = self._bias(0, ends[:, None] - rows), self._bias(1, rows[:, None] - ends)
        return attend(q, A, attend(A, k, v, mask=b1), mask=b2)  # broadcast of the aggregation

    def new_cache(self, batch: int, max_len: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> BlockKV:
        """All T keys/values, the current block's queries, and each completed block's (A_j, V_A_j)."""
        if not self.causal:
            raise ValueError("agent: variant 'published' is not causal and cannot be decoded incrementally")
        cache = BlockKV.empty(batch, self.count, max_len, self.ctx.head_dim, self.options.block, None, device, dtype)
        if self.options.bias:  # the cache builds each agent's V_A_j as blocks complete: with B1
            cache.aggregation_bias = functools.partial(self._bias, 0)
        return cache

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: BlockKV) -> torch.Tensor:
        """Prefill: the full forward over the prompt. A later token at row t (which may complete a
        block, whose agent it then already sees) attends in one softmax to the agents of all completed
        blocks and to the keys t-w < p <= t; with `dwc`, plus the convolution over its K most recent rows of v."""
        q, k, v = self._qkv(x, positions)  # [B, H, T, h']
        if cache.write("agent", q, k, v, positions):  # the prefill
            return self.forward(x, positions)
        t, w = cache.row(), min(self.options.window, cache.kv.k.shape[2])  # t: 0-d tensor (static shapes)
        rows = t - w + 1 + torch.arange(w, device=x.device)  # the window t-w < p <= t; rows < 0 are masked
        near = rows.clamp(min=0)
        keys = torch.cat((cache.landmarks, cache.kv.k.index_select(2, near)), 2)  # every agent slot + window
        values = torch.cat((cache.values, cache.kv.v.index_select(2, near)), 2)
        n_max = cache.landmarks.shape[2]
        done = torch.arange(n_max, device=x.device) < (t + 1) // self.options.block  # completed
        mask = torch.cat((done, rows >= 0))[None]  # [1, n_max + w]
        if self.options.bias:  # + B2 [H, 1, n_max + w] on the agent columns
            mask = self._biased(1, t - block_ends(n_max, self.options.block, x.device)[None], mask)
        out = attend(q, keys, values, mask=mask)  # one softmax
        if self.options.dwc:  # the last K rows of v (rows < 0 are zeros), the convolution's last output
            K = self.options.dwc
            taps = t - K + 1 + torch.arange(K, device=x.device)
            recent = cache.kv.v.index_select(2, taps.clamp(min=0)) * (taps >= 0)[:, None]  # [B, H, K, h']
            out = out + self._dwc(recent)[:, :, -1:]
        return self._merge(out)
