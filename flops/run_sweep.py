"""Train the points of a sweep (flops/sweep.py) one after another; resumable and failure-tolerant.

    python -m flops.run_sweep sweeps/tiny [--only mosa_s8,dense_s1] [--leakfree-windows N] [--lock /tmp/cpu_heavy.lock] \
        [trainer.max_steps=500 ...]

For each point of `<dir>/sweep.json`: record it `failed` if `<out_dir>` holds a run of other settings than the
point's with the given overrides (other in more than how long it trains, lm.run_dir.result_changes: an earlier sweep,
or overrides it was not trained with); skip it if `<out_dir>/metrics.json` already reports step >=
trainer.max_steps (finished); otherwise run `train_lm.py --config <point>.yaml --resume [overrides]`
(an interrupted point continues from its newest checkpoint), log to `<out_dir>/train.log` (no progress
bars: the log is not a terminal). `<dir>/status.json` records every point: `running` (with the
training process id) while it trains, then `done` only when the run reached trainer.max_steps,
`partial` when it stopped early without an error (trainer.max_minutes), `failed` with its exit code
and the log's last line (the sweep goes on), or `interrupted`: SIGTERM/SIGINT to the runner is
forwarded to the training process (or stops the leak-free evaluation), the point is recorded as interrupted and the
runner exits with 128 + the signal number (a rerun resumes it). A line per point shows progress and the ETA (mean time
of the points trained so far). For a point whose heads are not causal (e.g. MoSA expert choice), the finished model is
evaluated leak-free (lm/leakfree.py: every prediction from its own prefix) on `--leakfree-windows`
validation windows (default: the same windows as training's validation), written to
`<out_dir>/leakfree.json` with the step it evaluated; a point trained but not yet evaluated at its last step (also
one trained further since) is only evaluated. Exit status 1 if any point this run handled (all, or --only's) failed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from flops.cli import positive_int, script_parser
from data_prep.atomic import atomic_write
from flops.json_files import point_results, read_status, read_sweep
from heads.base import ConfigError
from lm.run_files import read_json

if TYPE_CHECKING:
    from lm.config import Config

ROOT = Path(__file__).resolve().parents[1]
LEAK_FREE = "leak-free evaluation"  # the phase of a point interrupted after its training


def point_config(entry: dict[str, Any], overrides: list[str]) -> Config:
    """The point's config with the runner's overrides, a relative data.path resolved as train_lm.py (run from the
    repository root) resolves it."""
    from lm.config_io import load_config

    cfg = load_config(entry["config"], *overrides, warnings=False)  # training prints the warnings
    data = ROOT / cfg.data.path
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(data)))


def trained(entry: dict[str, Any], overrides: list[str]) -> bool:
    """The point's metrics.json reports the final step."""
    metrics = Path(entry["out_dir"]) / "metrics.json"
    if not metrics.is_file():
        return False
    return read_json(metrics).get("step", 0) >= point_config(entry, overrides).trainer.max_steps


def other_run(entry: dict[str, Any], overrides: list[str]) -> str | None:
    """Why the point's run directory holds a run of other settings than the point's with `overrides` (other in more
    than how long it trains: lm.run_dir.result_changes), or None: skipped as finished or resumed, its result would be
    reported under settings it was not trained with."""
    from lm.run_dir import result_changes

    cfg = point_config(entry, overrides)  # bad overrides stop the runner (ConfigError), a damaged run only its point
    try:
        changes = result_changes(Path(entry["out_dir"]), cfg)
    except ConfigError as err:
        return str(err)
    if not changes:
        return None
    return (f"{entry['out_dir']} holds a run with other settings ({'; '.join(changes)}): pass the overrides it was "
            "trained with, or write the sweep into a new --out")


def needs_leak_free(entry: dict[str, Any]) -> bool:
    """A non-causal point without a leak-free result of the step its metrics.json reports."""
    return not entry["causal"] and not point_results(entry["out_dir"])[1]


