"""Small real experiment: dense vs MoSA (causal, faithful) vs fixed vs Routing attention
on Gutenberg at matched forward FLOPs, reporting standard and leak-free validation perplexity.

    python -m bench.gutenberg_compare [--config configs/experiments/gutenberg_compare.yaml]
        [--only NAME,NAME] [--force] [--lock /tmp/cpu_heavy.lock [--hold-lock]] [--out STEM] [section.key=value ...]

Every variant shares `base` of the settings file (data, tokenizer, seed, schedule, size); its head mix is
FLOP-matched to the dense baseline with MoSA App. C (flops.isoflop.solve). The data directory is prepared
once (data_prep.prepare). Each variant trains with train_lm.py in its own process (OMP_NUM_THREADS=1;
with --lock, holding that file lock for its training and evaluation only), then its final checkpoint is
evaluated on `eval.windows` evenly spaced validation windows: teacher-forced and leak-free (lm/leakfree.py).
Results are merged by variant name into STEM.csv, and the markdown table STEM.md is rewritten from it (--out STEM;
default bench/results/gutenberg_compare). Command-line overrides are folded into `base` (the report states them) and
train under <out_dir>/o-<hash of them>, so they neither reuse nor delete the runs without them; a stem holds the results
of one set of overrides (others: one-line error, give them their own --out). A
variant already in the csv is skipped unless --force or named in --only; a finished run directory of the identical
config is only re-evaluated, not retrained, unless --force (after a code change, --force retrains). So adding a
variant means adding one entry to the settings file and running only that one.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import yaml
from omegaconf import DictConfig, OmegaConf

from flops.cli import hardware, in_results, results_stem, script_parser
from flops.run_sweep import locked

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gutenberg_compare"  # the default --out stem
COLUMNS = ["variant", "heads", "causal", "params", "fwd_gflop", "flop_ratio", "kv_total", "steps", "tokens",
           "train_s", "tokens_per_s", "val_loss", "val_ppl", "leakfree_loss", "leakfree_ppl", "windows", "torch", "code",
           "machine", "overrides"]
CODE_DIRS = ["heads", "routing", "lm", "flops", "train_lm.py"]  # what a variant's numbers depend on


def code_version() -> str:
    """The git commit the code is at, + "+dirty" if CODE_DIRS differ from it ("" outside a git checkout)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    return head + ("+dirty" if head and git("status", "--porcelain", "--untracked-files=no", "--", *CODE_DIRS) else "")


def load_settings(path: str, sections: tuple[str, ...] = ("base", "variants")) -> Any:
    """The settings YAML at `path`; ValueError, one line, unless it is a mapping with these sections."""
    if not Path(path).is_file():
        raise ValueError(f"--config {path}: settings file not found")
    try:
        settings = OmegaConf.load(path)
    except yaml.YAMLError as err:  # multi-line messages
        raise ValueError(f"--config {path}: not valid YAML ({type(err).__name__})") from None
    if not isinstance(settings, DictConfig) or not set(sections) <= set(settings):
        raise ValueError(f"--config {path}: expected a mapping with sections {', '.join(sections)}")
    return settings


