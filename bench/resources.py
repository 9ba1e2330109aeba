"""Resource use of training configs side by side (MoSA Table 2): wall time per step, peak memory,
parameters, tokens/s, KV entries, analytic FLOPs.

    python -m bench.resources --pair table2-tiny --seq-len 256 --batch 2 [--out resources.md]
    python -m bench.resources --config configs/a.yaml --config configs/b.yaml [--device cuda]
    python -m bench.resources --pair table2-tiny --activation-checkpointing   # each config also checkpointed

Every config is measured in a fresh subprocess (honest peak RSS; no allocator state shared), `--rounds` times
with the configs alternating (medians over rounds; the per-round time changes are printed too): random
tokens, AdamW, forward + cross-entropy (+ auxiliary losses) + backward + step; `--warmup` steps are
discarded, then the median of `--steps` timed steps. Peak memory is torch.cuda.max_memory_allocated
on GPU. On CPU it is the peak RSS (ru_maxrss) of a second fresh process per config and round that runs two
training steps with glibc mapping every block of 128 KiB or more (flops.cli.CPU_MEMORY_ENV), so that RSS follows the
live tensors as CUDA's counter does (the timing process keeps the default allocator); also shown above the RSS once
torch, torch._dynamo (which the optimizer loads), heads/ and lm/ are imported (model, activations, gradients,
optimizer state).
KV is MoSA Table 2's "KV Total" (one layer: T*H_dense + k*H_sparse) and the sum over layers, next to
the measured fill: after the timed steps (MoSA's thresholds moved by them), one sequence of T tokens is
prefilled into lm/generate.py's cache and the key/value entries actually stored are counted, of the
slots allocated ("-" for head types that cannot decode). Ratios are to the first config. fp32 on CPU, bf16 autocast on GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from flops.cli import (CPU_MEMORY_ENV, command_line, hardware, nonnegative_int, output_file, positive_int,
                       run_in_worker, script_parser, torch_device, use_device)
from flops.model import model_cost
from flops.presets import baseline
from lm.config import HeadGroupConfig, ModelConfig, OptimConfig
from lm.config_io import from_dict, load_config


def table2_pair(size: str, sparsity: int, mosa_heads: int, dense_kept: int = 4) -> list[tuple[str, ModelConfig]]:
    """MoSA Table 2's perplexity-matched pair: the dense baseline vs dense_kept dense + mosa_heads MoSA."""
    dense = baseline(size)
    hybrid = dataclasses.replace(
        dense, heads=[HeadGroupConfig("dense", dense_kept), HeadGroupConfig("mosa", mosa_heads, {"sparsity": sparsity})]
    )
    return [(f"{size} dense", dense), (f"{size} {dense_kept}+{mosa_heads} MoSA rho={sparsity}", hybrid)]


PAIRS = {  # Table 2 head counts and sparsities
    "table2-tiny": lambda: table2_pair("tiny", 32, 17),
    "table2-small": lambda: table2_pair("small", 32, 14),
    "table2-medium": lambda: table2_pair("medium", 32, 12),
    "table2-large": lambda: table2_pair("large", 16, 16),
    "isoflop-tiny": lambda: table2_pair("tiny", 32, 276),  # Table 5's IsoFLOP point: 4 dense + 276 MoSA, rho 32
}


def measure(cfg: ModelConfig, batch: int, steps: int, warmup: int, device: str, threads: int,
            checkpointing: bool = False) -> dict[str, Any]:
    """Runs in the worker subprocess: train steps on random tokens and report time and memory (with
    `checkpointing`: every block activation-checkpointed, lm/checkpointing.py)."""
    import resource

    import torch
    import torch._dynamo  # noqa: F401  (the optimizer imports it, and sympy, on construction: ~140 MB of runtime)
    import torch.nn.functional as F

    from heads import commit_states
    from lm.model import build_model, checkpoint_blocks
    from lm.optimizer import adamw

    torch.set_num_threads(threads)
    use_device(device)
    rss_after_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch + heads + lm + dynamo loaded
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    checkpoint_blocks(model, checkpointing)
    opt = adamw(model, OptimConfig())  # training's (lm/optimizer.py)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()  # the first step's clock (--warmup 0) starts with nothing queued
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) + model.aux_loss
        loss.backward()
        opt.step()
        commit_states(model)  # as training does after every step (MoSA's thresholds, Routing's centroids)
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stored, slots = measured_kv(model, x[:1])  # after reading the training peak: the prefill is not training
    return {
        "step_ms": 1000 * step_s,
        "tokens_per_s": batch * cfg.seq_len / step_s,
        "peak_mem_bytes": peak,
        "mem_above_import": None if cuda else peak - rss_after_import,
        "params": model.num_params(),
        "kv_total": model.kv_total(),
        "kv_stored": stored,
        "kv_slots": slots,
        "device_name": hardware(device),
        "torch": torch.__version__,
    }


