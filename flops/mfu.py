"""Model FLOPs utilisation (MFU) of training runs, from what they logged:

    python -m flops.mfu runs/tiny [runs/small ...] [--peak-tflops 989] [> bench/results/mfu.md]

achieved model FLOP/s = tokens/s (metrics.json: timed training steps, all devices together) x training FLOPs
per token; MFU = that / (peak FLOP/s of one device x devices). Training FLOPs per token = 3 x the forward
FLOPs of one sequence / T (backward = 2 x forward), counted as everywhere in this stack (flops/formulas.py,
MoSA App. C: dense attention as the full T x T square, routers included) plus the vocabulary projection,
which a GPU executes too (flops/model.py: `training_flops(..., include_lm_head=True)`). Activation
checkpointing's replayed forward passes are not counted (model FLOPs, not hardware FLOPs). The peak is
the device's dense peak at the run's precision (flops/model.py: PEAK_TFLOPS_BF16 for bf16 runs,
PEAK_TFLOPS_FP16 for fp16, PEAK_TFLOPS_FP32 for 32-true, from the device name and precision in metrics.json), or
--peak-tflops; on a CPU, or a GPU or precision missing from the tables, there is none, and MFU is left out.
A compression run (lm/compressed_training.py) counts the suffix tokens its loss is taken on (batch x model.seq_len)
and draws each step's layout (prefix spans, t, full memory) from (seed, step): its FLOPs per token are 3 x the mean,
over the layouts of its steps [0, step), of one sample's forward FLOPs (flops/model.py: compressed_flops, the
prefix chunks and compressions included) plus its vocabulary projection on the suffix, / model.seq_len.
"""
from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from flops.cli import script_parser
from flops.model import TRAINING_PER_FORWARD, compressed_flops, mfu, model_cost, peak_flops, training_flops
from heads.base import ConfigError
from lm.config import Config
from lm.run_files import read_json, read_run_config


class RunError(ValueError):
    """A run directory that cannot be read: the message is one line."""


def run_mfu(run: Path, peak_tflops: float | None = None) -> dict[str, Any]:
    """{run, device, devices, precision, compile, params, tokens_per_s, flops_per_token, achieved, peak, mfu} of
    the run directory `run` (trainer.out_dir); peak and mfu None when no peak is known."""
    config, metrics = run / "config.yaml", run / "metrics.json"
    for path in (config, metrics):
        if not path.is_file():
            raise RunError(f"{run}: no {path.name} (not a training run directory, or no validation written yet)")
    cfg = read_run_config(config)
    m = read_json(metrics)
    tokens_per_s = m.get("tokens_per_s")
    if not isinstance(tokens_per_s, (int, float)) or not tokens_per_s > 0:
        raise RunError(f"{run}: metrics.json has no measured tokens_per_s (too few training steps timed)")
    if cfg.compression is None:
        per_token = training_flops(model_cost(cfg.model), 1, include_lm_head=True) / cfg.model.seq_len
    else:
        step, last = m.get("step"), cfg.trainer.max_steps
        if not isinstance(step, int) or isinstance(step, bool) or not 1 <= step <= last:
            raise RunError(f"{run}: metrics.json has no step in [1, trainer.max_steps={last}] (a compression run's "
                           f"FLOPs follow its steps' layouts), got {step!r}")
        try:
            per_token = compressed_flops_per_token(cfg, step)
        except ConfigError as err:  # head groups whose slots are set by model.seq_len, run on other windows
            raise RunError(f"{run}: {err}") from None
    devices = m.get("world_size", 1)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise RunError(f"{run}: metrics.json's world_size is {devices!r}, not a number of devices >= 1")
    device, precision = m.get("device", "unknown"), m.get("precision", "?")
    try:
        peak = peak_tflops * 1e12 if peak_tflops else peak_flops(device, precision)
    except ValueError:
        peak = None
    achieved = tokens_per_s * per_token
    return {"run": str(run), "device": device, "devices": devices, "precision": precision,
            "compile": cfg.trainer.compile, "params": m.get("params"), "tokens_per_s": tokens_per_s,
            "flops_per_token": per_token, "achieved": achieved, "peak": peak,
            "mfu": None if peak is None else mfu(per_token, 1 / tokens_per_s, peak, devices)}


def compressed_flops_per_token(cfg: Config, steps: int) -> float:
    """Training FLOPs per suffix token of a compression run over its steps [0, steps) (module docstring): each step's
    layout replayed as training drew it (lm.compressed_training.LayoutSampler.at_step); every step weighs the same
    (the FLOPs of a layout drawn n times are computed once and counted n times)."""
    from lm.compressed_training import LayoutSampler  # Lightning and the data stack: only for compression runs

    assert cfg.compression is not None
    sampler = LayoutSampler(cfg.compression, cfg.model.seq_len)
    layouts = Counter(sampler.at_step(cfg.trainer.seed, step)[0] for step in range(steps))
    forward = sum(n * compressed_flops(cfg.model, cfg.compression, layout) for layout, n in layouts.items()) / steps
    return TRAINING_PER_FORWARD * (forward + model_cost(cfg.model).lm_head_flops) / cfg.model.seq_len


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | device | precision | compiled | params (M) | tokens/s | GFLOP / token | achieved TFLOP/s "
             "| peak TFLOP/s per device | MFU |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        peak = "-" if r["peak"] is None else f"{r['peak'] / 1e12:.4g}"
        util = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        params = "-" if r["params"] is None else f"{r['params'] / 1e6:.2f}"
        lines.append(f"| {r['run']} | {r['devices']} x {r['device']} | {r['precision']} | {r['compile']} | {params} "
                     f"| {r['tokens_per_s']:,.0f} | {r['flops_per_token'] / 1e9:.4g} | {r['achieved'] / 1e12:.4g} "
                     f"| {peak} | {util} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, "python -m flops.mfu")
    p.add_argument("runs", nargs="+", type=Path, help="run directories (trainer.out_dir)")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s of one device (default: from the device name)")
    a = p.parse_args(argv)
    try:
        if a.peak_tflops is not None and not 0 < a.peak_tflops < math.inf:
            raise RunError(f"--peak-tflops must be a finite number > 0, got {a.peak_tflops}")
        text = table([run_mfu(run, a.peak_tflops) for run in a.runs])
    except ValueError as err:  # RunError, or a ConfigError from the run's config
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text, end="")  # a markdown table
    return 0


if __name__ == "__main__":
    sys.exit(main())
