"""Generation with online KV-cache compression (adaptive_attention_compression.txt, "Parallelization").

The text is generated in windows of W tokens (W = compression.prefix_len, the span length the model
was trained to compress). Inside a window, blocks [0, L) keep a KV cache of the window only, and
blocks [L, n) a KV cache of [memory | window]. When a window is full, its depth-L states (kept as
they were computed) are compressed together with the old memory, m <- C([m | window], t) (the
recursion the model was trained with), the window's cache entries are dropped, and the t memory
states are run through blocks [L, n) once to give their keys and values there. The compression is
amortised: one O((t + W) t) pass per W tokens, independent of the tokens being decoded, so it can run
beside generation; here it runs at the window boundary. Position ids never exceed t + W.

With an `AdaptiveRatio` (lm/ratio_predictor.py) each compression keeps t = round(r* W) states, r* chosen by
the ratio predictor for the window being compressed and a tolerance Delta* (the post's adaptive ratio);
without one, t = round(compression.ratio * W) every time. `CompressedCache.kept` lists the t of each
compression so far.

`CompressedCache.kv_entries()` counts the entries kept (sum over layers and heads) and
`kv_uncompressed()` what a plain dense cache of every token so far would keep.

The per-layer caches are the head groups' own decoding caches (`HeadGroup.new_cache`, used through
`Block.forward(x, positions, cache)` as in lm/generate.py), fresh ones for every window: blocks
below L get room for W tokens, blocks above L for t + W, prefilled with the memory.

    python -m lm.compressed_generate --ckpt runs/compression/checkpoints/last.ckpt --prompt "It was a dark" \
        [--max-new-tokens 300] [--temperature 1.0] [--seed 0] [--tokenizer PATH] [--predictor P --tolerance D]
samples from a compression checkpoint (lm.compressed_training) this way and reports the KV entries kept against an
uncompressed cache's; with --predictor (python -m lm.ratio_predictor train) each compression's t is the adaptive one.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from data_prep import tokenizer as sp_codec
from data_prep.cli import OneLineParser
from heads.base import ConfigError
from lm.compression import CompressedLM, tokens_for
from lm.generate import check_command, check_prompt, check_sampling, sample
from lm.loading import TOKENIZER_HELP, load_tokenizer
from lm.ratio_predictor import AdaptiveRatio


@dataclass
class CompressedCache:
    """Per block, one decoding cache per head group; the window's depth-L states; the memory."""

    batch: int
    layers: list[list[Any]] = field(default_factory=list)
    window_states: list[torch.Tensor] = field(default_factory=list)  # [B, n_i, d] pieces
    memory: torch.Tensor | None = None  # [B, t, d] at depth L
    kept: list[int] = field(default_factory=list)  # t of each compression so far
    seen: int = 0  # tokens processed so far
    heads: int = 0  # attention heads summed over all layers

    def window_len(self) -> int:
        return sum(s.shape[1] for s in self.window_states)

    def kv_entries(self) -> int:
        """Entries kept now per sequence: each head group's cache entries (`entries()`: keys/values, plus the
        agents' and landmarks' pairs), summed over layers and heads, averaged over the batch."""
        return sum(c.entries() for layer in self.layers for c in layer) // self.batch

    def held_states(self) -> int:
        """Depth-L hidden states (of width d) kept per sequence besides the caches, which a dense decoder does not
        hold: the window's, compressed when it fills, and the memory's t."""
        return self.window_len() + (0 if self.memory is None else self.memory.shape[1])

    def kv_uncompressed(self) -> int:
        """Entries a dense cache of all `seen` tokens would keep."""
        return self.seen * self.heads


