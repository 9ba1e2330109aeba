"""Configs in and out: YAML files and dotted overrides -> a validated Config (`load_config`), a Config -> YAML
(`to_yaml`), a plain dict (a checkpoint's, a run record's) -> a validated Config (`from_dict`).

`load_config(path, *dotlist, **overrides)` merges the YAML over the dataclass defaults of lm/config.py, then
dotted overrides (`model.n_layers=4`, the same syntax as on the `train_lm.py` command line), checks types and
unknown keys (OmegaConf) and values (lm/config.py `validate`). Every problem is a one-line ConfigError naming the
field; settings that are valid but suspect (lm/sanity.py) print one-line warnings.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, KeyValidationError, OmegaConfBaseException

from heads import ConfigError
from lm.config import CompressionConfig, Config, HeadGroupConfig, validate
from lm.sanity import config_warnings, warn


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


def _tuple_keys(cls: type) -> dict[str, int]:
    """Dotted keys of the sections' tuple-of-numbers fields (optim.betas) -> their length."""
    return {f"{section}.{name}": len(typing.get_args(hint))
            for section, inner in typing.get_type_hints(cls).items() if dataclasses.is_dataclass(inner)
            for name, hint in typing.get_type_hints(inner).items() if typing.get_origin(hint) is tuple}


BOOL_KEYS = _bool_keys(Config)  # OmegaConf reads any integer there as a bool (trainer.compile=2 is true): refused
TUPLE_KEYS = _tuple_keys(Config)  # a YAML file's nested value there passed the merge; a bad one had no key named


def _check_values(values: dict[str, Any], where: str = "") -> None:
    """ConfigError unless every value given for a bool field is a bool (YAML true/false, yes/no) and every value for
    a tuple field a list of that many numbers."""
    for key, value in values.items():
        if isinstance(value, str):
            with contextlib.suppress(yaml.YAMLError):
                value = yaml.safe_load(value)
        if key.rpartition(".")[0] in TUPLE_KEYS:  # optim.betas.0=0.95: OmegaConf said "TupleConfig is immutable"
            raise ConfigError(f"{key}: set the whole list, {key.rpartition('.')[0]}=[...] with "
                              f"{TUPLE_KEYS[key.rpartition('.')[0]]} numbers")
        if str(value).startswith("${"):  # an interpolation: checked as what it resolves to
            continue
        if key in BOOL_KEYS and not isinstance(value, bool):
            raise ConfigError(f"{where}{key} must be true or false, got {value!r}")
        numbers = isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        if key in TUPLE_KEYS and not (numbers and len(value) == TUPLE_KEYS[key]):
            raise ConfigError(f"{where}{key} must be a list of {TUPLE_KEYS[key]} numbers, got {value!r}")


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


def _kind(node: Any) -> str:
    return "a mapping" if isinstance(node, DictConfig) else "a list" if isinstance(node, ListConfig) else "a value"


def _wrong_shape(schema: DictConfig, layer: DictConfig, prefix: str = "") -> str | None:
    """The first key of a YAML layer whose value is a mapping where the schema has a list or a value, or a list or
    a value where it has a mapping or a list of sections (e.g. `heads: {type: dense}`), as a one-line message; None
    if none. (A list or a value where the schema has a value, e.g. a tuple, is OmegaConf's to check.)"""
    for key in layer.keys():
        if key not in schema or OmegaConf.is_missing(layer, key) or OmegaConf.is_missing(schema, key):
            continue  # unknown keys get OmegaConf's message, which names them
        want, got = schema._get_node(key), layer._get_node(key)
        if want is None or got is None or (not isinstance(want, (DictConfig, ListConfig)) and _kind(got) != "a mapping"):
            continue
        if want._is_none() and dataclasses.is_dataclass(want._metadata.ref_type):  # an optional section, off by default
            want = OmegaConf.structured(want._metadata.ref_type)
        if got._is_none() and not want._is_optional():
            return f"{prefix}{key} must be {_kind(want)}, got null"
        if want._is_none() or got._is_none():
            continue
        if _kind(want) != _kind(got):
            value = "" if _kind(got) != "a value" else f" ({OmegaConf.to_container(layer)[key]!r})"  # type: ignore[index]
            return (f"{prefix}{key} must be {_kind(want)}, got {_kind(got)}{value}" if _kind(want) != "a value"
                    else f"{prefix}{key} must not be a mapping")
        if isinstance(want, DictConfig) and want._metadata.object_type is not dict:  # a section, not a free mapping
            if deeper := _wrong_shape(want, got, f"{prefix}{key}."):  # type: ignore[arg-type]
                return deeper
        elif wrong := _wrong_items(want._metadata.element_type, got, f"{prefix}{key}"):  # model.heads, layer_heads
            return wrong
    return None


def _wrong_items(element: Any, got: Any, where: str) -> str | None:
    """The first item of a YAML list or free mapping `got` whose shape is not that of `element`, the schema's item
    type, when that is a section (a head group) or a list of sections (a layer's mix), as `_wrong_shape` says it
    (e.g. `model.heads[0].options must be a mapping, got a list`); None otherwise."""
    if not (dataclasses.is_dataclass(element) or typing.get_origin(element) is list):
        return None
    items = enumerate(got) if isinstance(got, ListConfig) else got.items()
    for k, item in items:
        here = f"{where}[{k}]" if isinstance(got, ListConfig) else f"{where}.{k}"
        want = "a mapping" if dataclasses.is_dataclass(element) else "a list"
        if _kind(item) != want:
            return f"{here} must be {want}, got {_kind(item)}" + (f" ({item!r})" if _kind(item) == "a value" else "")
        wrong = (_wrong_shape(OmegaConf.structured(element), item, f"{here}.") if want == "a mapping"
                 else _wrong_items(typing.get_args(element)[0], item, here))
        if wrong:
            return wrong
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
        if missing := sorted(OmegaConf.missing_keys(layer)):  # the merge would keep the defaults' values silently
            raise ConfigError(f"{p}: {missing[0]} is ??? (missing): give it a value, or leave it out for the default")
        _check_values({f"{section}.{key}": value for section, fields in raw.items() if isinstance(fields, dict)
                       for key, value in fields.items()}, f"{p}: ")
        layers.append(layer)
    keywords = {k.replace("__", "."): str(v) if isinstance(v, Path) else v for k, v in overrides.items()}
    _check_values({**dict(u.split("=", 1) for u in dotlist if "=" in u), **keywords})
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
