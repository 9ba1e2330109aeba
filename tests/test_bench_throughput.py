"""bench/throughput.py: a step is lm/module.py's training step (its compiled loss under trainer.compile, every
micro-batch of trainer.accumulate_grad_batches, its gradient clipping), configs are timed in turn and compared."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from heads import ConfigError
from lm.config_io import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import throughput  # noqa: E402

TINY = ["model.n_layers=1", "model.d_model=32", "model.head_dim=8", "model.seq_len=16", "model.vocab_size=64",
        "model.heads=[{type: dense, count: 2}]", "data.batch_size=2"]


def test_a_step_is_the_modules_training_step() -> None:
    cfg = load_config(None, *TINY, "trainer.accumulate_grad_batches=3", "optim.grad_clip=1e-3")
    bench = throughput.Bench(cfg, torch.device("cpu"))
    calls = []
    loss = bench.module.train_losses
    bench.module.train_losses = lambda x, y: calls.append(x.shape) or loss(x, y)
    clip = bench.module.configure_gradient_clipping
    norms = []

    def clipped(optimizer, value):
        clip(optimizer, value)
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in bench.module.parameters()], 2.0).item())

    bench.module.configure_gradient_clipping = clipped
    bench.run(steps=2, warmup=1)
    assert calls == [(2, 16)] * 9 and len(norms) == 3 and max(norms) <= 1e-3 * 1.0001
    assert bench.tokens_per_step == 3 * 2 * 16 and len(bench.times) == 2
    assert bench.result()["tokens_per_s"] == 96 / bench.result()["median_s"]
    bench.times = [1.0, 1.0, 4.0]  # one slow step (a GC pause, another process) leaves the median where it was
    assert bench.result() | {"params": 0} == {"params": 0, "median_s": 1.0, "min_s": 1.0, "max_s": 4.0,
                                               "tokens_per_s": 96.0}


def test_auto_precision_follows_the_benched_device(monkeypatch) -> None:
    """trainer.precision auto is resolved for the device timed, not the machine's GPU: on a CUDA machine a CPU bench
    runs 32-true (it raised "bf16-mixed is not timed here" on the H200)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert throughput.Bench(load_config(None, *TINY), torch.device("cpu")).precision == "32-true"


def test_the_device_is_the_configs_accelerator(monkeypatch) -> None:
    """main times on the device trainer.accelerator picks, not on any GPU the machine has (on the H200, a CPU config
    was timed on CUDA in bf16-mixed); configs that disagree are one line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cpu, auto = load_config(None, *TINY, "trainer.accelerator=cpu"), load_config(None, *TINY)
    assert throughput.device_name([cpu, cpu]) == (torch.device("cpu"), "cpu")
    assert throughput.device_name([auto]) == (torch.device("cuda"), "cuda_nvidia_h200")
    with pytest.raises(ConfigError, match="^the configs train on different devices"):
        throughput.device_name([cpu, auto])


def test_compiled_loss_and_side_by_side_ratio(tmp_path: Path, capsys) -> None:
    compiled = throughput.Bench(load_config(None, *TINY, "trainer.compile=true"), torch.device("cpu")).module
    assert compiled.train_losses != compiled.losses  # what a step calls (above) is the compiled loss
    out = tmp_path / "t.md"
    args = ["--config", "configs/quickstart.yaml", "--config", "configs/quickstart.yaml", *TINY,
            "trainer.accelerator=cpu", "--steps", "2",
            "--warmup", "1", "--rounds", "2", "--out", str(out)]
    assert throughput.main(args) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| configs/")]
    assert len(rows) == 2 and rows[0].endswith("| 1.000 |") and "| 1 x 2 x 16 | 32-true | False |" in rows[1]
    assert throughput.main([*args[:4], *TINY, "trainer.compile=true", "--warmup", "0"]) == 2
    assert capsys.readouterr().err.endswith("error: trainer.compile needs --warmup >= 1: the first step compiles\n")
