"""Collect sweeps' results: `results.csv`, a markdown table and a PNG of IsoFLOP curves (MoSA Fig. 3).

    python -m flops.aggregate sweeps/tiny [sweeps/small ...] [--out bench/results/isoflop] [--note "how it was run"]

Reads each `<dir>/sweep.json`, `status.json`, and every point's `metrics.json` (last validation),
`config.yaml` (trainer.max_steps as trained; lm/run_dir.py) and, for points whose heads are not causal,
`leakfree.json` (the perplexity used for them is the leak-free one). A point counts only when it is
done: its run reached trainer.max_steps (and, if not causal, was evaluated leak-free at that step). Points that
stopped early are `partial`: listed with the step they reached, marked in the tables and drawn as
hollow markers, never part of a curve or a mean. A finished point whose perplexity is inf or NaN is `diverged`:
listed, not drawn, never part of a curve or a mean. Replicas (`flops.sweep --seeds N`) of a point are
summarised as mean ± sample standard deviation over the done ones; points of different sweep directories
are never pooled (a hybrid and a pure sweep of one size are two experiments). The PNG has one panel per
sweep (titled by its size, and its directory when two sweeps share a size), a line per head type with
error bars over the swept values: sparsity, where each line starts at that sweep's dense baseline (ρ = 1), or the
option of a `flops.sweep --vary` sweep, where the baseline is a dashed line and its own table column. A grid
(`flops.sweep --sparsity ... --vary KEY=...`) has a line per (head type, value of KEY) over sparsity, and a table row
per (value, head type), in a block per value; a grid of two options (`--vary X=... --vary KEY=...`) likewise over X,
with the baseline as a line and its own column. Writes `<out>.csv`, `<out>.md`, `<out>.png` (default out:
`<first dir>/results`).
The markdown opens with each sweep's command and training length (unless --note replaces that). Done points of one
sweep that trained for different lengths (a point rerun with `run_sweep --only NAME trainer.max_steps=...`) are not
comparable at equal FLOPs per pass: a warning on stderr, above the tables and in the PNG's title names them.
"""
from __future__ import annotations

import csv
import math
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from flops.cli import script_parser
from flops.json_files import as_text, point_results, read_status, read_sweep
from heads.base import ConfigError

COLUMNS = [
    "sweep", "size", "name", "head", "vary", "value", "setting", "sparsity", "seed", "k", "dense_heads", "sparse_heads",
    "params",
    "flops_per_pass", "baseline_flops_per_pass", "kv_total", "causal", "status", "step", "max_steps", "tokens", "val_ppl",
    "leakfree_ppl", "ppl", "tokens_per_s",
]


def max_steps(entry: dict[str, Any]) -> int | None:
    """trainer.max_steps the point was trained to (its run's config.yaml), else the one it was written with."""
    import yaml

    for path in (Path(entry["out_dir"]) / "config.yaml", Path(entry["config"])):
        if path.is_file():
            try:
                return int(yaml.safe_load(path.read_text())["trainer"]["max_steps"])
            except (yaml.YAMLError, KeyError, TypeError, ValueError, UnicodeDecodeError) as err:
                raise ConfigError(f"{path} is damaged (no trainer.max_steps: {type(err).__name__}: "
                                  f"{' '.join(str(err).split())}); restore or delete it") from None
    return None


def point_status(recorded: str | None, step: int | None, target: int | None, ppl: float | None) -> str:
    """done | diverged | partial | failed | interrupted | running | not run (module doc)."""
    finished = step is not None and target is not None and step >= target and ppl is not None
    if finished and recorded not in ("failed", "interrupted", "running"):
        return "done" if math.isfinite(ppl) else "diverged"
    if recorded in ("failed", "interrupted", "running"):
        return recorded
    return "partial" if step is not None else "not run"


def sweep_labels(sweeps: list[Path]) -> list[str]:
    """One label per sweep directory: its size, or "size (directory)" when another sweep has the same size."""
    sizes = [read_sweep(sweep / "sweep.json", keys=("points", "size"))["size"] for sweep in sweeps]
    return [size if sizes.count(size) == 1 else f"{size} ({sweep})" for size, sweep in zip(sizes, sweeps)]