def measured_kv(model: Any, tokens: Any) -> tuple[int | None, int | None]:
    """(key/value entries stored, slots allocated) after prefilling tokens[1, T] into a decoding cache;
    (None, None) if a head type of the model cannot decode."""
    import torch

    from lm.generate import cache_fill, new_cache

    model.eval()
    try:
        cache = new_cache(model, 1, tokens.shape[1])
    except (NotImplementedError, ValueError):
        return None, None
    with torch.no_grad():
        model(tokens, torch.arange(tokens.shape[1], device=tokens.device)[None], cache)
    fill = cache_fill(model, cache).values()
    return sum(n for n, _ in fill), sum(c for _, c in fill)


MEMORY_STEPS = {"warmup": 1, "steps": 1}  # the CPU memory worker's: the second step's peak holds AdamW's moments


def run_worker(name: str, cfg: ModelConfig, a: argparse.Namespace, checkpointing: bool = False) -> dict[str, Any]:
    """Measure one config in a fresh Python process."""
    spec = {"model": dataclasses.asdict(cfg), "batch": a.batch, "steps": a.steps, "warmup": a.warmup,
            "device": a.device, "threads": a.threads, "checkpointing": checkpointing}
    result = run_in_worker("bench.resources", spec, name)
    if not a.device.startswith("cuda"):  # memory from a process whose RSS follows the live tensors (module doc)
        memory = run_in_worker("bench.resources", {**spec, **MEMORY_STEPS}, name, env=CPU_MEMORY_ENV)
        result.update(peak_mem_bytes=memory["peak_mem_bytes"], mem_above_import=memory["mem_above_import"])
    cost = model_cost(cfg)
    per_layer = cost.kv_per_layer  # one number when every layer holds the same, else each layer's
    return {**result, "name": name + (" (activation checkpointing)" if checkpointing else ""),
            "flops_per_pass": cost.flops_per_pass,
            "kv_per_layer": per_layer[0] if len(set(per_layer)) == 1 else " / ".join(f"{n:,}" for n in per_layer),
            "heads": "; ".join([cfg.mix_text(), *(f"layer {i}: {cfg.mix_text(i)}" for i in sorted(cfg.layer_heads))])}


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One config's results over rounds: medians of the measured time and memory (each memory figure a median of
    the rounds' own values), the rest from the first round."""
    step_ms = statistics.median(r["step_ms"] for r in rounds)
    above = [r["mem_above_import"] for r in rounds if r["mem_above_import"] is not None]
    return {**rounds[0], "step_ms": step_ms, "tokens_per_s": rounds[0]["tokens_per_s"] * rounds[0]["step_ms"] / step_ms,
            "peak_mem_bytes": statistics.median(r["peak_mem_bytes"] for r in rounds),
            "mem_above_import": statistics.median(above) if above else None}


ROWS = [  # (label, key, format, scale)
    ("Heads per layer", "heads", "{}", None),
    ("Parameters (M)", "params", "{:.2f}", 1e-6),
    ("FLOPs per pass (G, analytic)", "flops_per_pass", "{:.3f}", 1e-9),
    ("Wall-time/step (ms, median)", "step_ms", "{:.1f}", 1),
    ("Tokens/s", "tokens_per_s", "{:.0f}", 1),
    ("Peak memory (MB)", "peak_mem_bytes", "{:.0f}", 1e-6),
    ("Peak memory above import (MB)", "mem_above_import", "{:.0f}", 1e-6),
    ("KV Total per layer (Table 2)", "kv_per_layer", "{:,}", 1),
    ("KV Total, all layers", "kv_total", "{:,}", 1),
    ("KV entries stored, all layers (measured)", "kv_stored", "{:,}", 1),
    ("KV slots allocated, all layers", "kv_slots", "{:,}", 1),
]


