"""Forward+backward time and peak memory of head groups vs dense heads at equal forward FLOPs.

    flock /tmp/cpu_heavy.lock env OMP_NUM_THREADS=1 .venv/bin/python -m bench.heads --out heads_cpu.md
    python -m bench.heads --device cuda --d-model 512 --head-dim 64 --out heads_gpu.md
    python -m bench.heads --T 1024 --variants dense mosa-threshold mosaic fixed routing mita agent local topk

The variants are MoSA's two selections by default, or any head type (`--variants`, default options plus
`--sparsity` where the type has one); `mosa-lean` is mosa-threshold with the Triton kernels off
(heads.gathered.fused_disabled: the lean PyTorch core, which CPU runs anyway) and `mosa-tiled` mosa-threshold with
the whole-head kernels off (heads.gathered.whole_head_disabled: the tiled kernels around SDPA take every head), to
compare the three cores on a GPU, and `mosa-column-grid` mosa-threshold with the Triton scatter's grid of before
2026-12-01 (heads.gathered_triton.column_loop_disabled: a program per column block, each reading its U tile from L2).
For each T, `--dense-heads` dense heads set the budget; each other variant gets the largest head count whose forward
FLOPs (MoSA App. C via flops/formulas.py: dense 8hh'T + 4h'T^2, MoSA 8hh'k + 4h'k^2 + 2hT + h'k per head) do not
exceed it. Every (T, variant) runs in a fresh
subprocess, one after the other, so the ratios come from one run on one machine. Peak memory is that of the
step after a warm-up step (one-time allocations, ~40 MiB of autograd and BLAS buffers on CPU, excluded): CPU =
peak-RSS increase over the RSS before that step (VmHWM, reset by /proc/self/clear_refs), in a separate process
whose glibc returns every freed block over 128 KiB to the system (MALLOC_MMAP_THRESHOLD_, a fixed threshold):
RSS then follows the live tensors, as CUDA's counter does, instead of what the allocator kept from earlier
allocations (with glibc's default a MiTA step read 850 MiB against ~550 MiB live); CUDA =
max_memory_allocated minus allocated before the step. Time: median of `--repeats` fwd+bwd steps after those
two, in a process with the default allocator (the fixed threshold makes every large allocation
page-fault afresh, ~1.5x the time). The column "peak − param grads" subtracts the bytes of the group's
parameter gradients (alive at the end of backward): a MoSA group at equal FLOPs has many times the dense group's
parameters (dense-head FLOPs over MoSA-head FLOPs: 276 / 5 = 55x at h = 512, h' = 64, T = 1024, rho = 32), so
this is the activation memory the head's implementation is responsible for; on CUDA it still holds autocast's bf16
copies of the weights (2 bytes per parameter, saved for backward as training's bf16-mixed saves them).
Precision: fp32 on CPU, bf16 autocast on CUDA (as training's bf16-mixed: flash SDPA, the Triton kernels' bf16
tiles). The column "saved" counts exactly the bytes one forward pass keeps for backward (`saved_bytes`, parameters
and their autocast copies left out): no allocator, no noise, the same on any machine at one precision.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from flops.cli import (CPU_MEMORY_ENV, command_line, hardware, output_file, positive_int, run_in_worker, script_parser,
                       torch_device, use_device)

VARIANTS = {  # name -> (head type, options; types with a `sparsity` option get --sparsity)
    "dense": ("dense", {}),
    "mosa-threshold": ("mosa", {"selection": "threshold"}),
    "mosa-expert_choice": ("mosa", {"selection": "expert_choice"}),
    "mosa-lean": ("mosa", {"selection": "threshold"}),  # mosa-threshold on the lean PyTorch core, on CUDA too
    "mosa-tiled": ("mosa", {"selection": "threshold"}),  # on CUDA: the tiled kernels, also for heads that fit on chip
    "mosa-column-grid": ("mosa", {"selection": "threshold"}),  # on CUDA: the scatter's grid before 2026-12-01
    "mosaic": ("mosaic", {}),
    "fixed": ("fixed", {}),
    "routing": ("routing", {}),
    "mita": ("mita", {}),
    "mita-published": ("mita", {"variant": "published"}),  # Algorithm 1 over the whole sequence: not causal
    "agent": ("agent", {}),
    "agent-published": ("agent", {"variant": "published"}),  # eq. 5 over the whole sequence, fixed n: not causal
    "local": ("local", {}),
    "topk": ("topk", {}),
}
DEFAULT_VARIANTS = ["dense", "mosa-threshold", "mosa-expert_choice"]
CORES = {"mosa-lean": "lean", "mosa-tiled": "tiled",  # variants that force a gathered-head core on CUDA (worker)
         "mosa-column-grid": "column-grid"}  # ... or the Triton scatter's earlier grid, a program per column block


def matched_count(variant: str, T: int, args: argparse.Namespace) -> tuple[int, int, dict]:
    """(heads, forward FLOPs, options) of `variant` FLOP-matched to args.dense_heads dense heads; ValueError if
    not even one head fits, or the options do not fit T (k > T: a config load's one line)."""
    from flops.formulas import group_cost
    from heads import GroupContext, head_class, make_options

    budget = group_cost("dense", args.d_model, args.head_dim, T, args.dense_heads).flops
    head_type, options = VARIANTS[variant]
    if head_type == "dense":
        return args.dense_heads, budget, {}
    if "sparsity" in {f.name for f in dataclasses.fields(head_class(head_type).Options)}:
        options = {**options, "sparsity": args.sparsity}
    make_options(head_type, options, GroupContext(args.d_model, args.head_dim, T)).validate_length(head_type, T)
    per_head = group_cost(head_type, args.d_model, args.head_dim, T, 1, options).flops
    n = budget // per_head
    if n == 0:
        raise ValueError(f"{variant}: not even one head fits the FLOP budget of {args.dense_heads} dense head(s) "
                         f"at T = {T}")
    return n, group_cost(head_type, args.d_model, args.head_dim, T, n, options).flops, options


def batch_at(T: int, args: argparse.Namespace) -> int:
    """Sequences per step at length T: --batch, or max(1, --tokens // T) (at most --tokens tokens per step, where
    T <= --tokens; at least one sequence)."""
    return max(1, args.tokens // T) if args.tokens else args.batch


def is_cast_of(t: torch.Tensor, params: tuple[torch.Tensor, ...]) -> bool:
    """Whether t's storage holds a lower-precision copy of one of `params` (autocast casts each weight once per
    forward pass and saves the copy for backward), in any layout: the same values, in some order."""
    storage = t.untyped_storage()
    for p in params:
        if t.dtype != p.dtype and t.is_floating_point() and storage.nbytes() == p.numel() * t.element_size():
            flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)
            if torch.equal(flat.sort().values, p.detach().to(t.dtype).flatten().sort().values):
                return True
    return False


def saved_storages(group: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor,
                   exclude: tuple[torch.Tensor, ...] = (), casts_of: tuple[torch.Tensor, ...] = ()) -> list[int]:
    """Sizes in bytes of the distinct storages that one forward pass of `group` leaves saved for backward
    (torch.autograd.graph.saved_tensors_hooks), except those of `exclude` and the lower-precision copies of
    `casts_of` (`is_cast_of`: under autocast, the bf16 weights). Counted once the pass is over, among the
    saved tensors still alive: a tensor saved by a branch the pass dropped is freed, and its memory may be reused by
    a later one, so counting at save time would be neither exact nor repeatable. (Under the hooks, a dropped node
    that saved its own output, e.g. exp's, keeps it through a reference cycle the collector cannot see: still
    counted.)"""
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = group(x, positions)
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    sizes = {}
    for ref in saved:
        t = ref()
        if t is None or (ptr := t.untyped_storage().data_ptr()) in skip or ptr in sizes:
            continue
        if is_cast_of(t, casts_of):
            skip.add(ptr)
        else:
            sizes[ptr] = t.untyped_storage().nbytes()
    del y  # frees the graph and what it saved
    return list(sizes.values())


def saved_bytes(group: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor) -> int:
    """Bytes of the tensors one forward pass saves for backward, distinct storages, not counting the parameters
    (in any precision) and the input: what the implementation keeps alive between forward and backward, exactly and
    independently of the allocator."""
    params = tuple(group.parameters())
    return sum(saved_storages(group, x, positions, (x, *params), casts_of=params))


def worker(spec: dict) -> dict:
    """Build one head group, run fwd+bwd steps, return time and peak memory."""
    from heads import GroupContext, head_class, make_options
    from heads.gathered import fused_disabled, whole_head_disabled
    from heads.gathered_triton import column_loop_disabled

    torch.manual_seed(0)
    device = use_device(spec["device"])
    T, h = spec["T"], spec["d_model"]
    ctx = GroupContext(h, spec["head_dim"], T)
    group = head_class(spec["type"])(ctx, spec["count"], make_options(spec["type"], spec["options"], ctx)).to(device)
    for p in group.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(spec["batch"], T, h, device=device, requires_grad=True)
    pos = torch.arange(T, device=device).expand(spec["batch"], T)
    cot = torch.randn_like(x)  # a dense upstream gradient, as in training (not sum()'s broadcast ones)

    def precision() -> contextlib.AbstractContextManager:
        """fp32 on CPU; on CUDA bf16 autocast, as training's bf16-mixed (flash SDPA, bf16 Triton tiles), around the
        forward pass only."""
        return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def forced() -> contextlib.AbstractContextManager:
        """The gathered-head path a variant forces (CORES), around forward and backward (the scatter's grid is chosen
        at each launch, the backward's too): "lean" with the Triton kernels off, "tiled" with the whole-head kernels
        off, "column-grid" with the scatter's column loop off."""
        switch = {"lean": fused_disabled, "tiled": whole_head_disabled, "column-grid": column_loop_disabled}.get(
            spec.get("core"))
        return switch() if switch else contextlib.nullcontext()

    def step() -> None:
        with forced():
            with precision():
                y = group(x, pos)
            y.backward(cot)
        x.grad = None
        group.zero_grad(set_to_none=True)

    step()  # warm-up: one-time allocations (autograd's and the BLAS libraries' buffers, ~40 MiB on CPU) land here
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = reset_peak_rss()
        step()
        peak = _status_kib("VmHWM") * 1024 - base
    times = []
    for _ in range(spec["repeats"]):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    grad_bytes = sum(p.numel() * p.element_size() for p in group.parameters())
    with forced(), precision():
        saved = saved_bytes(group, x, pos)
    return {"seconds": statistics.median(times) if times else None, "peak_bytes": peak, "grad_bytes": grad_bytes,
            "saved_bytes": saved,
            "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}


def _status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (Linux), e.g. VmRSS (resident now) or VmHWM (peak resident)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def reset_peak_rss() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux clear_refs 5); that RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def run_worker(spec: dict, env: dict[str, str] | None = None) -> dict:
    """One fresh worker process (extra environment variables `env`); its result. RuntimeError with the worker's
    last stderr line if it fails."""
    return run_in_worker("bench.heads", spec, f"T = {spec['T']}, {spec['count']} {spec['type']} head(s)", env)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--T", type=positive_int, nargs="+", default=[1024, 4096, 8192], help="sequence lengths")
    parser.add_argument("--d-model", type=positive_int, default=128, help="model width h")
    parser.add_argument("--head-dim", type=positive_int, default=32, help="head width h'")
    parser.add_argument("--dense-heads", type=positive_int, default=4, help="dense heads that set the FLOP budget")
    parser.add_argument("--sparsity", type=positive_int, default=32, help="rho of the variants whose type has one")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--batch", type=positive_int, default=1, help="sequences per step")
    sizes.add_argument("--tokens", type=positive_int, default=None,
                       help="tokens per step instead: batch max(1, tokens // T) at each T (e.g. 65536: training's "
                            "batch 64 at T = 1024, 8 at T = 8192)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="timed fwd+bwd steps (median reported)")
    parser.add_argument("--rounds", type=positive_int, default=1, help="fresh processes per variant, alternating (medians)")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS),
                        help="head groups to measure (dense = the budget)")
    parser.add_argument("--device", type=torch_device, default="cpu", help="torch device: cpu, cuda or cuda:N")
    parser.add_argument("--out", type=output_file, default=None, help="write a markdown table here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    command = command_line(["-m", "bench.heads"], argv)

    def write(rows: list[dict]) -> None:  # after each T: a run stopped at a time limit keeps the lengths it finished
        if args.out:
            Path(args.out).write_text(format_table(rows, args, command))

    try:
        rows = measure_all(args, write)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(rows, args, command))
    return 0


