"""flops/mfu.py: MFU of a training run from its config.yaml and metrics.json, against a hand count."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT
from flops import mfu
from lm.config_io import load_config
from tests.synthetic import run_overrides, write_prepared

# The tiny run (h = 32, 2 layers of 4 dense heads of h' = 8, T = 32, vocab 64, FFN 4h), per sequence, forward:
# attention 4 x (8 h h' T + 4 h' T^2) = 393,216 per layer, FFN 16 h^2 T = 524,288 per layer, vocabulary
# projection 2 h V T = 131,072; training = 3 x forward: 3 x (2 x 917,504 + 131,072) / T per token.
FLOPS_PER_TOKEN = 3 * (2 * (393_216 + 524_288) + 131_072) / 32


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lm.train import train

    data = write_prepared(tmp_path_factory.mktemp("data"), train_tokens=4000, val_tokens=1000)
    out = tmp_path_factory.mktemp("run")
    train(load_config(None, *run_overrides(data, out, max_steps=6, val_every=3)))
    return out


def test_mfu_of_a_run_against_a_hand_count(run: Path) -> None:
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["device"] == "cpu" and metrics["world_size"] == 1 and metrics["precision"] == "32-true"
    r = mfu.run_mfu(run, peak_tflops=0.5)
    assert r["flops_per_token"] == FLOPS_PER_TOKEN
    assert r["achieved"] == pytest.approx(metrics["tokens_per_s"] * FLOPS_PER_TOKEN, rel=1e-12)
    assert r["mfu"] == pytest.approx(r["achieved"] / 0.5e12, rel=1e-12)
    assert mfu.run_mfu(run)["mfu"] is None  # a CPU has no known peak


@pytest.mark.parametrize("precision, peak", [("32-true", 67e12), ("bf16-mixed", 989e12)])
def test_the_peak_follows_the_runs_precision(run: Path, tmp_path: Path, precision: str, peak: float) -> None:
    """An fp32 run on an H100 is measured against the fp32 peak: against the bf16 one its MFU read ~15x low."""
    (tmp_path / "config.yaml").write_text((run / "config.yaml").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    metrics.update(device="NVIDIA H100 80GB HBM3", precision=precision, tokens_per_s=1e8)
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    r = mfu.run_mfu(tmp_path)
    assert r["peak"] == peak and r["mfu"] == pytest.approx(1e8 * FLOPS_PER_TOKEN / peak, rel=1e-12)
    metrics["world_size"] = 4  # tokens_per_s counts every rank's tokens: the same rate on 4 GPUs is a quarter the MFU
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    r = mfu.run_mfu(tmp_path)
    assert r["devices"] == 4 and r["mfu"] == pytest.approx(1e8 * FLOPS_PER_TOKEN / (4 * peak), rel=1e-12)


def test_cli_table_and_errors(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert mfu.main([str(run), "--peak-tflops", "0.5"]) == 0
    row = capsys.readouterr().out.splitlines()[2].split(" | ")
    assert row[1] == "1 x cpu" and row[2] == "32-true" and row[6] == f"{FLOPS_PER_TOKEN / 1e9:.4g}" != "0"  # 4 digits: 0.000 before
    assert mfu.main([str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no config.yaml" in err
    for bad in ("0", "inf"):
        assert mfu.main([str(run), "--peak-tflops", bad]) == 2
        assert "--peak-tflops must be a finite number > 0" in capsys.readouterr().err
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.yaml").write_text((run / "config.yaml").read_text())
    (damaged / "metrics.json").write_text("{step: 3")
    assert mfu.main([str(damaged)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{damaged / 'metrics.json'} is damaged" in err
    (damaged / "config.yaml").write_text("model: [unclosed\n")  # a 34-line ParserError traceback before
    assert mfu.main([str(damaged)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {damaged / 'config.yaml'} is damaged (") and "restore it" in err


def _run_dir(path: Path, config: str | None, metrics: dict, *overrides: str) -> Path:
    """A run directory holding the config.yaml of `config` (a YAML config file; None: the defaults) with `overrides`,
    and `metrics`."""
    from lm.config_io import to_yaml

    path.mkdir()
    (path / "config.yaml").write_text(to_yaml(load_config(config, *overrides)))
    (path / "metrics.json").write_text(json.dumps(metrics))
    return path


COMPRESSION = str(ROOT / "configs" / "experiments" / "compression.yaml")  # h = 128, V = 2048, S = 128, P ~ 128


def test_a_fixed_compression_run_counts_its_one_layout(tmp_path: Path) -> None:
    """Fixed regime, depth 1: every step compresses one chunk of P = 128 tokens into t = 16 states before the suffix
    of S = 128; per suffix token 3 x (that sample's forward FLOPs + the vocabulary projection on the suffix) / S."""
    from flops.model import compressed_flops
    from lm.compression import Layout

    run = _run_dir(tmp_path / "fixed", COMPRESSION, {"step": 5, "tokens_per_s": 1e4}, "compression.regime=fixed",
                   "compression.max_depth=1")
    cfg = load_config(COMPRESSION)
    forward = compressed_flops(cfg.model, cfg.compression, Layout((128,), 16, 128))
    r = mfu.run_mfu(run, peak_tflops=1)
    assert r["flops_per_token"] == 3 * (forward + 2 * 128 * 2048 * 128) / 128
    assert r["achieved"] == pytest.approx(1e4 * r["flops_per_token"], rel=1e-12)


@pytest.mark.parametrize("overrides", [(), ("compression.full_prob=0.3",),
                                       ("compression.mode=recent", "compression.full_prob=0.3")])
def test_a_random_compression_run_counts_the_layouts_its_batches_carry(tmp_path: Path, overrides: tuple) -> None:
    """Random regime (prefix length, ratio and depth drawn per step; full-memory batches; the `recent` baseline):
    FLOPs per token = 3 x the mean over the run's steps of the FLOPs of the layouts its training batches
    (LayoutBatches) carry, + the vocabulary projection, / S; a run's own seed gives its own layouts. (That these are
    the layouts training runs on, over accumulation and a resume: tests/test_compression.py.)"""
    import numpy as np

    from flops.model import compressed_flops
    from lm.compressed_training import DocumentWindows, LayoutBatches, LayoutSampler, decode

    cfg = load_config(COMPRESSION, *overrides)
    assert cfg.compression is not None
    windows = DocumentWindows([np.arange(1, 1001, dtype=np.uint16)], eos_id=0)  # one document of 1000 tokens
    steps = 40
    for seed in (0, 7):
        batches = LayoutBatches(windows, LayoutSampler(cfg.compression, 128), batch=1, seed=seed)
        layouts = [decode(batches.batch(step)[1]) for step in range(steps)]
        assert len(set(layouts)) > 10  # the test sees many layouts, not one
        assert any(layout.full for layout in layouts) == ("compression.full_prob=0.3" in overrides)
        forward = sum(compressed_flops(cfg.model, cfg.compression, layout) for layout in layouts) / steps
        run = _run_dir(tmp_path / f"random{seed}", COMPRESSION, {"step": steps, "tokens_per_s": 1e4},
                       f"trainer.seed={seed}", *overrides)
        assert mfu.run_mfu(run)["flops_per_token"] == 3 * (forward + 2 * 128 * 2048 * 128) / 128


@pytest.mark.parametrize("step", [None, 0, "3", True, 401])
def test_a_compression_run_without_its_step_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          step: object) -> None:
    """A compression run's FLOPs follow its steps' layouts: metrics.json without a step in [1, trainer.max_steps]
    (400 here) names that, exit 2 (a damaged step of 10^9 would be replayed for hours)."""
    metrics = {"tokens_per_s": 1e4} if step is None else {"step": step, "tokens_per_s": 1e4}
    run = _run_dir(tmp_path / "compressed", COMPRESSION, metrics)
    assert mfu.main([str(run)]) == 2
    assert capsys.readouterr() == ("", f"error: {run}: metrics.json has no step in [1, trainer.max_steps=400] (a "
                                       f"compression run's FLOPs follow its steps' layouts), got {step!r}\n")


