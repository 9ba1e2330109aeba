"""DDP with 2 CPU processes (gloo) through train_lm.py equals one process running the same micro-batches.

Each rank takes its slice of the global batch of step s (lm/data.py), so 2 ranks x batch 4 see the same 8
windows as 1 process accumulating 2 micro-batches of 4, and the all-reduced gradient is the same mean (for the
weights that is one batch of 8 as well: tests/test_accumulation.py). Heads with state moved by batch statistics
(MoSA's running threshold, the Routing Transformer's k-means centroids) stage them in the forward passes and
reduce them over the ranks once per step (routing/distributed.py), so that state (a buffer in the state dict,
compared like the weights) matches too. Tolerance: every weight and buffer within relative RMS 1e-5 per tensor
(measured ~3e-7: float summation order of the all-reduce; without the reduction the first diverging tensor is
at 2.5e-2 for MoSA and 4.8e-2 for Routing), validation losses within 1e-5 relative.
"""
from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lm.config_io import load_config
from lm.run_logs import tb_scalars
from tests.conftest import child_env
from tests.synthetic import run_overrides, wait_for_file, write_prepared

ROOT = Path(__file__).resolve().parents[1]


# (head mix, steps): dense; the stateful heads with fast-moving state so that a per-rank update shows.
MIXES = {
    "dense": ("[{type: dense, count: 4}]", 20),
    "mosa_threshold": ("[{type: dense, count: 2}, {type: mosa, count: 4, options: {sparsity: 4, "
                       "threshold_momentum: 0.5}}]", 10),
    "routing_kmeans": ("[{type: dense, count: 2}, {type: routing, count: 2, options: {sparsity: 4, decay: 0.5}}]", 10),
    "routing_ema_counts": ("[{type: dense, count: 2}, {type: routing, count: 2, options: {sparsity: 4, decay: 0.5, "
                           "centroids: ema_counts}}]", 10),  # saved sums and counts: the global batch's, not a mean
}


@pytest.mark.slow
@pytest.mark.parametrize("mix,accumulate,checkpointing",
                         [*((mix, 1, False) for mix in MIXES), ("dense", 2, False), ("routing_kmeans", 2, False),
                          ("mosa_threshold", 1, True)])
