"""A run directory (`trainer.out_dir`) owns one run, and records what that run is.

At start, `claim` writes into the directory
    config.yaml       the resolved run config (defaults <- YAML <- overrides), as trained
    run.json          data.path (absolute), the data's fingerprint and tokenizer hash, the command
    tokenizer.model   a copy of the data's SentencePiece model (when the data has one)
and refuses, with one line, a directory that already holds a run: `--resume` continues it (after
checking that config, tokenizer and data are the run's own), `--overwrite` deletes that run's outputs
and starts again. `provenance` is what every checkpoint carries besides the config (lm/module.py), so
that it can be evaluated and decoded on another machine: the data hashes and the tokenizer's bytes.
"""
from __future__ import annotations

import functools
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from data_prep.atomic import atomic_write
from heads import ConfigError
from lm.config import Config
from lm.config_io import to_yaml
from lm.errors import DataError
from lm.resume_settings import reported_here
from lm.run_files import read_json, read_run_config

CONFIG, RECORD, TOKENIZER = "config.yaml", "run.json", "tokenizer.model"
CHUNK = 1 << 20  # bytes read from each end of a shard for the data fingerprint
# What a run writes into its directory (the only things --overwrite deletes; train.log is the sweep's).
OUTPUTS = ("checkpoints", "tb", "profile", "metrics.json", "val_curve.png", "leakfree.json", CONFIG, RECORD, TOKENIZER)
# Fields a resumed run may change (each change is printed): how long, how often, on what hardware (the strategy
# within a kind of checkpoint: lm/train.resume_path refuses DeepSpeed's directories elsewhere and files under it), the
# optimiser's settings and the batch size (lm/resume_settings.py applies those); not the model, the seed,
# validation or trainer.accumulate_grad_batches (Lightning's restored loop counts micro-batches, so the
# accumulation windows would no longer start at step boundaries).
# data.path may move: the data's hash is checked instead. A section named None: any of its fields.
RESUMABLE: dict[str, set[str] | None] = {
    "trainer": {"max_steps", "max_minutes", "val_every", "validate_first", "ckpt_every", "log_every", "keep_last_k", "precision",
                "accelerator", "devices", "num_nodes", "strategy", "out_dir", "compile", "activation_checkpointing", "max_bad_steps",
                "deterministic", "profiler"},
    "optim": None,
    "data": {"path", "num_workers", "batch_size"},
}


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def data_fingerprint(data: Path, index: dict[str, Any]) -> str:
    """sha256 over index.json and, for every shard it lists, its size and its first and last MiB:
    cheap on a corpus of any size, and different for data prepared again (other tokens, other split)."""
    h = hashlib.sha256((data / "index.json").read_bytes())
    for split in sorted(index.get("splits", {})):
        for shard in index["splits"][split].get("shards", []):
            path = data / shard["file"]
            size = path.stat().st_size if path.is_file() else -1
            h.update(f"{shard['file']}:{size}".encode())
            if size > 0:
                with open(path, "rb") as f:
                    h.update(f.read(CHUNK))
                    f.seek(max(size - CHUNK, 0))
                    h.update(f.read(CHUNK))
    return h.hexdigest()


def _index_and_tokenizer(data: Path) -> tuple[dict[str, Any], Path]:
    """The data directory's index.json ({} if none) and the tokenizer file it names."""
    index = json.loads((data / "index.json").read_text()) if (data / "index.json").is_file() else {}
    return index, data / index.get("tokenizer", TOKENIZER)


def tokenizer_sha256(data: Path) -> str | None:
    """The SHA-256 of the data directory's tokenizer (as its index.json records it), None without one."""
    index, model = _index_and_tokenizer(data)
    return index.get("tokenizer_sha256") or _sha256(model)


def read_provenance(data: Path) -> dict[str, Any]:
    """Data identity and tokenizer of the data directory `data` (resolved): {data_path, data_sha256,
    tokenizer_sha256, tokenizer_model}."""
    index, model = _index_and_tokenizer(data)
    return {
        "data_path": str(data),
        "data_sha256": data_fingerprint(data, index) if index else None,
        "tokenizer_sha256": tokenizer_sha256(data),
        "tokenizer_model": model.read_bytes() if model.is_file() else None,
    }


