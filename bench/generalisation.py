"""Algorithmic generalisation (MiTA App. C; top-k attention §4.4): a dense-trained checkpoint evaluated
with its dense heads swapped, at evaluation only and with the same weights, for top-k (several k),
MiTA (several block sizes b -> m = T // b landmarks, expert widths k, routed experts s) and causal
agent attention, with sliding-window heads as a control (the local context alone); validation
perplexity against the dense original.

    python -m bench.generalisation --ckpt runs/gutenberg-exp/dense/checkpoints/last.ckpt \\
        --topk 8 16 32 64 --mita 64:32:1 32:32:1 32:64:1 16:64:2 --agent 32:32 --local 32 \\
        --out bench/results/generalisation.md

All these types share dense's `qkv` / `out` parameter layout, so `swap_heads` only rewrites the
config and loads the dense state dict strictly.
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flops.cli import hardware, output_file, positive_int, script_parser
from heads import ConfigError
from lm.checkpoint import load_model
from lm.config import HeadGroupConfig, ModelConfig, validate_model
from lm.data import DataError, ValWindows, open_split
from lm.leakfree import evaluate
from lm.model import DecoderLM, build_model
from lm.perplexity import perplexity


def swapped_config(cfg: ModelConfig, head_type: str, options: dict[str, Any]) -> ModelConfig:
    """`cfg` with its dense groups made `head_type` groups (same counts) with `options`, validated against the model's
    length (k <= T, ...): a one-line ConfigError."""
    def swap(groups: list[HeadGroupConfig]) -> list[HeadGroupConfig]:
        return [HeadGroupConfig(head_type, g.count, dict(options)) if g.type == "dense" else g for g in groups]

    swapped = dataclasses.replace(cfg, heads=swap(cfg.heads), layer_heads={i: swap(m) for i, m in cfg.layer_heads.items()})
    validate_model(swapped)
    return swapped


def swap_heads(model: DecoderLM, head_type: str, options: dict[str, Any]) -> DecoderLM:
    """A copy of `model` whose dense groups are `head_type` groups (same counts) with `options`,
    carrying the dense weights unchanged (strict state-dict load)."""
    swapped = build_model(swapped_config(model.cfg, head_type, options))
    swapped.load_state_dict(model.state_dict())
    return swapped.eval()


def _parse(spec: str, names: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, int]:
    """"a:b:c" -> {names[0]: a, ...}; the `optional` names may follow."""
    parts = spec.split(":")
    if not len(names) <= len(parts) <= len(names) + len(optional) or not all(p.isdigit() for p in parts):
        form = ":".join(names) + "".join(f"[:{n}]" for n in optional)
        raise ConfigError(f"expected {form} (integers), got {spec!r}")
    return dict(zip(names + optional, map(int, parts)))


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--ckpt", required=True, help="checkpoint of a model trained with dense heads")
    parser.add_argument("--topk", type=positive_int, nargs="*", default=[], help="k values for top-k heads")
    parser.add_argument("--mita", nargs="*", default=[], help="block:k:s[:local_blocks] for MiTA heads")
    parser.add_argument("--mita-no-shared", nargs="*", default=[],
                        help="block:k:s[:local_blocks], MiTA without shared expert")
    parser.add_argument("--agent", nargs="*", default=[], help="block:window pairs for agent heads")
    parser.add_argument("--local", type=positive_int, nargs="*", default=[],
                        help="control: sliding-window heads (heads/local.py) of these widths, i.e. the local context alone")
    parser.add_argument("--val-windows", type=positive_int, default=64, help="validation windows of seq_len tokens")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="validation windows per forward pass")
    parser.add_argument("--out", type=output_file, default=None, help="write the markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        dense, cfg = load_model(args.ckpt)
        if any(g.type != "dense" for layer in range(cfg.model.n_layers) for g in cfg.model.mix(layer)):
            raise ConfigError(f"{args.ckpt}: expected a model with dense heads only")
        T = cfg.model.seq_len
        windows = ValWindows(open_split(cfg.data.path, "val", cfg.model), T, args.val_windows)
        variants: list[tuple[str, dict[str, Any]]] = [("dense", {})]
        variants += [("topk", {"k": k, "chunk": 128}) for k in args.topk]
        mita = ("block", "k", "s"), ("local_blocks",)
        variants += [("mita", _parse(s, *mita)) for s in args.mita]
        variants += [("mita", {**_parse(s, *mita), "shared": False}) for s in args.mita_no_shared]
        variants += [("agent", _parse(s, ("block", "window"))) for s in args.agent]
        variants += [("local", {"window": w}) for w in args.local]
        for head_type, options in variants[1:]:  # every variant's options, before the first is evaluated
            swapped_config(cfg.model, head_type, options)
        rows = []
        for head_type, options in variants:
            model = dense.eval() if head_type == "dense" else swap_heads(dense, head_type, options)
            t0 = time.perf_counter()
            loss = evaluate(model, windows.tokens().split(args.batch_size), leak_free=False)["loss"]
            rows.append((head_type, options, loss, time.perf_counter() - t0))
            print(f"{head_type:6s} {options} val loss {loss:.4f} ppl {perplexity(loss):.2f}", flush=True)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    table = _markdown(rows, cfg.model, args, windows)
    if args.out:
        Path(args.out).write_text(table)
    print(table)
    return 0


def _describe(head_type: str, options: dict[str, Any], T: int) -> str:
    if head_type == "topk":
        return f"k = {options['k']}"
    if head_type == "mita":
        shared = "" if options.get("shared", True) else ", no shared expert"
        local = f", {options['local_blocks']} local blocks" if options.get("local_blocks", 1) != 1 else ""
        return f"b = {options['block']} (m = {T // options['block']}), k = {options['k']}, s = {options['s']}{local}{shared}"
    if head_type == "agent":
        return f"b = {options['block']} ({T // options['block']} agents), window = {options['window']}"
    if head_type == "local":
        return f"window = {options['window']} (control: local context only)"
    return "(trained)"


def _markdown(rows: list[tuple[str, dict[str, Any], float, float]], m: ModelConfig, args: argparse.Namespace,
              windows: ValWindows) -> str:
    dense_loss = rows[0][2]
    lines = [
        "| attention at evaluation | options | val loss | val ppl | ppl / dense ppl | eval s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for head_type, options, loss, seconds in rows:
        lines.append(
            f"| {head_type} | {_describe(head_type, options, m.seq_len)} | {loss:.4f} | {perplexity(loss):.2f} | "
            f"{perplexity(loss - dense_loss):.3f} | {seconds:.1f} |"
        )
    cmd = "python -m bench.generalisation " + " ".join(sys.argv[1:])
    return "\n".join([
        "# Algorithmic generalisation: dense-trained model, heads swapped at evaluation",
        "",
        f"Model: {m.n_layers} layers, d_model {m.d_model}, {sum(g.count for g in m.heads)} heads x {m.head_dim}, "
        f"T = {m.seq_len}, vocab {m.vocab_size}; checkpoint `{args.ckpt}`. Validation: {len(windows)} fixed windows "
        f"of {m.seq_len} tokens ({len(windows) * m.seq_len} predicted tokens). Same weights in every row.",
        "",
        *lines,
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {hardware()}, {torch.get_num_threads()} thread(s); Python {platform.python_version()}, "
        f"torch {torch.__version__}; fp32.",
        "",
    ])


if __name__ == "__main__":
    sys.exit(main())
