"""Resume after kill -9 equals an uninterrupted run, bit for bit on CPU; checkpoint writes are atomic."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lm.checkpoint import AtomicCheckpointIO
from tests.synthetic import run_overrides, write_prepared

ROOT = Path(__file__).resolve().parents[1]
STEPS = 150  # long enough that the kill lands well before the end


def command(data: Path, out: Path, *extra: str) -> list[str]:
    """train_lm.py on defaults (an empty YAML file) + the tiny-run overrides."""
    config = data / "empty.yaml"
    config.write_text("{}\n")
    overrides = run_overrides(data, out, max_steps=STEPS, ckpt_every=10, val_every=20)
    return [sys.executable, str(ROOT / "train_lm.py"), "--config", str(config), *overrides, *extra]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # same threads in every run


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


def test_kill_and_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    data = write_prepared(tmp_path / "data")
    full, killed = tmp_path / "full", tmp_path / "killed"
    uninterrupted = subprocess.Popen(command(data, full), env=env(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)  # runs alongside, on the other core
    proc = subprocess.Popen(command(data, killed), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = killed / "checkpoints" / "step0000010.ckpt"
    deadline = time.monotonic() + 120
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL, "the run ended before it could be killed"
    saved = sorted((killed / "checkpoints").glob("*.ckpt"))
    for path in saved:  # every checkpoint file present after the kill is complete
        load(path)
    # resume takes the newest step file (the kill may have come before last.ckpt was linked to it)
    killed_at = max(load(p)["global_step"] for p in saved)
    assert 10 <= killed_at < STEPS
    print(f"killed after step {killed_at} ({len(saved)} checkpoint files)")

    subprocess.run(command(data, killed, "--resume"), env=env(), check=True, capture_output=True, timeout=300)
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.stderr.read()[-2000:]
    assert_same_state(load(full / "checkpoints" / "last.ckpt"), load(killed / "checkpoints" / "last.ckpt"))


class Unpicklable:
    def __reduce__(self):  # noqa: ANN204
        raise RuntimeError("disk full")


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