def leak_free_eval(entry: dict[str, Any], windows: int | None) -> dict[str, float]:
    """Teacher-forced and leak-free loss/perplexity of the point's last checkpoint on validation windows
    (default: the data.val_batches * data.batch_size windows that training validated on). A DeepSpeed run's
    checkpoint directory is made one file first (<out_dir>/consolidated.ckpt, lm.consolidate)."""
    from lm.checkpoint import is_deepspeed_dir, model_from_checkpoint, read_checkpoint
    from lm.consolidate import consolidate
    from lm.data import ValWindows, open_split
    from lm.leakfree import evaluate

    last = Path(entry["out_dir"]) / "checkpoints" / "last.ckpt"
    if is_deepspeed_dir(last):
        consolidate(last, Path(entry["out_dir"]) / "consolidated.ckpt")
        last = Path(entry["out_dir"]) / "consolidated.ckpt"
    ckpt = read_checkpoint(last, mmap=False)
    model, cfg = model_from_checkpoint(ckpt, last)
    windows = windows or cfg.data.val_batches * cfg.data.batch_size
    val = ValWindows(open_split(cfg.data.path, "val", cfg.model), cfg.model.seq_len, windows)
    result = evaluate(model, val.tokens().split(cfg.data.batch_size), leak_free=True)
    text = json.dumps({**result, "windows": windows, "step": ckpt["global_step"]}, indent=1)
    atomic_write(Path(entry["out_dir"]) / "leakfree.json", lambda f: f.write(text.encode()))
    return result


