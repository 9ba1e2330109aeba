"""Suffix perplexity of a compression checkpoint (lm.compressed_training) at chosen depths and ratios, against its
own references (adaptive_attention_compression.txt, "Evaluations": Delta = Loss(compressed) - Loss(full)).

    python -m lm.compressed_evaluate --ckpt runs/compression/checkpoints/last.ckpt [--data DIR] [--split val] \\
        [--depths 1,2,3] [--ratios 0.125,0.25,0.5] [--batches 8] [--batch 8] [--seed 0] [--out eval.json]

Every row is scored on the same suffix tokens: fixed windows of max(depths) P + S + 1 tokens, each cut from inside
one document of the prepared split (lm.compressed_training.DocumentWindows, drawn with --seed), depth k using the
last k P + S + 1 of them (P = compression.prefix_len, S = model.seq_len). Rows:
- `none`: the suffix alone (no memory);
- `full`: k chunks kept uncompressed (their raw depth-L states), Delta's reference; a model trained without
  compression.full_prob > 0 never saw such a memory, so its `full` row is out of distribution;
- `compress` (or `recent`, the FLOP-matched baseline's mode): k chunks each compressed (or cut) to t = round(r P)
  states; `delta` = its loss minus the `full` row's at the same depth.
Defaults: the depths 1..compression.max_depth and the ratio compression.ratio the model trained with. Prints a
markdown table; --out writes the rows as JSON. Data other than the checkpoint's tokenizer's, documents shorter than
the window, a missing or foreign checkpoint: one line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from data_prep.cli import OneLineParser
from heads.base import ConfigError
from lm.checkpoint import read_checkpoint
from lm.cli import check_output
from lm.compressed_training import compressed_from_checkpoint, document_windows, evaluate, fixed_windows
from lm.compression import CompressedLM, Layout, tokens_for
from lm.config import Config
from lm.data import DataError
from lm.loading import trained_tokenizer_sha256
from lm.perplexity import perplexity
from lm.run_dir import tokenizer_sha256
from lm.scoring import progress_bar


def numbers(text: str, kind: Callable[[str], float], ok: Callable[[float], bool], what: str) -> list[Any]:
    """A comma-separated option's values, each `kind` and `ok`, none repeated; else a one-line ValueError."""
    try:
        values = [kind(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(map(ok, values)) or len(set(values)) < len(values):
        raise ValueError(f"expected distinct comma-separated {what}, got {text!r}")
    return values


def layouts(cfg: Config, depths: list[int], ratios: list[float]) -> list[tuple[dict[str, Any], Layout]]:
    """(row, layout) of every evaluation: none; then per depth k: full, and each ratio's compression."""
    P, S = cfg.compression.prefix_len, cfg.model.seq_len
    out = [({"memory": "none", "depth": 0, "ratio": None, "t": 0}, Layout((), 0, S))]
    for k in depths:
        out.append(({"memory": "full", "depth": k, "ratio": None, "t": k * P}, Layout((P,) * k, 0, S, full=True)))
        for r in ratios:
            t = tokens_for(r, P)
            out.append(({"memory": cfg.compression.mode, "depth": k, "ratio": r, "t": t}, Layout((P,) * k, t, S)))
    return out


def evaluate_layouts(model: CompressedLM, windows: list[torch.Tensor], planned: list[tuple[dict[str, Any], Layout]],
                     ) -> list[dict[str, Any]]:
    """Each planned row with its mean suffix loss (nats/token), perplexity and, for compressed rows, delta."""
    rows = []
    for row, layout in progress_bar(planned, desc="layouts", unit="layout"):
        loss = evaluate(model, windows, layout)
        rows.append({**row, "loss": loss, "ppl": perplexity(loss), "delta": None})
    full = {r["depth"]: r["loss"] for r in rows if r["memory"] == "full"}
    for r in rows:
        if r["ratio"] is not None:
            r["delta"] = r["loss"] - full[r["depth"]]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| memory | depth | ratio | memory states | loss | ppl | delta vs full |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio_text = "-" if r["ratio"] is None else f"{r['ratio']:g}"
        delta = "-" if r["delta"] is None else f"{r['delta']:+.4f}"
        lines.append(f"| {r['memory']} | {r['depth']} | {ratio_text} | {r['t']} | {r['loss']:.4f} | {r['ppl']:.2f} | "
                     f"{delta} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m lm.compressed_evaluate", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a checkpoint of lm.compressed_training")
    p.add_argument("--data", help="prepared data directory (data_prep.prepare; default: the run's data.path)")
    p.add_argument("--split", default="val", choices=("train", "val"), help="split the windows come from (default val)")
    p.add_argument("--depths", help="comma-separated compressed chunks before the suffix (default 1..compression.max_depth)")
    p.add_argument("--ratios", help="comma-separated t / P ratios in (0, 1] (default compression.ratio)")
    p.add_argument("--batches", type=int, default=8, help="batches of windows (default 8)")
    p.add_argument("--batch", type=int, default=8, help="windows per batch (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the windows' draw (default 0)")
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args(argv)
    try:
        depths = None if a.depths is None else numbers(a.depths, int, lambda d: d >= 1, "integers >= 1 for --depths")
        ratios = None if a.ratios is None else numbers(a.ratios, float, lambda r: 0 < r <= 1,
                                                       "ratios in (0, 1] for --ratios")
        if a.batches < 1 or a.batch < 1:
            raise ValueError(f"--batches and --batch must be >= 1, got {a.batches} and {a.batch}")
        check_output("--out", a.out, {"--ckpt": a.ckpt})
        saved = read_checkpoint(a.ckpt, mmap=False)  # read once: weights, config and the run record
        model, cfg = compressed_from_checkpoint(saved, a.ckpt)
        depths = depths or list(range(1, cfg.compression.max_depth + 1))
        planned = layouts(cfg, depths, ratios or [cfg.compression.ratio])
        n = max(depths) * cfg.compression.prefix_len + cfg.model.seq_len + 1
        data = Path(a.data or cfg.data.path)
        source = document_windows(data, a.split, cfg)  # (the index's and shards' own checks first)
        trained = trained_tokenizer_sha256(saved.get("run") or {})
        if None not in (trained, have := tokenizer_sha256(data)) and trained != have:
            raise DataError(f"{data} was tokenised with another tokenizer than the one {a.ckpt} trained with "
                            f"(SHA-256 {have[:12]}, the checkpoint's {trained[:12]})")
        try:
            windows = fixed_windows(source, a.batches, a.batch, n, seed=a.seed)
        except ValueError as err:
            raise ValueError(f"{err}: depth {max(depths)} needs windows of {n} tokens (max(depths) x prefix_len "
                             f"{cfg.compression.prefix_len} + seq_len {cfg.model.seq_len} + 1); give smaller --depths")
    except (ConfigError, DataError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = evaluate_layouts(model, windows, planned)
    print(f"{a.ckpt}: {a.batches * a.batch} windows of {n} tokens from {data} ({a.split}), "
          f"suffix S = {cfg.model.seq_len} tokens, chunks of P = {cfg.compression.prefix_len}")
    print(table(rows))
    if a.out:
        Path(a.out).write_text(json.dumps({"ckpt": str(a.ckpt), "windows": a.batches * a.batch, "window_tokens": n,
                                           "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
