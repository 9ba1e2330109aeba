"""The head-group contract (see ../shared/DESIGN.md, "The head-group contract").

A head group is `count` attention heads of one type. It maps x[B, T, h] (already layer-normed) and
the tokens' original positions[B, T] to y[B, T, h], the *summed* contribution of its heads with
their output projections applied, so the groups of a layer simply add (MoSA eq. 3).

Each head type is one file under heads/ defining
- an `Options` dataclass (subclass of HeadOptions) with its per-type settings, validated once at
  config load by `validate(ctx)`, `kv_per_head(seq_len)`: KV-cache entries one head keeps (the only
  statement of them; flops/ reads it too), and `example()` / `grid()`: the options the shared tests use;
- a HeadGroup subclass registered under the type's config name with `@register("name")`,
  implementing `forward_reference` (plain, readable, explicit masks) and, where speed needs it,
  `forward_fast`; `forward` dispatches on `options.impl`.
Groups report `aux_losses` (name -> scalar tensor, already weighted, added to the LM loss) and
`stats` (name -> detached tensor, 0-d or per head [H]) after each forward pass, and declare `causal`
honestly. State moved by training batches (MoSA's running threshold, Routing's k-means centroids) never moves
inside the forward pass: a training forward pass stages its batch statistics (where `updates_state` says so: in
training, and not while a forward pass is replayed, as activation checkpointing's recomputation does,
`frozen_state`), into a `routing.staged.StagedStatistics`, and `commit_states`, which the trainer calls once after
every optimizer step (lm/module.py), applies them. So every micro-batch of a step sees the same state, a replayed pass takes the original's decisions, a
compiled graph's backward never reads state its forward moved (routing/kmeans.py), and DDP reduces the statistics
once per step, outside the forward pass (routing/distributed.py). Stats stay tensors (no host sync in the forward
pass, so training compiles with fullgraph=True); lm/module.py reads them only every `trainer.log_every` steps.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from heads.rope import RotaryEmbedding
from routing.staged import StagedStatistics


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the field and what is allowed."""


@dataclass(frozen=True)
class GroupContext:
    """Model-level facts every head group is built from."""

    d_model: int  # h, the residual width
    head_dim: int  # h', the per-head width
    seq_len: int  # T, the training sequence length
    rope_fraction: float = 0.5
    rope_base: float = 10000.0
    layer: int = 0


@dataclass
class HeadOptions:
    """Options common to every head type. Subclasses add their own fields with defaults."""

    impl: str = "fast"  # "fast" (batched / fused kernels) or "reference" (plain readable code)

    @classmethod
    def example(cls) -> dict[str, Any]:
        """Small valid options that fit the shared tests' tiny models (seq_len >= 32), as a config's dict. A type
        with options of its own defines it (tests/test_head_contract_random.py fails until it does). Its blocks,
        strides and windows divide 960: tests/test_rope.py shifts every position by 960 and expects the same output."""
        return {}

    @classmethod
    def grid(cls) -> dict[str, list[Any]]:
        """Option -> values the random contract test draws from, edge values included (window 1, k > T, ...).
        A type with options of its own defines it, next to example()."""
        return {}

    @property
    def causal(self) -> bool:
        """Whether heads with these options are causal: outputs at position t depend only on inputs at positions
        <= t. False only for a paper's faithful, non-causal rule kept behind an option."""
        return True

    def validate(self, ctx: GroupContext) -> None:
        """Raise ConfigError (one line) for values that cannot work with this context."""
        if self.impl not in ("fast", "reference"):
            raise ConfigError(f"impl must be 'fast' or 'reference', got {self.impl!r}")

    def validate_length(self, head: str, seq_len: int) -> None:
        """Raise ConfigError (one line) for options of `head` heads that a model trained on length-T sequences
        would waste (checked at config load only: a built group must still run on sequences shorter than that,
        where they are clamped). Here: a sparsity rho > T (k = T / rho below one token per head); types with
        other sizes extend it."""
        sparsity = getattr(self, "sparsity", None)
        if sparsity is not None and sparsity > seq_len:
            raise ConfigError(f"{head}: options.sparsity = {sparsity} > model.seq_len {seq_len}")

    def at_most(self, head: str, name: str, seq_len: int, otherwise: str) -> None:
        """validate_length's check that options.<name> <= T, where the head would degenerate (`otherwise`)."""
        value = getattr(self, name)
        if value > seq_len:
            raise ConfigError(f"{head}: options.{name} = {value} > model.seq_len {seq_len}: {otherwise}")

    def validate_count(self, count: int) -> None:
        """Raise ConfigError (one line) if these options cannot work with `count` heads (checked at config load
        and when a group is built)."""

    def kv_per_head(self, seq_len: int) -> int:
        """KV-cache entries (tokens with a stored key and value) one head keeps for a length-T
        sequence (MoSA Table 2's definition). Dense heads keep all T."""
        return seq_len

    def advice(self, count: int) -> str | None:
        """A one-line warning when these options with `count` heads run but waste their compute
        (warned at config load, printed by the IsoFLOP solver and the sweep); None when fine."""
        return None


