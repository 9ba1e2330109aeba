"""Run configuration: YAML validated into dataclasses (OmegaConf structured configs).

One file holds four sections, `model`, `data`, `optim`, `trainer`. `load_config(path, **overrides)`
merges the YAML over the dataclass defaults, then dotted overrides (`model.n_layers=4`, the same
syntax as on the `train_lm.py` command line), checks types and unknown keys (OmegaConf), and checks
values (`validate`). Every problem is a one-line ConfigError naming the field; settings that are
valid but suspect (lm/sanity.py) print one-line warnings.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, KeyValidationError, OmegaConfBaseException

from heads import ConfigError, GroupContext, make_options
from lm.sanity import config_warnings, warn


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
    accelerator: str = "auto"  # auto / gpu = CUDA if there is a CUDA GPU, else CPU; cpu; cuda (MPS is not supported)
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


def _bool_keys(cls: type, prefix: str = "") -> set[str]:
    """Dotted keys of a config dataclass's bool fields, nested sections included."""
    keys = set()
    for name, hint in typing.get_type_hints(cls).items():
        inner = next((a for a in typing.get_args(hint) if a is not type(None)), hint)  # Optional[X] -> X
        if hint is bool:
            keys.add(prefix + name)
        elif dataclasses.is_dataclass(inner):
            keys |= _bool_keys(inner, f"{prefix}{name}.")  # type: ignore[arg-type]
    return keys


BOOL_KEYS = _bool_keys(Config)  # OmegaConf reads any integer there as a bool (trainer.compile=2 is true): refused


def _check_bools(values: dict[str, Any], where: str = "") -> None:
    """ConfigError unless every value given for a bool field is a bool (YAML true/false, yes/no)."""
    for key, value in values.items():
        if isinstance(value, str):
            with contextlib.suppress(yaml.YAMLError):
                value = yaml.safe_load(value)
        if key in BOOL_KEYS and not isinstance(value, bool) and not str(value).startswith("${"):  # interpolation
            raise ConfigError(f"{where}{key} must be true or false, got {value!r}")


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


def _one_line(err: OmegaConfBaseException) -> str:
    message = " ".join(str(err).split("\n")[0].split())
    key = getattr(err, "full_key", None)
    if isinstance(err, KeyValidationError) and str(key).startswith("model.layer_heads."):
        return (f"{key}: model.layer_heads keys are layer indices, each set to a whole head mix: "
                "model.layer_heads.1=[{type: dense, count: 4}] or model.layer_heads={1: [...]} (items only once "
                "the layer has a mix)")
    if getattr(err, "object_type", None) is HeadGroupConfig and "." not in str(key):  # merged from a YAML list item
        hint = (f" (a head group has type, count and options; its type's options go under options, e.g. "
                f"{{type: mosa, count: 8, options: {{{key}: ...}}}})") if isinstance(err, ConfigKeyError) else ""
        return f"model.heads / model.layer_heads: a head group's {key}: {message}{hint}"
    return f"{key}: {message}" if key else message


def _wrong_shape(schema: DictConfig, layer: DictConfig, prefix: str = "") -> str | None:
    """The first key of a YAML layer whose value is a mapping where the schema has a list or a value, or a list or
    a value where it has a mapping or a list of sections (e.g. `heads: {type: dense}`), as a one-line message; None
    if none. (A list or a value where the schema has a value, e.g. a tuple, is OmegaConf's to check.)"""
    def kind(node: Any) -> str:
        return "a mapping" if isinstance(node, DictConfig) else "a list" if isinstance(node, ListConfig) else "a value"

    for key in layer.keys():
        if key not in schema or OmegaConf.is_missing(layer, key) or OmegaConf.is_missing(schema, key):
            continue  # unknown keys get OmegaConf's message, which names them
        want, got = schema._get_node(key), layer._get_node(key)
        if want is None or got is None or (not isinstance(want, (DictConfig, ListConfig)) and kind(got) != "a mapping"):
            continue
        if want._is_none() or got._is_none():
            continue
        if kind(want) != kind(got):
            value = "" if kind(got) != "a value" else f" ({OmegaConf.to_container(layer)[key]!r})"  # type: ignore[index]
            return (f"{prefix}{key} must be {kind(want)}, got {kind(got)}{value}" if kind(want) != "a value"
                    else f"{prefix}{key} must not be a mapping")
        if isinstance(want, DictConfig) and want._metadata.object_type is not dict:  # a section, not a free mapping
            if deeper := _wrong_shape(want, got, f"{prefix}{key}."):  # type: ignore[arg-type]
                return deeper
    return None


def _whole_layer(update: str) -> str:
    """`model.layer_heads.N=[...]` as `model.layer_heads={N: [...]}`: OmegaConf's dotted path cannot add the
    int key N (it would be the string "N"); the merge keeps the other layers' mixes."""
    match = re.fullmatch(r"model\.layer_heads\.([^.=]+)=(.*)", update, flags=re.DOTALL)
    return f"model.layer_heads={{{match[1]}: {match[2]}}}" if match else update