def head_mix(base_model: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The variant's per-layer head mix: the baseline's, an explicit list, or FLOP-matched by App. C."""
    from flops.isoflop import solve

    if not spec:
        return [dataclasses.asdict(g) for g in base_model.heads]
    if "heads" in spec:
        return list(spec["heads"])
    result = solve(base_model, spec["head"], spec.get("sparsity"), spec.get("dense_heads", 4), dict(spec.get("options", {})))
    return result.heads


def base_config(settings: Any, overrides: list[str]) -> Any:
    """The shared Config (`base` + CLI overrides); its heads are the dense baseline."""
    from lm.config_io import load_config

    return load_config(None, *[f"{k}={v}" for k, v in _flat(OmegaConf.to_container(settings.base))], *overrides)


def apply_overrides(settings: Any, overrides: list[str]) -> None:
    """Fold dotted command-line overrides (checked by base_config first) into settings.base; their runs go under
    <out_dir>/o-<hash of them> unless they set trainer.out_dir (a run without them is never reused nor deleted)."""
    if not overrides:
        return
    settings.base = OmegaConf.merge(settings.base, OmegaConf.from_dotlist(overrides))
    if not any(o.startswith("trainer.out_dir=") for o in overrides):
        tag = hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:8]
        settings.base.trainer.out_dir = f"{settings.base.trainer.out_dir}/o-{tag}"


def stem_overrides(rows: Iterable[dict[str, Any]], path: Path) -> list[str] | None:
    """The overrides the rows of results file `path` were run with (None without rows); ValueError if they differ."""
    found = {r.get("overrides") or "[]" for r in rows}  # rows from before the column: none
    if len(found) > 1:
        raise ValueError(f"{path} mixes results of different overrides: {', '.join(sorted(found))}")
    return json.loads(found.pop()) if found else None


def check_stem(rows: Iterable[dict[str, Any]], overrides: list[str], path: Path) -> None:
    """One stem, one set of overrides: ValueError if `path` holds results run with others."""
    held = stem_overrides(rows, path)
    if held is not None and held != overrides:
        raise ValueError(f"{path} holds results run with overrides {held}, not {overrides}: give these their own --out")


def run_config(settings: Any, name: str, overrides: list[str]) -> Any:
    """The full validated Config of one variant (base + its head mix + CLI overrides)."""
    from lm.config_io import from_dict

    base = base_config(settings, overrides)
    heads = head_mix(base.model, OmegaConf.to_container(settings.variants[name]))
    cfg = OmegaConf.merge(OmegaConf.structured(base), {"model": {"heads": heads},
                                                       "trainer": {"out_dir": f"{base.trainer.out_dir}/{name}"}})
    return from_dict(OmegaConf.to_container(cfg))


def _flat(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _flat(v, key + ".")
        else:
            yield key, json.dumps(v) if isinstance(v, (list, dict)) else v


def prepare_data(settings: Any, data_path: str) -> None:
    if (ROOT / data_path / "index.json").is_file():
        return
    p = settings.prepare
    cmd = [sys.executable, "-m", "data_prep.prepare", "--source", p.source, "--src", str((ROOT / p.src).resolve()),
           "--out", data_path, "--vocab-size", str(p.vocab_size), "--sample-chars", str(p.sample_chars), "--no-progress"]
    print("preparing data:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def finished_run(out: Path, cfg: Any) -> bool:
    """`out` holds a completed training run of exactly this config (then only the evaluation is redone)."""
    from lm.config_io import load_config

    needed = [out / "config.yaml", out / "metrics.json", out / "train_seconds.txt", out / "checkpoints" / "last.ckpt"]
    if not all(p.is_file() for p in needed):
        return False
    return load_config(out / "config.yaml") == cfg and json.loads((out / "metrics.json").read_text())["step"] >= cfg.trainer.max_steps


def train_and_evaluate(cfg: Any, name: str, windows: int, budget: int, retrain: bool) -> dict[str, Any]:
    """Train one variant from scratch (unless a finished run of the same config exists and not
    `retrain`), then evaluate its last checkpoint (standard and leak-free).
    `budget`: the dense baseline's forward FLOPs per sequence."""
    import torch

    from flops.model import model_cost
    from lm.checkpoint import load_model
    from lm.config_io import to_yaml
    from lm.leakfree import evaluate

    out = ROOT / cfg.trainer.out_dir
    if not retrain and finished_run(out, cfg):
        print(f"{name}: reusing the finished run in {out}", flush=True)
    else:
        shutil.rmtree(out, ignore_errors=True)  # a fresh run: same seed, same data order as every variant
        out.mkdir(parents=True)
        (out / "config.yaml").write_text(to_yaml(cfg))
        (out / "code_version.txt").write_text(code_version() + "\n")
        (out / "machine.txt").write_text(hardware() + "\n")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        start = time.time()
        with open(out / "train.log", "w") as log:
            subprocess.run([sys.executable, str(ROOT / "train_lm.py"), "--config", str(out / "config.yaml")],
                           cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        (out / "train_seconds.txt").write_text(f"{time.time() - start:.1f}\n")
    train_s = float((out / "train_seconds.txt").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    torch.set_num_threads(1)
    model, _ = load_model(out / "checkpoints" / "last.ckpt")
    result = evaluate(model, eval_windows(cfg, windows).split(cfg.data.batch_size), leak_free=True)
    cost = model_cost(cfg.model)
    return {
        "variant": name,
        "heads": " + ".join(f"{g.count} {g.type}" + (f" {dict(g.options)}" if g.options else "") for g in cfg.model.heads),
        "causal": model.causal,
        "params": model.num_params(),
        "fwd_gflop": round(cost.flops_per_pass / 1e9, 4),
        "flop_ratio": round(cost.flops_per_pass / budget, 4),
        "kv_total": model.kv_total(),
        "steps": metrics["step"],
        "tokens": metrics["tokens_seen"],
        "train_s": round(train_s, 1),
        "tokens_per_s": round(metrics["tokens_per_s"]),
        "val_loss": round(result["loss"], 4),
        "val_ppl": round(result["ppl"], 2),
        "leakfree_loss": round(result["leakfree_loss"], 4),
        "leakfree_ppl": round(result["leakfree_ppl"], 2),
        "windows": windows,
        "torch": torch.__version__,
        "code": _recorded(out / "code_version.txt"),
        "machine": _recorded(out / "machine.txt"),
    }


def _recorded(path: Path) -> str:
    """What a run directory recorded at training time in the text file `path` ("" for runs from before it did)."""
    return path.read_text().strip() if path.is_file() else ""


def distinct(rows: Iterable[dict[str, Any]], key: str, quote: bool = False) -> str:
    """The different values of `key` in `rows`, in order of appearance ("not recorded" for rows without one),
    joined by "; "; with `quote`, each recorded value in backticks."""
    values = dict.fromkeys(f"`{r[key]}`" if quote and r.get(key) else str(r.get(key) or "not recorded") for r in rows)
    return "; ".join(values)


def eval_windows(cfg: Any, windows: int) -> Any:
    """The `windows` evenly spaced validation windows of T + 1 tokens [N, T+1] (the same for every
    run on the same data and seq_len)."""
    from lm.data import ValWindows, open_split

    return ValWindows(open_split(cfg.data.path, "val", cfg.model), cfg.model.seq_len, windows).tokens()


def csv_rows(stem: Path) -> list[dict[str, str]]:
    """The rows of stem.csv ([] before the first)."""
    path = in_results(stem, ".csv")
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_rows(stem: Path) -> dict[str, dict[str, Any]]:
    """The rows of stem.csv by variant ({} before the first)."""
    return {row["variant"]: row for row in csv_rows(stem)}


def write_results(rows: dict[str, dict[str, Any]], settings: Any, order: list[str], stem: Path) -> None:
    """stem.csv (the rows) and stem.md (their table), variants in the settings' order."""
    names = [n for n in order if n in rows] + sorted(set(rows) - set(order))
    with open(in_results(stem, ".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for n in names:
            writer.writerow({c: rows[n].get(c, "") for c in COLUMNS})
    b = settings.base
    lines = [
        "# Gutenberg: dense vs sparse heads at matched forward FLOPs (bench/gutenberg_compare.py)",
        "",
        f"Machine: {distinct(rows.values(), 'machine')}, 1 thread per run; torch {distinct(rows.values(), 'torch')}, fp32.",
        f"Data: `{b.data.path}` prepared once from ../shared/data/gutenberg (SentencePiece vocab "
        f"{settings.prepare.vocab_size}); same tokenizer, data order and seed ({b.trainer.seed}) for every run.",
        f"Model: {b.model.n_layers} layers, h = {b.model.d_model}, h' = {b.model.head_dim}, T = {b.model.seq_len}; "
        f"baseline {b.model.heads[0].count} dense heads; sparse variants keep 4 dense heads and add the most sparse "
        f"heads whose MoSA App. C forward FLOPs fit the baseline's (flops.isoflop.solve).",
        f"Training: AdamW lr {b.optim.lr}, warmup {b.optim.warmup_steps}, cosine to {b.optim.min_lr_ratio}x, "
        f"clip {b.optim.grad_clip}, batch {b.data.batch_size} x {b.model.seq_len} tokens, {b.trainer.max_steps} steps.",
        f"Overrides of the settings file: {rows[names[0]].get('overrides') or '[]'} (runs under {b.trainer.out_dir}).",
        f"Evaluation: the final checkpoint on {rows[names[0]].get('windows', '?')} evenly spaced validation windows of "
        f"T tokens: `val_ppl` teacher-forced (one pass per window), `leakfree_ppl` with every prediction recomputed "
        f"from its own prefix (lm/leakfree.py; expert-choice / top-k selections re-made on the prefix).",
        "",
        "Reproduce: `python -m bench.gutenberg_compare` (all variants; `--only NAME` for one, `--force` to rerun; "
        "`--lock /tmp/cpu_heavy.lock [--hold-lock]` on a shared machine; `--report` rewrites this file from the csv).",
        "",
        "Caveats: a few hundred steps of a tiny model on a shared CPU: differences of a few percent in perplexity are "
        "within run-to-run noise (one seed each). `train s` is wall time including start-up and depends on the "
        "machine's load at the time, so it does not compare speeds. `causal = False` rows are leaky as published; "
        "their honest number is the leak-free perplexity. `code`: the commit the variant was trained at (a row "
        "is re-trained with `--only NAME --force` when its head's code changes; `-`: trained before the column "
        "existed). `KV total` is analytic (model.kv_total), recomputed for the agent and MiTA rows when their count "
        "gained one pair per completed block (2026-11-25). `dense_kept` trains only the 4 dense heads every sparse variant keeps "
        "(fewer FLOPs than the baseline): a sparse variant worse than it is made worse by its sparse heads at this "
        "budget, not merely no better than dense.",
        "",
        "| variant | heads per layer | causal | params | fwd GFLOP (/ dense) | KV total | steps | train s | val ppl | leak-free ppl | code |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for n in names:
        r = rows[n]
        lines.append(f"| {n} | {r['heads']} | {r['causal']} | {int(r['params']):,} | {float(r['fwd_gflop']):.3f} ({float(r['flop_ratio']):.3f}) | "
                     f"{r['kv_total']} | {r['steps']} | {r['train_s']} | {float(r['val_ppl']):.2f} | "
                     f"{float(r['leakfree_ppl']):.2f} | {r.get('code') or '-'} |")
    in_results(stem, ".md").write_text("\n".join(lines) + "\n")


def wanted_variants(order: list[str], only: str | None) -> list[str]:
    """The variants named by --only (comma-separated; all of `order` when None); ValueError for unknown names."""
    wanted = order if only is None else only.split(",")
    unknown = sorted(set(wanted) - set(order))
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(order)}")
    return wanted


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "experiments" / "gutenberg_compare.yaml"),
                        help="settings YAML: base config, variants and evaluation")
    parser.add_argument("--only", default=None, help="comma-separated variant names (rerun even if present)")
    parser.add_argument("--force", action="store_true", help="rerun variants that already have results, retraining even a finished run directory")
    parser.add_argument("--lock", default=None, help="hold this file lock while a variant trains and evaluates")
    parser.add_argument("--hold-lock", action="store_true", help="hold --lock once for all selected variants")
    parser.add_argument("--report", action="store_true", help="only rewrite the markdown table from the csv")
    parser.add_argument("--out", type=results_stem, default=RESULTS, metavar="STEM",
                        help="results STEM.csv and STEM.md (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of `base`, e.g. trainer.max_steps=100")
    args = parser.parse_args(argv)
    csv_path = in_results(args.out, ".csv")
    try:
        settings = load_settings(args.config)
        order = list(settings.variants)
        wanted = wanted_variants(order, args.only)
        rows = read_rows(args.out)
        if args.report:  # the overrides the rows were run with
            if not rows:
                raise ValueError(f"--report: {csv_path} has no results yet; run a variant first")
            args.overrides = stem_overrides(rows.values(), csv_path)
        base_config(settings, args.overrides)  # ConfigError of the overrides: reported before any run
        check_stem(rows.values(), args.overrides, csv_path)
        apply_overrides(settings, args.overrides)
        configs = {} if args.report else {name: run_config(settings, name, []) for name in wanted}
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.report:
        write_results(rows, settings, order, args.out)
        return 0
    with locked(args.lock if args.hold_lock else None):
        for name, cfg in configs.items():
            if name in rows and not (args.force or args.only):
                print(f"{name}: already in {csv_path}, skipped (--force to rerun)")
                continue
            row = run_variant(settings, name, cfg, args)
            rows = {**read_rows(args.out), name: row}  # merge with rows other processes may have written meanwhile
            write_results(rows, settings, order, args.out)
    return 0


def run_variant(settings: Any, name: str, cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Train and evaluate variant `name`, whose full Config is `cfg` (run_config); its result row."""
    from flops.model import model_cost

    with locked(None if args.hold_lock else args.lock):
        prepare_data(settings, cfg.data.path)
        print(f"{name}: training {cfg.trainer.max_steps} steps -> {cfg.trainer.out_dir}", flush=True)
        budget = model_cost(base_config(settings, []).model).flops_per_pass
        row = {**train_and_evaluate(cfg, name, int(settings.eval.windows), budget, args.force),
               "overrides": json.dumps(args.overrides)}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
