"""Reading the JSON files a sweep keeps (sweep.json, status.json, each point's metrics.json and leakfree.json):
a missing file gives the default, a damaged one a one-line ConfigError naming it, never a traceback."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from heads.base import ConfigError
from lm.run_files import read_json


POINT_KEYS = ("name", "config", "out_dir", "causal")  # what run_sweep and aggregate read of every point


def read_sweep(path: Path, keys: tuple[str, ...] = ("points",)) -> dict[str, Any]:
    """A sweep.json (flops/sweep.py) holding `keys`, whose `points` is a list of objects each with POINT_KEYS; a
    one-line ConfigError naming the first damaged point otherwise."""
    manifest = read_json(path, keys=keys)
    points = manifest["points"]
    if not isinstance(points, list):
        raise ConfigError(f"{path} is damaged (points is not a list); restore it or write it again with flops.sweep")
    vary = manifest.get("vary")  # a grid's `swept` (flops.sweep --sparsity with --vary, or --vary twice) is [x, vary]
    swept = manifest.get("swept")
    if "swept" in manifest and (not isinstance(swept, list) or len(swept) != 2
                                or not all(isinstance(k, str) for k in swept) or swept[1] != vary
                                or vary in ("sparsity", swept[0])):
        raise ConfigError(f"{path} is damaged (swept is not [<x>, <vary>]); restore it or write it again with "
                          "flops.sweep")
    x = swept[0] if isinstance(swept, list) else None  # a two-option grid's points are placed by their setting
    for i, point in enumerate(points):
        missing = [k for k in POINT_KEYS if not isinstance(point, dict) or k not in point]
        if missing:
            raise ConfigError(f"{path} is damaged (point {i} is not an object with {', '.join(missing)}); restore it "
                              "or write it again with flops.sweep")
        setting = point.get("setting", {})
        if not isinstance(setting, dict) or (x not in (None, "sparsity") and point.get("head") != "dense"
                                             and x not in setting):
            raise ConfigError(f"{path} is damaged (point {i}'s setting is not an object"
                              f"{f' holding {x}' if x not in (None, 'sparsity') else ''}); restore it or write it "
                              "again with flops.sweep")
    return manifest


def as_text(value: Any) -> str:
    """A swept value as written on the command line and in point names: 16, 1.5, true, quota."""
    return value if isinstance(value, str) else json.dumps(value)


def read_status(path: Path) -> dict[str, dict[str, Any]]:
    """A sweep's status.json (flops/run_sweep.py): point name -> {"status": ..., ...}; {} if it does not exist; a
    one-line ConfigError if it is damaged or an entry is not such an object."""
    status = read_json(path, {})
    bad = [name for name, entry in status.items() if not isinstance(entry, dict) or "status" not in entry]
    if bad:
        raise ConfigError(f"{path} is damaged (the entry of {bad[0]!r} is not an object with a status); "
                          "restore or delete it")
    return status


def point_results(out_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A point's metrics.json and leakfree.json ({} for a missing one); the leak-free result only if it evaluated
    the step metrics.json reports (a point trained further since has no leak-free result yet)."""
    metrics, leak_free = read_json(Path(out_dir) / "metrics.json", {}), read_json(Path(out_dir) / "leakfree.json", {})
    current = "step" in metrics and leak_free.get("step") == metrics["step"]
    return metrics, leak_free if current else {}
