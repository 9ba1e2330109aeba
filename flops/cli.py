"""Command-line pieces shared by the scripts of flops/ and bench/: a parser whose --help shows the
script's whole module docstring and whose errors are one `error: ...` line (exit 2), argparse types
that reject bad numbers and devices before any work starts, worker processes whose failure is one line,
and what a results file states: the command that reruns it and the hardware it ran on."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from data_prep.cli import OneLineParser

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]


def script_parser(doc: str | None, prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of a script: one-line errors (data_prep/cli.py); --help prints its module docstring `doc` as written
    (usage examples included)."""
    return OneLineParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def output_file(text: str) -> Path:
    """argparse type of a report file (--out): its directory must exist and it must not be a directory, checked when
    the arguments are parsed, before the work whose result it holds (lm.cli.check_output)."""
    from lm.cli import check_output

    try:
        check_output("", text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).strip()) from None
    return Path(text)


RESULT_SUFFIXES = (".csv", ".md", ".png")


def results_stem(text: str) -> Path:
    """argparse type of a results stem (--out STEM: the files STEM.csv, STEM.md, ...): output_file's checks, and a
    trailing .csv/.md/.png dropped (`--out x.md` names the same files as `--out x`). Name the files with
    `in_results(stem, suffix)`, not Path.with_suffix, which would cut a stem such as `run_lr0.003`."""
    path = output_file(text)
    return path.with_suffix("") if path.suffix in RESULT_SUFFIXES else path


def in_results(stem: Path, suffix: str) -> Path:
    """The results file `stem` + `suffix` (e.g. '.csv')."""
    return stem.with_name(stem.name + suffix)


def _integer(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _integer(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _integer(text, 0, "an integer >= 0")


def finite_float(text: str) -> float:
    """argparse type: a finite number (no nan, no inf)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """argparse type: "a,b,c" -> [item("a"), item("b"), item("c")]; empty or repeated entries are errors."""

    def parse(text: str) -> list[T]:
        parts = text.split(",")
        if "" in parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated values without empty entries, got {text!r}")
        values = [item(part) for part in parts]
        repeated = sorted({part for part, value in zip(parts, values) if values.count(value) > 1})
        if repeated:
            raise argparse.ArgumentTypeError(f"{', '.join(repeated)} given more than once in {text!r}")
        return values

    return parse


def torch_device(text: str) -> str:
    """argparse type: cpu, cuda or cuda:N where this machine has that GPU (the benchmarks time and measure memory
    on those two only); the text itself."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= gpus:
        raise argparse.ArgumentTypeError(f"{text}: this machine has {gpus} CUDA GPU(s) (torch {torch.__version__})")
    return text


def use_device(text: str) -> Any:
    """torch.device(text), made the current CUDA device when it is one: torch.cuda.synchronize and the memory
    counters act on the current device, which is cuda:0 unless set."""
    import torch

    device = torch.device(text)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


# A CPU worker whose RSS follows its live tensors, like CUDA's allocated-memory counter: glibc maps (and unmaps on
# free) every block of 128 KiB or more, instead of keeping freed blocks under a threshold that moves with the history
# of allocations (with it, one config's peak RSS varied by ~200 MB, 8 %, between runs).
CPU_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def run_in_worker(module: str, spec: dict[str, Any], name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`python -m module --worker <spec as JSON>` in a fresh process from the repository root, with the extra
    environment variables `env`: the JSON object it prints last. If it fails, RuntimeError "<name>: worker failed:
    <the last line of its stderr>"."""
    out = subprocess.run([sys.executable, "-m", module, "--worker", json.dumps(spec)], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, **env} if env else None)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        raise RuntimeError(f"{name}: worker failed: {lines[-1] if lines else f'exit status {out.returncode}'}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def command_line(program: list[str], argv: list[str] | None = None) -> str:
    """The shell command that reruns a script: OMP_NUM_THREADS=N where it is set, `python`, `program` (e.g.
    ["-m", "bench.decode"]) and `argv` (default sys.argv[1:]), quoted."""
    threads = [f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"] if "OMP_NUM_THREADS" in os.environ else []
    return shlex.join([*threads, "python", *program, *(sys.argv[1:] if argv is None else argv)])


def flop_count(value: float) -> str:
    """A FLOP count with 2 decimals in G (MoSA Table 4's 54.76G, 1130.65G), or in M or k below 1G (micro's 41.94M)."""
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{prefix}"
    return f"{value:.0f}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def hardware(device: str = "cpu") -> str:
    """What runs on torch device `device`: the GPU's name for cuda, else the CPU's model and core count."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({os.cpu_count() or '?'} cores)"
