"""Reading back the files a run or a sweep writes (run.json, config.yaml, metrics.json, a sweep's JSON): a damaged
one is a one-line ConfigError naming it, never a traceback."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from heads.base import ConfigError
from lm.config import Config
from lm.config_io import from_dict

MISSING = object()


def read_json(path: Path, default: Any = MISSING, keys: tuple[str, ...] = (), advice: str = "restore or delete it") -> Any:
    """The JSON object in `path` (which must hold `keys`); `default` if the file does not exist
    (ConfigError if no default is given); a damaged file's error ends with `advice`."""
    if not path.is_file():
        if default is MISSING:
            raise ConfigError(f"{path} not found")
        return default
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:
        raise ConfigError(f"{path} is damaged ({type(err).__name__}: {' '.join(str(err).split())}); {advice}") from None
    missing = [k for k in keys if not isinstance(value, dict) or k not in value]
    if not isinstance(value, dict) or missing:
        raise ConfigError(f"{path} is damaged (not a JSON object{' with ' + ', '.join(missing) if missing else ''}); "
                          f"{advice}")
    return value


def read_run_config(path: Path, advice: str = "restore it") -> Config:
    """The Config a run saved as `path` (<trainer.out_dir>/config.yaml), validated; a damaged file's error ends with
    `advice`."""
    try:
        values = OmegaConf.to_container(OmegaConf.load(path))
        if not isinstance(values, dict) or not values:  # a list; an empty file would read as the defaults
            raise ValueError(f"holds {'no settings' if not values else 'a ' + type(values).__name__}, not a config")
        return from_dict(values)
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException) as err:  # ConfigError is a ValueError
        raise ConfigError(f"{path} is damaged ({' '.join(str(err).split())[:200]}); {advice}") from None