class CompressedGenerator:
    """Online-compressing decoder around a trained CompressedLM."""

    def __init__(self, model: CompressedLM, window: int | None = None, t: int | None = None,
                 adaptive: AdaptiveRatio | None = None) -> None:
        comp = model.comp
        self.model, self.adaptive = model, adaptive
        self.window = comp.prefix_len if window is None else window
        self.t = tokens_for(comp.ratio, self.window) if t is None else t
        if self.window < 1 or not 1 <= self.t <= self.window:
            raise ValueError(f"need window >= 1 and t in [1, window], got window {self.window} and t {self.t}")
        if adaptive is not None and adaptive.prefix_len not in (None, self.window):  # its Deltas are of that span
            raise ValueError(f"the ratio predictor was fit on spans of {adaptive.prefix_len} tokens, this decoder "
                             f"compresses windows of {self.window}: fit one on ratio data of this window")
        for g in model.lm.head_groups():
            try:
                g.new_cache(1, 1)
            except NotImplementedError as err:
                raise ValueError(f"compressed generation needs KV-cached decoding: {err}") from None

    def new_cache(self, batch: int) -> CompressedCache:
        cache = CompressedCache(batch, heads=sum(g.count for g in self.model.lm.head_groups()))
        self._reset(cache)
        return cache

    def _reset(self, cache: CompressedCache) -> None:
        """Fresh per-window caches: W slots below L, memory + W above."""
        p = next(self.model.parameters())
        mem = 0 if cache.memory is None else cache.memory.shape[1]
        cache.layers = [
            [g.new_cache(cache.batch, self.window + (mem if i >= self.model.layer else 0), p.device, p.dtype)
             for g in block.attn.groups]
            for i, block in enumerate(self.model.lm.blocks)
        ]

    @torch.no_grad()
    def feed(self, cache: CompressedCache, tokens: torch.Tensor) -> torch.Tensor:
        """Process tokens[B, n] (prompt or generated) -> logits[B, n, V]; compresses whenever a
        window fills."""
        out = []
        while tokens.shape[1] > 0:
            # The decoding-cache contract (lm/generate.py): a prefill on fresh caches, then one token
            # per call. Only the first window starts with every cache fresh.
            fresh = cache.memory is None and cache.window_len() == 0
            n = self.window if fresh else 1
            piece, tokens = tokens[:, :n], tokens[:, n:]
            out.append(self._feed_window(cache, piece))
            if cache.window_len() == self.window:
                self._compress(cache)
        return torch.cat(out, dim=1)

    def _feed_window(self, cache: CompressedCache, tokens: torch.Tensor) -> torch.Tensor:
        m, L, j = self.model, self.model.layer, cache.window_len()
        B, n = tokens.shape
        pos = torch.arange(j, j + n, device=tokens.device).expand(B, -1)  # window-local below L
        x = m.lm.embed(tokens)
        for block, caches in zip(m.lm.blocks[:L], cache.layers[:L]):
            x = block(x, pos, caches)
        cache.window_states.append(x)
        mem = 0 if cache.memory is None else cache.memory.shape[1]
        for block, caches in zip(m.lm.blocks[L:], cache.layers[L:]):
            x = block(x, pos + mem, caches)
        cache.seen += n
        return m.lm.lm_head(m.lm.norm(x))

    def _compress(self, cache: CompressedCache) -> None:
        """m <- C([m | window], t) (t adaptive or fixed); drop the window's entries; memory K/V for blocks [L, n)."""
        m, L = self.model, self.model.layer
        window = torch.cat(cache.window_states, dim=1)
        t = self.t if self.adaptive is None else self.adaptive.tokens(m, window)
        cache.memory = m.memory([window], t, cache.memory)
        cache.window_states = []
        cache.kept.append(t)
        self._reset(cache)
        x = cache.memory
        pos = torch.arange(t, device=x.device).expand(cache.batch, -1)
        for block, caches in zip(m.lm.blocks[L:], cache.layers[L:]):
            x = block(x, pos, caches)  # prefill: the memory states attend causally among themselves

    @torch.no_grad()
    def generate(
        self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
        vocab: int | None = None,
    ) -> tuple[torch.Tensor, CompressedCache]:
        """prompt[B, n] -> (prompt + new tokens [B, n + max_new_tokens], final cache). temperature 0
        = greedy, else sampling from softmax(logits / temperature) (lm.generate.sample; `vocab`: only ids below it,
        the tokenizer's pieces when the model's vocabulary is padded beyond them). One-line ValueError
        for a prompt that is not [B, n >= 1] ids in the vocabulary (`check_prompt`), max_new_tokens < 0 or a
        temperature that is not finite and >= 0."""
        prompt = check_prompt(prompt, self.model.lm.cfg.vocab_size, max_new_tokens)
        check_sampling(temperature, 0, 1.0)
        was = self.model.training
        self.model.eval()
        try:
            g = torch.Generator(device=prompt.device).manual_seed(seed)
            cache = self.new_cache(prompt.shape[0])
            logits = self.feed(cache, prompt)[:, -1]
            out = [prompt]
            for i in range(max_new_tokens):
                nxt = sample(logits, temperature, generator=g, vocab=vocab)[:, None]
                out.append(nxt)
                if i < max_new_tokens - 1:
                    logits = self.feed(cache, nxt)[:, -1]
        finally:
            self.model.train(was)
        return torch.cat(out, dim=1), cache


def main(argv: list[str] | None = None) -> int:
    from lm.checkpoint import read_checkpoint
    from lm.compressed_training import compressed_from_checkpoint

    ap = OneLineParser(prog="python -m lm.compressed_generate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="a checkpoint of lm.compressed_training")
    ap.add_argument("--prompt", required=True, help="text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default 100)")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    ap.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    ap.add_argument("--predictor", help="ratio predictor (python -m lm.ratio_predictor train): adaptive t per window")
    ap.add_argument("--tolerance", type=float, help="with --predictor: the loss increase Delta* it may cost")
    args = ap.parse_args(argv)
    try:
        check_command(args.max_new_tokens, args.seed, args.prompt)
        if (args.predictor is None) != (args.tolerance is None):
            raise ValueError("--predictor and --tolerance go together")
        check_sampling(args.temperature, 0, 1.0, flags=True)
        # the predictor before the checkpoint: a --tolerance outside its fitted Deltas fails at once
        adaptive = None if args.predictor is None else AdaptiveRatio.load(args.predictor, args.tolerance)
        saved = read_checkpoint(args.ckpt, mmap=False)  # read once: weights, config and the run record
        model, cfg = compressed_from_checkpoint(saved, args.ckpt)
        sp = load_tokenizer(Path(args.ckpt), saved.get("run") or {}, cfg, args.tokenizer)
        ids = sp_codec.encode_text(sp, args.prompt)
        if not ids:
            raise ValueError("--prompt encodes to no tokens")
        if adaptive is not None and adaptive.predictor.hparams["d_model"] != cfg.model.d_model:
            raise ValueError(f"--predictor {args.predictor} reads states of d_model {adaptive.predictor.hparams['d_model']},"
                             f" {args.ckpt} has d_model {cfg.model.d_model}: train it on this checkpoint's ratio data")
        out, cache = CompressedGenerator(model, adaptive=adaptive).generate(
            torch.tensor([ids]), args.max_new_tokens, args.temperature, args.seed, vocab=sp.get_piece_size())
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"KV cache after {out.shape[1] - 1} tokens fed: {cache.kv_entries()} entries kept, "
          f"{cache.kv_uncompressed()} in an uncompressed cache, plus {cache.held_states()} hidden states of width "
          f"{cfg.model.d_model} (the window to compress and the memory); {len(cache.kept)} compression(s) of windows "
          f"of {cfg.compression.prefix_len} tokens, keeping t = {cache.kept}", file=sys.stderr)
    print(sp.decode(out[0].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
