"""MiTA's routed experts on CUDA: packed varlen kernels (flash-attn, else Triton) vs the padded path,
side by side in one run: forward+backward time and peak memory of one MiTA head group.

    python -m bench.mita_varlen --T 1024 4096 16384 --out bench/results/mita_varlen_gpu.md

Both paths compute the same function (tests/test_varlen.py); the padded path packs each expert's queries
into groups of b rows (its last group padded), the varlen path packs exactly the (query, expert) pairs.
Time: median of `--repeats` fwd+bwd steps after `--warmup` steps, CUDA events; memory:
max_memory_allocated increase over the state before the step. bf16 inputs.
"""
from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
from pathlib import Path

import torch

from flops.cli import nonnegative_int, output_file, positive_int, script_parser


def run(T: int, varlen: bool, args: argparse.Namespace) -> tuple[float, int, str]:
    """(median seconds, peak bytes, backend name) of fwd+bwd of one MiTA group at length T."""
    from heads import GroupContext, head_class, make_options
    from heads import varlen as kernels

    torch.manual_seed(0)
    ctx = GroupContext(args.d_model, args.head_dim, T)
    options = make_options("mita", {"block": args.block, "k": args.k, "s": 1}, ctx)
    group = head_class("mita")(ctx, args.heads, options).cuda().bfloat16()
    x = torch.randn(args.batch, T, args.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(T, device="cuda").expand(args.batch, T)
    backend = kernels.cuda_backend(x.new_empty(1, args.head_dim))  # what MiTA's q[..., h'] gets
    with contextlib.nullcontext() if varlen else kernels.disabled():
        times = []
        for i in range(args.warmup + args.repeats):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            group(x, pos).float().square().mean().backward()
            end.record()
            x.grad = None  # fresh gradients every step, as in training (none accumulate across steps)
            group.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(start.elapsed_time(end) / 1e3)
        peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(times), peak, type(backend).__name__ if varlen else "padded"


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--T", type=positive_int, nargs="+", default=[1024, 4096, 16384], help="sequence lengths")
    p.add_argument("--d-model", type=positive_int, default=1024, help="model width h")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head width h'")
    p.add_argument("--heads", type=positive_int, default=16, help="heads in the MiTA group")
    p.add_argument("--block", type=positive_int, default=64, help="block size b (m = T / b landmarks)")
    p.add_argument("--k", type=positive_int, default=64, help="tokens per routed expert")
    p.add_argument("--batch", type=positive_int, default=4, help="sequences per step")
    p.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed steps first")
    p.add_argument("--repeats", type=positive_int, default=10, help="timed fwd+bwd steps (median reported)")
    p.add_argument("--out", type=output_file, default=None, help="write a markdown table here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench.mita_varlen times the CUDA kernels; no CUDA device here", file=sys.stderr)
        return 2
    rows = []
    for T in args.T:
        padded, varlen = run(T, False, args), run(T, True, args)
        rows.append((T, padded, varlen))
        print(f"T={T:6d} padded {padded[0] * 1e3:8.2f} ms {padded[1] / 2**20:8.1f} MiB | {varlen[2]} "
              f"{varlen[0] * 1e3:8.2f} ms {varlen[1] / 2**20:8.1f} MiB | time ratio {varlen[0] / padded[0]:.2f}", flush=True)
    lines = [
        "# MiTA routed experts: packed varlen kernels vs padded (bench/mita_varlen.py)", "",
        f"Machine: {torch.cuda.get_device_name()}, {platform.system()} {platform.release()}; torch {torch.__version__}, "
        f"Python {platform.python_version()}.",
        f"Setup: one MiTA group of {args.heads} heads, h = {args.d_model}, h' = {args.head_dim}, b = {args.block}, "
        f"k = {args.k}, s = 1, batch {args.batch}, bf16; median fwd+bwd of {args.repeats} steps after {args.warmup}.", "",
        f"Command: `python -m bench.mita_varlen {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
        "| T | padded ms | varlen ms | varlen / padded | padded MiB | varlen MiB | varlen kernels |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for T, (pt, pm, _), (vt, vm, name) in rows:
        lines.append(f"| {T} | {pt * 1e3:.2f} | {vt * 1e3:.2f} | {vt / pt:.2f} | {pm / 2**20:.1f} | {vm / 2**20:.1f} | {name} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