def missing_tokenizer(data: Path) -> str | None:
    """The warning for a data directory without its tokenizer file (shards made elsewhere), or None: then the
    checkpoints carry no tokenizer either."""
    _, model = _index_and_tokenizer(data)
    return None if model.is_file() else (f"data.path {data} has no {model.name}: checkpoints will carry no tokenizer, "
                                         f"so decoding and evaluating them (lm.generate, lm.evaluate) will need --tokenizer")


def check_tokenizer(data: Path) -> None:
    """A one-line DataError if the data directory's tokenizer.model is not the one its index.json records (the
    shards were made with that one; checkpoints carry the file's bytes)."""
    index, model = _index_and_tokenizer(data)
    sha, recorded = _sha256(model), index.get("tokenizer_sha256")
    if sha is not None and recorded is not None and sha != recorded:
        raise DataError(f"data.path: {model} is not the tokenizer {data} was prepared with (SHA-256 {sha[:12]}, "
                        f"index.json's {recorded[:12]}); rerun data_prep.prepare on it")


def provenance(cfg: Config) -> dict[str, Any]:
    """`read_provenance` of the run's data, read once per process: every checkpoint carries it."""
    return dict(_cached(Path(cfg.data.path).resolve()))


@functools.lru_cache(maxsize=4)
def _cached(data: Path) -> tuple[tuple[str, Any], ...]:
    return tuple(read_provenance(data).items())


def holds_run(out: Path) -> bool:
    """Whether `out` already holds (part of) a run: its record, checkpoints or metrics."""
    return (out / RECORD).is_file() or (out / "metrics.json").is_file() or any((out / "checkpoints").glob("*"))


