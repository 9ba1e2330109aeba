"""Run configuration: the dataclasses of a config's sections and their value checks (`validate`).

A config has the sections `model`, `data`, `optim`, `trainer` and, for a compressed model, `compression`.
YAML files and command-line overrides become a Config through lm/config_io.py (`load_config`), which checks
types and unknown keys (OmegaConf structured configs) and then values here. Every problem is a one-line
ConfigError naming the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from heads import ConfigError, GroupContext, make_options


@dataclass
class HeadGroupConfig:
    """`count` heads of one registered `type`, with that type's options (see heads/<type>.py). Both `type` and
    `count` must be given: a head count is what an IsoFLOP point is made of, so none is assumed."""

    type: str = MISSING
    count: int = MISSING
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConfig:
    """Pre-LN decoder LM (MoSA App. H). Defaults: the paper's Tiny model (Table 4)."""

    vocab_size: int = 8000
    n_layers: int = 6
    d_model: int = 512  # h
    head_dim: int = 64  # h'
    ffn_mult: int = 4  # FFN hidden = ffn_mult * h
    seq_len: int = 1024  # T
    rope_fraction: float = 0.5  # MoSA App. H: rotate half of each head's dims
    rope_base: float = 10000.0
    init_std: float = 0.02
    # The head mix of every layer: groups whose outputs are summed (MoSA eq. 3).
    heads: list[HeadGroupConfig] = field(default_factory=lambda: [HeadGroupConfig("dense", 9)])
    # Per-layer overrides: layer index -> head mix for that layer.
    layer_heads: dict[int, list[HeadGroupConfig]] = field(default_factory=dict)

    def mix(self, layer: int) -> list[HeadGroupConfig]:
        return self.layer_heads.get(layer, self.heads)

    def mix_text(self, layer: int | None = None) -> str:
        """A layer's head mix (default: model.heads) as '4 dense + 276 mosa'."""
        return " + ".join(f"{g.count} {g.type}" for g in (self.heads if layer is None else self.mix(layer)))

    def group_context(self, layer: int) -> GroupContext:
        return GroupContext(self.d_model, self.head_dim, self.seq_len, self.rope_fraction, self.rope_base, layer)


@dataclass
class DataConfig:
    """Defaults: MoSA App. H's recipe (C4, batch 64), like the model's and the optimizer's (whose cosine decay after
    the warm-up is ours: OptimConfig), so that an experiment config that sets only its heads trains like
    configs/tiny.yaml's dense baseline."""

    path: str = "data/c4"  # a directory written by data_prep.prepare (index.json + shards)
    batch_size: int = 64  # sequences per device and micro-batch (global batch = batch_size x devices x accumulation)
    val_batches: int = 16  # validation windows = val_batches * batch_size, fixed and evenly spaced
    num_workers: int = 0


@dataclass
class OptimConfig:
    """AdamW; MoSA App. H: lr 2.5e-4, clip 0.25, linear warmup 4k steps. The cosine decay after it is ours (the
    paper states no decay; `min_lr_ratio: 1.0` keeps the peak rate)."""

    lr: float = 2.5e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0  # 0 = the paper's Adam
    warmup_steps: int = 4000
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at trainer.max_steps
    grad_clip: float = 0.25


@dataclass
class TrainerConfig:
    max_steps: int = 100_000  # optimizer steps
    accumulate_grad_batches: int = 1  # micro-batches of data.batch_size per optimizer step (per device)
    precision: str = "auto"  # auto = bf16-mixed on GPU, 32-true on CPU
    accelerator: str = "auto"  # auto = CUDA if there is a CUDA GPU, else CPU; cpu; gpu / cuda (MPS is not supported)
    devices: int = 1
    num_nodes: int = 1
    strategy: str = "auto"  # auto | ddp | deepspeed_stage_2
    seed: int = 1234
    log_every: int = 50  # the presets' (configs/tiny.yaml ... large.yaml), which experiment configs inherit
    val_every: int = 1000
    validate_first: bool = False  # also validate the untrained model (step 0) when a run starts from scratch
    ckpt_every: int = 1000
    keep_last_k: int = 3  # step checkpoints kept (the newest k; 0 = all)
    out_dir: str = "runs/default"
    max_minutes: Optional[float] = None  # also stop after this much wall time in fit (validations, saves included)
    max_bad_steps: int = 0  # NaN/inf loss or gradient: 0 = stop the run; n = skip up to n such steps (lm/nonfinite.py)
    compile: bool = False  # torch.compile(fullgraph=True) the training step's forward + loss
    activation_checkpointing: bool = False  # keep only each block's input, recompute the block in backward
    deterministic: bool = False  # torch.use_deterministic_algorithms: bitwise-reproducible steps (fused kernels too)
    profiler: Optional[str] = None  # simple | pytorch: Lightning's profiler, report (+ trace) in <out_dir>/profile


