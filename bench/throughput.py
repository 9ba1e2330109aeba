"""Training throughput (tokens/s) of configs on the current device.

One training step = forward + backward + gradient clipping + AdamW/scheduler step, exactly the loss
and optimizer of lm/module.py (no Lightning loop, no data loading: random tokens). Each config runs
`--warmup` untimed steps, then `--steps` timed ones; the table reports the median step time and
tokens/s = batch * seq_len / median. Results go to bench/results/throughput_<device>.md together
with the machine, library versions and the exact command.

    python bench/throughput.py --config configs/quickstart.yaml [--config configs/tiny.yaml] \\
        [model.n_layers=4 data.batch_size=8 ...] [--steps 20 --warmup 5] [--out PATH]
"""
from __future__ import annotations

import contextlib
import os
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning  # noqa: E402
import torch  # noqa: E402

from flops.cli import nonnegative_int, positive_int, script_parser  # noqa: E402
from heads import ConfigError, commit_states  # noqa: E402
from lm.config import Config, load_config  # noqa: E402
from lm.module import LMModule  # noqa: E402
from lm.train import resolve_precision  # noqa: E402


def device_name() -> tuple[torch.device, str]:
    """The device to run on and a short slug for the results file name."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return torch.device("cuda"), "cuda_" + re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return torch.device("cpu"), "cpu"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def measure(cfg: Config, device: torch.device, steps: int, warmup: int) -> dict[str, float]:
    """Median seconds per training step of `cfg` and the derived tokens/s."""
    torch.manual_seed(cfg.trainer.seed)
    module = LMModule(cfg).to(device)
    module.setup("fit")  # what Lightning does before training (trainer.activation_checkpointing)
    opt_cfg = module.configure_optimizers()
    optimizer, scheduler = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    B, T, V = cfg.data.batch_size, cfg.model.seq_len, cfg.model.vocab_size
    tokens = torch.randint(0, V, (B, T + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    bf16 = resolve_precision(cfg.trainer) == "bf16-mixed" and device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            loss = module.losses(x, y)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        commit_states(module.model)  # as training does after every step (MoSA's thresholds, Routing's centroids)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"params": module.model.num_params(), "median_s": median, "tokens_per_s": B * T / median,
            "min_s": min(times), "max_s": max(times), "precision": "bf16-mixed" if bf16 else "32-true"}


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--config", action="append", required=True, help="YAML config (repeatable)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every config")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per config")
    parser.add_argument("--warmup", type=nonnegative_int, default=5, help="untimed steps first")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/throughput_<device>.md")
    args = parser.parse_args(argv)
    try:
        configs = [(path, load_config(path, *args.overrides)) for path in args.config]
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    device, slug = device_name()
    load = os.getloadavg()  # the machine may be shared: record how busy it was
    rows = []
    for path, cfg in configs:
        r = measure(cfg, device, args.steps, args.warmup)
        B, T = cfg.data.batch_size, cfg.model.seq_len
        print(f"{path}: {r['params'] / 1e6:.2f}M params, batch {B} x {T}: median {r['median_s']:.3f} s/step, "
              f"{r['tokens_per_s']:,.0f} tokens/s")
        rows.append(f"| {path} | {r['params'] / 1e6:.2f}M | {B} x {T} | {r['precision']} | {r['median_s']:.4f} "
                    f"| {r['min_s']:.4f} / {r['max_s']:.4f} | {r['tokens_per_s']:,.0f} |")
    threads_env = [f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"] if "OMP_NUM_THREADS" in os.environ else []
    command = shlex.join([*threads_env, "python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    hardware = torch.cuda.get_device_name(0) if device.type == "cuda" else f"{cpu_model()}, {os.cpu_count()} cores"
    lines = [
        f"# Training throughput on {slug}",
        "",
        "One step = forward + backward + clip + AdamW (lm/module.py loss and optimizer), random tokens, "
        f"median of {args.steps} timed steps after {args.warmup} warm-up steps.",
        "",
        f"- command: `{command}` (overrides: {' '.join(args.overrides) or 'none'})",
        f"- device: {hardware}; torch threads: {torch.get_num_threads()}; load average before the run: "
        f"{load[0]:.2f} (1 min)",
        f"- python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}, "
        f"{platform.platform()}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| config | params | batch x T | precision | median step (s) | min / max (s) | tokens/s |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    out = args.out or ROOT / "bench" / "results" / f"throughput_{slug}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