def collect(sweep: Path, label: str | None = None) -> list[dict[str, Any]]:
    """One row per point, `sweep` = label (default: the size); `ppl` is val_ppl for causal heads and
    leakfree_ppl otherwise (None if missing or of an earlier step); besides COLUMNS, `swept`: the swept options (sweep.json's, else
    [vary]), and `setting`: the point's value of each."""
    manifest = read_sweep(sweep / "sweep.json", keys=("points", "size"))
    status = read_status(sweep / "status.json")
    rows = []
    for e in manifest["points"]:
        m, lf = point_results(e["out_dir"])
        row = {c: e.get(c) for c in COLUMNS}
        vary = manifest.get("vary", "sparsity")
        row.update(sweep=label or manifest["size"], size=manifest["size"], vary=vary, swept=manifest.get("swept", [vary]),
                   value=e.get("value", e.get("sparsity")), setting=e.get("setting", {}), step=m.get("step"),
                   max_steps=max_steps(e),
                   tokens=m.get("tokens_seen"), val_ppl=m.get("val_ppl"), leakfree_ppl=lf.get("leakfree_ppl"),
                   tokens_per_s=m.get("tokens_per_s"))
        row["ppl"] = row["val_ppl"] if e["causal"] else row["leakfree_ppl"]
        row["status"] = point_status(status.get(e["name"], {}).get("status"), row["step"], row["max_steps"], row["ppl"])
        rows.append(row)
    return rows


def length(steps: Any, tokens: int | None) -> str:
    """A point's training length as the tables show it: '300 steps (614,400 tokens)'."""
    return f"{steps} steps ({'tokens not recorded' if tokens is None else f'{tokens:,} tokens'})"


def unequal_training(rows: list[dict[str, Any]]) -> list[str]:
    """One line per sweep whose done points trained for different lengths (steps, and tokens where every point
    recorded them), naming them."""
    lines = []
    for sweep in dict.fromkeys(r["sweep"] for r in rows):
        done = [r for r in rows if r["sweep"] == sweep and r["status"] == "done"]
        known = all(r["tokens"] is not None for r in done)
        lengths: dict[tuple[Any, Any], list[str]] = {}
        for r in done:
            lengths.setdefault((r["max_steps"], r["tokens"] if known else None), []).append(r["name"])
        if len(lengths) > 1:
            parts = [f"{', '.join(names[:3])}{' ...' * (len(names) > 3)}: {length(steps, tokens)}"
                     for (steps, tokens), names in sorted(lengths.items(), key=lambda kv: -len(kv[1]))]
            lines.append(f"sweep {sweep}: its finished points trained for different lengths ({'; '.join(parts)}); "
                         "their perplexities are not comparable at equal FLOPs per pass: train them to one length")
    return lines


def default_note(sweeps: list[Path], rows: list[dict[str, Any]]) -> str:
    """Each sweep's command (sweep.json) and its done points' training length, and the machine."""
    lines = []
    for sweep, label in zip(sweeps, sweep_labels(sweeps)):
        command = read_sweep(sweep / "sweep.json", keys=("points", "size")).get("command", "(not recorded)")
        done = [r for r in rows if r["sweep"] == label and r["status"] == "done"]
        lengths = ", ".join(dict.fromkeys(length(r["max_steps"], r["tokens"]) for r in done))
        lines.append(f"- IsoFLOP sweep `{sweep}` ({label}): `{command}`; each finished point trained "
                     f"{lengths or '(none finished)'}")
    return "\n".join(lines + [f"- machine: {platform.platform()}"])


def position(row: dict[str, Any]) -> tuple[str, Any]:
    """(curve, x) of a point: its head type over the value of the swept option, or in a grid (--sparsity with
    --vary, or --vary twice) `<head> <KEY>=<value>` (the last swept option) over the first swept option; the dense
    baseline's curve is `dense`, its x 1 over sparsity, None over another option."""
    if len(row["swept"]) == 1:
        return row["head"], row["value"]
    curve = "dense" if row["head"] == "dense" else f"{row['head']} {row['vary']}={as_text(row['value'])}"
    x = row["swept"][0]
    return curve, row["sparsity"] if x == "sparsity" else row["setting"].get(x)


