"""How many CPU cores this process may use, on every platform."""
from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores in this process's affinity mask (Linux: a container's or `taskset`'s limit, which os.cpu_count
    ignores), else every core of the machine (macOS and Windows have no sched_getaffinity)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
