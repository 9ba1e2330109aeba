"""Config sanity warnings: settings that are valid but almost certainly not what was meant.

Each is one line on stderr (rank 0 only), never an error: a head group's own advice (`HeadOptions.advice`,
e.g. MoSAIC load far from capacity; the IsoFLOP solver and sweeps print the same text), a sparsity that does not
divide the training length (the solver refuses it), a non-causal head mix
(its teacher-forced validation loss leaks), a shrunk run (`trainer.max_steps=30` on a
preset) that keeps the preset's warm-up never leaves it (the loss stays near ln V), one whose
`val_every` exceeds `max_steps` validates only at the end, and validation windows that overlap (or a
validation split shorter than one batch of windows) measure fewer distinct tokens than they count, and a
compression prefix length other than the suffix length (generation decodes windows of one length).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from heads import make_options
from heads.rope import RotaryEmbedding

if TYPE_CHECKING:
    from lm.config import Config, DataConfig, ModelConfig


def warn(message: str) -> None:
    """One `warning:` line on stderr, on rank 0 only (Lightning's rank; imported here, not at module level, so that
    the config and the FLOP calculators load without Lightning's import, which takes seconds)."""
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def config_warnings(cfg: Config) -> list[str]:
    """Warnings that follow from the config alone (each distinct head advice once, naming where the mix is written:
    model.heads, or model.layer_heads.N)."""
    m, o, t = cfg.model, cfg.optim, cfg.trainer
    groups = [(f"model.layer_heads.{layer}" if layer in m.layer_heads else "model.heads", g,
               make_options(g.type, dict(g.options), m.group_context(layer)))
              for layer in range(m.n_layers) for g in m.mix(layer)]
    out = [f"{where}: {text}" for where, text in sorted({(where, opts.advice(g.count)) for where, g, opts in groups
                                                         if opts.advice(g.count) is not None})]
    uneven = sorted({(where, g.type, opts.sparsity) for where, g, opts in groups
                     if m.seq_len % getattr(opts, "sparsity", 1)})
    out += [f"{where}: {name} sparsity {rho} does not divide model.seq_len {m.seq_len}, so its k = T / rho is "
            f"rounded (flops/formulas.py states how per type); flops.isoflop and flops.sweep, which FLOP-match divisible "
            f"sparsities as the paper does, refuse it" for where, name, rho in uneven]
    leaky = sorted({f"{g.type} ({where})" for where, g, opts in groups if not opts.causal})
    if leaky:
        out.append(f"{', '.join(leaky)} not causal (a paper's faithful rule): the validation loss logged "
                   f"while training is teacher-forced and sees future tokens; python -m lm.evaluate --ckpt ... "
                   f"measures it leak-free")
    if m.rope_fraction > 0 and RotaryEmbedding(m.head_dim, m.rope_fraction, m.rope_base).rot_dim == 0:
        out.append(f"model.rope_fraction={m.rope_fraction} rotates 0 of head_dim {m.head_dim} dimensions (rounded down to "
                   f"an even count): the heads get no position information; "
                   + (f"use at least 2/{m.head_dim}, or 0" if m.head_dim >= 2 else "a head_dim of at least 2 (RoPE rotates "
                      "pairs of dimensions), or rope_fraction 0"))
    if o.warmup_steps >= t.max_steps:
        out.append(f"optim.warmup_steps={o.warmup_steps} >= trainer.max_steps={t.max_steps}: the learning rate "
                   f"never leaves warm-up (set optim.warmup_steps to a fraction of max_steps)")
    if t.val_every > t.max_steps:
        out.append(f"trainer.val_every={t.val_every} > trainer.max_steps={t.max_steps}: validation runs only at the end")
    if t.log_every > t.max_steps:
        out.append(f"trainer.log_every={t.log_every} > trainer.max_steps={t.max_steps}: the training scalars "
                   f"(train/loss, train/lr, ...) are never logged")
    c = cfg.compression
    if c is not None and c.prefix_len != m.seq_len:
        out.append(f"compression.prefix_len={c.prefix_len} != model.seq_len={m.seq_len}: generation "
                   f"(lm.compressed_generate) decodes windows of prefix_len tokens, each the suffix while decoded and a "
                   f"compressed span after, so one role runs at a length training never used (the post trains both "
                   f"at seq_len)")
    return out


def val_batches_that_fit(data: DataConfig, model: ModelConfig, val_tokens: int) -> int:
    """How many batches of validation windows (data.batch_size windows of seq_len + 1 tokens) a split of
    `val_tokens` tokens holds without overlap (0 if not even one)."""
    return val_tokens // (data.batch_size * (model.seq_len + 1))


VOCAB_PADDING = 128  # a model vocabulary padded up to a multiple of this (for matmul shapes) is not warned about


def vocab_warnings(model: ModelConfig, data_vocab: int | None) -> list[str]:
    """A warning when model.vocab_size exceeds the data's vocabulary by more than padding: those embedding rows and
    logits are never a target, and early training spends its updates pushing them down."""
    if data_vocab is None or model.vocab_size <= -(-data_vocab // VOCAB_PADDING) * VOCAB_PADDING:
        return []
    return [f"model.vocab_size {model.vocab_size} > the data's vocabulary {data_vocab}: {model.vocab_size - data_vocab} "
            f"ids are never a target; set model.vocab_size={data_vocab} (padding up to a multiple of {VOCAB_PADDING} "
            "is not warned about)"]


def validation_warnings(data: DataConfig, model: ModelConfig, val_tokens: int) -> list[str]:
    """Warnings about the validation windows on a split of `val_tokens` tokens (lm/data.py ValWindows)."""
    window = model.seq_len + 1
    windows = data.val_batches * data.batch_size
    if val_tokens < data.batch_size * window:
        return [f"the validation split has {val_tokens} tokens, fewer than one batch of windows "
                f"(data.batch_size={data.batch_size} x {window}): every validation window overlaps others"]
    if val_tokens < windows * window:
        return [f"validation windows overlap: data.val_batches x data.batch_size = {windows} windows of {window} "
                f"tokens need {windows * window} but the validation split has {val_tokens} "
                f"(lower data.val_batches to {val_batches_that_fit(data, model, val_tokens)})"]
    return []
