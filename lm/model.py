"""Pre-LN decoder-only LM (MoSA App. H): embed -> [Block] * L -> LayerNorm -> vocab projection.

Block = x + HeadMix(LN(x)); x + FFN(LN(x)). HeadMix sums its head groups' outputs (MoSA eq. 3), so a
layer can mix dense and sparse heads (e.g. 4 dense + 17 MoSA). FFN: h -> 4h -> h, GELU, no dropout.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from heads import HeadGroup, head_class, make_options
from lm.checkpointing import checkpointed
from lm.config import HeadGroupConfig, ModelConfig


class HeadMix(nn.Module):
    """The attention of one layer: a list of head groups whose outputs add up."""

    def __init__(self, cfg: ModelConfig, layer: int, groups: list[HeadGroupConfig]) -> None:
        super().__init__()
        ctx = cfg.group_context(layer)
        self.groups = nn.ModuleList(
            head_class(g.type)(ctx, g.count, make_options(g.type, dict(g.options), ctx)) for g in groups
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: list[Any] | None = None) -> torch.Tensor:
        caches = cache if cache is not None else [None] * len(self.groups)
        return sum(g(x, positions, c) for g, c in zip(self.groups, caches))  # type: ignore[return-value]


class FeedForward(nn.Module):
    def __init__(self, d_model: int, mult: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, mult * d_model, bias=False)
        self.down = nn.Linear(mult * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class Block(nn.Module):
    checkpoint = False  # activation checkpointing (lm/checkpointing.py): recompute this block in backward

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(cfg.d_model)
        self.attn = HeadMix(cfg, layer, cfg.mix(layer))
        self.norm_ffn = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_mult)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: list[Any] | None = None) -> torch.Tensor:
        if self.checkpoint and cache is None and torch.is_grad_enabled():
            return checkpointed(self.body, x, positions)
        return self.body(x, positions, cache)

    def body(self, x: torch.Tensor, positions: torch.Tensor, cache: list[Any] | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x), positions, cache)
        return x + self.ffn(self.norm_ffn(x))


class DecoderLM(nn.Module):
    """tokens[B, T] -> logits[B, T, vocab]. After a forward pass, `aux_losses` holds every head
    group's auxiliary losses (summed over layers per name) and `aux_loss` their total."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)

    def _init(self, module: nn.Module) -> None:
        """Every Linear, Embedding and Conv1d weight N(0, init_std), their biases 0: projections, embeddings and the
        agent heads' convolution (whose PyTorch default, std ~0.3 at K = 3, made its term ~4x the attention's at
        init). LayerNorms keep PyTorch's weight 1, bias 0."""
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
            nn.init.normal_(module.weight, std=self.cfg.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def head_groups(self) -> list[HeadGroup]:
        return [g for block in self.blocks for g in block.attn.groups]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: list[list[Any]] | None = None,
    ) -> torch.Tensor:
        """tokens[B, T] (int64); positions[B, T] default 0..T-1; `cache` per layer per group
        (see lm/generate.py)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, positions, None if cache is None else cache[i])
        return self.lm_head(self.norm(x))

    @property
    def aux_losses(self) -> dict[str, torch.Tensor]:
        total: dict[str, torch.Tensor] = {}
        for g in self.head_groups():
            for name, value in g.aux_losses.items():
                total[name] = total[name] + value if name in total else value
        return total

    @property
    def aux_loss(self) -> torch.Tensor | float:
        return sum(self.aux_losses.values(), 0.0)

    @property
    def causal(self) -> bool:
        return all(g.causal for g in self.head_groups())

    def kv_total(self, seq_len: int | None = None) -> int:
        """KV-cache entries summed over layers and heads (MoSA Table 2: sum_l T*H_dense + k*H_sparse)."""
        T = seq_len or self.cfg.seq_len
        return sum(g.kv_entries(T) for g in self.head_groups())

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def checkpoint_blocks(model: nn.Module, on: bool = True) -> None:
    """Activation checkpointing (lm/checkpointing.py) of every Block in `model` (a DecoderLM or a model built
    around one)."""
    for module in model.modules():
        if isinstance(module, Block):
            module.checkpoint = on


def build_model(cfg: ModelConfig) -> DecoderLM:
    return DecoderLM(cfg)
