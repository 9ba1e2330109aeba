"""Resume after kill -9 equals an uninterrupted run, bit for bit on CPU; checkpoint writes are atomic."""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lm.checkpoint import AtomicCheckpointIO
from tests.conftest import child_env
from tests.synthetic import run_overrides, wait_for_file, write_prepared

ROOT = Path(__file__).resolve().parents[1]
STEPS = 150  # long enough that the kill lands well before the end


def command(data: Path, out: Path, *extra: str) -> list[str]:
    """train_lm.py on defaults (an empty YAML file) + the tiny-run overrides."""
    config = data / "empty.yaml"
    config.write_text("{}\n")
    overrides = run_overrides(data, out, max_steps=STEPS, ckpt_every=10, val_every=20)
    return [sys.executable, str(ROOT / "train_lm.py"), "--config", str(config), *overrides, *extra]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_state(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"] == STEPS
    for k, v in a["state_dict"].items():
        assert torch.equal(v, b["state_dict"][k]), f"weights differ: {k}"
    sa, sb = a["optimizer_states"][0], b["optimizer_states"][0]
    assert sa["param_groups"] == sb["param_groups"]
    for i, state in sa["state"].items():
        for name, value in state.items():
            assert torch.equal(value, sb["state"][i][name]), f"optimizer state {i}.{name} differs"
    assert a["lr_schedulers"] == b["lr_schedulers"]
    assert a["val_history"] == b["val_history"]  # same validation losses, bit for bit
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])


def logged_steps(run: Path, tag: str = "train/loss") -> list[int]:
    """The steps of one TensorBoard scalar as TensorBoard reads the run's directory (every event file in order,
    purges applied), repeats included."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def kill_after_logging_past(proc: subprocess.Popen, run: Path, step: int) -> None:
    """SIGKILL a training run once TensorBoard holds train/loss beyond `step`, at a moment (checked with the process
    stopped) when its newest checkpoint's step has its values logged: not in the milliseconds between a
    checkpoint and its step's values (docs/training.md), which a kill right after a checkpoint appears hits."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        os.kill(proc.pid, signal.SIGSTOP)
        acc.Reload()
        logged = max((e.step for e in acc.Scalars("train/loss")), default=0) if "train/loss" in acc.Tags()["scalars"] else 0
        saved = [int(p.stem.removeprefix("step")) for p in (run / "checkpoints").glob("step*.ckpt")]
        if logged > step and saved and logged >= max(saved):
            os.kill(proc.pid, signal.SIGKILL)
            return
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.02)