@dataclass
class CompressionConfig:
    """Adaptive-attention compression layer (lm/compression.py) and its training regime
    (lm/compressed_training.py). Prefix chunks of ~prefix_len tokens are compressed into
    t = round(ratio * prefix_len) states at depth `layer`; the suffix is model.seq_len tokens."""

    layer: int = 2  # L: blocks [0, L) see each chunk alone; the compression sits before block L
    n_heads: int = 4  # heads of the compression attention (width model.head_dim)
    ffn_mult: int = 4  # SwiGLU hidden = 2/3 * ffn_mult * d_model (the GELU FFN's parameter count)
    detach_prefix: bool = True  # prefix states are frozen (no gradient) as keys/values of that attention
    mode: str = "compress"  # compress | recent (baseline: keep the last t raw states, no compression)
    regime: str = "fixed"  # fixed | random (prefix_len and ratio uniform, spread growing over ramp_steps)
    prefix_len: Optional[int] = None  # P (centre of its range under regime=random); None: model.seq_len (the post's P = S)
    ratio: float = 0.125  # t / P, the fraction kept (centre of its range under regime=random)
    prefix_spread: float = 0.5  # regime=random: P ~ U[P(1-s), P(1+s)] once the ramp is over
    ratio_spread: float = 0.5  # regime=random: ratio ~ U[r(1-s), r(1+s)] once the ramp is over
    ramp_steps: int = 1000  # the spreads grow linearly from 0 over these steps
    max_depth: int = 1  # recursion: each batch compresses 1..max_depth chunks one after another
    full_prob: float = 0.0  # probability that a training batch keeps its prefix uncompressed (Delta's reference)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    compression: Optional[CompressionConfig] = None  # set: train a CompressedLM (lm/compression.py)


ACCELERATORS = ("auto", "cpu", "gpu", "cuda")  # auto and gpu: CUDA if there is one, else CPU (never MPS)
MAX_MINUTES = 525_600  # trainer.max_minutes: at most a year (the trainer's timedelta overflows near 1.4e12)
PROFILERS = (None, "simple", "pytorch")  # trainer.profiler (lm/train.py build_profiler)
FLOAT32_MAX = 3.4028234663852886e38  # AdamW's step size above it overflows its fp32 arithmetic
SECTIONS = {"ModelConfig": "model", "DataConfig": "data", "OptimConfig": "optim", "TrainerConfig": "trainer",
            "CompressionConfig": "compression"}  # a section's name in YAML files and overrides


