"""Seed-replicated comparison of causal sparse routing on Gutenberg (issue 12): dense, faithful MoSA
(leak-free perplexity), each causal MoSA selection, MoSAIC and fixed heads at matched forward FLOPs.

    python -m bench.causal_routing [--config configs/experiments/causal_routing.yaml]
        [--only NAME,NAME] [--seeds S,S] [--report] [--out STEM] [section.key=value ...]

Each (variant, seed) run is one bench/gutenberg_compare.py run (same base config, FLOP-matched head
mix, train_lm.py in its own process, final checkpoint evaluated teacher-forced and leak-free on the
same `eval.windows` held-out windows) with `trainer.seed` = the seed, in <out_dir>/s<seed>/<variant>.
For causal MoSA selections it also measures, on those windows, coverage by sequence quarter
(routing/coverage.py): the fraction of the head's candidates it keeps ("cand") and of the faithful
expert-choice top-k of its router scores it keeps ("topk"), and the predictor's accuracy.
A finished run writes result.json next to its checkpoint and is skipped on the next call, so the
comparison resumes after a cut-off. Parallel workers (start the command several times) claim runs with
an exclusive <out_dir>/s<seed>/<variant>.claim file holding their pid (a dead pid's claim is taken over).
`--report` (also after every run) aggregates all result.json files into STEM.csv (one row per run), STEM.md (mean ±
std over seeds) and STEM.png (validation perplexity vs training tokens); --out STEM, default
bench/results/causal_routing. Command-line overrides are folded into `base` (the report states them) and their runs
go under <out_dir>/o-<hash of them> (bench/gutenberg_compare.apply_overrides; `--report` with the same overrides finds
them); a stem holds the results of one set of overrides (others: one-line error, give them their own --out).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.gutenberg_compare import (
    apply_overrides, base_config, check_stem, csv_rows, distinct, eval_windows, load_settings, prepare_data, run_config,
    train_and_evaluate, wanted_variants)
from flops.cli import command_line, in_results, results_stem, script_parser

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "causal_routing"  # the default --out stem
QUARTERS = 4


def run_overrides(settings: Any, seed: int) -> list[str]:
    return [f"trainer.seed={seed}", f"trainer.out_dir={settings.base.trainer.out_dir}/s{seed}"]


def selection_coverage(model: Any, windows: Any) -> dict[str, Any]:
    """Per causal MoSA group of `model`, on windows [N, T+1]: coverage by quarter of its candidates and
    of the expert-choice top-k of its router logits, pooled over layers; the predictor's accuracy."""
    import torch

    from heads.mosa import MoSAHeads
    from routing.coverage import coverage_by_position, members
    from routing.expert_choice import expert_choice, tokens_per_head

    picked, cands, topk, accuracy = [], [], [], []

    def probe(group: MoSAHeads, args: tuple, _out: Any) -> None:
        x = args[0]
        logits = group.router_logits(x)
        scores = group.selection_scores(x, logits)
        T = x.shape[1]
        picked.append(members(group.select(scores), T))
        cands.append(group.candidates(scores))
        topk.append(members(expert_choice(logits, tokens_per_head(T, group.options.sparsity)), T))
        if "predictor_acc" in group.stats:
            accuracy.append(group.stats["predictor_acc"])

    groups = [m for m in model.modules() if isinstance(m, MoSAHeads) and m.causal]
    if not groups:
        return {}
    hooks = [g.register_forward_hook(probe) for g in groups]
    model.eval()
    with torch.no_grad():
        for batch in windows.split(8):
            model(batch[:, :-1])
    for h in hooks:
        h.remove()
    sel = torch.cat([p.flatten(0, 1) for p in picked])
    return {"cover_cand": coverage_by_position(sel, torch.cat([c.flatten(0, 1) for c in cands]), QUARTERS),
            "cover_topk": coverage_by_position(sel, torch.cat([t.flatten(0, 1) for t in topk]), QUARTERS),
            "predictor_acc": statistics.fmean(accuracy) if accuracy else None}


def run_one(settings: Any, name: str, seed: int, overrides: list[str], command: str) -> dict[str, Any]:
    """Train and evaluate one (variant, seed) for the command line `command`; write and return its result (with the
    val curve)."""
    from flops.model import model_cost
    from lm.checkpoint import load_model

    over = run_overrides(settings, seed)
    cfg = run_config(settings, name, over)
    prepare_data(settings, cfg.data.path)
    budget = model_cost(base_config(settings, over).model).flops_per_pass
    print(f"{name} seed {seed}: training {cfg.trainer.max_steps} steps -> {cfg.trainer.out_dir}", flush=True)
    row = train_and_evaluate(cfg, name, int(settings.eval.windows), budget, retrain=False)
    out = ROOT / cfg.trainer.out_dir
    model, _ = load_model(out / "checkpoints" / "last.ckpt")
    windows = eval_windows(cfg, int(settings.eval.windows))
    row.update(seed=seed, command=command, overrides=json.dumps(overrides), **selection_coverage(model, windows))
    row["history"] = json.loads((out / "metrics.json").read_text())["history"]
    (out / "result.json").write_text(json.dumps(row, indent=1))
    print(json.dumps({k: v for k, v in row.items() if k != "history"}), flush=True)
    return row


