"""DDP with 2 CPU processes (gloo) through train_lm.py equals one process with the same global batch.

Each rank takes its slice of the global batch of step s (lm/data.py), so 2 ranks x batch 4 see the
same 8 windows as 1 process x batch 8, and the all-reduced gradient is the same mean. Heads with
state moved by batch statistics (MoSA's running threshold, the Routing Transformer's k-means
centroids; routing/distributed.py) must reduce the statistic over the ranks, so that state (a
buffer in the state dict, compared like the weights) matches too. Tolerance: every weight and
buffer within relative RMS 1e-5 per tensor (measured ~3e-7: float summation order of the
all-reduce; without the reduction the first diverging tensor is at 2.6e-2 for MoSA and 4.8e-2 for
Routing), validation losses within 1e-5 relative.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lm.config import load_config
from tests.synthetic import run_overrides, write_prepared

ROOT = Path(__file__).resolve().parents[1]


# (head mix, steps): dense; the stateful heads with fast-moving state so that a per-rank update shows.
MIXES = {
    "dense": ("[{type: dense, count: 4}]", 20),
    "mosa_threshold": ("[{type: dense, count: 2}, {type: mosa, count: 4, options: {sparsity: 4, "
                       "threshold_momentum: 0.5}}]", 10),
    "routing_kmeans": ("[{type: dense, count: 2}, {type: routing, count: 2, options: {sparsity: 4, decay: 0.5}}]", 10),
}


@pytest.mark.slow
@pytest.mark.parametrize("mix,accumulate,checkpointing",
                         [*((mix, 1, False) for mix in MIXES), ("dense", 2, False), ("mosa_threshold", 1, True)])
def test_ddp_two_cpu_processes_match_one_process(tmp_path: Path, mix: str, accumulate: int, checkpointing: bool) -> None:
    """accumulate = 2: each rank runs 2 micro-batches of 2 per step (micro-batch i on rank r = slice 2i + r of
    the step's 8 windows; Lightning syncs gradients on the last one). checkpointing: the DDP run's blocks are
    activation-checkpointed; their replays must not gather the thresholds' statistics again."""
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
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300, cwd=ROOT,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    train(load_config(None, *run_overrides(data, single_out, max_steps=steps, val_every=5, ckpt_every=5),
                      f"model.heads={heads}", "data.batch_size=8", "data.val_batches=1"))

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