def summary(rows: list[dict[str, Any]]) -> dict[tuple[str, str, Any], dict[str, Any]]:
    """(sweep, curve, x) (position) -> {mean, std, n (done replicas), replicas, partial (rows not done, with a ppl)}."""
    groups: dict[tuple[str, str, Any], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["sweep"], *position(r)), []).append(r)
    out = {}
    for key, members in groups.items():
        done = [r["ppl"] for r in members if r["status"] == "done"]
        out[key] = {
            "mean": statistics.fmean(done) if done else None,
            "std": statistics.stdev(done) if len(done) > 1 else 0.0 if done else None,
            "n": len(done), "replicas": len(members),
            "partial": [r for r in members if r["status"] != "done" and r["ppl"] is not None],
        }
    return out


def swept_option(rows: list[dict[str, Any]], sweep: str) -> str:
    """The option on a sweep's x axis: sparsity, unless flops.sweep --vary without --sparsity swept another one (the
    first of two)."""
    return next(r["swept"][0] for r in rows if r["sweep"] == sweep)


def dense_baseline(s: dict[tuple[str, str, Any], dict[str, Any]], sweep: str) -> dict[str, Any] | None:
    """The summary of a sweep's dense baseline (dense_s1), if it has one."""
    return next((g for (sw, head, _), g in s.items() if sw == sweep and head == "dense"), None)


