"""Sweep config generation, the resumable runner's bookkeeping, and aggregation on fake metrics."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import lm
from flops.aggregate import collect, curves
from flops.aggregate import main as aggregate_main
from flops.model import model_cost
from flops.run_sweep import main as run_main
from flops.sweep import main as sweep_main


def _sweep(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "sw"
    args = ["--size", "micro", "--heads", "mosa,fixed", "--sparsity", "1,4,16", "--dense-heads", "2", "--out", str(out)]
    assert sweep_main([*args, *extra, "trainer.max_steps=3", f"data.path={tmp_path / 'nodata'}"]) == 0
    return json.loads((out / "sweep.json").read_text())


def test_sweep_writes_flop_matched_loadable_configs(tmp_path: Path) -> None:
    manifest = _sweep(tmp_path)
    names = [e["name"] for e in manifest["points"]]
    assert names == ["dense_s1", "mosa_s4", "mosa_s16", "fixed_s4", "fixed_s16"]
    for e in manifest["points"]:
        cfg = lm.load_config(e["config"])  # a plain train_lm.py config
        cost = model_cost(cfg.model)
        assert cost.flops_per_pass == e["flops_per_pass"] <= e["baseline_flops_per_pass"]
        assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.seq_len, cfg.trainer.max_steps) == (64, 2, 128, 3)
        assert cfg.trainer.out_dir == e["out_dir"] and e["causal"]
        if e["head"] != "dense":
            assert [g.type for g in cfg.model.heads] == ["dense", e["head"]] and cfg.model.heads[0].count == 2
            assert cfg.model.heads[1].options["sparsity"] == e["sparsity"]


def test_sweep_marks_non_causal_points(tmp_path: Path) -> None:
    manifest = _sweep(tmp_path, "--option", "mosa.selection=expert_choice")
    causal = {e["name"]: e["causal"] for e in manifest["points"]}
    assert causal == {"dense_s1": True, "mosa_s4": False, "mosa_s16": False, "fixed_s4": True, "fixed_s16": True}


def test_sweep_rejects_bad_sparsity(tmp_path: Path, capsys) -> None:
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "3", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "error: sparsity 3 does not divide seq_len 128"


def _fake_metrics(entry: dict, ppl: float, step: int = 3) -> None:
    out = Path(entry["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps({"step": step, "val_ppl": ppl, "tokens_per_s": 1000.0}))


def test_runner_skips_finished_and_records_failures(tmp_path: Path) -> None:
    manifest = _sweep(tmp_path)
    points = {e["name"]: e for e in manifest["points"]}
    _fake_metrics(points["dense_s1"], 30.0)
    _fake_metrics(points["mosa_s4"], 40.0, step=1)  # unfinished: trained again, fails (no data)
    rc = run_main([str(tmp_path / "sw"), "--only", "dense_s1,mosa_s4"])
    status = json.loads((tmp_path / "sw" / "status.json").read_text())
    assert rc == 1
    assert status["dense_s1"] == {"status": "done"}
    assert status["mosa_s4"]["status"] == "failed" and status["mosa_s4"]["rc"] == 2
    assert "nodata does not exist" in status["mosa_s4"]["error"]


def test_aggregate_on_fake_metrics(tmp_path: Path) -> None:
    manifest = _sweep(tmp_path)
    fake = {"dense_s1": 30.0, "mosa_s4": 28.0, "mosa_s16": 27.0, "fixed_s4": 33.0}  # fixed_s16 not run
    for e in manifest["points"]:
        if e["name"] in fake:
            _fake_metrics(e, fake[e["name"]])
    rows = collect(tmp_path / "sw")
    assert [r["ppl"] for r in rows] == [30.0, 28.0, 27.0, 33.0, None]
    assert curves(rows) == {"mosa": [(1, 30.0), (4, 28.0), (16, 27.0)], "fixed": [(1, 30.0), (4, 33.0)]}
    out = tmp_path / "res" / "isoflop"
    assert aggregate_main([str(tmp_path / "sw"), "--out", str(out), "--note", "fake"]) == 0
    with open(out.with_suffix(".csv")) as f:
        assert [r["name"] for r in csv.DictReader(f)] == [e["name"] for e in manifest["points"]]
    md = out.with_suffix(".md").read_text()
    assert "| mosa | 30.00 | 28.00 | 27.00 |" in md and "| fixed | 30.00 | 33.00 | - |" in md
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