def _check_list_items(merged: DictConfig, key: str) -> None:
    """A one-line ConfigError if the dotted `key` indexes past the end of a list (`model.heads.5.count` with one
    head group): OmegaConf would try to create the item and fail with a message about types."""
    node: Any = merged
    for i, part in enumerate(key.split(".")):
        if isinstance(node, ListConfig) and part.isdigit() and int(part) >= len(node):
            where = ".".join(key.split(".")[:i])
            raise ConfigError(f"{key}: {where} has {len(node)} item(s), no item {part}; to add one, set the whole "
                              f"list ({where}=[...])")
        if isinstance(node, ListConfig) and part.isdigit():
            node = node[int(part)]
        elif isinstance(node, DictConfig) and (part in node or part.isdigit() and int(part) in node):
            node = node[part] if part in node else node[int(part)]  # layer_heads' keys are ints
        else:
            return


def _apply(merged: DictConfig, update: str) -> None:
    """One dotted update. Sections and mappings merge (`model.layer_heads.N=...` keeps the other layers), except
    a whole `model.layer_heads=...`, which replaces the YAML's per-layer mixes (`model.layer_heads={}` clears them)."""
    if "=" not in update:
        raise ConfigError(f"override {update!r} is not key=value (e.g. model.n_layers=4)")
    _check_list_items(merged, update.split("=", 1)[0])
    if update.startswith("model.layer_heads="):
        OmegaConf.update(merged, "model.layer_heads", OmegaConf.from_dotlist([update]).model.layer_heads, merge=False)
    else:
        merged.merge_with_dotlist([_whole_layer(update)])


def _apply_keyword(merged: DictConfig, key: str, value: Any) -> None:
    """One keyword update, a Python value, with `_apply`'s rules for model.layer_heads: one layer's mix
    (`model.layer_heads.N`, an int key) merges, the whole map replaces."""
    _check_list_items(merged, key)
    if match := re.fullmatch(r"model\.layer_heads\.(\d+)", key):
        OmegaConf.update(merged, "model.layer_heads", {int(match[1]): value}, merge=True)
    elif key == "model.layer_heads":
        OmegaConf.update(merged, key, OmegaConf.create(value), merge=False)
    else:
        OmegaConf.update(merged, key, value, merge=True)


def load_config(path: str | Path | None = None, *dotlist: str, warnings: bool = True, **overrides: Any) -> Config:
    """Defaults <- YAML file <- dotted CLI strings ("model.n_layers=4") <- keyword overrides
    (`model__n_layers=4` or `**{"model.n_layers": 4}`, Python values as they are), validated into a Config;
    `warnings=False` reads a config without printing its suspect settings (lm/sanity.py) again."""
    schema = OmegaConf.structured(Config)
    layers = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        top_level = f"{p}: the top level must be a mapping with sections model, data, optim, trainer"
        try:
            raw = yaml.safe_load(p.read_text())  # None: empty or only comments ({} asks for the defaults)
            if raw is not None and not isinstance(raw, dict):  # a scalar or a list: OmegaConf's errors misname it
                raise ConfigError(f"{top_level} (this file holds {'a list' if isinstance(raw, list) else 'one value'})")
            layer = OmegaConf.load(p)
        except ConfigError:
            raise
        except Exception as err:  # yaml.YAMLError has multi-line messages: the problem and its line
            where = getattr(err, "problem_mark", None)
            what = getattr(err, "problem", None) or type(err).__name__
            raise ConfigError(f"{p}: not valid YAML: {what}" + (f" (line {where.line + 1})" if where else "")) from None
        if not isinstance(layer, DictConfig):
            raise ConfigError(top_level)
        if raw is None:  # would train the defaults unasked
            raise ConfigError(f"{p}: the file sets nothing (empty, or only comments; {{}} to mean the defaults)")
        if wrong := _wrong_shape(schema, layer):  # OmegaConf's merge says neither the key nor the file
            raise ConfigError(f"{p}: {wrong}")
        _check_bools({f"{section}.{key}": value for section, fields in raw.items() if isinstance(fields, dict)
                      for key, value in fields.items()}, f"{p}: ")
        layers.append(layer)
    keywords = {k.replace("__", "."): str(v) if isinstance(v, Path) else v for k, v in overrides.items()}
    _check_bools({**dict(u.split("=", 1) for u in dotlist if "=" in u), **keywords})
    try:
        merged = OmegaConf.merge(schema, *layers)
        if merged.compression is None and any(u.startswith("compression.") for u in [*dotlist, *keywords]):
            merged.compression = CompressionConfig()  # `compression.x=...` switches the optional section on
        for update in dotlist:  # applied as updates, not merged as a layer, so list items work: model.heads.0.count=4
            _apply(merged, update)
        for key, value in keywords.items():
            _apply_keyword(merged, key, value)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        raise ConfigError(_one_line(err)) from None
    except ConfigError:
        raise
    except (ValueError, yaml.YAMLError) as err:  # an override that is not key=value or not valid YAML
        raise ConfigError(f"overrides {' '.join(dotlist)}: {' '.join(str(err).split())}") from None
    validate(cfg)
    for message in config_warnings(cfg) if warnings else []:
        warn(message)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_dict(values: dict) -> Config:
    """A Config from a plain dict (e.g. saved in a checkpoint, or read back from JSON, whose keys are strings:
    model.layer_heads' "1" is layer 1), validated."""
    model = values.get("model")
    if isinstance(model, dict) and isinstance(model.get("layer_heads"), dict):
        layers = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in model["layer_heads"].items()}
        values = {**values, "model": {**model, "layer_heads": layers}}
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(values)))
    except OmegaConfBaseException as err:
        raise ConfigError(_one_line(err)) from None
    return validate(cfg)  # type: ignore[arg-type]
