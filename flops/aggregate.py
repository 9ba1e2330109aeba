"""Collect a sweep's results: `results.csv`, a markdown table and a PNG IsoFLOP curve (MoSA Fig. 3).

    python -m flops.aggregate sweeps/tiny [--out bench/results/isoflop_tiny] [--note "how it was run"]

Reads `<dir>/sweep.json`, each point's `metrics.json` (last validation) and, for points whose heads are
not causal, `leakfree.json` (the perplexity plotted and tabulated for them is the leak-free one).
Writes `<out>.csv`, `<out>.md`, `<out>.png` (default out: `<dir>/results`). The curve is validation
perplexity against sparsity (log2 axis), one line per head type, each starting at the dense baseline.
"""
from __future__ import annotations

import argparse
import csv
import platform
import sys
from pathlib import Path
from typing import Any

from flops.json_files import read_json
from heads.base import ConfigError

COLUMNS = [
    "name", "head", "sparsity", "k", "dense_heads", "sparse_heads", "params", "flops_per_pass",
    "baseline_flops_per_pass", "kv_total", "causal", "status", "step", "val_ppl", "leakfree_ppl", "ppl",
    "tokens_per_s",
]


def collect(sweep: Path) -> list[dict[str, Any]]:
    """One row per point; `ppl` is val_ppl for causal heads and leakfree_ppl otherwise (None if missing)."""
    status = read_json(sweep / "status.json", {})
    rows = []
    for e in read_json(sweep / "sweep.json", keys=("points",))["points"]:
        out = Path(e["out_dir"])
        m, lf = read_json(out / "metrics.json", {}), read_json(out / "leakfree.json", {})
        row = {c: e.get(c) for c in COLUMNS}
        row.update(
            status=status.get(e["name"], {}).get("status", "not run"), step=m.get("step"), val_ppl=m.get("val_ppl"),
            leakfree_ppl=lf.get("leakfree_ppl"), tokens_per_s=m.get("tokens_per_s"),
        )
        row["ppl"] = row["val_ppl"] if e["causal"] else row["leakfree_ppl"]
        rows.append(row)
    return rows


def curves(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """head type -> [(sparsity, ppl)] sorted, each starting at the dense baseline (sparsity 1)."""
    base = [(1, r["ppl"]) for r in rows if r["head"] == "dense" and r["ppl"] is not None]
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["head"] != "dense" and r["ppl"] is not None:
            out.setdefault(r["head"], list(base)).append((r["sparsity"], r["ppl"]))
    return {head: sorted(points) for head, points in out.items()}


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def markdown(rows: list[dict[str, Any]], note: str) -> str:
    sparsities = sorted({r["sparsity"] for r in rows})
    heads = sorted({r["head"] for r in rows if r["head"] != "dense"})
    by = {(r["head"], r["sparsity"]): r for r in rows}
    base = next((r for r in rows if r["head"] == "dense"), None)

    def cell(head: str, rho: int, key: str) -> str:
        r = base if rho == 1 else by.get((head, rho))
        return _fmt(r[key]) if r else "-"

    lines = [note, "", "Validation perplexity (leak-free for non-causal heads) at equal FLOPs per pass:", ""]
    lines += ["| head | " + " | ".join(f"rho={s}" for s in sparsities) + " |", "|---" * (len(sparsities) + 1) + "|"]
    lines += [f"| {h} | " + " | ".join(cell(h, s, "ppl") for s in sparsities) + " |" for h in heads]
    lines += ["", "Sparse heads per layer (plus the dense heads kept):", ""]
    lines += ["| head | " + " | ".join(f"rho={s}" for s in sparsities) + " |", "|---" * (len(sparsities) + 1) + "|"]
    lines += [f"| {h} | " + " | ".join(cell(h, s, "sparse_heads") for s in sparsities) + " |" for h in heads]
    lines += ["", "All points:", "", "| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for head, points in curves(rows).items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=head)
    base = [r["ppl"] for r in rows if r["head"] == "dense" and r["ppl"] is not None]
    if base:
        ax.axhline(base[0], color="grey", linestyle="--", linewidth=1, label="dense baseline")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["sparsity"] for r in rows})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("sparsity rho (tokens per sparse head k = T / rho)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flops.aggregate", description=__doc__.split("\n")[0])
    p.add_argument("sweep", type=Path)
    p.add_argument("--out", type=Path, help="output prefix (default <sweep>/results)")
    p.add_argument("--note", default="", help="markdown written above the tables (machine, command, ...)")
    a = p.parse_args(argv)
    try:
        rows = collect(a.sweep)
        size = read_json(a.sweep / "sweep.json", keys=("size",))["size"]
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = a.out or a.sweep / "results"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    note = a.note or f"IsoFLOP sweep `{a.sweep}` ({size}); {platform.platform()}"
    out.with_suffix(".md").write_text(markdown(rows, note))
    plot(rows, out.with_suffix(".png"), f"IsoFLOP curves ({size}, equal FLOPs per pass)")
    print(f"wrote {out.with_suffix('.csv')}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