def measure_all(args: argparse.Namespace, done: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """One row per (T, variant): the medians over the rounds, passed to `done` after each T. ValueError before any
    work if a variant gets no head; RuntimeError if a worker fails."""
    matched = {(T, v): matched_count(v, T, args) for T in args.T for v in args.variants}
    rows = []
    for T in args.T:
        batch = batch_at(T, args)
        runs: dict[str, list[dict]] = {v: [] for v in args.variants}
        for _ in range(args.rounds):  # variants alternate, so load drift on a shared machine hits all alike
            for variant in args.variants:
                count, flops, options = matched[T, variant]
                spec = dict(type=VARIANTS[variant][0], options=options, count=count, T=T, d_model=args.d_model,
                            head_dim=args.head_dim, batch=batch, repeats=args.repeats, device=args.device,
                            core=CORES.get(variant))
                result = run_worker(spec)
                if not args.device.startswith("cuda"):  # as format_table states it
                    result["peak_bytes"] = run_worker({**spec, "repeats": 0}, CPU_MEMORY_ENV)["peak_bytes"]
                runs[variant].append(result)
                print(f"T={T:5d} {variant:20s} heads={count:5d} {flops * batch / 1e9:8.2f} GFLOP fwd  "
                      f"{runs[variant][-1]['seconds'] * 1e3:9.1f} ms  "
                      f"{runs[variant][-1]['peak_bytes'] / 2**20:9.1f} MiB", flush=True)
        for variant, results in runs.items():
            count, flops, _ = matched[T, variant]
            keys = ("seconds", "peak_bytes", "grad_bytes", "saved_bytes")
            median = {key: statistics.median(r[key] for r in results) for key in keys}
            rows.append(dict(T=T, variant=variant, heads=count, gflops=flops * batch / 1e9, **median))
        done(rows)
    return rows


def batches(args: argparse.Namespace) -> str:
    """The setup's batch: "batch 4", or with --tokens the batch at each T ("batch 8 at T = 8192, 64 at T = 1024
    (max(1, 65536 // T))")."""
    if not args.tokens:
        return f"batch {args.batch}"
    at = ", ".join(f"{batch_at(T, args)} at T = {T}" for T in args.T)
    return f"batch {at} (max(1, {args.tokens} // T))"


def format_table(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    dense = {r["T"]: r for r in rows if r["variant"] == "dense"}
    lines = [
        "# Head groups vs dense heads at equal forward FLOPs (bench/heads.py)",
        "",
        f"Machine: {hardware(args.device)}, {platform.system()} {platform.release()}; torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}; Python {platform.python_version()}; "
        + ("bf16 autocast (as training's bf16-mixed)." if args.device.startswith("cuda") else "fp32."),
        f"Setup: h = {args.d_model}, h' = {args.head_dim}, {batches(args)}, ρ = {args.sparsity}; the dense group has "
        f"{args.dense_heads} heads, each other group the most heads whose App. C forward FLOPs (flops/formulas.py) fit the same budget. "
        f"Time = median fwd+bwd of {args.repeats} steps after two, median over {args.rounds} alternating rounds "
        f"of fresh processes; memory = the step after a warm-up step: "
        + ("CUDA max_memory_allocated increase." if args.device.startswith("cuda") else
           "peak-RSS increase (VmHWM after clear_refs) of a fresh process with MALLOC_MMAP_THRESHOLD_=131072, so "
           "that RSS follows the live tensors."),
        "",
        f"Command: `{command}`",
        "",
        "Saved = bytes of the tensors a forward pass saves for backward (saved_tensors_hooks; distinct storages, "
        "parameters, their autocast copies and the input excluded): exact, allocator-independent.",
        "",
        "| T | variant | heads | fwd GFLOP | fwd+bwd ms | time / dense | peak MiB | memory / dense "
        "| peak − param grads MiB | that / dense | saved MiB | saved / dense |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        d = dense.get(r["T"])
        t_ratio = f"{r['seconds'] / d['seconds']:.2f}" if d else "-"
        m_ratio = f"{r['peak_bytes'] / d['peak_bytes']:.2f}" if d and d["peak_bytes"] > 0 else "-"
        act, d_act = r["peak_bytes"] - r["grad_bytes"], d["peak_bytes"] - d["grad_bytes"] if d else 0
        a_ratio = f"{act / d_act:.2f}" if d and d_act > 0 and act >= 0 else "-"  # < 0: below what RSS resolves
        s_ratio = f"{r['saved_bytes'] / d['saved_bytes']:.2f}" if d and d["saved_bytes"] > 0 else "-"
        lines.append(f"| {r['T']} | {r['variant']} | {r['heads']} | {r['gflops']:.2f} | {r['seconds'] * 1e3:.1f} | "
                     f"{t_ratio} | {r['peak_bytes'] / 2**20:.1f} | {m_ratio} | {act / 2**20:.1f} | {a_ratio} | "
                     f"{r['saved_bytes'] / 2**20:.2f} | {s_ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
