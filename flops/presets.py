"""Dense baseline sizes: MoSA Table 4 (Tiny, Small, Medium, Large) plus `micro` for CPU demos.

Each size is a dense model: `n_heads` dense heads in every layer, FFN 4h, vocabulary 8000, T = 1024.
`micro` is not in the paper: 2 layers, h = 64, 6 heads of h' = 16, T = 128, so an IsoFLOP sweep
trains on a laptop CPU in minutes (keep 2 dense heads there: `--dense-heads 2`).
"""
from __future__ import annotations

import dataclasses

from heads.base import ConfigError
from lm.config import HeadGroupConfig, ModelConfig, validate_model

SIZES: dict[str, dict[str, int]] = {
    "micro": dict(n_layers=2, d_model=64, head_dim=16, n_heads=6, seq_len=128),
    "tiny": dict(n_layers=6, d_model=512, head_dim=64, n_heads=9, seq_len=1024),
    "small": dict(n_layers=9, d_model=1024, head_dim=64, n_heads=9, seq_len=1024),
    "medium": dict(n_layers=18, d_model=1024, head_dim=64, n_heads=9, seq_len=1024),
    "large": dict(n_layers=27, d_model=1280, head_dim=64, n_heads=16, seq_len=1024),
}


def baseline(
    size: str | None = None,
    base: ModelConfig | None = None,
    *,
    n_layers: int | None = None,
    d_model: int | None = None,
    head_dim: int | None = None,
    n_heads: int | None = None,
    seq_len: int | None = None,
    vocab_size: int | None = None,
    dense: bool = True,
) -> ModelConfig:
    """The dense baseline ModelConfig of a size (or of `base`'s shape), with explicit overrides, checked as a
    config's model section. Fields not set by the size (vocab, RoPE, ...) come from `base` (default: ModelConfig()).
    With dense=False, `base` may have any one head mix in every layer (e.g. 4 local + 4 routing heads, MoSA Sec. 3's
    long-sequence baseline), kept as it is; n_heads then cannot be set."""
    base = base or ModelConfig()
    if size is not None and size not in SIZES:
        raise ConfigError(f"unknown size {size!r}; known sizes: {', '.join(SIZES)}")
    mixed = size is None and any(g.type != "dense" for g in base.heads)
    if size is None and (base.layer_heads or (mixed and dense)):
        raise ConfigError(("the baseline must be a dense config (one dense head group, no model.layer_heads); " if dense
                           else "the baseline must have one head mix in every layer (no model.layer_heads); ")
                          + f"this one has {', '.join(sorted({g.type for g in base.heads}))} heads"
                          + (" and layer_heads" if base.layer_heads else ""))
    if mixed and n_heads is not None:
        raise ConfigError(f"the head count override sets a dense baseline's heads; this baseline is {base.mix_text()}")
    shape = dict(SIZES[size]) if size else dict(
        n_layers=base.n_layers, d_model=base.d_model, head_dim=base.head_dim, seq_len=base.seq_len,
        n_heads=sum(g.count for g in base.heads),
    )
    given = dict(n_layers=n_layers, d_model=d_model, head_dim=head_dim, n_heads=n_heads, seq_len=seq_len)
    shape.update({k: v for k, v in given.items() if v is not None})
    for name, value in shape.items():
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    heads = base.heads if mixed else [HeadGroupConfig("dense", shape["n_heads"], {})]
    del shape["n_heads"]
    model = dataclasses.replace(base, **shape, heads=heads, layer_heads={},
                                vocab_size=base.vocab_size if vocab_size is None else vocab_size)
    validate_model(model)
    return model
