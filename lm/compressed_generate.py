"""Generation with online KV-cache compression (adaptive_attention_compression.txt, "Parallelization").

The text is generated in windows of W tokens (W = compression.prefix_len, the span length the model
was trained to compress). Inside a window, blocks [0, L) keep a KV cache of the window only, and
blocks [L, n) a KV cache of [memory | window]. When a window is full, its depth-L states (kept as
they were computed) are compressed together with the old memory, m <- C([m | window], t) (the
recursion the model was trained with), the window's cache entries are dropped, and the t memory
states are run through blocks [L, n) once to give their keys and values there. The compression is
amortised: one O((t + W) t) pass per W tokens, independent of the tokens being decoded, so it can run
beside generation; here it runs at the window boundary. Position ids never exceed t + W.

`CompressedCache.kv_entries()` counts the entries kept (sum over layers and heads) and
`kv_uncompressed()` what a plain dense cache of every token so far would keep.

Dense heads only: lm/generate.py's head-cache interface had not landed when this was written, so the
cached attention of a dense group is done here, with the group's own projections (`_qkv`, `out`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from heads.attention import attend
from heads.dense import DenseHeads
from lm.compression import CompressedLM
from lm.model import Block


@dataclass
class _KV:
    """Keys and values [B, H, n, hd] of one dense group, and the positions [n] they were rotated by."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    pos: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]


def _cached_attention(group: DenseHeads, x: torch.Tensor, positions: torch.Tensor, kv: _KV) -> torch.Tensor:
    """x[B, n, h] at positions[n] -> y[B, n, h]; appends the new keys/values to kv. Query i sees
    every cached key and the new keys at positions <= its own (MoSA eq. 1 with the causal mask)."""
    B, n, _ = x.shape
    q, k, v = group._qkv(x, positions.expand(B, -1))
    if kv.k is not None:
        k, v, pos = torch.cat([kv.k, k], 2), torch.cat([kv.v, v], 2), torch.cat([kv.pos, positions])
    else:
        pos = positions
    kv.k, kv.v, kv.pos = k, v, pos
    mask = pos[None, :] <= positions[:, None]  # [n, keys]
    a = attend(q, k, v, mask=mask)
    return group.out(a.transpose(1, 2).reshape(B, n, group.count * group.ctx.head_dim))


def _block_step(block: Block, x: torch.Tensor, positions: torch.Tensor, kvs: list[_KV]) -> torch.Tensor:
    """Block.forward with cached dense attention: x + HeadMix(LN(x)); x + FFN(LN(x))."""
    h = block.norm_attn(x)
    x = x + sum(_cached_attention(g, h, positions, kv) for g, kv in zip(block.attn.groups, kvs))
    return x + block.ffn(block.norm_ffn(x))


@dataclass
class CompressedCache:
    """Per block, per head group, a _KV; the window's depth-L states; the memory."""

    layers: list[list[_KV]]
    window_states: list[torch.Tensor] = field(default_factory=list)  # [B, n_i, d] pieces
    memory: torch.Tensor | None = None  # [B, t, d] at depth L
    seen: int = 0  # tokens processed so far
    group_heads: list[list[int]] = field(default_factory=list)

    def window_len(self) -> int:
        return sum(s.shape[1] for s in self.window_states)

    def kv_entries(self) -> int:
        """Entries kept now: sum over layers and heads of the cached keys."""
        return sum(h * len(kv) for kvs, heads in zip(self.layers, self.group_heads) for kv, h in zip(kvs, heads))

    def kv_uncompressed(self) -> int:
        """Entries a dense cache of all `seen` tokens would keep."""
        return self.seen * sum(sum(heads) for heads in self.group_heads)


class CompressedGenerator:
    """Online-compressing decoder around a trained CompressedLM with dense heads."""

    def __init__(self, model: CompressedLM, window: int | None = None, t: int | None = None) -> None:
        for g in model.lm.head_groups():
            if not isinstance(g, DenseHeads):
                raise ValueError(f"compressed generation supports dense heads only, got {type(g).__name__}")
        comp = model.comp
        self.model = model
        self.window = window or comp.prefix_len
        self.t = t or max(1, round(comp.ratio * self.window))
        if not 1 <= self.t <= self.window:
            raise ValueError(f"t must be in [1, window={self.window}], got {self.t}")

    def new_cache(self) -> CompressedCache:
        blocks = self.model.lm.blocks
        return CompressedCache(
            layers=[[_KV() for _ in b.attn.groups] for b in blocks],
            group_heads=[[g.count for g in b.attn.groups] for b in blocks],
        )

    @torch.no_grad()
    def feed(self, cache: CompressedCache, tokens: torch.Tensor) -> torch.Tensor:
        """Process tokens[B, n] (prompt or generated) -> logits[B, n, V]; compresses whenever a
        window fills."""
        out = []
        while tokens.shape[1] > 0:
            room = self.window - cache.window_len()
            piece, tokens = tokens[:, :room], tokens[:, room:]
            out.append(self._feed_window(cache, piece))
            if cache.window_len() == self.window:
                self._compress(cache)
        return torch.cat(out, dim=1)

    def _feed_window(self, cache: CompressedCache, tokens: torch.Tensor) -> torch.Tensor:
        m, L, j = self.model, self.model.layer, cache.window_len()
        pos = torch.arange(j, j + tokens.shape[1], device=tokens.device)  # window-local below L
        x = m.lm.embed(tokens)
        for block, kvs in zip(m.lm.blocks[:L], cache.layers[:L]):
            x = _block_step(block, x, pos, kvs)
        cache.window_states.append(x)
        mem = 0 if cache.memory is None else cache.memory.shape[1]
        for block, kvs in zip(m.lm.blocks[L:], cache.layers[L:]):
            x = _block_step(block, x, pos + mem, kvs)
        cache.seen += tokens.shape[1]
        return m.lm.lm_head(m.lm.norm(x))

    def _compress(self, cache: CompressedCache) -> None:
        """m <- C([m | window], t); drop the window's entries; memory K/V for blocks [L, n)."""
        m, L = self.model, self.model.layer
        cache.memory = m.memory([torch.cat(cache.window_states, dim=1)], self.t, cache.memory)
        cache.window_states = []
        for kvs in cache.layers:
            for kv in kvs:
                kv.k = kv.v = kv.pos = None
        x, pos = cache.memory, torch.arange(self.t, device=cache.memory.device)
        for block, kvs in zip(m.lm.blocks[L:], cache.layers[L:]):
            x = _block_step(block, x, pos, kvs)

    @torch.no_grad()
    def generate(
        self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> tuple[torch.Tensor, CompressedCache]:
        """prompt[B, n] -> (prompt + new tokens [B, n + max_new_tokens], final cache). temperature 0
        = greedy, else sampling from softmax(logits / temperature)."""
        was = self.model.training
        self.model.eval()
        g = torch.Generator(device="cpu").manual_seed(seed)
        cache = self.new_cache()
        logits = self.feed(cache, prompt)[:, -1]
        out = [prompt]
        for i in range(max_new_tokens):
            if temperature == 0.0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = (logits / temperature).softmax(-1).cpu()
                nxt = torch.multinomial(probs, 1, generator=g).to(prompt.device)
            out.append(nxt)
            if i < max_new_tokens - 1:
                logits = self.feed(cache, nxt)[:, -1]
        self.model.train(was)
        return torch.cat(out, dim=1), cache
