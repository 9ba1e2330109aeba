"""Does a run stopped and resumed from its checkpoint continue like the uninterrupted run? One config, one strategy.

    python -m bench.resume_check --config configs/tiny.yaml --steps 50 [--out PATH] [section.key=value ...]
    python -m bench.resume_check --config configs/tiny.yaml trainer.strategy=deepspeed_stage_2 data.path=data/c4

train_lm.py runs in fresh processes with the same config and seed: A trains --steps optimizer steps
uninterrupted; B gets SIGTERM once it has written the checkpoint of half the steps (lm/preemption.py: it finishes
the step in flight, checkpoints it and exits 143), then `B --resume` trains to the end. The report compares A's
and B's train/loss at every step (trainer.log_every=1): the largest |A - B| up to the stop is the run-to-run noise
of the device's kernels (zero where they are deterministic), the largest after the resume is what resuming
changed on top of it; and the two final validation losses (metrics.json). Run directories go under --work.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from flops.cli import ROOT, command_line, hardware, output_file, positive_int, script_parser
from heads import ConfigError
from lm.config_io import load_config
from lm.run_logs import tb_scalars
from lm.devices import lightning_accelerator


def command(config: str, out: Path, overrides: list[str], steps: int, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "train_lm.py"), "--config", config, *overrides, f"trainer.out_dir={out}",
            f"trainer.max_steps={steps}", "trainer.log_every=1", f"trainer.val_every={steps}",
            f"trainer.ckpt_every={max(1, steps // 2)}", *extra]


def train(cmd: list[str], run: Path, log: Path, stop_after: int | None = None, timeout: float = 1800) -> int:
    """Run `cmd` (training into `run`, output to `log`); with `stop_after`, send SIGTERM once the checkpoint of that
    step is written (TensorBoard's events reach the disk too late to watch). Returns the exit status."""
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while stop_after is not None and proc.poll() is None and time.monotonic() < deadline:
            if (run / "checkpoints" / f"step{stop_after:07d}.ckpt").exists():
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.02)  # a GPU trains the second half of a short run in about a second
        try:
            return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def largest_difference(a: dict[int, float], b: dict[int, float], steps: range) -> float | None:
    """max |a - b| over the steps of `steps` that both logged (None: none did)."""
    both = [abs(a[s] - b[s]) for s in steps if s in a and s in b]
    return max(both) if both else None


def final_val_loss(run: Path) -> float | None:
    path = run / "metrics.json"
    return json.loads(path.read_text()).get("val_loss") if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--config", required=True, help="YAML training config")
    parser.add_argument("--steps", type=positive_int, default=50, help="optimizer steps of the whole run")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "resume_check", help="run directories and logs")
    parser.add_argument("--out", type=output_file, help="also write the markdown report here")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides (trainer.strategy=..., data.path=...)")
    args = parser.parse_intermixed_args(argv)
    try:  # the config the three runs train, checked once here (each run would fail alone, and the verdict mislead)
        device = lightning_accelerator(load_config(args.config, *args.overrides).trainer)  # what the runs train on
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    a, b = args.work / "uninterrupted", args.work / "resumed"
    run = {"A": (a, "--overwrite", None), "B stopped": (b, "--overwrite", args.steps // 2), "B resumed": (b, "--resume", None)}
    status, logs = {}, {}
    for name, (out, flag, stop_after) in run.items():
        logs[name] = args.work / f"{name.replace(' ', '_')}.log"
        status[name] = train(command(args.config, out, args.overrides, args.steps, flag), out, logs[name], stop_after)
    stop_log = logs["B stopped"].read_text()
    found = re.findall(r"stopped by SIGTERM at step (\d+)", stop_log)  # not only the last line: shutdown warnings follow
    stopped = int(found[-1]) if found else None
    stop_line = (stop_log.strip().splitlines() or [""])[-1]
    la, lb = tb_scalars(a, "train/loss"), tb_scalars(b, "train/loss")
    noise = largest_difference(la, lb, range(1, (stopped or 0) + 1))
    after = largest_difference(la, lb, range((stopped or args.steps) + 1, args.steps + 1))
    va, vb = final_val_loss(a), final_val_loss(b)

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.6g}"

    from_scratch = "--resume: continuing from" not in logs["B resumed"].read_text()  # no checkpoint found: no resume
    ran = (stopped is not None and status == {"A": 0, "B stopped": 128 + signal.SIGTERM, "B resumed": 0}
           and not from_scratch and len(la) == len(lb) == args.steps and None not in (va, vb))
    val_diff = None if va is None or vb is None else abs(va - vb)
    if not ran:
        failed = next((n for n, code in status.items() if code not in (0, 128 + signal.SIGTERM)), None)
        why = (f"run {failed} exited with {status[failed]}: "
               f"{(logs[failed].read_text().strip().splitlines() or [''])[-1]}" if failed else
               "B ended before the SIGTERM landed: raise --steps" if status["B stopped"] == 0 else
               "B's --resume did not continue from a checkpoint" if from_scratch else
               "a run did not do its part (exit statuses, steps logged)")
        verdict = f"FAILED: {why}; see the logs in {args.work}"
    elif after == 0 and val_diff == 0:
        verdict = "the resumed run equals the uninterrupted one, bit for bit"
    else:
        verdict = (f"the resumed run differs from the uninterrupted one by up to {num(after)} in train/loss after the "
                   f"resume, against {num(noise)} of run-to-run noise before the stop")
    report = "\n".join([
        f"Device: {hardware(device)}; torch {torch.__version__}  ",
        f"Command: `{command_line(['-m', 'bench.resume_check'], argv)}`",
        "",
        "| run | exit status | train/loss steps logged | final val loss |",
        "|---|---|---|---|",
        f"| A uninterrupted | {status['A']} | {len(la)} | {num(va)} |",
        f"| B stopped (SIGTERM), then --resume | {status['B stopped']}, {status['B resumed']} | {len(lb)} | {num(vb)} |",
        "",
        f"B stopped at step {stopped if stopped is not None else '? (' + stop_line + ')'} of {args.steps}. "
        f"max |A - B| train/loss: {num(noise)} up to the stop (run-to-run noise), {num(after)} after the resume; "
        f"final val loss |A - B| = {num(val_diff)}.",
        "",
        f"Verdict: {verdict}.",
    ])
    print(report)
    if args.out:
        args.out.write_text(report + "\n")
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