def test_ddp_two_cpu_processes_match_one_process(tmp_path: Path, mix: str, accumulate: int, checkpointing: bool) -> None:
    """accumulate = 2: each rank runs 2 micro-batches of 2 per step (micro-batch i on rank r = slice 2i + r of
    the step's 8 windows; Lightning syncs gradients on the last one; Routing's centroids move once per step, from
    the 4 micro-batches of both ranks: routing/kmeans.py). checkpointing: the DDP run's blocks are
    activation-checkpointed; their replays must not stage the thresholds' statistics again."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch build has no gloo backend, so CPU DDP cannot run")
    from lm.train import train

    data = write_prepared(tmp_path / "data")
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    ddp_out, single_out = tmp_path / "ddp", tmp_path / "single"
    heads, steps = MIXES[mix]
    overrides = [*run_overrides(data, ddp_out, max_steps=steps, val_every=5, ckpt_every=5, devices=2, strategy="ddp",
                                accumulate_grad_batches=accumulate, activation_checkpointing=str(checkpointing).lower()),
                 f"model.heads={heads}"]
    ran = subprocess.run(
        [sys.executable, str(ROOT / "train_lm.py"), "--config", str(config), *overrides,
         f"data.batch_size={4 // accumulate}", f"data.val_batches={2 * accumulate}"],  # 8 validation windows
        env=child_env(), capture_output=True, text=True,
        timeout=300, cwd=ROOT,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    micro = 4 // accumulate  # the same micro-batches, one after the other
    train(load_config(None, *run_overrides(data, single_out, max_steps=steps, val_every=5, ckpt_every=5,
                                           accumulate_grad_batches=2 * accumulate),
                      f"model.heads={heads}", f"data.batch_size={micro}", f"data.val_batches={8 // micro}"))

    ddp = torch.load(ddp_out / "checkpoints" / "last.ckpt", weights_only=True)
    single = torch.load(single_out / "checkpoints" / "last.ckpt", weights_only=True)
    assert ddp["state_dict"].keys() == single["state_dict"].keys()
    for name, w in single["state_dict"].items():
        if w.dtype == torch.bool:  # MoSA's `initialized` flag
            assert torch.equal(ddp["state_dict"][name], w), name
            continue
        rel = ((ddp["state_dict"][name] - w).norm() / w.norm()).item()
        assert rel <= 1e-5, f"{name}: relative RMS difference {rel:.1e}"
    for a, b in zip(ddp["val_history"], single["val_history"], strict=True):
        assert a["step"] == b["step"] and a["tokens_seen"] == b["tokens_seen"]
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    metrics = json.loads((ddp_out / "metrics.json").read_text())
    assert metrics["tokens_seen"] == steps * 2 * 4 * 32
    # the logged training loss is the whole global batch's mean, not rank 0's half of it
    assert metrics["train_loss"] == pytest.approx(json.loads((single_out / "metrics.json").read_text())["train_loss"],
                                                  rel=1e-5)
    ddp_curve, single_curve = tb_scalars(ddp_out, "train/loss"), tb_scalars(single_out, "train/loss")
    assert ddp_curve.keys() == single_curve.keys() and len(ddp_curve) >= 2
    assert all(ddp_curve[s] == pytest.approx(single_curve[s], rel=1e-5) for s in single_curve)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["every process", "rank 0"])
def test_sigterm_stops_every_rank_at_one_checkpointed_step_and_resumes(tmp_path: Path, to: str) -> None:
    """SIGTERM to the whole process group (as SLURM, Kubernetes and torchrun deliver it) or to rank 0 only: both
    ranks stop after the same optimizer step, that step is checkpointed, each prints the one line and the run exits
    143; --resume then ends exactly where an uninterrupted 2-process run ends. With Lightning's own handling
    (lm/preemption.py) the process-group case hung or died with a gloo traceback in 3 of 3 runs."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch build has no gloo backend, so CPU DDP cannot run")
    from tests.test_resume import load

    data = write_prepared(tmp_path / "data")
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    steps = 60

    def command(out: Path, *extra: str) -> list[str]:
        return [sys.executable, str(ROOT / "train_lm.py"), "--config", str(config), "data.batch_size=4",
                *run_overrides(data, out, max_steps=steps, ckpt_every=10, val_every=25, devices=2, strategy="ddp"),
                *extra]

    run_env = child_env()
    full, out = tmp_path / "full", tmp_path / "run"
    subprocess.run(command(full), env=run_env, check=True, capture_output=True, timeout=300, cwd=ROOT)
    proc = subprocess.Popen(command(out), env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)  # its own process group, as a scheduler's job
    assert wait_for_file(proc, out / "checkpoints" / "step0000010.ckpt"), "the run wrote no checkpoint in time"
    time.sleep(0.3)  # into the middle of a checkpoint interval
    os.killpg(proc.pid, signal.SIGTERM) if to == "every process" else proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the ranks hung after SIGTERM: {proc.communicate()[1][-2000:]}")
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    lines = re.findall(rf"error: stopped by SIGTERM at step (\d+) of {steps}; continue from the newest checkpoint with "
                       r"--resume", err)
    assert len(lines) == 2 and lines[0] == lines[1], err[-2000:]  # one line from each rank, the same step
    stopped = int(lines[0])
    assert 10 < stopped < steps and load(out / "checkpoints" / f"step{stopped:07d}.ckpt")["global_step"] == stopped

    subprocess.run(command(out, "--resume"), env=run_env, check=True, capture_output=True, timeout=300, cwd=ROOT)
    a, b = load(full / "checkpoints" / "last.ckpt"), load(out / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == steps and a["val_history"] == b["val_history"]
    for name, w in a["state_dict"].items():
        assert torch.equal(w, b["state_dict"][name]), name


@pytest.mark.slow
def test_ddp_compression_training_with_full_memory_batches_matches_one_process(tmp_path: Path) -> None:
    """compression.full_prob: a full-memory batch leaves the compression layer without gradient, which plain DDP
    refuses at the next step ("parameters that were not used in producing loss"); lm.devices.build_strategy then
    finds unused parameters, whose gradients stay None as in one process. 2 ranks x 4 windows = 1 process
    accumulating 2 micro-batches of 4 (lm/compressed_training.LayoutBatches), weights within relative RMS 1e-5."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch build has no gloo backend, so CPU DDP cannot run")
    import numpy as np

    from conftest import tiny_config
    from lm.compressed_training import LayoutSampler, train_compressed
    from lm.config import CompressionConfig
    from lm.config_io import to_yaml
    from tests.test_compression import V, _prepared

    rng = np.random.default_rng(0)
    (tmp_path / "data").mkdir()
    path = _prepared(tmp_path / "data", [np.tile(rng.integers(1, V, 6), 40) for _ in range(54)])
    steps = 6
    cfg = tiny_config([{"type": "dense", "count": 4}], n_layers=4, d_model=32, head_dim=8, seq_len=8, vocab_size=V)
    cfg.compression = CompressionConfig(layer=2, n_heads=2, prefix_len=12, ratio=0.25, regime="random", ramp_steps=3,
                                        max_depth=2, full_prob=0.5)
    for key, value in dict(max_steps=steps, val_every=steps, ckpt_every=steps, accelerator="cpu").items():
        setattr(cfg.trainer, key, value)
    cfg.data.path, cfg.data.batch_size, cfg.data.val_batches = path, 4, 2
    sampler = LayoutSampler(cfg.compression, cfg.model.seq_len)
    full = [sampler.sample(s, np.random.default_rng([cfg.trainer.seed, s])).full for s in range(steps)]
    assert any(a and not b for a, b in zip(full, full[1:])), full  # a compressing step follows a full one
    config = tmp_path / "run.yaml"
    config.write_text(to_yaml(cfg))
    ran = subprocess.run(
        [sys.executable, "-m", "lm.compressed_training", "--config", str(config), f"trainer.out_dir={tmp_path / 'ddp'}",
         "trainer.devices=2", "trainer.strategy=ddp"],
        env=child_env(), capture_output=True, text=True,
        timeout=300, cwd=ROOT,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    cfg.trainer.out_dir, cfg.trainer.accumulate_grad_batches, cfg.data.val_batches = str(tmp_path / "single"), 2, 4
    train_compressed(cfg)
    ddp = torch.load(tmp_path / "ddp" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    single = torch.load(tmp_path / "single" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert ddp.keys() == single.keys()
    for name, w in single.items():
        rel = ((ddp[name] - w).norm() / w.norm()).item()
        assert rel <= 1e-5, f"{name}: relative RMS difference {rel:.1e}"


def test_training_entry_points_release_the_process_group(tmp_path: Path, monkeypatch) -> None:
    """lm.train.train and train_compressed destroy the process group DDP made when they return or raise: a gloo
    group left to the interpreter's exit now and then aborted a finished run (exit status -6, 'terminate called
    without an active exception'; seen in test_ddp_compression_training_with_full_memory_batches_matches_one_process).
    Each entry point runs with its run set-up replaced by one that creates a group, as Lightning's DDP set-up does,
    and then fails; a group the caller made before (e.g. under torchrun) stays the caller's."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch build has no gloo backend")
    import lm.compressed_training
    import lm.train
    from conftest import tiny_config
    from lm.config import CompressionConfig

    def init(name: str) -> None:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1)

    def failing_start(name: str):
        def start_run(*args, **kwargs):
            init(name)
            raise RuntimeError("a failed run")
        return start_run

    plain = tiny_config([{"type": "dense", "count": 4}], n_layers=4, d_model=32, head_dim=8, seq_len=8)
    compressed = copy.deepcopy(plain)
    compressed.compression = CompressionConfig(layer=2, n_heads=2, prefix_len=12, ratio=0.25, max_depth=2)
    for module, entry, cfg in ((lm.train, lm.train.train, plain),
                               (lm.compressed_training, lm.compressed_training.train_compressed, compressed)):
        monkeypatch.setattr(module, "start_run", failing_start(entry.__name__))
        with pytest.raises(RuntimeError, match="a failed run"):
            entry(cfg)
        assert not dist.is_initialized(), f"{entry.__name__} left its process group"
    init("callers")
    with lm.train.process_group_released():
        pass
    assert dist.is_initialized()
    dist.destroy_process_group()