def train_point(entry: dict[str, Any], overrides: list[str], started: Callable[[int], None]) -> dict[str, Any]:
    """Run train_lm.py for one point (resuming from its last checkpoint), calling `started(pid)` once it
    runs; its status (module doc), with the log's last line on failure. SIGTERM/SIGINT received
    meanwhile go to the training process (in a session of its own, so a terminal's Ctrl-C reaches it
    once, through here)."""
    out = Path(entry["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    cmd = [sys.executable, str(ROOT / "train_lm.py"), "--config", entry["config"], "--resume", *overrides]
    received: list[int] = []
    with open(out / "train.log", "a") as log:
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def forward(signum: int, frame: Any) -> None:
            received.append(signum)
            child.send_signal(signum)

        with signals_to(forward):
            started(child.pid)
            rc = child.wait()
    seconds = round(time.time() - start, 1)
    if received:
        return {"status": "interrupted", "signal": signal.Signals(received[0]).name, "rc": rc, "seconds": seconds}
    finished = rc == 0 and trained(entry, overrides)
    status: dict[str, Any] = {"status": "done" if finished else "partial" if rc == 0 else "failed", "rc": rc,
                              "seconds": seconds}
    if rc != 0:
        lines = (out / "train.log").read_text(errors="replace").strip().splitlines()
        status["error"] = lines[-1] if lines else f"exit status {rc}"
    return status


@contextlib.contextmanager
def signals_to(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """SIGTERM and SIGINT handled by `handler` for the duration of the block."""
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


class Interrupted(BaseException):
    """SIGTERM/SIGINT received during the leak-free evaluation (args: the signal number); not an Exception, so that
    evaluate_point does not record it as the evaluation's failure."""


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def evaluate_interruptibly(entry: dict[str, Any], status: dict[str, Any], windows: int | None) -> dict[str, Any]:
    """evaluate_point, or on SIGTERM/SIGINT meanwhile the point's status `interrupted` (phase: the evaluation), as for
    a signal during training (module doc)."""
    try:
        with signals_to(_interrupt):
            return evaluate_point(entry, status, windows)
    except Interrupted as sig:
        return {**status, "status": "interrupted", "signal": signal.Signals(sig.args[0]).name, "phase": LEAK_FREE}


def describe(status: dict[str, Any]) -> str:
    """A point's status as the runner prints it, e.g. `done in 6.7 s` or `failed (rc 2) in 3.1 s: <log line>`."""
    failed = status["status"] == "failed"
    text = status["status"] + (f" (rc {status['rc']})" if failed and status.get("rc") else "")
    if "seconds" in status:
        text += f" in {status['seconds']} s"
    if "leakfree_ppl" in status:
        text += f", leak-free perplexity {status['leakfree_ppl']:.2f}"
    if status["status"] == "partial":
        text += " (stopped before trainer.max_steps; rerun to continue)"
    return text + (f": {status['error']}" if failed else "")


def evaluate_point(entry: dict[str, Any], status: dict[str, Any], windows: int | None) -> dict[str, Any]:
    """Add the leak-free evaluation of a trained non-causal point to its status (a failure is recorded)."""
    try:
        return {**status, "leakfree_ppl": leak_free_eval(entry, windows)["leakfree_ppl"]}
    except Exception as err:  # recorded, not fatal: the sweep goes on
        return {**status, "status": "failed", "error": f"{LEAK_FREE}: {type(err).__name__}: {err}"}


def finished(previous: dict[str, Any] | None) -> dict[str, Any]:
    """The status of a point whose training had already finished: what an earlier "done" recorded (its seconds,
    its leak-free perplexity), the training's rc and seconds of a failure or interruption after it (in the leak-free
    evaluation's: rc 0, or its phase), nothing of another failure or run (rc, error, pid)."""
    previous = previous or {}
    if previous.get("status") == "done":
        return dict(previous)
    if (previous.get("status") == "failed" and previous.get("rc") == 0) or previous.get("phase") == LEAK_FREE:
        return {k: previous[k] for k in ("rc", "seconds") if k in previous} | {"status": "done"}
    return {"status": "done"}


@contextlib.contextmanager
def locked(path: str | Path | None) -> Iterator[None]:
    """Exclusive flock on `path` (shared heavy-job queue) for the duration of the block; no-op if None."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, "python -m flops.run_sweep")
    p.add_argument("sweep", type=Path, help="directory written by python -m flops.sweep")
    p.add_argument("--only", help="comma-separated point names (default: all)")
    p.add_argument("--leakfree-windows", type=positive_int, help="validation windows for the leak-free evaluation "
                   "(default: the val_batches * batch_size windows of training's validation)")
    p.add_argument("--lock", type=Path, help="hold this lock file (flock) while training each point, e.g. /tmp/cpu_heavy.lock")
    p.add_argument("overrides", nargs="*", help="dotted overrides passed to train_lm.py")
    a = p.parse_intermixed_args(argv)  # overrides before or after the options
    try:
        return run(a)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def run(a: argparse.Namespace) -> int:
    """Train and evaluate the sweep's points (see main); ConfigError for a damaged sweep directory."""
    manifest_file = a.sweep / "sweep.json"
    if not manifest_file.is_file():
        raise ConfigError(f"{manifest_file} not found; write it with python -m flops.sweep")
    points = read_sweep(manifest_file)["points"]
    if a.only:
        wanted = set(a.only.split(","))
        unknown = wanted - {e["name"] for e in points}
        if unknown:
            print(f"error: unknown point(s) {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        points = [e for e in points if e["name"] in wanted]
    status_file = a.sweep / "status.json"
    status = read_status(status_file)

    def save() -> None:
        text = json.dumps(status, indent=1)
        atomic_write(status_file, lambda f: f.write(text.encode()))

    times: list[float] = []  # seconds of each point trained by this runner
    for i, entry in enumerate(points):
        name, left = entry["name"], len(points) - i
        eta = f"ETA {sum(times) / len(times) * left / 60:.1f} min for {left} point(s)" if times else "ETA after the first point"
        head = f"[{i + 1}/{len(points)}] {name}"
        mismatch = other_run(entry, a.overrides)
        if mismatch:
            status[name] = {"status": "failed", "error": mismatch}
            print(f"{head}: {describe(status[name])}", flush=True)
            continue
        if trained(entry, a.overrides) and not needs_leak_free(entry):
            print(f"{head}: finished, skipped", flush=True)
            status[name] = finished(status.get(name))
            continue
        with locked(a.lock):
            if not trained(entry, a.overrides):
                print(f"{head}: training ... ({eta}; log {Path(entry['out_dir']) / 'train.log'})", flush=True)

                # the seconds of earlier runs of the point (partial, interrupted or failed), if this one resumes them
                resumes = any((Path(entry["out_dir"]) / "checkpoints").glob("step*"))
                earlier = status.get(name, {}).get("seconds", 0.0) if resumes else 0.0

                def running(pid: int, name: str = name, earlier: float = earlier) -> None:
                    status[name] = {"status": "running", "pid": pid, **({"seconds": earlier} if earlier else {})}
                    save()

                status[name] = train_point(entry, a.overrides, running)
                times.append(status[name]["seconds"])
                status[name]["seconds"] = round(earlier + status[name]["seconds"], 1)  # over all runs of the point
            else:
                status[name] = finished(status.get(name))
            if status[name]["status"] == "done" and needs_leak_free(entry):
                print(f"{head}: {LEAK_FREE} ...", flush=True)
                status[name] = evaluate_interruptibly(entry, status[name], a.leakfree_windows)
            if status[name]["status"] == "interrupted":
                save()
                print(f"{head}: interrupted by {status[name]['signal']}; rerun to resume it", file=sys.stderr)
                return 128 + signal.Signals[status[name]["signal"]].value
        print(f"{head}: {describe(status[name])}", flush=True)
        save()
    save()
    failed = [e["name"] for e in points if status[e["name"]]["status"] == "failed"]  # this run's points only
    if failed:
        print(f"failed points: {', '.join(failed)} (see {status_file})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