def _positive(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not (value > 0 and (isinstance(value, int) or math.isfinite(value))):
            where = SECTIONS.get(type(section).__name__, type(section).__name__)
            raise ConfigError(f"{where}.{name} must be a finite number > 0, got {value}")


def validate_model(m: ModelConfig) -> None:
    """The model section's value checks (also for a ModelConfig built in code, e.g. bench/generalisation.py's
    swapped heads): a one-line ConfigError."""
    _positive(m, "vocab_size", "n_layers", "d_model", "head_dim", "ffn_mult", "seq_len", "init_std")
    if not 0.0 <= m.rope_fraction <= 1.0:
        raise ConfigError(f"model.rope_fraction must be in [0, 1], got {m.rope_fraction}")
    if not 1.0 < m.rope_base < math.inf:  # theta_j = base^(-2j/r): base <= 1 gives constant, infinite or NaN
        raise ConfigError(f"model.rope_base must be finite and > 1, got {m.rope_base}")  # frequencies, inf all 0 but one
    if m.vocab_size > 2**16:
        raise ConfigError(f"model.vocab_size must be <= 65536 (ids in uint16 token shards), got {m.vocab_size}")
    for layer in m.layer_heads:
        if not 0 <= layer < m.n_layers:
            raise ConfigError(f"model.layer_heads: layer {layer} outside [0, {m.n_layers})")
    for layer in range(m.n_layers):
        where = f"model.layer_heads.{layer}" if layer in m.layer_heads else "model.heads"  # the mix as written
        if not m.mix(layer):
            raise ConfigError(f"{where}: layer {layer} has an empty head mix")
        for g in m.mix(layer):
            try:
                check_group(m, g, layer)
            except ConfigError as err:
                raise ConfigError(f"{where}: {err}") from None


def check_group(m: ModelConfig, g: HeadGroupConfig, layer: int = 0) -> None:
    """One head group's checks in layer `layer` of model `m`: its options, their fit to model.seq_len, its count."""
    opts = make_options(g.type, dict(g.options), m.group_context(layer))
    opts.validate_length(g.type, m.seq_len)
    if g.count < 1:
        raise ConfigError(f"{g.type} count must be >= 1, got {g.count}")
    opts.validate_count(g.count)


def validate(cfg: Config) -> Config:
    """Value checks beyond types. Raises a one-line ConfigError."""
    validate_model(cfg.model)
    _positive(cfg.data, "batch_size", "val_batches")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers must be >= 0, got {cfg.data.num_workers}")
    o = cfg.optim
    _positive(o, "lr", "grad_clip")
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    if not all(0.0 <= beta < 1.0 for beta in o.betas):
        raise ConfigError(f"optim.betas must both be in [0, 1), got {list(o.betas)}")
    if o.lr / (1 - o.betas[0]) > FLOAT32_MAX:  # AdamW's largest step size, lr / (1 - beta1) at its first step
        raise ConfigError(f"optim.lr / (1 - optim.betas[0]) must fit in float32 (<= {FLOAT32_MAX:.4g}; AdamW's first "
                          f"step size), got lr {o.lr}, betas[0] {o.betas[0]}")
    if not (o.weight_decay >= 0 and math.isfinite(o.weight_decay)):
        raise ConfigError(f"optim.weight_decay must be a finite number >= 0, got {o.weight_decay}")
    t = cfg.trainer
    _positive(t, "max_steps", "accumulate_grad_batches", "devices", "num_nodes", "log_every", "val_every", "ckpt_every")
    if t.accelerator == "mps":
        raise ConfigError("trainer.accelerator=mps is not supported: validation and some heads compute in float64, "
                          "which MPS lacks; use trainer.accelerator=cpu")
    if t.accelerator not in ACCELERATORS:
        raise ConfigError(f"trainer.accelerator must be one of {', '.join(ACCELERATORS)}, got {t.accelerator!r}")
    if t.max_minutes is not None:
        _positive(t, "max_minutes")
        if t.max_minutes > MAX_MINUTES:
            raise ConfigError(f"trainer.max_minutes must be <= {MAX_MINUTES} (a year), got {t.max_minutes}")
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"trainer.seed must be in [0, 2**32), got {t.seed}")
    if t.keep_last_k < 0:
        raise ConfigError(f"trainer.keep_last_k must be >= 0 (0 = keep every checkpoint), got {t.keep_last_k}")
    if t.max_bad_steps < 0:
        raise ConfigError(f"trainer.max_bad_steps must be >= 0, got {t.max_bad_steps}")
    if t.activation_checkpointing and t.compile:
        raise ConfigError("trainer.activation_checkpointing and trainer.compile cannot be combined (torch.compile "
                          "refuses the head groups' side effects inside a checkpointed block); set one of them false")
    if t.profiler not in PROFILERS:
        raise ConfigError(f"trainer.profiler must be simple, pytorch or null, got {t.profiler!r}")
    if t.strategy not in ("auto", "ddp", "deepspeed_stage_2"):
        raise ConfigError(f"trainer.strategy must be auto, ddp or deepspeed_stage_2, got {t.strategy!r}")
    if t.precision not in ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true"):
        raise ConfigError(f"trainer.precision must be auto, 32-true, bf16-mixed, 16-mixed or bf16-true, got {t.precision!r}")
    if cfg.compression is not None:
        validate_compression(cfg.compression, cfg.model)
    return cfg


def validate_compression(c: CompressionConfig, m: ModelConfig) -> None:
    """One-line ConfigErrors for the compression section; an unset prefix_len becomes model.seq_len."""
    if c.prefix_len is None:
        c.prefix_len = m.seq_len
    _positive(c, "n_heads", "ffn_mult", "prefix_len", "ratio", "max_depth")
    if not 1 <= c.layer < m.n_layers:
        raise ConfigError(f"compression.layer must be in [1, {m.n_layers}) (model.n_layers), got {c.layer}")
    if c.mode not in ("compress", "recent"):
        raise ConfigError(f"compression.mode must be compress or recent, got {c.mode!r}")
    if c.regime not in ("fixed", "random"):
        raise ConfigError(f"compression.regime must be fixed or random, got {c.regime!r}")
    if not 0.0 <= c.prefix_spread < 1.0 or not 0.0 <= c.ratio_spread < 1.0:
        raise ConfigError("compression.prefix_spread and compression.ratio_spread must be in [0, 1)")
    top = c.ratio * (1 + c.ratio_spread) if c.regime == "random" else c.ratio  # the spread applies to random only
    if top > 1.0:
        raise ConfigError(f"compression.ratio{' * (1 + ratio_spread)' if c.regime == 'random' else ''} must be <= 1, "
                          f"got {top}")
    if c.ramp_steps < 0:
        raise ConfigError(f"compression.ramp_steps must be >= 0, got {c.ramp_steps}")
    if not 0.0 <= c.full_prob < 1.0:
        raise ConfigError(f"compression.full_prob must be in [0, 1), got {c.full_prob}")
    leaky = sorted({f"{g.type} ({f'model.layer_heads.{layer}' if layer in m.layer_heads else 'model.heads'})"
                    for layer in range(m.n_layers) for g in m.mix(layer)
                    if not make_options(g.type, dict(g.options), m.group_context(layer)).causal})
    if leaky:  # its training, evaluation and decoding are teacher-forced or incremental: a leak would go unmeasured
        verb = "is" if len(leaky) == 1 else "are"
        raise ConfigError(f"compression needs causal head groups (the suffix runs causal attention throughout), but "
                          f"{', '.join(leaky)} {verb} not causal as configured; choose causal options")
