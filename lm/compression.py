"""Adaptive-attention compression layers (../shared/seeds/adaptive_attention_compression.txt).

A compression layer sits between blocks L-1 and L of a DecoderLM and shrinks a span of N hidden
states to t (the post's "[b, s, d] -> [b, t, d]"):

    c0 = span[:, N-t:]                              suffix initialisation: the span's last t states
    c  = c0 + W_O attend(LN(c0) W_Q, LN(sg(span)) W_K, LN(sg(span)) W_V)    O(N t), no mask
    c  = c + SwiGLU(LN(c))                          SwiGLU(x) = W_2 (silu(x W_g) * x W_u)

sg = stop-gradient: the span is "frozen during attention". `CompressedLM` runs a batch laid out as
[chunk_1 | ... | chunk_k | suffix]: blocks [0, L) see every chunk and the suffix separately (each
causal over itself, so no suffix token sees the raw prefix, as at inference); at L the chunks are
compressed recursively, m_1 = C(chunk_1), m_j = C([m_{j-1} | chunk_j]), and the t memory states are
prepended to the suffix; blocks [L, n) run plain causal attention over the t + S positions. Only
the suffix's logits are returned (the loss is on the suffix only).

Positions: every chunk and the suffix are numbered from 0 below L (each is its own window, as at
inference), memory + suffix from 0 above L, and the span from 0 inside the compression attention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from heads.attention import attend
from heads.rope import RotaryEmbedding
from lm.config import CompressionConfig, ModelConfig
from lm.model import DecoderLM


@dataclass(frozen=True)
class Layout:
    """How one batch is cut: `spans` prefix chunks, compressed one after another into `t` states
    each, then `suffix` tokens whose next-token losses count. No spans = a plain LM on the suffix.
    full=True: no compression, the memory is every chunk's raw depth-L states (the "full attention"
    reference of Delta = Loss(compressed) - Loss(full)); t must then be 0."""

    spans: tuple[int, ...]
    t: int
    suffix: int
    full: bool = False

    def __post_init__(self) -> None:
        if self.suffix < 1 or any(n < 1 for n in self.spans):
            raise ValueError(f"Layout: spans and suffix must be >= 1, got {self.spans}, {self.suffix}")
        if self.full and self.t != 0:
            raise ValueError(f"Layout: a full layout keeps its prefix uncompressed, t must be 0, got {self.t}")
        if self.spans and not self.full and not 1 <= self.t <= self.spans[0]:
            raise ValueError(f"Layout: t must be in [1, {self.spans[0]}] (first span), got {self.t}")

    @property
    def prefix(self) -> int:
        return sum(self.spans)

    @property
    def window(self) -> int:
        """Tokens one sample needs: prefix + suffix + 1 (the last suffix token's target)."""
        return self.prefix + self.suffix + 1

    @property
    def memory(self) -> int:
        """States prepended to the suffix above L."""
        return 0 if not self.spans else self.prefix if self.full else self.t

    def chunks_used(self, compress: bool) -> tuple[int, ...]:
        """The chunks whose depth-L states the memory depends on: all of them when compressing or
        keeping them full; for the `recent` baseline only the last ones, enough to hold its t states."""
        if compress or self.full:
            return self.spans
        used: tuple[int, ...] = ()
        while sum(used) < self.t and len(used) < len(self.spans):
            used = (self.spans[-1 - len(used)], *used)
        return used


def tokens_for(ratio: float, span: int) -> int:
    """t = round(ratio * span), at least 1: the number of states a span compresses to."""
    return max(1, min(span, round(ratio * span)))


def token_nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """logits[B, S, V], target[B, S] -> next-token cross-entropy per token [B, S], computed in fp32 (under bf16 too)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="none").view_as(target)


class SwiGLU(nn.Module):
    """W_2 (silu(x W_g) * x W_u) (Shazeer 2020)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def swiglu_hidden(d_model: int, ffn_mult: int) -> int:
    """2/3 * ffn_mult * d: three matrices with the parameter count of a two-matrix GELU FFN."""
    return 2 * ffn_mult * d_model // 3


class CompressionLayer(nn.Module):
    """span[B, N, d] -> t compressed states [B, t, d] (module docstring)."""

    def __init__(self, cfg: ModelConfig, comp: CompressionConfig) -> None:
        super().__init__()
        d, H, hd = cfg.d_model, comp.n_heads, cfg.head_dim
        self.n_heads, self.head_dim, self.detach = H, hd, comp.detach_prefix
        self.norm_q, self.norm_kv, self.norm_mlp = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.q = nn.Linear(d, H * hd, bias=False)
        self.kv = nn.Linear(d, 2 * H * hd, bias=False)
        self.out = nn.Linear(H * hd, d, bias=False)
        self.mlp = SwiGLU(d, swiglu_hidden(d, comp.ffn_mult))
        self.rope = RotaryEmbedding(hd, cfg.rope_fraction, cfg.rope_base)

    def forward(self, span: torch.Tensor, t: int) -> torch.Tensor:
        B, N, _ = span.shape
        if not 1 <= t <= N:
            raise ValueError(f"CompressionLayer: t must be in [1, {N}] (span length), got {t}")
        H, hd = self.n_heads, self.head_dim
        c = span[:, N - t :]  # suffix initialisation, [B, t, d]
        src = span.detach() if self.detach else span  # frozen during the attention
        q = self.q(self.norm_q(c)).view(B, t, H, hd).transpose(1, 2)  # [B, H, t, hd]
        k, v = self.kv(self.norm_kv(src)).view(B, N, 2, H, hd).permute(2, 0, 3, 1, 4)  # [B, H, N, hd]
        pos = torch.arange(N, device=span.device)
        a = attend(self.rope(q, pos[N - t :]), self.rope(k, pos), v)  # every new state sees all N
        c = c + self.out(a.transpose(1, 2).reshape(B, t, H * hd))
        return c + self.mlp(self.norm_mlp(c))


def _positions(batch: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(length, device=device).expand(batch, -1)


class CompressedLM(nn.Module):
    """A DecoderLM (its embedding, blocks, norm and head, unchanged) with a compression layer
    before block `comp.layer`. mode="recent" is the FLOP-matched baseline: the memory is the last t
    raw states at depth L instead of compressed ones (same t + S positions above L). A layout with
    full=True skips the compression in either mode: blocks above L see every raw prefix state.
    Head groups with auxiliary losses report those of each block's last call in a forward pass
    (for blocks below L: the prefix chunks)."""

    def __init__(self, cfg: ModelConfig, comp: CompressionConfig) -> None:
        super().__init__()
        self.cfg, self.comp, self.layer = cfg, comp, comp.layer
        self.lm = DecoderLM(cfg)
        self.compressor = CompressionLayer(cfg, comp) if comp.mode == "compress" else None
        if self.compressor is not None:
            self.compressor.apply(self.lm._init)

    def compress(self, span: torch.Tensor, t: int) -> torch.Tensor:
        """span[B, N, d] at depth L -> memory[B, t, d]."""
        return span[:, -t:] if self.compressor is None else self.compressor(span, t)

    def lower(self, tokens: torch.Tensor, hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Blocks [0, L) on one window of tokens[B, N] alone, positions 0..N-1 -> [B, N, d]."""
        x = self.lm.embed(tokens)
        pos = _positions(*tokens.shape, tokens.device)
        for block in self.lm.blocks[: self.layer]:
            x = block(x, pos)
            if hidden is not None:
                hidden.append(x)
        return x

    def memory(self, chunks: list[torch.Tensor], t: int, mem: torch.Tensor | None = None) -> torch.Tensor | None:
        """Recursive compression of depth-L chunk states: m_j = C([m_{j-1} | chunk_j], t)."""
        for h in chunks:
            mem = self.compress(h if mem is None else torch.cat([mem, h], dim=1), t)
        return mem

    def upper(
        self, x: torch.Tensor, mem: torch.Tensor | None, hidden: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Blocks [L, n), causal over [mem | x] (positions 0..t+S-1), then the final norm ->
        the states of x's positions [B, S, d]."""
        m = 0 if mem is None else mem.shape[1]
        if mem is not None:
            x = torch.cat([mem, x], dim=1)
        pos = _positions(x.shape[0], x.shape[1], x.device)
        for block in self.lm.blocks[self.layer :]:
            x = block(x, pos)
            if hidden is not None:
                hidden.append(x[:, m:])
        return self.lm.norm(x[:, m:])

    def forward(
        self, tokens: torch.Tensor, layout: Layout, hidden: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """tokens[B, >= prefix + suffix] -> suffix logits[B, S, V]. If `hidden` is a list, the
        suffix's states after every block ([B, S, d] each) are appended to it (for tests)."""
        P, S = layout.prefix, layout.suffix
        if tokens.shape[1] < P + S:
            raise ValueError(f"CompressedLM: need {P + S} tokens for {layout}, got {tokens.shape[1]}")
        x = self.lower(tokens[:, P : P + S], hidden)  # the suffix cannot see the prefix below L
        used = layout.chunks_used(self.compressor is not None)
        chunks = self._lower_chunks(tokens[:, P - sum(used) : P], used)
        mem = (torch.cat(chunks, dim=1) if chunks else None) if layout.full else self.memory(chunks, layout.t)
        return self.lm.lm_head(self.upper(x, mem, hidden))

    def _lower_chunks(self, prefix: torch.Tensor, spans: tuple[int, ...]) -> list[torch.Tensor]:
        if not spans:
            return []
        B = prefix.shape[0]
        if len(set(spans)) == 1:  # one batched pass over all chunks
            h = self.lower(prefix.reshape(B * len(spans), spans[0]))
            return list(h.view(B, len(spans), spans[0], -1).unbind(1))
        return [self.lower(c) for c in prefix.split(list(spans), dim=1)]

    def suffix_loss(self, tokens: torch.Tensor, layout: Layout, reduce: bool = True) -> torch.Tensor:
        """Next-token cross-entropy on the suffix only: logits at suffix position i predict
        tokens[P + i + 1]. tokens[B, >= layout.window]. reduce=False -> per-sample mean [B]."""
        P, S = layout.prefix, layout.suffix
        if tokens.shape[1] < layout.window:
            raise ValueError(f"CompressedLM.suffix_loss: need {layout.window} tokens for {layout} (the last suffix "
                             f"position's target too), got {tokens.shape[1]}")
        loss = token_nll(self(tokens, layout), tokens[:, P + 1 : P + S + 1])
        return loss.mean() if reduce else loss.mean(1)

    @property
    def causal(self) -> bool:
        """The decoder's head groups' (the compression layer reads only the prefix, before every suffix token)."""
        return self.lm.causal

    def kv_total(self, window: int | None = None, memory: int | None = None) -> int:
        """KV entries while decoding a window of W tokens (default prefix_len, the decoder's window) after a memory
        of t states (default round(ratio * prefix_len)): blocks [0, L) keep W per head, blocks [L, n) keep
        t + W (lm/compressed_generate.py)."""
        W = self.comp.prefix_len if window is None else window
        t = tokens_for(self.comp.ratio, self.comp.prefix_len) if memory is None else memory
        return sum(g.kv_entries(W if i < self.layer else t + W) for i, b in enumerate(self.lm.blocks) for g in b.attn.groups)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
