"""Training curves as PNG: validation perplexity against tokens seen (from metrics.json history).

    python -m lm.plots runs/dense runs/mosa --out curves.png [--title TEXT]   # several runs on one plot
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from data_prep.cli import OneLineParser
from heads.base import ConfigError
from lm.cli import check_png
from lm.run_files import read_json


def plot_val_curves(histories: dict[str, list[dict[str, Any]]], path: str | Path, title: str = "",
                    min_points: int = 2) -> Path | None:
    """Write the validation-perplexity curve of each history (label -> entries with tokens_seen, val_ppl; log
    scale) with at least `min_points` validations to `path` (one validation: a lone marker); None (nothing written)
    when no history has that many."""
    curves = {label: [(h["tokens_seen"], h["val_ppl"]) for h in history if h.get("val_ppl") is not None]
              for label, history in histories.items()}
    curves = {label: points for label, points in curves.items() if len(points) >= min_points}
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in curves.items():
        tokens, ppl = zip(*points)
        ax.plot([t / 1e6 for t in tokens], ppl, marker="o", label=label or None)
    ax.set_yscale("log")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(title or "validation perplexity")
    ax.grid(alpha=0.3, which="both")
    if any(curves):
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_labels(runs: list[Path]) -> list[str]:
    """One legend label per run directory: its name, or its path where another run has the same name (two sweeps'
    `runs/mosa_s8`), so that no curve replaces another."""
    names = [run.name for run in runs]
    return [run.name if names.count(run.name) == 1 else str(run) for run in runs]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m lm.plots",
                           description="Plot the validation curves of training runs (metrics.json) together.")
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (trainer.out_dir)")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--title", default="", help="plot title")
    args = parser.parse_args(argv)
    try:
        check_png("--out", args.out)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    histories = {}
    for run, label in zip(args.runs, run_labels(args.runs)):
        metrics = run / "metrics.json"
        if not metrics.is_file():
            print(f"error: {run}: no metrics.json (not a training run directory, or no validation yet)", file=sys.stderr)
            return 2
        try:
            history = read_json(metrics, keys=("history",))["history"]
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        histories[label] = history
    # every run with a validation is drawn: a sweep point validated once, at its end, is a lone marker
    if plot_val_curves(histories, args.out, args.title, min_points=1) is None:
        print("error: no run has a validation yet (metrics.json's history holds no val_ppl)", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
