"""Training throughput (tokens/s) of configs on the current device, side by side.

One training step = trainer.accumulate_grad_batches micro-batches of forward + backward, then lm/module.py's
gradient clipping and the AdamW/scheduler step: the loss (compiled under trainer.compile), clipping and
optimizer of lm/module.py (no Lightning loop, no data loading: random tokens), on the device trainer.accelerator
picks (CUDA where there is a GPU, unless it says cpu). Precision 32-true, or bf16-mixed (autocast) on CUDA. Every
config is built first; then `--rounds` rounds each run `--warmup` untimed and `--steps` timed steps of every
config in turn, so the configs share the machine's state; the table reports the median step time over all timed
steps, tokens/s = accumulate * batch * seq_len / median, and each config's tokens/s as a
ratio to the first config's. Results go to bench/results/throughput_<device>.md together with the machine,
library versions and the exact command.

    python bench/throughput.py --config configs/quickstart.yaml [--config configs/tiny.yaml] \\
        [model.n_layers=4 data.batch_size=8 ...] [--steps 20 --warmup 5 --rounds 1] [--out PATH]
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning  # noqa: E402
import torch  # noqa: E402

from flops.cli import command_line, hardware, nonnegative_int, output_file, positive_int, script_parser  # noqa: E402
from heads import ConfigError, commit_states  # noqa: E402
from lm.config import Config  # noqa: E402
from lm.config_io import load_config  # noqa: E402
from lm.module import LMModule  # noqa: E402
from lm.devices import lightning_accelerator, resolve_precision  # noqa: E402


def device_name(configs: list[Config]) -> tuple[torch.device, str]:
    """The device the configs train on (trainer.accelerator, as lm.train resolves it; one for all of them, to be
    comparable) and a short slug for the results file name."""
    kinds = {lightning_accelerator(cfg.trainer) for cfg in configs}
    if len(kinds) > 1:
        raise ConfigError("the configs train on different devices (trainer.accelerator): time them in separate runs")
    if kinds == {"cuda"}:
        name = torch.cuda.get_device_name(0)
        return torch.device("cuda"), "cuda_" + re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return torch.device("cpu"), "cpu"


class Bench:
    """One config's module, optimizer and random batch, ready to time training steps."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        # trainer.precision auto as training would resolve it on this device (not on the machine's first GPU)
        on = "gpu" if device.type == "cuda" else "cpu"
        precision = resolve_precision(dataclasses.replace(cfg.trainer, accelerator=on))
        if precision not in ("32-true", "bf16-mixed") or (precision == "bf16-mixed" and device.type != "cuda"):
            raise ConfigError(f"trainer.precision {precision} is not timed here: 32-true, or bf16-mixed on CUDA")
        torch.manual_seed(cfg.trainer.seed)
        self.cfg, self.device, self.precision = cfg, device, precision
        self.module = LMModule(cfg).to(device)
        self.module.setup("fit")  # what Lightning does before training (trainer.activation_checkpointing)
        self.module.log = lambda *args, **kwargs: None  # no Lightning trainer to log the gradient norm to
        opt_cfg = self.module.configure_optimizers()
        self.optimizer, self.scheduler = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
        B, T, V = cfg.data.batch_size, cfg.model.seq_len, cfg.model.vocab_size
        tokens = torch.randint(0, V, (B, T + 1), device=device)
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]
        self.accumulate = cfg.trainer.accumulate_grad_batches
        self.tokens_per_step = self.accumulate * B * T
        self.times: list[float] = []

    def step(self) -> float:
        """Seconds of one training step."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else lambda: None
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.precision == "bf16-mixed" else contextlib.nullcontext()
        sync()
        start = time.perf_counter()
        for _ in range(self.accumulate):  # Lightning divides each micro-batch's loss by the accumulation
            with autocast:
                loss = self.module.train_losses(self.x, self.y)[0]
            (loss / self.accumulate).backward()
        self.module.configure_gradient_clipping(self.optimizer, self.cfg.optim.grad_clip)
        self.optimizer.step()
        commit_states(self.module.model)  # as training does after every step (MoSA's thresholds, Routing's centroids)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start

    def run(self, steps: int, warmup: int) -> None:
        for i in range(warmup + steps):
            seconds = self.step()
            if i >= warmup:
                self.times.append(seconds)

    def result(self) -> dict[str, float]:
        median = statistics.median(self.times)
        return {"params": self.module.model.num_params(), "median_s": median, "min_s": min(self.times),
                "max_s": max(self.times), "tokens_per_s": self.tokens_per_step / median}


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--config", action="append", required=True, help="YAML config (repeatable)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every config")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per config")
    parser.add_argument("--warmup", type=nonnegative_int, default=5,
                        help="untimed steps of every config in every round (compilation, allocator warm-up)")
    parser.add_argument("--rounds", type=positive_int, default=1, help="rounds over the configs, in turn")
    parser.add_argument("--out", type=output_file, default=None, help="default bench/results/throughput_<device>.md")
    args = parser.parse_args(argv)
    try:
        configs = [load_config(path, *args.overrides) for path in args.config]
        device, slug = device_name(configs)
        benches = [(path, Bench(cfg, device)) for path, cfg in zip(args.config, configs)]
        if args.warmup == 0 and any(b.cfg.trainer.compile for _, b in benches):
            raise ConfigError("trainer.compile needs --warmup >= 1: the first step compiles")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    load = os.getloadavg()  # the machine may be shared: record how busy it was
    for _ in range(args.rounds):
        for _, bench in benches:
            bench.run(args.steps, args.warmup)
    rows, first = [], benches[0][1].result()["tokens_per_s"]
    for path, bench in benches:
        r, c = bench.result(), bench.cfg
        shape = f"{bench.accumulate} x {c.data.batch_size} x {c.model.seq_len}"
        print(f"{path}: {r['params'] / 1e6:.2f}M params, {shape} tokens a step: median {r['median_s']:.3f} s/step, "
              f"{r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s'] / first:.3f} x the first config)")
        rows.append(f"| {path} | {r['params'] / 1e6:.2f}M | {shape} | {bench.precision} | {c.trainer.compile} "
                    f"| {r['median_s']:.4f} | {r['min_s']:.4f} / {r['max_s']:.4f} | {r['tokens_per_s']:,.0f} "
                    f"| {r['tokens_per_s'] / first:.3f} |")
    command = command_line(["bench/throughput.py"], argv)
    lines = [
        f"# Training throughput on {slug}",
        "",
        "One step = accumulate x (forward + backward), clip + AdamW (lm/module.py loss, clipping and optimizer), "
        f"random tokens; {args.rounds} round(s) over the configs in turn, each {args.warmup} warm-up and "
        f"{args.steps} timed steps of every config; median over the timed steps.",
        "",
        f"- command: `{command}` (overrides: {' '.join(args.overrides) or 'none'})",
        f"- device: {hardware(device.type)}; torch threads: {torch.get_num_threads()}; load average before the run: "
        f"{load[0]:.2f} (1 min)",
        f"- python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}, "
        f"{platform.platform()}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| config | params | accumulate x batch x T | precision | compiled | median step (s) | min / max (s) "
        "| tokens/s | tokens/s / first |",
        "|---|---|---|---|---|---|---|---|---|",
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