def test_kill_and_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    """... and TensorBoard shows every step once: what the killed run logged after its checkpoint is purged."""
    data = write_prepared(tmp_path / "data")
    full, killed = tmp_path / "full", tmp_path / "killed"
    uninterrupted = subprocess.Popen(command(data, full, "trainer.log_every=1"), env=child_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # on the other core
    proc = subprocess.Popen(command(data, killed, "trainer.log_every=1"), env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_file(proc, killed / "checkpoints" / "step0000010.ckpt")
    kill_after_logging_past(proc, killed, 11)  # so that the killed run logged a step after its checkpoint
    assert proc.wait(timeout=30) == -signal.SIGKILL, "the run ended before it could be killed"
    saved = sorted((killed / "checkpoints").glob("*.ckpt"))
    for path in saved:  # every checkpoint file present after the kill is complete
        load(path)
    # resume takes the newest step file (the kill may have come before last.ckpt was linked to it)
    killed_at = max(load(p)["global_step"] for p in saved)
    assert 10 <= killed_at < STEPS
    print(f"killed after step {killed_at} ({len(saved)} checkpoint files)")

    subprocess.run(command(data, killed, "trainer.log_every=1", "--resume"), env=child_env(), check=True,
                   capture_output=True, timeout=300)
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.stderr.read()[-2000:]
    assert_same_state(load(full / "checkpoints" / "last.ckpt"), load(killed / "checkpoints" / "last.ckpt"))
    assert logged_steps(killed) == logged_steps(full) == list(range(1, STEPS + 1))


def test_resume_continues_the_random_draws_of_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A head that draws random numbers in training (MoSAIC's random priority, torch.rand per step): a run resumed
    after step 3 of 6 ends with the weights and RNG state of the uninterrupted run, bit for bit, because the
    checkpoint's RNG states are restored (the runs above train dense heads, which draw nothing after
    initialisation, so they pass with or without that restore), and not without it. A rerun of the finished part
    first (it trains nothing, but saves its step again) keeps the saved RNG state, not its own process's."""
    import shutil

    import lm.module
    from lm.config_io import load_config
    from lm.train import train

    data = write_prepared(tmp_path / "data", train_tokens=4000, val_tokens=1000)
    heads = "model.heads=[{type: dense, count: 1}, {type: mosaic, count: 4, options: {sparsity: 4, priority: random}}]"

    def run(out: Path, steps: int, resume: str | None = None) -> dict:
        train(load_config(None, *run_overrides(data, out, max_steps=steps, ckpt_every=3, val_every=3), heads),
              resume=resume)
        return load(out / "checkpoints" / "last.ckpt")

    full = run(tmp_path / "full", 6)
    run(tmp_path / "part", 3)
    shutil.copytree(tmp_path / "part", tmp_path / "unrestored")
    saved = load(tmp_path / "part" / "checkpoints" / "last.ckpt")["rng"]["torch"]
    assert torch.equal(run(tmp_path / "part", 3, resume="last")["rng"]["torch"], saved)
    resumed = run(tmp_path / "part", 6, resume="last")
    assert all(torch.equal(v, resumed["state_dict"][k]) for k, v in full["state_dict"].items())
    assert torch.equal(full["rng"]["torch"], resumed["rng"]["torch"])
    monkeypatch.setattr(lm.module, "set_rng_state", lambda state: None)  # the control: without the restore ...
    unrestored = run(tmp_path / "unrestored", 6, resume="last")  # ... the same resume ends elsewhere
    assert not all(torch.equal(v, unrestored["state_dict"][k]) for k, v in full["state_dict"].items())


class Unpicklable:
    def __reduce__(self):  # noqa: ANN204
        raise RuntimeError("disk full")


def test_ctrl_c_stops_like_sigterm_and_a_second_one_aborts(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the process group, loader workers included: data.num_workers=2) checkpoints the step in
    flight like SIGTERM, says so, and exits 130 with the same one line naming SIGINT (it exited 1 with Lightning's
    "graceful shutdown", the steps since the last checkpoint lost; a worker killed by it crashed the next fetch).
    A second Ctrl-C aborts at once (KeyboardInterrupt)."""
    data = write_prepared(tmp_path / "data")
    out = tmp_path / "run"
    proc = subprocess.Popen(command(data, out, "trainer.val_every=1000", "data.num_workers=2"), env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert wait_for_file(proc, out / "checkpoints" / "step0000010.ckpt"), "the run wrote no checkpoint in time"
    time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    lines = err.strip().splitlines()
    assert lines[-2].startswith("Ctrl-C: stopping after this step, checkpointed (Ctrl-C again to abort at once")
    match = re.fullmatch(rf"error: stopped by SIGINT \(Ctrl-C\) at step (\d+) of {STEPS}; continue from the newest "
                         r"checkpoint with --resume", lines[-1])
    assert match, lines[-1]
    stopped = int(match.group(1))
    assert 10 <= stopped < STEPS and load(out / "checkpoints" / f"step{stopped:07d}.ckpt")["global_step"] == stopped

    from lm.checkpoint import StepCheckpoints
    from lm.preemption import Preemption

    guard = Preemption(StepCheckpoints(tmp_path / "ckpt", 10, 10))
    before = signal.getsignal(signal.SIGINT)
    guard._install()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # the first: a flag
        assert guard.received and guard.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second: abort
    finally:
        guard.teardown(None, None, "fit")  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGINT) is before


def test_sigterm_checkpoints_its_step_exits_143_and_resumes_like_an_uninterrupted_run(tmp_path: Path) -> None:
    """Lightning stops at the next batch end and exits 0, as if the run had finished: train_lm.py checkpoints that
    step (a preemption loses no finished step), says where it stopped, exits 128 + SIGTERM, and --resume from there
    equals the uninterrupted run bit for bit."""
    data = write_prepared(tmp_path / "data")
    full, out = tmp_path / "full", tmp_path / "run"
    no_val = "trainer.val_every=1000"  # validation only at the end: the signal lands in training, not in a validation
    every = "trainer.log_every=1"  # the stopped step's training values are logged too (they used to be lost)
    uninterrupted = subprocess.Popen(command(data, full, no_val, every), env=child_env(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(command(data, out, no_val, every), env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    assert wait_for_file(proc, out / "checkpoints" / "step0000010.ckpt"), "the run wrote no checkpoint in time"
    time.sleep(0.1)  # into the middle of a checkpoint interval
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    last = err.strip().splitlines()[-1]
    match = re.fullmatch(rf"error: stopped by SIGTERM at step (\d+) of {STEPS}; continue from the newest checkpoint "
                         r"with --resume", last)
    assert match, last
    stopped = int(match.group(1))
    assert 10 <= stopped < STEPS and load(out / "checkpoints" / f"step{stopped:07d}.ckpt")["global_step"] == stopped

    subprocess.run(command(data, out, no_val, every, "--resume"), env=child_env(), check=True, capture_output=True,
                   timeout=300)
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.stderr.read()[-2000:]
    assert_same_state(load(full / "checkpoints" / "last.ckpt"), load(out / "checkpoints" / "last.ckpt"))
    assert logged_steps(out) == logged_steps(full) == list(range(1, STEPS + 1))


@pytest.mark.parametrize("where", ["first validation", "last training step", "final validation"])
def test_sigterm_outside_the_step_checks_is_not_lost(where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM that no step's check sees (lm/preemption.py) still stops the run, with what was completed saved:
    in a validation of its own (the first or the final one; it runs to its end) or in the last training step. The
    final validation's checkpoint carries it, so --resume has nothing left to do; after the last training step
    the step is checkpointed without the final validation, which --resume then runs."""
    from lm.config_io import load_config
    from lm.errors import Interrupted
    from lm.module import LMModule
    from lm.train import train

    data = write_prepared(tmp_path / "data", train_tokens=4000, val_tokens=1000)
    cfg = load_config(None, *run_overrides(data, tmp_path / "run", max_steps=4, ckpt_every=3, val_every=3))
    real_val, real_train = LMModule.validation_step, LMModule.training_step
    validations: list[int] = []

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN202
        step, fn = self.trainer.global_step, self.trainer.state.fn
        if batch_idx == 0:
            validations.append(step)
            if fn == "validate" and (step, where) in ((0, "first validation"), (4, "final validation")):
                os.kill(os.getpid(), signal.SIGTERM)
        return real_val(self, batch, batch_idx)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN202
        if where == "last training step" and self.trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_train(self, batch, batch_idx)

    monkeypatch.setattr(LMModule, "validation_step", validation_step)
    monkeypatch.setattr(LMModule, "training_step", training_step)
    stopped = {"first validation": 0, "last training step": 4, "final validation": 4}[where]
    with pytest.raises(Interrupted, match=f"stopped by SIGTERM at step {stopped} of 4;"):
        cfg.trainer.validate_first = True
        train(cfg)
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step*.ckpt"))
    if stopped == 0:
        assert steps == [] and validations == [0]
        return
    assert steps == ["step0000003.ckpt", "step0000004.ckpt"]
    saved = load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    validated = [0, 3, 4] if where == "final validation" else [0, 3]
    assert saved["global_step"] == 4 and [h["step"] for h in saved["val_history"]] == validated == validations
    monkeypatch.setattr(LMModule, "training_step", real_train)
    metrics = train(cfg, resume="last")
    assert [h["step"] for h in metrics["history"]] == [0, 3, 4] and validations == [0, 3, 4]  # each step once
    # a resume that trains nothing reports the last step's loss and memory, as saved with it (it wrote NaN and 0)
    assert metrics["train_loss"] == saved["train_last"]["loss"] and math.isfinite(metrics["train_loss"])
    assert metrics["peak_mem_bytes"] == saved["train_last"]["peak_mem"] > 0


def test_a_time_limit_stop_between_validations_keeps_the_logging_cadence(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.max_minutes stops a run at step 4, a checkpoint step but no validation step (val_every 3): Lightning
    validates on stopping and the checkpoint is written at that validation's end, where Lightning's logging step still
    counts 3. Resumed, the training scalars are logged at the steps of the uninterrupted run (they came one late,
    at 5, 7, 9, 11)."""
    import lm.accumulation
    from lm.config_io import load_config
    from lm.train import train

    data = write_prepared(tmp_path / "data", train_tokens=4000, val_tokens=1000)

    def run(out: Path, resume: str | None = None, **extra: object) -> None:
        train(load_config(None, *run_overrides(data, out, max_steps=12, ckpt_every=2, val_every=3, log_every=2,
                                               **extra)), resume=resume)

    def time_is_up_at_step_4(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001, ANN202
        if trainer.global_step == 4:
            trainer.should_stop = True  # what the timer does when trainer.max_minutes has passed

    run(tmp_path / "full")
    monkeypatch.setattr(lm.accumulation.StepTimer, "on_train_batch_end", time_is_up_at_step_4)
    run(tmp_path / "part", max_minutes=60)
    assert load(tmp_path / "part" / "checkpoints" / "last.ckpt")["global_step"] == 4
    run(tmp_path / "part", resume="last")
    assert logged_steps(tmp_path / "full") == [2, 4, 6, 8, 10, 12] == sorted(set(logged_steps(tmp_path / "part")))


def test_sigterm_stops_only_after_a_finished_step_and_its_validation() -> None:
    """lm/preemption.py: the agreed stop comes after the micro-batch that ends a step (never mid-accumulation),
    after the step's validation when it has one (so its checkpoint carries it), never inside a validation of its
    own; the step is saved unless the step checkpoints already did, and the stop is Lightning's SIGTERMException
    (after a training step: at the next batch's start)."""
    from types import SimpleNamespace

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lm.preemption import Preemption

    saved: list[int] = []
    checkpoints = SimpleNamespace(saved_step=None, save=lambda trainer: saved.append(trainer.global_step),
                                  validates=lambda trainer: trainer.global_step % 10 == 0)  # val_every 10
    preemption = Preemption(checkpoints)  # type: ignore[arg-type]
    votes: list[bool] = []

    def trainer(step: int, fn: str = "fit", accumulate: int = 2) -> SimpleNamespace:
        return SimpleNamespace(global_step=step, accumulate_grad_batches=accumulate, state=SimpleNamespace(fn=fn),
                               strategy=SimpleNamespace(reduce_boolean_decision=lambda d, all: votes.append(d) or d))

    preemption.on_train_batch_end(trainer(7), None, None, None, batch_idx=5)  # type: ignore[arg-type]
    assert votes == [False] and saved == []  # every finished step asks the ranks, nobody got the signal
    preemption.received = True
    preemption.on_train_batch_end(trainer(7), None, None, None, batch_idx=4)  # type: ignore[arg-type]  # mid-step
    preemption.on_train_batch_end(trainer(10), None, None, None, batch_idx=19)  # type: ignore[arg-type]  # validates next
    preemption.on_validation_end(trainer(10, fn="validate"), None)  # type: ignore[arg-type]  # trainer.validate
    assert votes == [False] and saved == [] and not preemption.stopped
    checkpoints.saved_step = 10  # a checkpoint step: saved after its validation by StepCheckpoints
    with pytest.raises(SIGTERMException):
        preemption.on_validation_end(trainer(10), None)  # type: ignore[arg-type]
    assert saved == [] and preemption.stopped
    # after a training step: saved at its end, stopped at the next batch's start, so that Lightning logs the step
    after_step = Preemption(checkpoints)  # type: ignore[arg-type]
    after_step.received = True
    after_step.on_train_batch_start(trainer(12), None, None, batch_idx=24)  # type: ignore[arg-type]  # not yet agreed
    after_step.on_train_batch_end(trainer(13), None, None, None, batch_idx=25)  # type: ignore[arg-type]
    assert saved == [13] and after_step.stopped
    with pytest.raises(SIGTERMException):
        after_step.on_train_batch_start(trainer(13), None, None, batch_idx=26)  # type: ignore[arg-type]


def test_sigterm_at_the_last_step_under_deepspeed_waits_for_its_validation_inside_fit(tmp_path: Path) -> None:
    """Under DeepSpeed the last step is validated inside fit (StepCheckpoints.final_in_fit): an agreed SIGTERM at its
    end must not checkpoint it before that validation (its resume would validate after fit, which DeepSpeed cannot),
    but after it, as for any validating step; without final_in_fit the step is saved at its end as before."""
    from types import SimpleNamespace

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lm.checkpoint import StepCheckpoints
    from lm.preemption import Preemption

    saved: list[tuple[int, bool]] = []
    for final_in_fit in (True, False):
        checkpoints = StepCheckpoints(tmp_path, every=4, val_every=4, final_in_fit=final_in_fit)
        def save(trainer, checkpoints=checkpoints, f=final_in_fit) -> None:  # what the real save records, no file
            saved.append((trainer.global_step, f))
            checkpoints.saved_step = trainer.global_step

        checkpoints.save = save  # type: ignore[method-assign]
        preemption = Preemption(checkpoints)
        preemption.received = True
        last = SimpleNamespace(global_step=6, max_steps=6, accumulate_grad_batches=1, sanity_checking=False,
                               state=SimpleNamespace(fn="fit"),
                               strategy=SimpleNamespace(reduce_boolean_decision=lambda d, all: d))
        checkpoints.on_train_batch_end(last, None, None, None, batch_idx=5)  # type: ignore[arg-type]
        preemption.on_train_batch_end(last, None, None, None, batch_idx=5)  # type: ignore[arg-type]
        assert preemption.stopped != final_in_fit
        if final_in_fit:
            assert saved == []
            checkpoints.on_validation_end(last, None)  # type: ignore[arg-type]  # the last step: saved, carrying it
            with pytest.raises(SIGTERMException):
                preemption.on_validation_end(last, None)  # type: ignore[arg-type]
    assert saved == [(6, True), (6, False)]


def test_atomic_checkpoint_write_never_leaves_a_partial_file(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"w": torch.ones(1000)}, path)
    with pytest.raises(RuntimeError, match="disk full"):  # fails half-way through writing
        io.save_checkpoint({"w": torch.zeros(100_000), "z": Unpicklable()}, path)
    assert torch.equal(load(path)["w"], torch.ones(1000))  # the old checkpoint is intact
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # and no temporary file is left
    with pytest.raises(RuntimeError):
        io.save_checkpoint({"z": Unpicklable()}, tmp_path / "new.ckpt")
    assert not (tmp_path / "new.ckpt").exists()


def test_atomic_write_fsyncs_the_data_renames_then_fsyncs_the_directory(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Durable across a power loss, not just a kill: the new file's data reaches the disk before the rename, and
    the rename itself (the directory entry) after it."""
    import data_prep.atomic as atomic

    path = tmp_path / "last.ckpt"
    tmp = path.with_name(f".last.ckpt.tmp{os.getpid()}")
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        ino = os.fstat(fd).st_ino
        events.append("fsync dir" if ino == os.stat(tmp_path).st_ino else
                      "fsync tmp" if tmp.exists() and ino == os.stat(tmp).st_ino else "fsync other")
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(f"replace {Path(src).name} -> {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    atomic.atomic_write(path, lambda f: f.write(b"new"))
    assert events == ["fsync tmp", f"replace {tmp.name} -> last.ckpt", "fsync dir"]
    assert path.read_bytes() == b"new"


def test_atomic_write_swaps_the_file_instead_of_rewriting_it(tmp_path: Path) -> None:
    """A hard link to the old checkpoint (a copy kept by `ln`, a backup) still holds the old bytes: the new file
    is a new inode renamed over the name, never the old one overwritten in place."""
    from data_prep.atomic import atomic_write

    path, kept = tmp_path / "last.ckpt", tmp_path / "kept.ckpt"
    path.write_bytes(b"old")
    os.link(path, kept)
    atomic_write(path, lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new" and kept.read_bytes() == b"old"
    assert os.stat(path).st_ino != os.stat(kept).st_ino


def test_rng_state_survives_a_checkpoint_and_restores_every_generator(tmp_path: Path) -> None:
    """What a checkpoint stores under "rng" loads with weights_only=True (as resume loads it) and, restored, makes
    torch, numpy and python draw what they drew after it was taken: a MoSAIC `priority: random` run draws
    torch.rand every step, so its resume is bit for bit only if the torch stream continues."""
    import random

    import numpy as np

    from lm.checkpoint import rng_state, set_rng_state

    torch.save({"rng": rng_state()}, tmp_path / "rng.pt")
    drawn = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    set_rng_state(load(tmp_path / "rng.pt")["rng"])
    again = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    assert torch.equal(drawn[0], again[0]) and np.array_equal(drawn[1], again[1]) and drawn[2] == again[2]


def test_tb_scalars_reads_what_tensorboard_shows_after_a_rewind(tmp_path: Path) -> None:
    """A run logs steps 1-20; a --resume-from its step-10 checkpoint opens a writer purging from step 11 and logs
    11-15. TensorBoard shows 1-10 of the first and 11-15 of the second; tb_scalars merged the files in glob order
    without the purge, so the abandoned timeline's 16-20 (and, by file order, its 11-15) came back."""
    from torch.utils.tensorboard import SummaryWriter

    from lm.run_logs import tb_scalars

    first = SummaryWriter(tmp_path / "tb")
    for step in range(1, 21):
        first.add_scalar("train/lr", 1.0, step)
    first.close()
    resumed = SummaryWriter(tmp_path / "tb", purge_step=11)
    for step in range(11, 16):
        resumed.add_scalar("train/lr", 2.0, step)
    resumed.close()
    assert tb_scalars(tmp_path, "train/lr") == {**{s: 1.0 for s in range(1, 11)}, **{s: 2.0 for s in range(11, 16)}}
    assert tb_scalars(tmp_path, "train/loss") == {}


def test_cuda_rng_state_is_this_devices_and_restores_on_any_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA faked: a checkpoint holds the saving process's own device's generator state, and every rank restores it
    into its own device. It held every visible device's state as rank 0 saw them, restored whole on every rank: rank
    r > 0 got its device's untouched initial state back, and fewer GPUs at resume was an IndexError."""
    from lm.checkpoint import rng_state, set_rng_state

    restored: list[torch.Tensor] = []
    own, other = torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([9, 9, 9], dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": own)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [own, other])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("restored every device's state"))
    state = rng_state()
    assert torch.equal(state["cuda"], own)
    set_rng_state(state)
    set_rng_state({**state, "cuda": [own, other]})  # a checkpoint written before: rank 0's own state, cuda:0's
    set_rng_state({**state, "cuda": []})  # written without CUDA: nothing to restore
    assert len(restored) == 2 and all(torch.equal(s, own) for s in restored)


def test_a_cpu_run_on_a_gpu_machine_leaves_cuda_unstarted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint's RNG state reads CUDA's generator only in a process that uses CUDA: torch.cuda.get_rng_state
    starts CUDA (a context and GPU memory on GPU 0, in every CPU rank and test process on a GPU machine)."""
    from lm.checkpoint import rng_state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": pytest.fail("started CUDA"))
    assert rng_state()["cuda"] == []


def test_resume_skips_damaged_checkpoints_cleans_temp_files_and_applies_a_new_lr(tmp_path: Path, capsys) -> None:
    """Newest checkpoint truncated, the one before it garbled (zip CRC mismatch) and one empty: --resume
    continues from the newest loadable one and says why it passed over each; a temp file of an interrupted
    write is removed; a changed optim.lr and data.batch_size are applied and reported, not ignored."""
    from lm.config_io import load_config
    from lm.train import train

    data, out = write_prepared(tmp_path / "data", train_tokens=4000, val_tokens=1000), tmp_path / "run"
    train(load_config(None, *run_overrides(data, out, max_steps=8, ckpt_every=2, val_every=100)))
    ckpts = out / "checkpoints"
    step8, step6 = (ckpts / "step0000008.ckpt").read_bytes(), bytearray((ckpts / "step0000006.ckpt").read_bytes())
    (ckpts / "last.ckpt").unlink()
    (ckpts / "step0000008.ckpt").write_bytes(step8[: len(step8) // 2])
    step6[len(step6) // 2 : len(step6) // 2 + 64] = bytes(64)
    (ckpts / "step0000006.ckpt").write_bytes(bytes(step6))
    (ckpts / "step0000010.ckpt").write_bytes(b"")
    (ckpts / ".step0000012.ckpt.tmp4242").write_bytes(b"")  # what a kill mid-write leaves
    capsys.readouterr()
    overrides = run_overrides(data, out, max_steps=10, ckpt_every=2, val_every=100)
    metrics = train(load_config(None, *overrides, "optim.lr=1e-3", "data.batch_size=4"), resume="last")
    err = capsys.readouterr()
    text = err.err + err.out
    assert "removed" in text and not (ckpts / ".step0000012.ckpt.tmp4242").exists()
    assert "skipping step0000010.ckpt: checkpoint" in text and "is empty" in text
    assert "skipping step0000008.ckpt" in text and "truncated" in text
    assert "skipping step0000006.ckpt" in text and "CRC mismatch" in text
    assert f"continuing from {ckpts / 'step0000004.ckpt'}" in text
    assert "optim.lr changed 0.003 -> 0.001: applied" in text and "data.batch_size changed 8 -> 4" in text
    assert "the learning rate at step 4 moves from 0.003 to 0.001" in text  # step 4: warm-up (5 steps) complete
    last = load(ckpts / "last.ckpt")
    assert last["global_step"] == 10 and last["lr_schedulers"][0]["base_lrs"] == [1e-3, 1e-3]
    assert all(g["initial_lr"] == 1e-3 for g in last["optimizer_states"][0]["param_groups"])
    assert metrics["tokens_seen"] == 4 * 8 * 32 + 6 * 4 * 32  # 4 steps of batch 8, then 6 of batch 4


def test_tokens_seen_of_a_checkpoint_that_did_not_save_it() -> None:
    """Checkpoints written before tokens_seen was saved: step x batch x seq_len x every device of every node."""
    from lm.module import saved_tokens_seen

    config = {"data": {"batch_size": 8}, "model": {"seq_len": 32}, "trainer": {"devices": 2, "num_nodes": 3}}
    assert saved_tokens_seen({"global_step": 5, "config": config}) == 5 * 8 * 32 * 2 * 3
    assert saved_tokens_seen({"global_step": 5, "config": config, "tokens_seen": 123}) == 123


def test_a_changed_schedule_sets_the_resumed_steps_learning_rate() -> None:
    """warm-up 5 -> 20 at step 4: the next step runs at lr * 5 / 20 on the new schedule (the restored param group
    held the old schedule's rate for it, which the LambdaLR replaces only after that step), and the message says so."""
    from omegaconf import OmegaConf

    from lm.config_io import load_config
    from lm.resume_settings import apply_changes

    old = load_config(None, "optim.lr=1e-3", "optim.warmup_steps=5", "trainer.max_steps=10")
    new = load_config(None, "optim.lr=1e-3", "optim.warmup_steps=20", "trainer.max_steps=40")
    groups = [{"lr": 1e-3, "initial_lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0} for _ in range(2)]
    checkpoint = {"config": OmegaConf.to_container(OmegaConf.structured(old)), "global_step": 4,
                  "optimizer_states": [{"param_groups": groups}], "lr_schedulers": [{"base_lrs": [1e-3, 1e-3]}]}
    lines = apply_changes(checkpoint, new)
    assert [g["lr"] for g in groups] == [1e-3 * 5 / 20] * 2
    assert lines[-1] == ("--resume: the learning rate at step 4 moves from 0.001 to 0.00025 (the warm-up and cosine "
                         "follow the new settings)")


def test_a_resume_at_or_past_max_steps_says_nothing_is_left_to_train() -> None:
    """--resume trainer.max_steps=1 from a step-2 checkpoint trained nothing and said only that the learning rate
    moved; now one line says the run is already past max_steps."""
    from omegaconf import OmegaConf

    from lm.config_io import load_config
    from lm.resume_settings import apply_changes

    saved = OmegaConf.to_container(OmegaConf.structured(load_config(None, "trainer.max_steps=4")))
    for max_steps, expected in ((1, True), (2, True), (3, False)):
        new = load_config(None, f"trainer.max_steps={max_steps}", warnings=False)
        lines = apply_changes({"config": saved, "global_step": 2}, new)
        assert (f"--resume: the checkpoint is at step 2, trainer.max_steps is {max_steps}: nothing is left to train "
                "(raise trainer.max_steps to train on)" in lines) is expected


def test_a_changed_weight_decay_reaches_the_matrices_only() -> None:
    """weight decay 0.1 -> 0.05 on resume: group 0 (matrices and embeddings) takes the new value, group 1 (norms,
    biases) keeps 0, as lm/optimizer.adamw built them (writing it into every group decayed them all)."""
    from omegaconf import OmegaConf

    from lm.config_io import load_config
    from lm.resume_settings import apply_changes

    old = load_config(None, "optim.weight_decay=0.1")
    groups = [{"lr": 1e-3, "initial_lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": wd} for wd in (0.1, 0.0)]
    checkpoint = {"config": OmegaConf.to_container(OmegaConf.structured(old)), "global_step": 4,
                  "optimizer_states": [{"param_groups": groups}], "lr_schedulers": [{"base_lrs": [1e-3, 1e-3]}]}
    apply_changes(checkpoint, load_config(None, "optim.weight_decay=0.05"))
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]


def test_a_deepspeed_checkpoint_refuses_new_optimizer_group_settings() -> None:
    """Lightning's part of a DeepSpeed checkpoint has no optimizer_states: DeepSpeed restores AdamW's param groups from
    its shards, so a changed lr, betas or weight decay would be reported as applied and silently kept. One line; a
    changed schedule shape still resumes."""
    from omegaconf import OmegaConf

    from heads import ConfigError
    from lm.config_io import load_config
    from lm.resume_settings import apply_changes

    saved = load_config(None, "optim.lr=3e-3", "trainer.strategy=deepspeed_stage_2")
    checkpoint = {"config": OmegaConf.to_container(OmegaConf.structured(saved)), "global_step": 4,
                  "lr_schedulers": [{"base_lrs": [3e-3, 3e-3]}]}
    new = load_config(None, "optim.lr=1e-3", "optim.betas=[0.9,0.95]", "trainer.strategy=deepspeed_stage_2")
    with pytest.raises(ConfigError, match=r"^--resume under trainer.strategy=deepspeed_stage_2 cannot change optim.lr: "
                                          r"0.003 -> 0.001; optim.betas: \[0.9, 0.999\] -> \[0.9, 0.95\]: DeepSpeed"):
        apply_changes(checkpoint, new)
    schedule = load_config(None, "optim.lr=3e-3", "optim.warmup_steps=9", "trainer.strategy=deepspeed_stage_2")
    assert apply_changes(checkpoint, schedule)[0].startswith("--resume: optim.warmup_steps changed")


def test_the_final_checkpoint_carries_the_final_validation(tmp_path: Path) -> None:
    """max_steps 4 with ckpt_every 2 and val_every 3: step 4's checkpoint is due before the end-of-run validation;
    it is written again after it, so a run resumed from it (e.g. to train longer) keeps that validation."""
    from lm.config_io import load_config
    from lm.train import train

    data = write_prepared(tmp_path / "data", train_tokens=4000, val_tokens=1000)
    metrics = train(load_config(None, *run_overrides(data, tmp_path / "run", max_steps=4, ckpt_every=2, val_every=3)))
    saved = load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert [h["step"] for h in saved["val_history"]] == [h["step"] for h in metrics["history"]] == [3, 4]
    assert saved["val_history"] == metrics["history"]
    # a --resume of the finished run trains nothing and returns what metrics.json holds, not NaN loss and tokens/s
    again = train(load_config(None, *run_overrides(data, tmp_path / "run", max_steps=4, ckpt_every=2, val_every=3)),
                  resume="last")
    assert again == metrics and again["train_loss"] == again["train_loss"] and again["tokens_per_s"] > 0


def test_tokens_per_s_goes_on_over_a_resume(tmp_path: Path) -> None:
    """The checkpoint keeps the timed tokens and seconds, so a resumed run's tokens_per_s (metrics.json, flops.mfu)
    is over every run, not the resumed part alone (a walkthrough read 541 tokens/s uninterrupted, 702 resumed)."""
    from lm.config_io import load_config
    from lm.train import train

    data = write_prepared(tmp_path / "data", train_tokens=4000, val_tokens=1000)
    overrides = run_overrides(data, tmp_path / "run", max_steps=4, ckpt_every=2, val_every=4)
    train(load_config(None, *overrides))
    tokens, seconds = load(tmp_path / "run" / "checkpoints" / "last.ckpt")["timed"]
    assert tokens > 0 and seconds > 0
    metrics = train(load_config(None, *overrides, "trainer.max_steps=8"), resume="last")
    more, longer = load(tmp_path / "run" / "checkpoints" / "last.ckpt")["timed"]
    assert more > tokens and longer > seconds and metrics["tokens_per_s"] == pytest.approx(more / longer)


def test_setting_aside_a_timeline_of_checkpoint_directories(tmp_path: Path) -> None:
    """lm.checkpoint.set_aside_after on DeepSpeed-style checkpoints (directories): rewinding to step 2 moves steps 4
    and 6 and last.ckpt aside; a second rewind to step 2 replaces what the first set aside (a directory cannot be
    renamed onto a non-empty one); a rewind with nothing newer moves nothing and makes no folder."""
    from lm.checkpoint import set_aside_after

    def checkpoint(name: str, tag: str) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "latest").write_text(tag)
        return tmp_path / name

    def timeline(tag: str) -> None:
        for step in (4, 6):
            checkpoint(f"step{step:07d}.ckpt", f"{tag}{step}")
        checkpoint("last.ckpt", f"{tag}6")

    start = checkpoint("step0000002.ckpt", "2")
    timeline("first")
    aside = tmp_path / "abandoned-after-step0000002"
    assert sorted(p.name for p in set_aside_after(tmp_path, 2, start)) == \
        ["last.ckpt", "step0000004.ckpt", "step0000006.ckpt"]
    timeline("second")
    assert len(set_aside_after(tmp_path, 2, start)) == 3
    assert {p.name: (p / "latest").read_text() for p in aside.iterdir()} == \
        {"last.ckpt": "second6", "step0000004.ckpt": "second4", "step0000006.ckpt": "second6"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abandoned-after-step0000002", "step0000002.ckpt"]
    assert set_aside_after(tmp_path, 2, start) == [] and set_aside_after(tmp_path / "abandoned-after-step0000002", 6,
                                                                         start) == []
    assert sorted(p.name for p in aside.iterdir()) == ["last.ckpt", "step0000004.ckpt", "step0000006.ckpt"]


class NotATensor:
    """A pickled object of a class torch.load's weights_only mode refuses (code, not data)."""


def test_foreign_torch_files_are_refused_in_one_line(tmp_path: Path) -> None:
    """lm.checkpoint.read_checkpoint / read_deepspeed on readable torch files that are no train_lm.py checkpoint: a
    dict without a config, one whose config is no mapping (it crashed lm.generate with AttributeError), a pickled
    object of an arbitrary class (never unpickled: weights_only), model states without a config in a complete
    DeepSpeed directory; each a one-line CheckpointError naming the file."""
    from lm.checkpoint import COMPLETE, CheckpointError, read_checkpoint, read_deepspeed

    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    torch.save({"state_dict": {}, "config": [1, 2]}, tmp_path / "list.ckpt")
    torch.save({"config": NotATensor()}, tmp_path / "code.ckpt")
    shards = tmp_path / "ds.ckpt" / "global_step3"
    shards.mkdir(parents=True)
    (tmp_path / "ds.ckpt" / "latest").write_text("global_step3\n")
    (tmp_path / "ds.ckpt" / COMPLETE).write_text("")
    torch.save({"module": {}, "config": "tiny.yaml"}, shards / "mp_rank_00_model_states.pt")
    cases = [(read_checkpoint, tmp_path / name, rf"{tmp_path / name} is not a train_lm\.py checkpoint \(no config "
                                                 r"mapping\)") for name in ("plain.ckpt", "list.ckpt")]
    cases += [(read_checkpoint, tmp_path / "code.ckpt", rf"checkpoint {tmp_path / 'code.ckpt'} holds Python objects that "
                                                        r"only running code can load \(Unsupported global: GLOBAL "
                                                        r"\S*NotATensor was not an allowed global by default\), not only "
                                                        r"tensors and plain values as train_lm\.py's checkpoints do; it "
                                                        r"is not read"),
              (read_deepspeed, tmp_path / "ds.ckpt", rf"{tmp_path / 'ds.ckpt'} is not a train_lm\.py checkpoint \(no "
                                                     r"config mapping in mp_rank_00_model_states\.pt\)")]
    for read, path, message in cases:
        with pytest.raises(CheckpointError, match=f"^{message}$") as err:
            read(path)
        assert "\n" not in str(err.value)