_FROZEN = [0]  # depth of nested `frozen_state` blocks


@contextmanager
def frozen_state() -> Iterator[None]:
    """Forward passes inside move no head state: for replaying a forward pass whose update already happened.
    Nestable: the state stays frozen until the outermost block ends."""
    _FROZEN[0] += 1
    try:
        yield
    finally:
        _FROZEN[0] -= 1


def commit_states(module: nn.Module, keep: bool = True) -> None:
    """Apply the state updates staged under `module` (every routing.staged.StagedStatistics in it): call it after
    each optimizer step of a training loop (lm/module.py; the benchmarks' own loops). keep=False drops them
    instead, for a step that is skipped (lm/nonfinite.py)."""
    for state in module.modules():
        if isinstance(state, StagedStatistics):
            state.commit(keep)


class HeadGroup(nn.Module):
    """Base class of all head groups. Subclasses set `Options` and implement forward_reference."""

    type_name: ClassVar[str] = ""
    Options: ClassVar[type[HeadOptions]] = HeadOptions
    # What the group's decoding does past the training length (lm/generate.py says it before generating there);
    # every type with a KV cache states its own (tests/test_generate.py), "" for those without one.
    beyond_training: ClassVar[str] = ""

    def __init__(self, ctx: GroupContext, count: int, options: HeadOptions) -> None:
        super().__init__()
        if count < 1:
            raise ConfigError(f"{self.type_name}: head count must be >= 1, got {count}")
        options.validate_count(count)
        self.ctx, self.count, self.options = ctx, count, options
        self.rope = RotaryEmbedding(ctx.head_dim, ctx.rope_fraction, ctx.rope_base)
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.stats: dict[str, torch.Tensor] = {}

    @property
    def causal(self) -> bool:
        """Whether outputs at position t depend only on inputs at positions <= t (HeadOptions.causal)."""
        return self.options.causal

    @property
    def updates_state(self) -> bool:
        """Whether this forward pass moves the group's batch-statistics state: in training, outside `frozen_state`."""
        return self.training and not _FROZEN[0]

    def own_loss_parameters(self) -> list[nn.Parameter]:
        """Parameters trained by an auxiliary loss of their own only: no gradient of the LM loss reaches them and
        theirs reaches nothing else (MoSA's membership predictor). lm/module.py clips them apart, so that their
        gradient does not scale the LM's through the global clipping norm."""
        return []

    def kv_entries(self, seq_len: int) -> int:
        """KV-cache entries of the whole group for a length-T sequence."""
        return self.count * self.options.kv_per_head(seq_len)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Any = None) -> torch.Tensor:
        """x[B, T, h], positions[B, T] (original token positions) -> y[B, T, h], T >= 1."""
        if x.shape[1] == 0:  # routers reduce over T, blocked paths divide it: refused for every type alike
            raise ValueError(f"{self.type_name}: empty sequence (T = 0); give at least one token")
        if cache is not None:
            return self.forward_cached(x, positions, cache)
        if self.options.impl == "reference":
            return self.forward_reference(x, positions)
        return self.forward_fast(x, positions)

    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{self.type_name}: forward_reference is missing (every head type defines it: "
                                  "the plain implementation of its paper's equations)")

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Defaults to the reference; head types with a faster path override it."""
        return self.forward_reference(x, positions)

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """Incremental decoding with a KV cache (lm/generate.py): the first call on a fresh cache is the
        prefill (any length), later calls decode one token each. Types that support it override."""
        raise NotImplementedError(f"head type {self.type_name!r} does not support KV-cached decoding")

    def new_cache(self, batch: int, max_len: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> Any:
        """An empty decoding cache for `batch` sequences of up to max_len tokens; it has `fresh` (nothing written
        yet), `batch`, `nbytes()` (allocated bytes), `entries()` (key/value entries stored) and `capacity()` (slots
        allocated)."""
        raise NotImplementedError(f"head type {self.type_name!r} does not support KV-cached decoding")


REGISTRY: dict[str, type[HeadGroup]] = {}


def register(name: str):
    """Class decorator: make a HeadGroup subclass available under config name `name`."""

    def wrap(cls: type[HeadGroup]) -> type[HeadGroup]:
        if name in REGISTRY:
            raise RuntimeError(f"head type {name!r} registered twice")
        _check_decoding(name, cls)
        cls.type_name = name
        REGISTRY[name] = cls
        return cls

    return wrap


def _check_decoding(name: str, cls: type[HeadGroup]) -> None:
    """A class with attention of its own must not decode with a parent's: a subclass of DenseHeads that defines
    forward_reference / forward_fast but inherits DenseHeads' forward_cached would decode as dense attention, silently
    unlike its forward. It defines forward_cached, or refuses to decode with HeadGroup's forward_cached and
    new_cache. RuntimeError (a programming error, at import) otherwise."""
    own = sorted({"forward_reference", "forward_fast"} & vars(cls).keys())
    decoder = next(c for c in cls.__mro__ if "forward_cached" in vars(c))
    if own and decoder not in (cls, HeadGroup):
        raise RuntimeError(f"head type {name!r}: {cls.__name__} defines {' and '.join(own)} but would decode with "
                           f"{decoder.__name__}.forward_cached; define forward_cached (and new_cache for another cache), "
                           f"or set both to HeadGroup's to refuse decoding")
    if (cls.forward_cached is HeadGroup.forward_cached) != (cls.new_cache is HeadGroup.new_cache):
        raise RuntimeError(f"head type {name!r}: {cls.__name__} must both decode (forward_cached and new_cache) or "
                           f"refuse to (neither)")


def head_class(name: str) -> type[HeadGroup]:
    """The registered HeadGroup class for a config name, or a one-line ConfigError."""
    if name not in REGISTRY:
        raise ConfigError(f"unknown head type {name!r}; known types: {', '.join(sorted(REGISTRY))} (a new type is a "
                          "@register class in heads/<type>.py, imported in heads/__init__.py)")
    return REGISTRY[name]


def _typed(name: str, key: str, value: Any, kind: type) -> Any:
    """`value` checked against the option's declared type (int, float, str or bool); an int is a valid
    float, an integral float (4.0, from JSON/YAML) a valid int, a float must be finite (YAML's .nan and .inf
    pass every `x <= 0` check); anything else is a one-line ConfigError."""
    if kind not in (int, float, str, bool):  # richer annotations are left to the type's own validate()
        return value
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"head type {name!r}: option {key} must be a finite number, got {value!r}")
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise ConfigError(f"head type {name!r}: option {key} must be {'an' if kind is int else 'a'} {kind.__name__}, "
                      f"got {value!r}")


def make_options(name: str, values: dict[str, Any], ctx: GroupContext) -> HeadOptions:
    """Build and validate the Options of head type `name` from a plain dict (from YAML), each value
    type-checked against the field's declared type."""
    cls = head_class(name).Options
    types = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"head type {name!r}: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
        )
    opts = cls(**{k: _typed(name, k, v, types[k]) for k, v in values.items()})
    try:
        opts.validate(ctx)
    except ConfigError as err:  # name the head type where the check itself did not
        raise ConfigError(str(err) if str(err).startswith(f"{name}:") else f"{name}: {err}") from None
    return opts