def results(settings: Any) -> list[dict[str, Any]]:
    base = ROOT / settings.base.trainer.out_dir
    return [json.loads(p.read_text()) for p in sorted(base.glob("s*/*/result.json"))]


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    m = statistics.fmean(values)
    return f"{m:.2f} ± {statistics.stdev(values):.2f}" if len(values) > 1 else f"{m:.2f}"


def write_report(settings: Any, command: str, stem: Path) -> None:
    """stem.csv, stem.md and stem.png from every finished run, written by the command line `command`."""
    import csv

    rows = results(settings)
    if not rows:
        return
    order = [n for n in settings.variants if any(r["variant"] == n for r in rows)]
    columns = ["variant", "seed", "heads", "causal", "params", "fwd_gflop", "flop_ratio", "kv_total", "steps", "tokens",
               "train_s", "val_ppl", "leakfree_ppl", "cover_cand", "cover_topk", "predictor_acc", "torch", "code",
               "machine", "command", "overrides"]
    with open(in_results(stem, ".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        for r in sorted(rows, key=lambda r: (order.index(r["variant"]), r["seed"])):
            writer.writerow({c: json.dumps([round(v, 4) for v in r[c]]) if isinstance(r.get(c), list) else r.get(c, "")
                             for c in columns})
    by = {n: [r for r in rows if r["variant"] == n] for n in order}
    b = settings.base
    budget = "; ".join(dict.fromkeys(f"{r['steps']} steps ({r['tokens']:,} tokens)" for r in rows))  # as trained
    lines = [
        "# Causal sparse routing on Gutenberg, seed-replicated (bench/causal_routing.py)",
        "",
        f"Machine: {distinct(rows, 'machine')}, 1 thread per run, fp32, torch {distinct(rows, 'torch')}. "
        f"Runs trained by: {distinct(rows, 'command', quote=True)}; this report written by: `{command}`.",
        f"Overrides of the settings file: {distinct(rows, 'overrides')} (runs under {b.trainer.out_dir}).",
        f"Model: {b.model.n_layers} layers, h = {b.model.d_model}, h' = {b.model.head_dim}, T = {b.model.seq_len}, "
        f"vocab {b.model.vocab_size}; baseline {b.model.heads[0].count} dense heads per layer; sparse variants keep 4 "
        "dense heads and add the most sparse heads whose App. C forward FLOPs fit the baseline's (flops.isoflop.solve; "
        "causal MoSA counted at its capacity, the predictor's classifier included).",
        f"Training: {budget} per run, AdamW lr {b.optim.lr}, warmup {b.optim.warmup_steps}, cosine to {b.optim.min_lr_ratio}x; "
        f"seeds {sorted({r['seed'] for r in rows})} (init and data order).",
        f"Evaluation: final checkpoint on the same {settings.eval.windows} evenly spaced held-out windows for every run; "
        "`val ppl` teacher-forced, `leak-free ppl` with every prediction recomputed from its own prefix "
        "(lm/leakfree.py): the honest number for faithful (non-causal) MoSA; equal to val ppl for causal models.",
        "Coverage (causal MoSA, pooled over layers, heads and windows; by sequence quarter): `cand` = share of the "
        "head's candidates (tokens above its threshold) it keeps; `topk` = share of the faithful expert-choice "
        "top-k of its own router scores it keeps.",
        "",
        "| variant | heads per layer | causal | fwd GFLOP (/ dense) | KV total | leak-free ppl (mean ± std) | "
        "val ppl | coverage cand Q1..Q4 | coverage topk Q1..Q4 | predictor acc | seeds |",
        "|---|---|---|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for n, rs in by.items():
        r0 = rs[0]

        def quarters(key: str) -> str:
            vals = [r[key] for r in rs if r.get(key)]
            return " / ".join(f"{statistics.fmean(v[j] for v in vals):.2f}" for j in range(QUARTERS)) if vals else "-"

        acc = [r["predictor_acc"] for r in rs if r.get("predictor_acc") is not None]
        lines.append(f"| {n} | {r0['heads']} | {r0['causal']} | {r0['fwd_gflop']:.3f} ({r0['flop_ratio']:.3f}) | "
                     f"{r0['kv_total']} | {mean_std([r['leakfree_ppl'] for r in rs])} | "
                     f"{mean_std([r['val_ppl'] for r in rs])} | {quarters('cover_cand')} | {quarters('cover_topk')} | "
                     f"{f'{statistics.fmean(acc):.3f}' if acc else '-'} | {len(rs)} |")
    lines += ["", resolution(by)]
    in_results(stem, ".md").write_text("\n".join(lines) + "\n" + notes(settings))
    plot_curves(by, in_results(stem, ".png"))


def resolution(by: dict[str, list[dict[str, Any]]]) -> str:
    """What this budget can resolve: the pooled seed std of the leak-free perplexity and the smallest
    difference of two variants' means that is 2 standard errors (2 * sqrt(2/n) * std) above noise."""
    groups = [[r["leakfree_ppl"] for r in rs] for rs in by.values() if len(rs) > 1]
    if not groups:
        return "Resolution: one seed per variant so far; no noise estimate."
    dof = sum(len(g) - 1 for g in groups)
    pooled = math.sqrt(sum(statistics.variance(g) * (len(g) - 1) for g in groups) / dof)
    bounds = "; ".join(f"{n} seeds each: {2 * math.sqrt(2 / n) * pooled:.2f}" for n in sorted({len(g) for g in groups}, reverse=True))
    return (f"Resolution: pooled seed std of the leak-free perplexity {pooled:.2f} ({dof} degrees of freedom); differences "
            f"of two variants' means below 2·sqrt(2/n)·std are within noise (2 standard errors): {bounds} perplexity.")


def notes(settings: Any) -> str:
    """Hand-written conclusions, kept in the settings file next to the runs they describe."""
    return ("\n" + str(settings.notes).strip() + "\n") if settings.get("notes") else ""


def plot_curves(by: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Validation perplexity (teacher-forced, mean over seeds) against training tokens, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rs in by.items():
        steps = sorted({h["tokens_seen"] for r in rs for h in r["history"]})
        points = [(t, [h["val_ppl"] for r in rs for h in r["history"] if h["tokens_seen"] == t]) for t in steps]
        ax.plot([t / 1e6 for t, _ in points], [math.exp(statistics.fmean(math.log(v) for v in vs)) for _, vs in points],
                marker="o", label=f"{name} ({len(rs)} seeds)")
    ax.set_yscale("log")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("validation perplexity (teacher-forced)")
    ax.set_title("causal routing on Gutenberg (geometric mean over seeds)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def claim(settings: Any, seed: int, name: str) -> bool:
    """Atomically claim run (seed, name) for this process; a claim whose process is gone is taken over."""
    path = ROOT / settings.base.trainer.out_dir / f"s{seed}" / f"{name}.claim"
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = path.with_name(f"{path.name}.{os.getpid()}")
    mine.write_text(str(os.getpid()))
    try:
        os.link(mine, path)  # atomic and refused if the claim exists: a claim file always holds its pid
        return True
    except FileExistsError:
        try:
            os.kill(int(path.read_text()), 0)
            return False  # its owner is alive
        except PermissionError:
            return False  # alive, another user's process
        except (ProcessLookupError, ValueError):
            path.unlink(missing_ok=True)
            return claim(settings, seed, name)
    finally:
        mine.unlink(missing_ok=True)


def parse_seeds(text: str | None, seeds: list[int]) -> list[int]:
    """--seeds "2,3" -> [2, 3] (each one of the settings' seeds); None -> all; ValueError otherwise."""
    if text is None:
        return seeds
    wanted = [int(s) for s in text.split(",") if s.isdigit()]
    if not wanted or len(wanted) != len(text.split(",")) or set(wanted) - set(seeds):
        raise ValueError(f"--seeds must be a comma-separated subset of {seeds}, got {text!r}")
    return wanted


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "experiments" / "causal_routing.yaml"),
                        help="settings YAML: base config, variants and seeds")
    parser.add_argument("--only", default=None, help="comma-separated variant names")
    parser.add_argument("--seeds", default=None, help="comma-separated subset of the settings' seeds")
    parser.add_argument("--report", action="store_true", help="only rewrite the results from finished runs")
    parser.add_argument("--out", type=results_stem, default=RESULTS, metavar="STEM",
                        help="results STEM.csv, STEM.md and STEM.png (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of `base`, e.g. trainer.max_steps=100")
    args = parser.parse_args(argv)
    command = command_line(["-m", "bench.causal_routing"], argv)
    try:
        settings = load_settings(args.config, ("base", "variants", "seeds"))
        wanted = wanted_variants(list(settings.variants), args.only)
        seeds = parse_seeds(args.seeds, [int(s) for s in settings.seeds])
        base_config(settings, args.overrides)  # bad overrides: one line before any run is claimed
        check_stem(csv_rows(args.out), args.overrides, in_results(args.out, ".csv"))
        apply_overrides(settings, args.overrides)
        for name in [] if args.report else wanted:
            run_config(settings, name, run_overrides(settings, seeds[0]))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not args.report:
        done = {(r["variant"], r["seed"]) for r in results(settings)}
        for seed, name in [(s, n) for s in seeds for n in wanted if (n, s) not in done]:
            if claim(settings, seed, name):
                run_one(settings, name, seed, args.overrides, command)
                write_report(settings, command, args.out)
    write_report(settings, command, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