@pytest.mark.parametrize("world_size", [None, "x", 0, True])
def test_a_world_size_that_is_no_device_count_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           world_size: object) -> None:
    """metrics.json's world_size must be a count >= 1 (null was a TypeError traceback, "x" a message without the
    run's name)."""
    run = _run_dir(tmp_path / "run", None, {"step": 3, "tokens_per_s": 1e4, "world_size": world_size})
    assert mfu.main([str(run), "--peak-tflops", "1"]) == 2
    assert capsys.readouterr() == ("", f"error: {run}: metrics.json's world_size is {world_size!r}, not a number of "
                                       "devices >= 1\n")


@pytest.mark.parametrize("metrics", [{"step": 3}, {"step": 3, "tokens_per_s": 0}, {"step": 3, "tokens_per_s": None},
                                     {"step": 3, "tokens_per_s": "fast"}])
def test_a_run_without_a_measured_rate_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  metrics: dict) -> None:
    """metrics.json without a positive number of tokens/s (too few steps timed) gives no MFU and no table: one line,
    exit status 2."""
    run = _run_dir(tmp_path / "run", None, metrics)
    assert mfu.main([str(run), "--peak-tflops", "1"]) == 2
    assert capsys.readouterr() == ("", f"error: {run}: metrics.json has no measured tokens_per_s (too few training "
                                       "steps timed)\n")


def test_metrics_that_are_no_json_object_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A metrics.json holding a JSON list, not an object, is damaged: one line naming it, exit status 2."""
    run = _run_dir(tmp_path / "run", None, {})
    (run / "metrics.json").write_text("[1000.0]")
    assert mfu.main([str(run)]) == 2
    assert capsys.readouterr().err == (f"error: {run / 'metrics.json'} is damaged (not a JSON object); "
                                       "restore or delete it\n")


def test_a_compression_run_whose_heads_have_no_flop_count_on_its_windows_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """MoSA heads' slots are set by model.seq_len (128), and above the compression layer they run on t + S = 144
    tokens: no FLOP count there (flops.model.layer_flops), one line naming the run, exit 2."""
    run = _run_dir(tmp_path / "mosa", COMPRESSION, {"step": 10, "tokens_per_s": 1e4}, "compression.regime=fixed",
                   "model.heads=[{type: dense, count: 2}, {type: mosa, count: 4, options: {sparsity: 4}}]")
    assert mfu.main([str(run)]) == 2
    assert capsys.readouterr() == ("", f"error: {run}: no FLOP count of mosa heads ({{'sparsity': 4}}) on 144-token "
                                       "windows: their slots are set by model.seq_len=128, not by the window\n")