def table(results: list[dict[str, Any]]) -> str:
    """Table-2-style markdown: one column per config, and the change vs the first config."""
    head = "| | " + " | ".join(f"{r['name']} | change" if i else r["name"] for i, r in enumerate(results)) + " |"
    lines = [head, "|---" * (1 + len(results) + len(results) - 1) + "|"]
    for label, key, fmt, scale in ROWS:
        cells = []
        for i, r in enumerate(results):
            v = r.get(key)
            cells.append("-" if v is None else v if isinstance(v, str) else fmt.format(v * scale if scale else v))
            if i:
                base = results[0].get(key)
                numbers = isinstance(v, (int, float)) and isinstance(base, (int, float))
                change = f"{100 * (v / base - 1):+.1f}%" if scale and numbers and base else ""
                cells.append(change)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(a: argparse.Namespace, argv: list[str] | None, T: int, rounds: list[list[dict[str, Any]]]) -> str:
    """The markdown report of the rounds done so far: command, machine, setting, the per-round changes, the table."""
    results = [combine([r[i] for r in rounds]) for i in range(len(rounds[0]))]
    r0 = results[0]
    header = (
        f"Command: `{command_line(['-m', 'bench.resources'], argv)}`  \n"
        f"Machine: {platform.platform()}, {r0['device_name']}, device `{a.device}`, torch {r0['torch']}, "
        f"{a.threads} thread(s)  \n"
        f"Setting: batch {a.batch}, T = {T}, median of {a.steps} training steps after {a.warmup} "
        f"warm-up steps, random tokens, training's AdamW (fused), "
        f"{'bf16 autocast' if a.device.startswith('cuda') else 'fp32'}; "
        f"each config in a fresh process; {len(rounds)} of {a.rounds} round(s) of all configs in turn, medians over "
        "rounds"
        + ("" if a.device.startswith("cuda") else
           f"; CPU memory from a second process of {sum(MEMORY_STEPS.values())} steps per config and round with "
           f"{' '.join(f'{k}={v}' for k, v in CPU_MEMORY_ENV.items())} (RSS follows the live tensors)") + ".  \n"
        + "".join(f"Wall-time change per round, {r['name']}: "
                  + ", ".join(f"{100 * (x[i]['step_ms'] / x[0]['step_ms'] - 1):+.1f}%" for x in rounds) + "  \n"
                  for i, r in enumerate(results) if i)
    )
    return header + "\n" + table(results)


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, "python -m bench.resources")
    p.add_argument("--pair", action="append", default=[], help=f"built-in pair: {', '.join(PAIRS)}")
    p.add_argument("--config", action="append", default=[], help="YAML training config (its model section)")
    p.add_argument("--seq-len", type=positive_int, help="override T of every config (sparsity rho is kept, so k = T/rho)")
    p.add_argument("--batch", type=positive_int, default=2, help="sequences per step")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed steps first")
    p.add_argument("--device", type=torch_device, default="cpu", help="torch device: cpu, cuda or cuda:N")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="fresh processes per config, all configs in turn each round (medians; load drift hits all alike)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="measure every config also with activation checkpointing (lm/checkpointing.py), next to it")
    p.add_argument("--out", type=output_file, help="also write the markdown table here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        spec = json.loads(a.worker)
        cfg = from_dict({"model": spec["model"]}).model
        print(json.dumps(measure(cfg, spec["batch"], spec["steps"], spec["warmup"], spec["device"], spec["threads"],
                                 spec["checkpointing"])))
        return 0
    configs: list[tuple[str, ModelConfig]] = []
    try:
        for pair in a.pair:
            if pair not in PAIRS:
                raise ValueError(f"unknown pair {pair!r}; known: {', '.join(PAIRS)}")
            configs += PAIRS[pair]()
        configs += [(Path(c).stem, load_config(c).model) for c in a.config]
        if not configs:
            raise ValueError("give at least one --pair or --config")
        if a.seq_len:
            configs = [(n, dataclasses.replace(c, seq_len=a.seq_len)) for n, c in configs]
        modes = (False, True) if a.activation_checkpointing else (False,)
        runs = [(name, cfg, mode) for name, cfg in configs for mode in modes]
        rounds: list[list[dict[str, Any]]] = []
        for _ in range(a.rounds):  # all configs, in turn, per round; the table rewritten after each round
            rounds.append([run_worker(name, cfg, a, mode) for name, cfg, mode in runs])
            text = report(a, argv, configs[0][1].seq_len, rounds)
            if a.out:
                a.out.write_text(text)  # a run stopped at a time limit keeps the rounds it finished
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