def curves(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    """(sweep, curve) -> [(x, mean ppl, std)] over done points, sorted (position); curves over sparsity start at
    their sweep's dense baseline (sparsity 1) when it is done (another option's sweep shows it as a line)."""
    s = summary(rows)
    out: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for (sweep, curve, x), g in s.items():
        if curve == "dense" or g["mean"] is None:
            continue
        base = dense_baseline(s, sweep) if swept_option(rows, sweep) == "sparsity" else None
        start = [(1, base["mean"], base["std"])] if base and base["mean"] is not None else []
        out.setdefault((sweep, curve), start).append((x, g["mean"], g["std"]))
    return {key: sorted(points) for key, points in out.items()}


def setting_text(setting: dict[str, Any]) -> str:
    """A point's swept values as a table cell: 'capacity_factor=1 selection=quota' ('' for none recorded)."""
    return " ".join(f"{key}={as_text(value)}" for key, value in setting.items())


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        value = setting_text(value) or None
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def cell(g: dict[str, Any] | None) -> str:
    """'mean ± std (n=N)' over done replicas; partial points marked with their ppl and step, never averaged."""
    if g is None:
        return "-"
    spread = f" ± {g['std']:.2f} (n={g['n']})" if g["n"] > 1 else " (n=1)" if g["replicas"] > 1 else ""  # seeds missing
    text = "-" if g["mean"] is None else f"{g['mean']:.2f}{spread}"
    partial = ["diverged" if r["status"] == "diverged" else f"{r['ppl']:.2f}* @{r['step']}/{r['max_steps']}"
               for r in g["partial"]]
    return "; ".join(partial if g["mean"] is None and partial else [text, *partial])


def table(s: dict[tuple[str, str, Any], dict[str, Any]], rows: list[dict[str, Any]], sweep: str) -> list[str]:
    """The perplexity table of `sweep` (`s`: summary): a row per curve (a grid's in a block per value of its last swept
    option), a column per x; over sparsity the dense baseline is the rho = 1 column, else a column of its own."""
    mine = [r for r in rows if r["sweep"] == sweep]
    key, grid = swept_option(rows, sweep), len(mine[0]["swept"]) > 1
    xs = sorted({position(r)[1] for r in mine if position(r)[1] is not None})
    named = sorted({((r["value"], r["head"]) if grid else (r["head"],)): position(r)[0]
                    for r in mine if r["head"] != "dense"}.items(),
                   key=lambda item: [(isinstance(v, str), v) for v in item[0]])  # numbers, then text
    if key == "sparsity":
        header = [f"rho={x}" for x in xs]
        cells = [[cell(s.get((sweep, "dense" if x == 1 else curve, x))) for x in xs] for _, curve in named]
    else:
        header = ["dense baseline"] + [f"{key}={x}" for x in xs]
        cells = [[cell(dense_baseline(s, sweep))] + [cell(s.get((sweep, curve, x))) for x in xs] for _, curve in named]
    first = [mine[0]["vary"], "head"] if grid else ["head"]
    return ["| " + " | ".join(first + header) + " |", "|---" * (len(first) + len(header)) + "|"] + [
        "| " + " | ".join([*map(as_text, lead), *row]) + " |" for (lead, _), row in zip(named, cells)]


def markdown(rows: list[dict[str, Any]], note: str, warnings: list[str]) -> str:
    """The note, the `warnings` (unequal_training's), a perplexity table per sweep, and every point."""
    s = summary(rows)
    lines = [note, ""] + [line for warning in warnings for line in (f"**Warning: {warning}.**", "")]
    for sweep in dict.fromkeys(r["sweep"] for r in rows):
        lines += [f"Size {sweep}: validation perplexity (leak-free for non-causal heads) at equal FLOPs per pass, "
                  "mean ± std over finished seeds; `x* @step/max` = partial run, "
                  "not in the mean or the curve, nor is a diverged one (perplexity inf or NaN):", ""]
        lines += table(s, rows, sweep) + [""]
    lines += ["All points (tokens_per_s as measured during the sweep's training: on a shared or busy machine it is not "
              "comparable between points; time points side by side with bench/throughput.py --out FILE):", "",
              "| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = list(dict.fromkeys(r["sweep"] for r in rows))
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5 * len(sweeps), 4), squeeze=False)
    lines = curves(rows)
    colours = {c: f"C{i}" for i, c in enumerate(sorted({position(r)[0] for r in rows if r["head"] != "dense"}))}
    s = summary(rows)
    for ax, sweep in zip(axes[0], sweeps):
        for (sw, curve), points in lines.items():
            if sw == sweep:
                xs, ys, es = zip(*points)
                ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, color=colours[curve], label=curve)
        partial = [r for g in s.values() for r in g["partial"]
                   if r["sweep"] == sweep and position(r)[1] is not None and math.isfinite(r["ppl"])]
        if partial:
            ax.scatter([position(r)[1] for r in partial], [r["ppl"] for r in partial], facecolors="none",
                       edgecolors="black", label="partial run (not in the curve)")
        base = dense_baseline(s, sweep)
        if base and base["mean"] is not None:
            ax.axhline(base["mean"], color="grey", linestyle="--", linewidth=1, label="dense baseline")
        ax.set_xscale("log", base=2)
        ticks = sorted({position(r)[1] for r in rows if r["sweep"] == sweep and position(r)[1] is not None})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        key = swept_option(rows, sweep)
        ax.set_xlabel("sparsity rho (tokens per sparse head k = T / rho)" if key == "sparsity"
                      else f"option {key} of the sparse heads")
        ax.set_ylabel("validation perplexity (leak-free if not causal)")
        ax.set_title(sweep)
        if ax.get_legend_handles_labels()[0]:  # a sweep without finished runs has no curve to name
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, "python -m flops.aggregate")
    p.add_argument("sweeps", type=Path, nargs="+", help="sweep directories (one panel each)")
    p.add_argument("--out", type=Path, help="output prefix (default <first sweep>/results)")
    p.add_argument("--note", default="", help="markdown written above the tables (machine, command, ...)")
    a = p.parse_args(argv)
    a.sweeps = list(dict.fromkeys(a.sweeps))  # a directory named twice is one sweep, not two replicas of it
    try:
        rows = [row for sweep, label in zip(a.sweeps, sweep_labels(a.sweeps)) for row in collect(sweep, label)]
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = a.out or a.sweeps[0] / "results"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")  # (not `swept`: the columns name each point's)
        writer.writeheader()
        writer.writerows({**r, "setting": setting_text(r["setting"])} for r in rows)
    warnings = unequal_training(rows)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    out.with_suffix(".md").write_text(markdown(rows, a.note or default_note(a.sweeps, rows), warnings))
    unequal = " - WARNING: points trained for different lengths" if warnings else ""
    plot(rows, out.with_suffix(".png"), f"IsoFLOP curves (equal FLOPs per pass){unequal}")
    counts = {k: sum(r["status"] == k for r in rows) for k in dict.fromkeys(r["status"] for r in rows)}
    print(f"wrote {out.with_suffix('.csv')}, {out.with_suffix('.md')}, {out.with_suffix('.png')} "
          f"({', '.join(f'{n} {k}' for k, n in counts.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
