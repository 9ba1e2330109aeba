"""IsoFLOP sweep configs (MoSA Sec. 3, Fig. 3): one FLOP-matched training config per (head type, sparsity), per
(head type, value of another option) with --vary, per (head type, sparsity, value) with both, or per (head type,
value, value) with --vary twice.

    python -m flops.sweep --size micro --heads local --vary window=16,32,64 --dense-heads 2 --out sweeps/windows
    python -m flops.sweep --size micro --heads mosa --sparsity 1,4,8 --vary capacity_factor=1,2 --out sweeps/grid
    python -m flops.sweep --size micro --heads mosa --vary capacity_factor=1,2 --vary selection=threshold,quota \\
        --out sweeps/grid2
    python -m flops.sweep --size tiny --heads mosa,fixed,routing --sparsity 1,2,4,8,16,32,64,128,256 \\
        --out sweeps/tiny [--base configs/tiny.yaml] [--dense-heads 4] [--with local:2:window=128] \\
        [--option mosa.selection=expert_choice] [--seeds 3] [data.path=data/c4 trainer.max_steps=2000 ...]

Each point is the base config (defaults <- --base YAML <- dotted overrides) with the model shape of
`--size` (or the base's own shape with `--size base`; a preset size refuses a config that sets another shape)
and the head mix solved by flops.isoflop (`--dense-heads` dense heads, the `--with` groups, and the sparse heads);
sparsity 1 is the dense baseline, written once as `dense_s1`. `--vary KEY=V1,V2,...` alone sweeps another option of
the sparse heads instead (local `window`, MiTA `k`, MoSA `capacity_factor`, ...; positive numbers, the x axis), one
point `<head>_<KEY><V>` per value, and always writes `dense_s1`; with `--sparsity` it is a grid: one point
`<head>_s<RHO>_<KEY><V>` per (sparsity > 1, value), `dense_s1` only if 1 is listed, and the values may be any of
the option's (`selection=threshold,quota,predictor`: a curve each over sparsity). `--vary` twice, without
`--sparsity`, is a grid of two options: the first (positive numbers) is the x axis, the second's values (any) are
the curves, one point `<head>_<KEY1><V1>_<KEY2><V2>` per pair, and `dense_s1` as a line. `--seeds N` writes N replicas
of every point (`<name>_seed<S>`, trainer.seed = S = base seed + 0..N-1), aggregated as mean ± std. Writes
`<out>/<name>.yaml` (trainer.out_dir = `<out>/runs/<name>`) and `<out>/sweep.json`: `vary` (the last --vary's KEY,
else sparsity), a grid's `swept` ([sparsity, KEY] or [KEY1, KEY2]: x axis, then curves), and the list of points with
their sparsity, `value` (of `vary`), `setting` (the value of every swept option), FLOPs, KV entries, parameters and
causality. Train them with `python -m flops.run_sweep <out>`.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from flops.cli import comma_list, command_line, positive_int, script_parser
from flops.isoflop import option_names, parse_group, parse_options, solve
from flops.json_files import as_text
from flops.presets import SIZES, baseline
from heads.base import ConfigError
from lm.config import Config, HeadGroupConfig, ModelConfig, validate
from lm.config_io import load_config, to_yaml
from lm.model import build_model
from lm.run_dir import result_changes


def is_causal(cfg: Config) -> bool:
    """Whether every head group of the model is causal (built on the meta device: no memory)."""
    with torch.device("meta"):
        return build_model(cfg.model).causal


def sweep_points(
    cfg: Config, heads: list[str], swept: dict[str, list[Any]], out: Path, dense_heads: int = 4,
    options: dict[str, dict[str, Any]] | None = None, seeds: int = 1, keep: list[HeadGroupConfig] | None = None,
) -> list[tuple[Config, dict[str, Any]]]:
    """(config, manifest entry) of every point and replica; cfg.model must be the dense baseline; `swept`: the values
    of the swept options of the sparse heads, {"sparsity": [...]}, {KEY: [...]}, or two of them (sparsity first: a
    grid, one point per combination); the dense baseline (sparsity 1) is written when 1 is listed or sparsity is not
    swept;
    `keep`: head groups kept in every sparse point next to the dense heads (flops.isoflop.solve)."""
    if seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {seeds}")
    options = options or {}
    for head in heads:  # checked here: with --sparsity 1 alone no point of `head` is solved
        check_swept(head, list(swept), options.get(head, {}))
    unused = sorted(set(options) - set(heads))
    if unused:
        raise ConfigError(f"--option for {', '.join(unused)}, which is not in --heads {','.join(heads)}")
    if swept.get("sparsity") == [1]:
        if keep:
            raise ConfigError("--with keeps head groups in the sparse points; --sparsity 1 alone writes only the dense "
                              "baseline, which has none")
        if len(swept) > 1:
            raise ConfigError(f"--vary {list(swept)[1]} with --sparsity 1 alone: sparsity 1 is the dense baseline, "
                              "which has no sparse heads to vary; add sparsities > 1")
    points = []
    wanted = [("dense", {"sparsity": 1})] if 1 in swept.get("sparsity", [1]) else []
    settings = [dict(zip(swept, combo)) for combo in itertools.product(*swept.values())]
    wanted += [(head, setting) for head in heads for setting in settings if setting.get("sparsity") != 1]
    for (head, setting), replica in itertools.product(wanted, range(seeds)):
        if head == "dense":
            r = solve(cfg.model, head, 1, dense_heads)
        else:
            others = {k: v for k, v in setting.items() if k != "sparsity"}
            r = solve(cfg.model, head, setting.get("sparsity"), dense_heads, {**options.get(head, {}), **others},
                      keep or [])
            if not r.sparse_heads:  # sparsity 1 (an --option, or the type's default): solve's baseline itself
                raise ConfigError(f"{head} heads at sparsity 1 are the dense baseline itself, not a sparse point: give "
                                  f"--option {head}.sparsity=RHO with RHO > 1")
        seed = cfg.trainer.seed + replica
        name = point_name(head, setting) + (f"_seed{seed}" if seeds > 1 else "")
        point = dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, heads=[HeadGroupConfig(**g) for g in r.heads]),
            trainer=dataclasses.replace(cfg.trainer, out_dir=str(out / "runs" / name), seed=seed),
        )
        validate(point)
        entry = {
            "name": name, "head": head, "sparsity": r.sparsity, "value": setting.get(list(swept)[-1]), "seed": seed,
            "setting": {k: v for k, v in setting.items() if k in swept},
            "config": str(out / f"{name}.yaml"), "out_dir": point.trainer.out_dir, "causal": is_causal(point),
            "mix": point.model.mix_text(),
            **{k: getattr(r, k) for k in ("k", "dense_heads", "sparse_heads", "flops_per_pass",
                                          "baseline_flops_per_pass", "kv_total", "params", "warning")},
        }
        points.append((point, entry))
    return points


def check_swept(head: str, keys: list[str], options: dict[str, Any]) -> None:
    """ConfigError unless sparse head type `head` has every swept option `keys` and --option sets none of them."""
    if head == "dense":
        raise ConfigError("--heads lists the sparse types; dense is every sweep's baseline (its sparsity-1 point, "
                          "dense_s1)")
    fields = option_names(head)
    for key in reversed(keys):  # a grid's --vary key first: the hint for its missing sparsity sweeps that key alone
        if key in fields:
            if key in options:
                raise ConfigError(f"--option {head}.{key} conflicts with the swept values of {key}")
        elif key != "sparsity":
            raise ConfigError(f"--vary {key}: {head} heads have no option {key} (their options: {', '.join(fields)})")
        elif len(keys) > 1:
            raise ConfigError(f"--sparsity with --vary: {head} heads have no sparsity (their options: "
                              f"{', '.join(fields)}); sweep {keys[-1]} alone, without --sparsity")
        else:
            raise ConfigError(f"flops.sweep varies sparsity, which {head} heads do not have (their options: "
                              f"{', '.join(fields)}); sweep one of their options with --vary KEY=V1,V2,... or FLOP-match "
                              f"one setting with `python -m flops.isoflop --head {head} --option KEY=VALUE`")


def point_name(head: str, setting: dict[str, Any]) -> str:
    """'dense_s1', 'mosa_s4', 'local_window16', 'mosa_s4_capacity_factor2', 'mosa_s4_selectionquota',
    'mosa_capacity_factor1_selectionquota' (before any _seed<S>)."""
    if head == "dense":
        return "dense_s1"
    return "_".join([head, *(f"s{v}" if k == "sparsity" else f"{k}{as_text(v)}" for k, v in setting.items())])


SHAPE = ("n_layers", "d_model", "head_dim", "seq_len")  # the model fields a preset --size sets, besides the heads


def preset_conflicts(size: str, model: ModelConfig, base: str | None, overrides: list[str]) -> None:
    """ConfigError if the --base YAML or an override sets a model shape field to another value than the preset
    `size`, which would replace it silently. (The head mix is the sweep's own in any case.)"""
    given = set((yaml.safe_load(Path(base).read_text()) or {}).get("model") or {}) if base else set()
    given |= {o.split("=", 1)[0].removeprefix("model.") for o in overrides if o.startswith("model.")}
    for name in SHAPE:
        if name in given and getattr(model, name) != SIZES[size][name]:
            raise ConfigError(f"model.{name}={getattr(model, name)} conflicts with --size {size} "
                              f"({name}={SIZES[size][name]}); drop it, or pass --size base to sweep the config's own shape")


def stale_run(point: Config, out: Path) -> None:
    """ConfigError if `out` holds a run of another config than `point` (an earlier sweep into the same --out; other in
    more than how long it trains, lm.run_dir.result_changes): run_sweep would skip it as finished and the aggregate
    would report it under this point's settings."""
    changes = result_changes(out, point)
    if changes:
        raise ConfigError(f"{out} holds a run of another config ({'; '.join(changes)}): an earlier sweep into this "
                          "--out; use a new --out or delete that run directory")


def _options(texts: list[str]) -> dict[str, dict[str, Any]]:
    """['mosa.selection=expert_choice'] -> {'mosa': {'selection': 'expert_choice'}} (flops.isoflop.parse_options per
    head: JSON values, a key given twice with different values refused)."""
    grouped: dict[str, list[str]] = {}
    for text in texts:
        if "=" not in text or "." not in text.split("=", 1)[0]:
            raise ConfigError(f"--option expects head.key=value, got {text!r}")
        head, option = text.split(".", 1)
        grouped.setdefault(head, []).append(option)
    return {head: parse_options(options) for head, options in grouped.items()}


def varied(text: str) -> tuple[str, list[Any]]:
    """argparse type of --vary: 'window=32,64,128' -> ('window', [32, 64, 128]), 'selection=threshold,quota' ->
    ('selection', ['threshold', 'quota']): JSON values where they parse (a whole number is an int: the point's name and
    YAML value), text otherwise; none repeated, none null or non-finite. Alone, --vary needs positive numbers
    (`numeric`); the head type's Options check the values."""
    key, _, values = text.partition("=")
    if key == "sparsity":
        raise argparse.ArgumentTypeError("sparsity is swept with --sparsity (where 1 is the dense baseline)")
    parsed = [] if not key or not values else [_value(v) for v in values.split(",")]
    if not parsed or None in parsed or len(set(map(repr, parsed))) < len(parsed):
        raise argparse.ArgumentTypeError(f"expected KEY=V1,V2,... with distinct values, got {text!r}")
    return key, parsed


def _value(text: str) -> Any:
    """'64' -> 64, '1.25' -> 1.25, '1e1' -> 10, 'true' -> True, 'quota' -> 'quota'; None for '', null, nan and inf."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text or None
    if isinstance(value, float) and not math.isfinite(value) or not isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)  # (1e300 stays a float)
    return value


def numeric(values: list[Any]) -> bool:
    """Whether swept values can be an x axis (log scale): positive numbers, not booleans."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values)


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, "python -m flops.sweep")
    p.add_argument("--size", default="tiny", help=f"dense baseline: {', '.join(SIZES)}, or 'base' (the --base model)")
    p.add_argument("--heads", required=True, type=comma_list(str),
                   help="comma-separated sparse head types, e.g. mosa,fixed,routing")
    p.add_argument("--sparsity", type=comma_list(positive_int), help="comma-separated rho values; 1 = the dense baseline")
    p.add_argument("--vary", type=varied, action="append", metavar="KEY=V1,V2,...",
                   help="another option of the sparse heads and its values, e.g. window=32,64,128; alone (positive "
                        "numbers), the dense baseline is always written; with --sparsity, a point per (sparsity, value), "
                        "any values, e.g. selection=threshold,quota; twice without --sparsity, a point per pair of "
                        "values: the first (positive numbers) on the x axis, a curve per value of the second")
    p.add_argument("--dense-heads", type=int, default=4, help="dense heads kept in every sparse model (0 = pure)")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--base", help="base YAML config (data, optim, trainer, vocab)")
    p.add_argument("--option", action="append", default=[], metavar="HEAD.KEY=VALUE", help="head option, repeatable")
    p.add_argument("--with", dest="keep", action="append", default=[], metavar="TYPE:COUNT[:KEY=VALUE,...]",
                   help="another head group kept in every sparse point next to the dense heads, e.g. local:2:window=128")
    p.add_argument("--seeds", type=int, default=1, help="replicas of every point (trainer.seed, seed+1, ...)")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the base config, e.g. trainer.max_steps=500")
    a = p.parse_args(argv)
    if not (a.sparsity or a.vary):
        p.error("one of the arguments --sparsity --vary is required")
    vary = a.vary or []
    if len(vary) > 2 or (a.sparsity and len(vary) > 1):
        p.error("a sweep has at most two axes: --sparsity and one --vary, or two --vary without --sparsity")
    if len(vary) == 2 and vary[0][0] == vary[1][0]:
        p.error(f"--vary {vary[0][0]} given twice: give its values once, --vary {vary[0][0]}=V1,V2,...")
    if vary and not a.sparsity and not numeric(vary[0][1]):
        second = ("put it second: the second --vary's values may be any, a curve each" if len(vary) == 2
                  else "with --sparsity, any values of the option: a curve each over sparsity")
        role = "first of two" if len(vary) == 2 else "alone"
        p.error(f"--vary {vary[0][0]}: {role}, its values are the x axis and must be positive numbers, got "
                f"{','.join(map(as_text, vary[0][1]))} ({second})")
    swept = {"sparsity": a.sparsity} if a.sparsity else {}  # the first swept option is the x axis
    swept.update(dict(vary))
    try:
        cfg = load_config(a.base, *a.overrides)
        size = None if a.size == "base" else a.size
        if size in SIZES:
            preset_conflicts(size, cfg.model, a.base, a.overrides)
        cfg = dataclasses.replace(cfg, model=baseline(size, cfg.model))
        if a.out.exists() and not a.out.is_dir():
            raise ConfigError(f"--out {a.out} is a file, not a directory")
        a.out = a.out.resolve()  # run_sweep trains from the repository root: absolute config, run and data paths
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(Path(cfg.data.path).resolve())))
        points = sweep_points(cfg, a.heads, swept, a.out, a.dense_heads, _options(a.option), a.seeds,
                              [parse_group(g) for g in a.keep])
        for point, entry in points:
            stale_run(point, Path(entry["out_dir"]))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not (Path(cfg.data.path) / "index.json").is_file():  # planned before the data exists is fine; trained, not
        print(f"warning: data.path {cfg.data.path} holds no prepared data (index.json) yet: flops.run_sweep needs it",
              file=sys.stderr)
    a.out.mkdir(parents=True, exist_ok=True)
    for point, entry in points:
        Path(entry["config"]).write_text(to_yaml(point))
    manifest = {"size": a.size, "vary": list(swept)[-1], **({"swept": list(swept)} if len(swept) > 1 else {}),
                "dense_heads": a.dense_heads, "seeds": a.seeds, "command": command_line(["-m", "flops.sweep"], argv),
                "points": [entry for _, entry in points]}
    (a.out / "sweep.json").write_text(json.dumps(manifest, indent=1))
    width = max(len(e["mix"]) for e in manifest["points"]) + 2
    names = max(len(e["name"]) for e in manifest["points"])
    for e in manifest["points"]:
        print(f"{e['name']:>{names}}: {e['mix']:<{width}}"
              f"{e['flops_per_pass'] / e['baseline_flops_per_pass']:.4f} of the FLOP budget  -> {e['config']}")
        if e["warning"]:
            print(f"warning: {e['name']}: {e['warning']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