def _leaf_changes(path: str, old: Any, new: Any) -> list[str]:
    """'path: old -> new' for each differing leaf: into dicts and into lists of one length, so that a changed head
    count reads `model.heads.1.count: 2 -> 3`, not both head lists."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for key in sorted(set(old) | set(new), key=str)
                for line in _leaf_changes(f"{path}.{key}", old.get(key), new.get(key))]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [line for i, (x, y) in enumerate(zip(old, new)) for line in _leaf_changes(f"{path}.{i}", x, y)]
    return [f"{path}: {old} -> {new}"] if old != new else []


def config_changes(saved: Config, current: Config) -> tuple[list[str], list[str]]:
    """(fields that may not change on resume, fields that may), each as 'section.key[.subkey ...]: old -> new'."""
    a = OmegaConf.to_container(OmegaConf.structured(saved))
    b = OmegaConf.to_container(OmegaConf.structured(current))
    fixed, free = [], []
    for section in sorted(set(a) | set(b)):  # type: ignore[arg-type]
        old, new = a.get(section), b.get(section)  # type: ignore[union-attr]
        keys = sorted(set(old) | set(new)) if isinstance(old, dict) and isinstance(new, dict) else [None]
        for key in keys:
            x, y = (old, new) if key is None else (old.get(key), new.get(key))  # type: ignore[union-attr]
            if x != y:
                lines = _leaf_changes(f"{section}{'' if key is None else '.' + key}", x, y)
                allowed = section in RESUMABLE and (RESUMABLE[section] is None or key in RESUMABLE[section])  # type: ignore[operator]
                (free if allowed else fixed).extend(lines)
    return fixed, free


# Fields that say how long and how observably a run trains, not what it trains: a finished run whose config differs
# from another only in these (and in data.path, to the same data) holds that config's result (flops.sweep, run_sweep).
BOOKKEEPING = {"trainer": {"max_steps", "max_minutes", "val_every", "validate_first", "ckpt_every", "log_every",
                           "keep_last_k", "out_dir", "profiler"}, "data": {"num_workers"}}


def result_changes(out: Path, cfg: Config) -> list[str]:
    """The changes from the run in `out` (its config.yaml; [] if none) to `cfg` that change what is trained: every
    field but BOOKKEEPING's, and data.path only where it holds other data than run.json's fingerprint."""
    if not (out / CONFIG).is_file():
        return []
    fixed, free = config_changes(read_run_config(out / CONFIG, "restore it or delete the run directory"), cfg)
    changes = []
    for line in sorted(fixed + free):
        section, _, key = line.split(":")[0].partition(".")
        if key in BOOKKEEPING.get(section, ()):
            continue
        if (section, key) == ("data", "path") and _same_data(out, Path(cfg.data.path)):
            continue
        changes.append(line)
    return changes


def _same_data(out: Path, data: Path) -> bool:
    """Whether `data` holds the data the run in `out` was trained on (run.json's data fingerprint)."""
    if not (out / RECORD).is_file() or not (data / "index.json").is_file():
        return False
    index, _ = _index_and_tokenizer(data)
    return read_json(out / RECORD, advice="restore it or delete the run directory").get("data_sha256") == \
        data_fingerprint(data, index)


def _recorded(out: Path, name: str) -> Any:
    """The run's RECORD (a dict) or CONFIG (a Config) in `out`; a one-line ConfigError if it was damaged."""
    advice = "restore it, or pass --overwrite to start again"
    try:
        return read_json(out / RECORD, advice=advice) if name == RECORD else read_run_config(out / CONFIG, advice)
    except ConfigError as err:
        raise ConfigError(f"--resume: {err}") from None


def check_resume(cfg: Config, out: Path, here: dict[str, Any]) -> list[str]:
    """ConfigError if the run in `out` was trained on other data, another tokenizer or another model;
    the resumable fields that changed otherwise."""
    record = _recorded(out, RECORD)
    for key, what in (("tokenizer_sha256", "tokenizer"), ("data_sha256", "data")):
        if record.get(key) != here[key]:
            raise ConfigError(f"--resume: {out} was trained on another {what} (sha256 {str(record.get(key))[:12]}, "
                              f"{here['data_path']} has {str(here[key])[:12]}); use --overwrite to start again")
    fixed, free = config_changes(_recorded(out, CONFIG), cfg)
    if fixed:
        raise ConfigError(f"--resume: {out} was trained with a different config ({'; '.join(fixed)}); "
                          f"use --overwrite to start again")
    return free


@rank_zero_only
def claim(cfg: Config, resume: bool, overwrite: bool) -> None:
    """Make `trainer.out_dir` this run's directory (module doc). Rank 0 only: the other ranks are
    started after it and find the directory claimed. One-line ConfigError when refused."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    out = Path(cfg.trainer.out_dir)
    blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"trainer.out_dir {out}: {blocking} is a file, not a directory")
    check_tokenizer(Path(cfg.data.path).resolve())
    here = read_provenance(Path(cfg.data.path).resolve())
    if resume and (out / RECORD).is_file():
        for change in check_resume(cfg, out, here):
            if not reported_here(change.split(":")[0]):  # optimiser, length, batch: reported when applied
                print(f"resume: {change}", file=sys.stderr)
    elif holds_run(out) and not resume:
        if not overwrite:
            raise ConfigError(f"trainer.out_dir {out} already holds a run; pass --resume to continue it "
                              f"or --overwrite to start again")
        for name in OUTPUTS:
            target = out / name
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    tokenizer = here.pop("tokenizer_model")
    record = {**here, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": sys.argv}
    if resume and (out / RECORD).is_file():
        record = {**_recorded(out, RECORD), "data_path": here["data_path"], "resumed": record["started"]}
    text = to_yaml(cfg)
    atomic_write(out / CONFIG, lambda f: f.write(text.encode()))
    atomic_write(out / RECORD, lambda f: f.write(json.dumps(record, indent=1).encode()))
    if tokenizer is not None:
        atomic_write(out / TOKENIZER, lambda f: f.write(tokenizer))
