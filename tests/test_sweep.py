"""Sweep config generation, the resumable runner's bookkeeping, and aggregation on fake metrics."""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import lm
from heads import REGISTRY
from flops.aggregate import collect, curves, sweep_labels, unequal_training
from flops.aggregate import main as aggregate_main
from flops.model import model_cost
from flops.run_sweep import main as run_main
from flops.sweep import main as sweep_main
from tests.conftest import child_env

ROOT = Path(__file__).resolve().parents[1]


def _sweep(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "sw"
    args = ["--size", "micro", "--heads", "mosa,fixed", "--sparsity", "1,4,16", "--dense-heads", "2", "--out", str(out)]
    assert sweep_main([*args, *extra, "trainer.max_steps=3", f"data.path={tmp_path / 'nodata'}"]) == 0
    return json.loads((out / "sweep.json").read_text())


@pytest.mark.parametrize("heads, message", [
    ("mosa,bogus", f"unknown head type 'bogus'; known types: {', '.join(sorted(REGISTRY))}"),  # any registered
    ("dense,mosa", "--heads lists the sparse types; dense is every sweep's baseline (its sparsity-1 point, dense_s1)"),
    ("local", "flops.sweep varies sparsity, which local heads do not have (their options: impl, window); sweep one of "
              "their options with --vary KEY=V1,V2,... or FLOP-match one setting with `python -m flops.isoflop --head "
              "local --option KEY=VALUE`"),
])
def test_sweep_refuses_head_types_it_cannot_sweep(tmp_path: Path, heads: str, message: str, capsys) -> None:
    """With --sparsity 1 alone no sparse point is solved: an unknown type, or one without a sparsity, was dropped
    silently (only dense_s1 written). Refused in one line, nothing written."""
    assert sweep_main(["--size", "micro", "--heads", heads, "--sparsity", "1", "--out", str(tmp_path / "sw")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")
    assert not (tmp_path / "sw").exists()


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


def test_sweep_keeps_the_with_groups_in_every_sparse_point(tmp_path: Path, capsys) -> None:
    """--with local:1:window=32: every sparse point is 2 dense + 1 local + n sparse heads, n the most that fit the dense
    baseline's FLOPs (flops.isoflop.solve); the baseline dense_s1 stays dense; sweep.json and the printed table name each
    point's mix; a kept group training would refuse is one line, nothing written."""
    manifest = _sweep(tmp_path, "--with", "local:1:window=32")
    assert " mosa_s4: 2 dense + 1 local + " in capsys.readouterr().out
    for e in manifest["points"]:
        model = lm.load_config(e["config"]).model
        assert e["mix"] == model.mix_text()
        if e["head"] == "dense":
            assert e["mix"] == "6 dense"
            continue
        assert [(g.type, g.count, g.options) for g in model.heads[:2]] == [("dense", 2, {}), ("local", 1, {"window": 32})]
        assert e["mix"] == f"2 dense + 1 local + {e['sparse_heads']} {e['head']}" and e["sparse_heads"] > 0
        more = dataclasses.replace(model.heads[2], count=model.heads[2].count + 1)
        assert model_cost(model).flops_per_pass <= e["baseline_flops_per_pass"] < \
            model_cost(dataclasses.replace(model, heads=[*model.heads[:2], more])).flops_per_pass
    bad = ["--size", "micro", "--heads", "mosa", "--sparsity", "4", "--with", "local:1:window=500", "--out",
           str(tmp_path / "bad")]
    capsys.readouterr()  # (load_config's warnings above)
    assert sweep_main(bad) == 2
    assert capsys.readouterr().err.startswith("error: kept heads: local: options.window = 500 > model.seq_len 128")
    assert not (tmp_path / "bad").exists()


def test_sweep_marks_non_causal_points(tmp_path: Path) -> None:
    manifest = _sweep(tmp_path, "--option", "mosa.selection=expert_choice")
    causal = {e["name"]: e["causal"] for e in manifest["points"]}
    assert causal == {"dense_s1": True, "mosa_s4": False, "mosa_s16": False, "fixed_s4": True, "fixed_s16": True}


def test_sweep_options_are_parsed_as_flops_isoflop_parses_them(tmp_path: Path, capsys) -> None:
    """A head's option given twice with different values is refused, as flops.isoflop refuses it (the last one
    silently won, e.g. turning a causal point into expert choice); the manifest's command reruns as written."""
    args = ["--size", "micro", "--heads", "mosa", "--sparsity", "4", "--out", str(tmp_path / "sw")]
    assert sweep_main([*args, "--option", "mosa.selection=quota", "--option", "mosa.selection=expert_choice"]) == 2
    assert capsys.readouterr().err == "error: --option selection given twice: 'quota' and 'expert_choice'\n"
    assert sweep_main([*args, "--option", "selection=quota"]) == 2
    assert "--option expects head.key=value, got 'selection=quota'" in capsys.readouterr().err
    override = "model.heads=[{type: dense, count: 6}]"
    assert sweep_main([*args, "--option", "mosa.selection=quota", override]) == 0
    command = json.loads((tmp_path / "sw" / "sweep.json").read_text())["command"]
    assert command.endswith(f"python -m flops.sweep {' '.join(args)} --option mosa.selection=quota '{override}'")


def test_sweep_rejects_bad_sparsity(tmp_path: Path, capsys) -> None:
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "3", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "error: sparsity 3 does not divide seq_len 128"


def test_preset_size_refuses_a_config_with_another_shape(tmp_path: Path, capsys) -> None:
    """--size micro would silently replace model.n_layers=3: refused; --size base sweeps the config's shape."""
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "1", "--out", str(tmp_path / "a"),
                       "model.n_layers=3"]) == 2
    assert capsys.readouterr().err.strip() == ("error: model.n_layers=3 conflicts with --size micro (n_layers=2); "
                                               "drop it, or pass --size base to sweep the config's own shape")
    # a Tiny-shaped base (the defaults' shape) with another size: refused too; with its own size: fine
    assert sweep_main(["--size", "small", "--base", "configs/tiny.yaml", "--heads", "mosa", "--sparsity", "1",
                       "--out", str(tmp_path / "b")]) == 2
    assert "model.n_layers=6 conflicts with --size small (n_layers=9)" in capsys.readouterr().err
    assert sweep_main(["--size", "tiny", "--base", "configs/experiments/mosa_hybrid.yaml", "--heads", "mosa",
                       "--sparsity", "1", "--out", str(tmp_path / "e")]) == 0  # its head mix is replaced anyway
    shape = ["model.n_layers=3", "model.d_model=64", "model.head_dim=16", "model.seq_len=128",
             "model.heads=[{type: dense, count: 6}]"]
    assert sweep_main(["--size", "base", "--heads", "mosa", "--sparsity", "1", "--out", str(tmp_path / "c"), *shape]) == 0
    baseline = lm.load_config(str(tmp_path / "c" / "dense_s1.yaml")).model
    assert (baseline.n_layers, baseline.d_model, baseline.head_dim, baseline.seq_len) == (3, 64, 16, 128)
    assert [(g.type, g.count) for g in baseline.heads] == [("dense", 6)]  # the config's 6 dense heads, its budget
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "1", "--out", str(tmp_path / "d"), *shape[1:]]) == 0
    # --size base takes the config's dense head count as the baseline: a config with sparse heads or a per-layer mix
    # would silently shrink the budget
    capsys.readouterr()
    assert sweep_main(["--size", "base", "--base", "configs/experiments/mosa_hybrid.yaml", "--heads", "mosa",
                       "--sparsity", "1,8", "--out", str(tmp_path / "f")]) == 2
    assert capsys.readouterr().err.strip() == ("error: the baseline must be a dense config (one dense head group, "
                                               "no model.layer_heads); this one has dense, mosa heads")


def test_sweep_refuses_an_out_holding_runs_of_other_models(tmp_path: Path, capsys) -> None:
    """A second sweep into an --out whose run directories hold runs of other head counts is refused: run_sweep would
    skip them as finished and the aggregate would report their perplexity under the new head counts. The same
    sweep written again (e.g. with more steps) is fine."""
    manifest = _sweep(tmp_path)
    _fake_metrics(manifest["points"][1], 40.0)
    run = Path(manifest["points"][1]["out_dir"])
    (run / "config.yaml").write_text((tmp_path / "sw" / f"{manifest['points'][1]['name']}.yaml").read_text())
    assert _sweep(tmp_path)["points"] == manifest["points"]
    capsys.readouterr()
    args = ["--size", "micro", "--heads", "mosa,fixed", "--sparsity", "1,4,16", "--dense-heads", "1", "--out",
            str(tmp_path / "sw"), "trainer.max_steps=3", f"data.path={tmp_path / 'nodata'}"]
    assert sweep_main(args) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"error: {run} holds a run of another config (model.heads.0.count: 2 -> 1; "
                          "model.heads.1.count: 24 -> 30): an earlier sweep") and "use a new --out" in err
    # the optimiser's settings may change when a run resumes, but a finished run of another learning rate is not
    # this point's result either (it was skipped as finished and reported under the new sweep's command)
    assert sweep_main([*args[:7], "2", *args[8:], "optim.lr=0.01"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"error: {run} holds a run of another config (optim.lr: 0.00025 -> 0.01): an earlier sweep")


def test_sweep_paths_are_absolute_so_the_runner_finds_them_from_the_repository_root(tmp_path: Path, monkeypatch,
                                                                                     capsys) -> None:
    """Config, run and data paths given relative to where flops.sweep ran (data.path was copied as given: every
    point failed in run_sweep, which trains from the repository root); data not prepared yet is a warning."""
    monkeypatch.chdir(tmp_path)
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "1", "--out", "rel", "data.path=d"]) == 0
    entry = json.loads((tmp_path / "rel" / "sweep.json").read_text())["points"][0]
    assert entry["config"] == str(tmp_path / "rel" / "dense_s1.yaml") and Path(entry["config"]).is_file()
    assert entry["out_dir"] == str(tmp_path / "rel" / "runs" / "dense_s1")
    assert lm.load_config(entry["config"]).data.path == str(tmp_path / "d")
    assert (f"warning: data.path {tmp_path / 'd'} holds no prepared data (index.json) yet: flops.run_sweep needs it"
            in capsys.readouterr().err)


def _fake_metrics(entry: dict, ppl: float, step: int = 3) -> None:
    out = Path(entry["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps({"step": step, "tokens_seen": 1024 * step, "val_ppl": ppl,
                                                  "tokens_per_s": 1000.0}))


def test_runner_skips_finished_and_records_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = _sweep(tmp_path)
    points = {e["name"]: e for e in manifest["points"]}
    _fake_metrics(points["dense_s1"], 30.0)
    _fake_metrics(points["mosa_s4"], 40.0, step=1)  # unfinished: trained again, fails (no data)
    capsys.readouterr()  # flops.sweep's lines
    rc = run_main([str(tmp_path / "sw"), "--only", "dense_s1,mosa_s4"])
    status = json.loads((tmp_path / "sw" / "status.json").read_text())
    assert rc == 1
    assert status["dense_s1"] == {"status": "done"}
    assert status["mosa_s4"]["status"] == "failed" and status["mosa_s4"]["rc"] == 2
    assert "nodata does not exist" in status["mosa_s4"]["error"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[1/2] dense_s1: finished, skipped"
    # a readable line, not the status dict: the exit code, the time and the training log's last line
    assert re.fullmatch(r"\[2/2\] mosa_s4: failed \(rc 2\) in \d+\.\d s: error: .*nodata does not exist.*", lines[-1])
    # mosa_s4 finished since (e.g. trained by hand): a run of another point exits 0 despite its failed entry, and a
    # run of mosa_s4 records it done, without the failure's rc and error
    _fake_metrics(points["mosa_s4"], 40.0)
    assert run_main([str(tmp_path / "sw"), "--only", "dense_s1"]) == 0
    assert "failed points" not in capsys.readouterr().err
    assert run_main([str(tmp_path / "sw"), "--only", "mosa_s4"]) == 0
    assert json.loads((tmp_path / "sw" / "status.json").read_text())["mosa_s4"] == {"status": "done"}


def test_a_finished_points_status_keeps_only_what_its_training_recorded() -> None:
    """A point found finished keeps a "done" entry whole, the training's rc and seconds of a failure after training
    (the leak-free evaluation's), and nothing of a failed or interrupted training."""
    from flops.run_sweep import finished

    done = {"status": "done", "rc": 0, "seconds": 3.0, "leakfree_ppl": 9.0}
    assert finished(done) == done and finished(None) == {"status": "done"}
    leakfree = {"status": "failed", "rc": 0, "seconds": 3.0, "error": "leak-free evaluation: KeyError: 'x'"}
    assert finished(leakfree) == {"rc": 0, "seconds": 3.0, "status": "done"}
    for other in ({"status": "failed", "rc": 2, "seconds": 1.0, "error": "e"},
                  {"status": "interrupted", "signal": "SIGTERM", "rc": -15, "seconds": 1.0}, {"status": "running", "pid": 7}):
        assert finished(other) == {"status": "done"}


def test_runner_passes_overrides_to_the_resumed_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """run_sweep runs `train_lm.py --config <point> --resume <overrides>`: the overrides reach the run (a
    `--resume [PATH]` option took the first one for a checkpoint path and every point failed)."""
    from tests.synthetic import write_prepared

    data = write_prepared(tmp_path / "data")
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "1", "--out", str(tmp_path / "sw"),
                       f"data.path={data}", "model.vocab_size=64", "trainer.accelerator=cpu"]) == 0
    assert run_main([str(tmp_path / "sw"), "trainer.max_steps=2", "trainer.val_every=2", "optim.warmup_steps=1",
                     "data.batch_size=2", "data.val_batches=1"]) == 0
    entry = json.loads((tmp_path / "sw" / "sweep.json").read_text())["points"][0]
    assert json.loads((Path(entry["out_dir"]) / "metrics.json").read_text())["step"] == 2
    assert json.loads((tmp_path / "sw" / "status.json").read_text())["dense_s1"]["status"] == "done"
    assert re.fullmatch(r"\[1/1\] dense_s1: done in \d+\.\d s", capsys.readouterr().out.splitlines()[-1])
    # finished: skipped again with the same overrides, a longer validation interval or the data at another path;
    # with another learning rate, or without the overrides it was trained with, its result is not the point's
    same = ["trainer.max_steps=2", "optim.warmup_steps=1", "data.batch_size=2", "data.val_batches=1"]
    shutil.copytree(data, tmp_path / "moved")
    for overrides in (same, [*same, "trainer.val_every=5", f"data.path={tmp_path / 'moved'}"]):
        assert run_main([str(tmp_path / "sw"), *overrides]) == 0
        assert capsys.readouterr().out.splitlines() == ["[1/1] dense_s1: finished, skipped"]
    for overrides, changes in (([*same, "optim.lr=0.05"], "optim.lr: 0.00025 -> 0.05"),
                               (["trainer.max_steps=2"], "data.batch_size: 2 -> 64; data.val_batches: 1 -> 16; "
                                                         "optim.warmup_steps: 1 -> 4000")):
        assert run_main([str(tmp_path / "sw"), *overrides]) == 1
        assert capsys.readouterr().out.splitlines() == [
            f"[1/1] dense_s1: failed: {entry['out_dir']} holds a run with other settings ({changes}): pass the "
            "overrides it was trained with, or write the sweep into a new --out"]
        assert json.loads((tmp_path / "sw" / "status.json").read_text())["dense_s1"]["status"] == "failed"
    (Path(entry["out_dir"]) / "config.yaml").write_text("- 1\n")  # damaged: the point fails in one line, the sweep goes on
    assert run_main([str(tmp_path / "sw"), *same]) == 1
    assert json.loads((tmp_path / "sw" / "status.json").read_text())["dense_s1"]["error"] == (
        f"{entry['out_dir']}/config.yaml is damaged (holds a list, not a config); restore it or delete the run directory")
    # a run that ends cleanly (rc 0) before trainer.max_steps, here on trainer.max_minutes, is partial, not done
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "1", "--out", str(tmp_path / "timed"),
                       f"data.path={data}", "model.vocab_size=64", "trainer.accelerator=cpu"]) == 0
    assert run_main([str(tmp_path / "timed"), "trainer.max_steps=1000", "trainer.max_minutes=0.0001",
                     "optim.warmup_steps=1", "data.batch_size=2", "data.val_batches=1"]) == 0
    status = json.loads((tmp_path / "timed" / "status.json").read_text())["dense_s1"]
    assert status["status"] == "partial" and status["rc"] == 0


def test_aggregate_on_fake_metrics(tmp_path: Path) -> None:
    manifest = _sweep(tmp_path)
    fake = {"dense_s1": 30.0, "mosa_s4": 28.0, "mosa_s16": 27.0, "fixed_s4": 33.0}  # fixed_s16 not run
    for e in manifest["points"]:
        if e["name"] in fake:
            _fake_metrics(e, fake[e["name"]])
    rows = collect(tmp_path / "sw")
    assert [r["ppl"] for r in rows] == [30.0, 28.0, 27.0, 33.0, None]
    assert [r["status"] for r in rows] == ["done"] * 4 + ["not run"]
    assert curves(rows) == {("micro", "mosa"): [(1, 30.0, 0.0), (4, 28.0, 0.0), (16, 27.0, 0.0)],
                            ("micro", "fixed"): [(1, 30.0, 0.0), (4, 33.0, 0.0)]}
    out = tmp_path / "res" / "isoflop"
    assert aggregate_main([str(tmp_path / "sw"), "--out", str(out), "--note", "fake"]) == 0
    with open(out.with_suffix(".csv")) as f:
        assert [r["name"] for r in csv.DictReader(f)] == [e["name"] for e in manifest["points"]]
    md = out.with_suffix(".md").read_text()
    assert "| mosa | 30.00 | 28.00 | 27.00 |" in md and "| fixed | 30.00 | 33.00 | - |" in md
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "Warning" not in md and unequal_training(rows) == []


def test_a_sweep_of_another_option_writes_and_aggregates_its_points(tmp_path: Path, capsys) -> None:
    """--vary window=16,32,64 --heads local: one FLOP-matched point per window (flops.isoflop.solve with that option),
    always with the dense baseline; the aggregate's table has a dense-baseline column and one per window, the curves
    run over the windows without a dense point at x = 1, the PNG names the option. Bad --vary: one line."""
    out = tmp_path / "sw"
    assert sweep_main(["--size", "micro", "--heads", "local,topk", "--vary", "window=16,32,64", "--dense-heads", "2",
                       "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: --vary window: topk heads have no option window (their options: ")
    assert sweep_main(["--size", "micro", "--heads", "local", "--vary", "window=16,32,64", "--dense-heads", "2",
                       "--option", "local.window=8", "--out", str(out)]) == 2
    assert "error: --option local.window conflicts with the swept values of window" in capsys.readouterr().err
    for bad in ("window", "window=", "window=16,16", "window=16,1.6e1", "window=16,,32", "window=NaN", "window=null",
                "=16"):
        with pytest.raises(SystemExit):
            sweep_main(["--size", "micro", "--heads", "local", "--vary", bad, "--out", str(out)])
        assert "expected KEY=V1,V2,... with distinct values" in capsys.readouterr().err
    for bad in ("window=16,x", "window=0", "window=-8", "window=true"):  # alone, the values are the x axis
        with pytest.raises(SystemExit):
            sweep_main(["--size", "micro", "--heads", "local", "--vary", bad, "--out", str(out)])
        err = capsys.readouterr().err
        assert err.startswith("error: --vary window: alone, its values are the x axis and must be positive numbers, "
                              f"got {bad.split('=')[1]} (with --sparsity") and err.count("\n") == 1, err
    with pytest.raises(SystemExit):
        sweep_main(["--size", "micro", "--heads", "mosa", "--vary", "sparsity=2,4", "--out", str(out)])
    assert "sparsity is swept with --sparsity (where 1 is the dense baseline)" in capsys.readouterr().err
    # MoSA at sparsity 1 is the dense baseline: its "capacity_factor" points were copies of dense_s1 under sparse names
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--vary", "capacity_factor=1,1.5", "--option",
                       "mosa.sparsity=1", "--dense-heads", "2", "--out", str(out)]) == 2
    assert "error: mosa heads at sparsity 1 are the dense baseline itself, not a sparse point" in capsys.readouterr().err
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "1", "--with", "local:1:window=8", "--out",
                       str(out)]) == 2  # --with was dropped silently
    assert "error: --with keeps head groups in the sparse points; --sparsity 1 alone" in capsys.readouterr().err
    assert not out.exists()
    assert sweep_main(["--size", "micro", "--heads", "local", "--vary", "window=16,32,64", "--dense-heads", "2",
                       "--out", str(out), "trainer.max_steps=3", f"data.path={tmp_path / 'nodata'}"]) == 0
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["vary"] == "window"
    points = {e["name"]: e for e in manifest["points"]}
    assert list(points) == ["dense_s1", "local_window16", "local_window32", "local_window64"]
    for window in (16, 32, 64):
        e = points[f"local_window{window}"]
        model = lm.load_config(e["config"]).model
        assert e["value"] == window and e["sparsity"] is None and model.heads[1].options == {"window": window}
        more = dataclasses.replace(model.heads[1], count=model.heads[1].count + 1)
        assert model_cost(model).flops_per_pass <= e["baseline_flops_per_pass"] < \
            model_cost(dataclasses.replace(model, heads=[model.heads[0], more])).flops_per_pass
    assert points["local_window16"]["sparse_heads"] > points["local_window64"]["sparse_heads"]  # cheaper heads, more
    for name, ppl in {"dense_s1": 30.0, "local_window16": 33.0, "local_window64": 31.0}.items():
        _fake_metrics(points[name], ppl)
    rows = collect(out)
    assert curves(rows) == {("micro", "local"): [(16, 33.0, 0.0), (64, 31.0, 0.0)]}
    assert aggregate_main([str(out), "--out", str(tmp_path / "res")]) == 0
    md = (tmp_path / "res.md").read_text()
    assert "| head | dense baseline | window=16 | window=32 | window=64 |" in md
    assert "| local | 30.00 | 33.00 | - | 31.00 |" in md
    with open(tmp_path / "res.csv") as f:
        assert [(r["vary"], r["value"]) for r in csv.DictReader(f)] == [("window", "")] + [
            ("window", str(w)) for w in (16, 32, 64)]
    # replicas; a whole number written as a float names its point as the integer it is
    seeded = tmp_path / "seeded"
    assert sweep_main(["--size", "micro", "--heads", "local", "--vary", "window=1e1,16.0", "--dense-heads", "2",
                       "--seeds", "2", "--out", str(seeded)]) == 0
    entries = json.loads((seeded / "sweep.json").read_text())["points"]
    assert [(e["name"], e["value"]) for e in entries] == [
        ("dense_s1_seed1234", None), ("dense_s1_seed1235", None), ("local_window10_seed1234", 10),
        ("local_window10_seed1235", 10), ("local_window16_seed1234", 16), ("local_window16_seed1235", 16)]
    assert lm.load_config(entries[2]["config"]).model.heads[1].options == {"window": 10}


def test_aggregate_reads_a_sweep_written_before_vary(tmp_path: Path) -> None:
    """A sweep.json from before --vary (no `vary`, no point `value`, `mix` or `setting`) is a sparsity sweep: rho
    columns with the dense baseline at rho = 1, curves starting there."""
    manifest = _sweep(tmp_path)
    del manifest["vary"]
    for e in manifest["points"]:
        del e["value"], e["mix"], e["setting"]
    (tmp_path / "sw" / "sweep.json").write_text(json.dumps(manifest))
    for e in manifest["points"]:
        _fake_metrics(e, {"dense_s1": 30.0, "mosa_s4": 28.0, "mosa_s16": 27.0, "fixed_s4": 33.0, "fixed_s16": 31.0}[e["name"]])
    rows = collect(tmp_path / "sw")
    assert [(r["vary"], r["value"]) for r in rows] == [("sparsity", s) for s in (1, 4, 16, 4, 16)]
    assert curves(rows)[("micro", "mosa")] == [(1, 30.0, 0.0), (4, 28.0, 0.0), (16, 27.0, 0.0)]
    assert aggregate_main([str(tmp_path / "sw"), "--out", str(tmp_path / "res")]) == 0
    assert "| head | rho=1 | rho=4 | rho=16 |\n|---|---|---|---|\n| fixed | 30.00 | 33.00 | 31.00 |" in \
        (tmp_path / "res.md").read_text()


GRID = ["--size", "micro", "--heads", "mosa,routing", "--sparsity", "1,4,16", "--vary", "capacity_factor=1,2",
        "--dense-heads", "2"]


def _grid(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "sw"
    assert sweep_main([*GRID, "--out", str(out), *extra, "trainer.max_steps=3", f"data.path={tmp_path / 'nodata'}"]) == 0
    return json.loads((out / "sweep.json").read_text())


def test_a_grid_of_sparsity_and_another_option_writes_a_flop_matched_point_per_pair(tmp_path: Path) -> None:
    """--sparsity 1,4,16 --vary capacity_factor=1,2: dense_s1 once (sparsity 1), then a point per (head, sparsity > 1,
    value) with both options set, each the most heads that fit the dense baseline's FLOPs; sweep.json records both
    swept keys (`vary` is --vary's, as in a sweep of that option alone) and each point's sparsity and value."""
    manifest = _grid(tmp_path)
    assert (manifest["vary"], manifest["swept"]) == ("capacity_factor", ["sparsity", "capacity_factor"])
    assert [(e["name"], e["sparsity"], e["value"]) for e in manifest["points"]] == [("dense_s1", 1, None)] + [
        (f"{head}_s{s}_capacity_factor{v}", s, v) for head in ("mosa", "routing") for s in (4, 16) for v in (1, 2)]
    points = {e["name"]: e for e in manifest["points"]}
    assert lm.load_config(points["dense_s1"]["config"]).model.mix_text() == "6 dense"
    for e in manifest["points"][1:]:
        model = lm.load_config(e["config"]).model
        assert (model.heads[1].type, model.heads[1].options) == (
            e["head"], {"sparsity": e["sparsity"], "capacity_factor": e["value"]})
        more = dataclasses.replace(model.heads[1], count=model.heads[1].count + 1)
        assert model_cost(model).flops_per_pass == e["flops_per_pass"] <= e["baseline_flops_per_pass"] < \
            model_cost(dataclasses.replace(model, heads=[model.heads[0], more])).flops_per_pass
    # a capacity factor of 2 doubles what each head keeps: fewer heads fit
    assert points["mosa_s4_capacity_factor2"]["sparse_heads"] < points["mosa_s4_capacity_factor1"]["sparse_heads"]
    seeded = tmp_path / "seeded"
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "4", "--vary", "capacity_factor=2",
                       "--seeds", "2", "--out", str(seeded)]) == 0  # no sparsity 1: no dense baseline, as --sparsity
    assert [e["name"] for e in json.loads((seeded / "sweep.json").read_text())["points"]] == [
        "mosa_s4_capacity_factor2_seed1234", "mosa_s4_capacity_factor2_seed1235"]


def drawn_curves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple]]:
    """(label, x values) of every curve matplotlib's errorbar draws from now on (flops.aggregate's PNG)."""
    from matplotlib.axes import Axes

    drawn: list[tuple[str, tuple]] = []
    errorbar = Axes.errorbar

    def recorded(self: Axes, x: tuple, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        drawn.append((kwargs["label"], tuple(x)))
        return errorbar(self, x, *args, **kwargs)

    monkeypatch.setattr(Axes, "errorbar", recorded)
    return drawn


def test_aggregate_of_a_grid_has_a_row_and_a_curve_per_head_and_value(tmp_path: Path, monkeypatch) -> None:
    """A grid's table: a block of rows per capacity factor, a row per head, a column per rho (the dense baseline at
    rho = 1), mean ± std over seeds; the PNG draws a curve per (head, value) over sparsity from the baseline. (Its
    sweep.json as written before points recorded their `setting`: a grid over sparsity places them without it.)"""
    manifest = _grid(tmp_path, "--seeds", "2")
    for e in manifest["points"]:
        del e["setting"]
    (tmp_path / "sw" / "sweep.json").write_text(json.dumps(manifest))
    for e in manifest["points"]:
        ppl = 30.0 if e["head"] == "dense" else {"mosa": 20.0, "routing": 40.0}[e["head"]] + e["sparsity"] + 10 * e["value"]
        if e["name"] not in ("routing_s16_capacity_factor2_seed1234", "routing_s16_capacity_factor2_seed1235"):
            _fake_metrics(e, ppl + {1234: 0.0, 1235: 2.0}[e["seed"]])  # mean ppl + 1, std 2 ** 0.5
    rows = collect(tmp_path / "sw")
    means = {key: [(x, mean) for x, mean, _ in points] for key, points in curves(rows).items()}
    assert means == {("micro", "mosa capacity_factor=1"): [(1, 31.0), (4, 35.0), (16, 47.0)],
                     ("micro", "mosa capacity_factor=2"): [(1, 31.0), (4, 45.0), (16, 57.0)],
                     ("micro", "routing capacity_factor=1"): [(1, 31.0), (4, 55.0), (16, 67.0)],
                     ("micro", "routing capacity_factor=2"): [(1, 31.0), (4, 65.0)]}
    drawn = drawn_curves(monkeypatch)
    out = tmp_path / "res"
    assert aggregate_main([str(tmp_path / "sw"), "--out", str(out)]) == 0
    spread = " ± 1.41 (n=2)"
    assert "\n".join([
        "| capacity_factor | head | rho=1 | rho=4 | rho=16 |", "|---|---|---|---|---|",
        f"| 1 | mosa | 31.00{spread} | 35.00{spread} | 47.00{spread} |",
        f"| 1 | routing | 31.00{spread} | 55.00{spread} | 67.00{spread} |",
        f"| 2 | mosa | 31.00{spread} | 45.00{spread} | 57.00{spread} |",
        f"| 2 | routing | 31.00{spread} | 65.00{spread} | - |"]) in out.with_suffix(".md").read_text()
    with open(out.with_suffix(".csv")) as f:
        table = {r["name"]: (r["sparsity"], r["vary"], r["value"], r["ppl"]) for r in csv.DictReader(f)}
    assert table["dense_s1_seed1234"] == ("1", "capacity_factor", "", "30.0")
    assert table["mosa_s16_capacity_factor2_seed1235"] == ("16", "capacity_factor", "2", "58.0")
    assert sorted(drawn) == [(f"{head} capacity_factor={v}", xs) for head in ("mosa", "routing") for v, xs in
                             ((1, (1, 4, 16)), (2, (1, 4, 16) if head == "mosa" else (1, 4)))]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_a_grid_over_text_values_draws_a_curve_per_value(tmp_path: Path, capsys) -> None:
    """With --sparsity, --vary takes any values of the option, e.g. MoSA's selection rules: a point per (sparsity,
    rule) with that rule set (expert choice, not causal, recorded as such), a table block and a curve per rule over
    sparsity; a value the type refuses is one line naming it."""
    out = tmp_path / "sw"
    argv = ["--size", "micro", "--heads", "mosa", "--sparsity", "1,4", "--dense-heads", "2", "--out", str(out)]
    assert sweep_main([*argv, "--vary", "selection=threshold,expert_choice", "trainer.max_steps=3"]) == 0
    points = json.loads((out / "sweep.json").read_text())["points"]
    assert [(e["name"], e["value"], e["causal"]) for e in points] == [
        ("dense_s1", None, True), ("mosa_s4_selectionthreshold", "threshold", True),
        ("mosa_s4_selectionexpert_choice", "expert_choice", False)]
    assert [lm.load_config(e["config"]).model.heads[-1].options["selection"] for e in points[1:]] == [
        "threshold", "expert_choice"]
    for e in points:  # a non-causal point's perplexity is its leak-free one
        _fake_metrics(e, {None: 30.0, "threshold": 25.0, "expert_choice": 10.0}[e["value"]])
    (Path(points[2]["out_dir"]) / "leakfree.json").write_text(json.dumps({"leakfree_ppl": 20.0, "step": 3}))
    assert aggregate_main([str(out), "--out", str(tmp_path / "res")]) == 0
    assert "\n".join(["| selection | head | rho=1 | rho=4 |", "|---|---|---|---|",
                      "| expert_choice | mosa | 30.00 | 20.00 |", "| threshold | mosa | 30.00 | 25.00 |"]) in (tmp_path / "res.md").read_text()
    assert {key: [(x, m) for x, m, _ in pts] for key, pts in curves(collect(out)).items()} == {
        ("micro", "mosa selection=expert_choice"): [(1, 30.0), (4, 20.0)],
        ("micro", "mosa selection=threshold"): [(1, 30.0), (4, 25.0)]}
    capsys.readouterr()
    assert sweep_main([*argv, "--vary", "selection=threshold,bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bogus" in err and err.count("\n") == 1, err


def test_a_grid_of_two_options_has_a_curve_per_value_of_the_second_over_the_first(tmp_path: Path, monkeypatch,
                                                                                 capsys) -> None:
    """--vary capacity_factor=1.25,1.5 --vary selection=threshold,quota (no --sparsity): dense_s1, then a FLOP-matched
    point per (capacity factor, rule) with both set (the type's default sparsity); sweep.json records [capacity_factor,
    selection] and each point's setting; the aggregate has a block of rows per rule, a column per capacity factor and
    the baseline's own column (never at x = 1), draws a curve per rule over the capacity factor with the baseline as a
    line, and shows every point's setting. A point whose setting lacks the x option is a damaged sweep.json."""
    out = tmp_path / "sw"
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--vary", "capacity_factor=1.25,1.5", "--vary",
                       "selection=threshold,quota", "--dense-heads", "2", "--out", str(out), "trainer.max_steps=3",
                       f"data.path={tmp_path / 'nodata'}"]) == 0
    manifest = json.loads((out / "sweep.json").read_text())
    assert (manifest["vary"], manifest["swept"]) == ("selection", ["capacity_factor", "selection"])
    assert [(e["name"], e["value"], e["setting"]) for e in manifest["points"]] == [("dense_s1", None, {})] + [
        (f"mosa_capacity_factor{f}_selection{r}", r, {"capacity_factor": f, "selection": r})
        for f in (1.25, 1.5) for r in ("threshold", "quota")]
    for e in manifest["points"][1:]:
        model = lm.load_config(e["config"]).model
        assert {k: model.heads[1].options[k] for k in e["setting"]} == e["setting"]
        assert e["flops_per_pass"] <= e["baseline_flops_per_pass"]
    for e in manifest["points"]:
        _fake_metrics(e, 30.0 if e["head"] == "dense" else 10 * e["setting"]["capacity_factor"]
                      + {"threshold": 1.0, "quota": 2.0}[e["setting"]["selection"]])
    drawn = drawn_curves(monkeypatch)
    assert aggregate_main([str(out), "--out", str(tmp_path / "res")]) == 0
    report = (tmp_path / "res.md").read_text()
    assert "\n".join(["| selection | head | dense baseline | capacity_factor=1.25 | capacity_factor=1.5 |",
                      "|---|---|---|---|---|", "| quota | mosa | 30.00 | 14.50 | 17.00 |",
                      "| threshold | mosa | 30.00 | 13.50 | 16.00 |"]) in report
    row = "| mosa_capacity_factor1.5_selectionquota | mosa | selection | quota | capacity_factor=1.5 selection=quota |"
    assert row in report  # the points table shows the setting
    assert sorted(drawn) == [("mosa selection=quota", (1.25, 1.5)), ("mosa selection=threshold", (1.25, 1.5))]
    with open(tmp_path / "res.csv") as f:  # both swept values of every point, by name
        assert {r["name"]: r["setting"] for r in csv.DictReader(f)} == {
            "dense_s1": "", **{f"mosa_capacity_factor{f}_selection{r}": f"capacity_factor={f} selection={r}"
                               for f in (1.25, 1.5) for r in ("threshold", "quota")}}
    capsys.readouterr()
    for setting, why in ((None, "point 1's setting is not an object holding capacity_factor"),
                         ({"selection": "threshold"}, "point 1's setting is not an object holding capacity_factor")):
        manifest["points"][1]["setting"] = setting
        (out / "sweep.json").write_text(json.dumps(manifest))
        assert aggregate_main([str(out)]) == 2
        assert capsys.readouterr().err == f"error: {out / 'sweep.json'} is damaged ({why}); restore it or write it " \
                                          "again with flops.sweep\n"


@pytest.mark.parametrize("argv, message", [
    (["--heads", "local", "--sparsity", "1,4", "--vary", "window=16,32"],
     "--sparsity with --vary: local heads have no sparsity (their options: impl, window); sweep window alone, without "
     "--sparsity"),
    (["--heads", "mosa,fixed", "--sparsity", "4", "--vary", "capacity_factor=1,2"],
     "--vary capacity_factor: fixed heads have no option capacity_factor (their options: impl, sparsity)"),
    (["--heads", "mosa", "--sparsity", "4", "--vary", "capacity_factor=1,2", "--option", "mosa.sparsity=8"],
     "--option mosa.sparsity conflicts with the swept values of sparsity"),
    (["--heads", "mosa", "--sparsity", "4", "--vary", "capacity_factor=1,2", "--option", "mosa.capacity_factor=3"],
     "--option mosa.capacity_factor conflicts with the swept values of capacity_factor"),
    (["--heads", "mosa", "--sparsity", "1", "--vary", "capacity_factor=1,2"],
     "--vary capacity_factor with --sparsity 1 alone: sparsity 1 is the dense baseline, which has no sparse heads to "
     "vary; add sparsities > 1"),
    (["--heads", "mosa", "--sparsity", "4", "--vary", "sparsity=2,4"],
     "argument --vary: sparsity is swept with --sparsity (where 1 is the dense baseline)"),
    (["--heads", "mosa"], "one of the arguments --sparsity --vary is required"),
    (["--heads", "mosa", "--sparsity", "4", "--vary", "capacity_factor=1,2", "--vary", "selection=quota"],
     "a sweep has at most two axes: --sparsity and one --vary, or two --vary without --sparsity"),
    (["--heads", "mosa", "--vary", "capacity_factor=1,2", "--vary", "capacity_factor=3"],
     "--vary capacity_factor given twice: give its values once, --vary capacity_factor=V1,V2,..."),
    (["--heads", "mosa", "--vary", "selection=threshold,quota", "--vary", "capacity_factor=1,2"],
     "--vary selection: first of two, its values are the x axis and must be positive numbers, got threshold,quota "
     "(put it second: the second --vary's values may be any, a curve each)"),
    (["--heads", "local", "--vary", "window=16,32", "--vary", "capacity_factor=1,2"],
     "--vary capacity_factor: local heads have no option capacity_factor (their options: impl, window)"),
])
def test_bad_grids_are_one_line_errors(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    out = tmp_path / "sw"
    try:
        rc = sweep_main(["--size", "micro", *argv, "--out", str(out)])
    except SystemExit as stop:  # argparse's errors
        rc = stop.code
    assert (rc, capsys.readouterr().err) == (2, f"error: {message}\n")
    assert not out.exists()


def test_aggregate_names_points_trained_for_different_lengths(tmp_path: Path, capsys) -> None:
    """A point rerun longer (`run_sweep --only mosa_s4 trainer.max_steps=5`) is done at its own length, but its
    perplexity is not comparable with the others': warned on stderr, above the tables and in the PNG title. The
    default note records the sweep's command and the points' length."""
    manifest = _sweep(tmp_path)
    points = {e["name"]: e for e in manifest["points"]}
    for name in ("dense_s1", "mosa_s16", "fixed_s4"):
        _fake_metrics(points[name], 30.0)
    longer = Path(points["mosa_s4"]["out_dir"])
    longer.mkdir(parents=True)
    (longer / "config.yaml").write_text(Path(points["mosa_s4"]["config"]).read_text().replace("max_steps: 3",
                                                                                               "max_steps: 5"))
    _fake_metrics(points["mosa_s4"], 20.0, step=5)
    rows = collect(tmp_path / "sw")
    assert [r["status"] for r in rows] == ["done"] * 4 + ["not run"]
    warning = ("sweep micro: its finished points trained for different lengths (dense_s1, mosa_s16, fixed_s4: 3 steps "
               "(3,072 tokens); mosa_s4: 5 steps (5,120 tokens)); their perplexities are not comparable at equal FLOPs "
               "per pass: train them to one length")
    assert unequal_training(rows) == [warning]
    capsys.readouterr()
    out = tmp_path / "isoflop"
    assert aggregate_main([str(tmp_path / "sw"), "--out", str(out)]) == 0
    assert f"warning: {warning}\n" in capsys.readouterr().err
    md = out.with_suffix(".md").read_text()
    assert f"**Warning: {warning}.**" in md
    assert md.startswith(f"- IsoFLOP sweep `{tmp_path / 'sw'}` (micro): `python -m flops.sweep --size micro --heads "
                         "mosa,fixed")
    assert "each finished point trained 3 steps (3,072 tokens), 5 steps (5,120 tokens)" in md
    # metrics without tokens_seen (older runs): compared on steps alone, no false warning at equal steps
    for row in rows:
        row["tokens"] = None if row["name"] == "dense_s1" else row["tokens"]
    assert unequal_training([r for r in rows if r["name"] != "mosa_s4"]) == []
    assert "dense_s1, mosa_s16, fixed_s4: 3 steps (tokens not recorded); mosa_s4: 5 steps (tokens not recorded)" in \
        unequal_training(rows)[0]


def test_non_causal_points_are_read_and_evaluated_leak_free(tmp_path: Path, capsys,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-causal point's perplexity is its leak-free one: run_sweep evaluates it after training (leakfree.json,
    on training's validation windows) and flops.aggregate reads that, not the run's teacher-forced val_ppl; a
    causal point's is its val_ppl. A DeepSpeed point's last.ckpt (a directory) is consolidated first (it failed:
    readers take files)."""
    from tests.synthetic import write_prepared

    data = write_prepared(tmp_path / "data")
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "1,4", "--out", str(tmp_path / "sw"),
                       "--option", "mosa.selection=expert_choice", f"data.path={data}", "model.vocab_size=64",
                       "trainer.accelerator=cpu"]) == 0
    assert run_main([str(tmp_path / "sw"), "trainer.max_steps=2", "trainer.val_every=2", "optim.warmup_steps=1",
                     "data.batch_size=2", "data.val_batches=1"]) == 0
    points = {e["name"]: e for e in json.loads((tmp_path / "sw" / "sweep.json").read_text())["points"]}
    assert not points["mosa_s4"]["causal"] and points["dense_s1"]["causal"]
    assert [json.loads((Path(points[name]["out_dir"]) / "metrics.json").read_text())["causal"]  # the runs say so too
            for name in ("mosa_s4", "dense_s1")] == [False, True]
    assert not (Path(points["dense_s1"]["out_dir"]) / "leakfree.json").exists()
    leakfree = json.loads((Path(points["mosa_s4"]["out_dir"]) / "leakfree.json").read_text())
    assert leakfree["windows"] == 2 and leakfree["leakfree_ppl"] != leakfree["ppl"] and leakfree["step"] == 2
    status = json.loads((tmp_path / "sw" / "status.json").read_text())["mosa_s4"]
    assert status["status"] == "done" and status["leakfree_ppl"] == leakfree["leakfree_ppl"]
    rows = {r["name"]: r for r in collect(tmp_path / "sw")}
    assert rows["mosa_s4"]["ppl"] == leakfree["leakfree_ppl"] != rows["mosa_s4"]["val_ppl"]
    assert rows["dense_s1"]["ppl"] == rows["dense_s1"]["val_ppl"] is not None
    (Path(points["mosa_s4"]["out_dir"]) / "leakfree.json").unlink()  # not evaluated: no perplexity, not done
    row = {r["name"]: r for r in collect(tmp_path / "sw")}["mosa_s4"]
    assert row["ppl"] is None and row["status"] != "done"
    import lm.consolidate
    from flops.run_sweep import leak_free_eval

    last = Path(points["mosa_s4"]["out_dir"]) / "checkpoints" / "last.ckpt"
    trained = last.with_name("trained.ckpt")
    last.rename(trained)
    last.mkdir()
    (last / "latest").write_text("checkpoint")  # as DeepSpeed leaves it; its consolidation: the trained file
    monkeypatch.setattr(lm.consolidate, "consolidate", lambda directory, out: shutil.copy(trained, out))
    assert leak_free_eval(points["mosa_s4"], None)["leakfree_ppl"] == leakfree["leakfree_ppl"]
    assert (Path(points["mosa_s4"]["out_dir"]) / "consolidated.ckpt").is_file()


def test_damaged_sweep_files_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run's config.yaml without trainer.max_steps and a status.json entry that is no object stop flops.aggregate
    and flops.run_sweep with one line naming the file; so do a --out that is a file and a bad runner argument."""
    manifest = _sweep(tmp_path)
    capsys.readouterr()
    point = manifest["points"][0]
    _fake_metrics(point, 30.0)
    (Path(point["out_dir"]) / "config.yaml").write_text("trainer: [unclosed")
    status = tmp_path / "sw" / "status.json"
    cases = [(aggregate_main, [str(tmp_path / "sw")], "config.yaml is damaged (no trainer.max_steps: ")]
    cases += [(aggregate_main, [str(tmp_path / "sw")], "status.json is damaged (the entry of 'dense_s1' is not an object"),
              (run_main, [str(tmp_path / "sw")], "status.json is damaged (the entry of 'dense_s1' is not an object"),
              (run_main, [str(tmp_path / "sw"), "--leakfree-windows", "x"], "--leakfree-windows: expected a positive integer, got 'x'"),
              # checked before any point trains (a negative count failed only after training the point)
              (run_main, [str(tmp_path / "sw"), "--leakfree-windows", "-1"], "--leakfree-windows: expected a positive integer, got '-1'"),
              (run_main, [str(tmp_path / "sw"), "--leakfree-windows", "0"], "--leakfree-windows: expected a positive integer, got '0'"),
              (sweep_main, ["--heads", "mosa", "--sparsity", "4", "--out", str(status)], "is a file, not a directory")]
    for i, (main, args, message) in enumerate(cases):
        if i == 1:
            (Path(point["out_dir"]) / "config.yaml").unlink()
            status.write_text(json.dumps({"dense_s1": "done"}))
        with pytest.raises(SystemExit) if "--leakfree-windows" in args else contextlib.nullcontext():
            assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_aggregate_of_a_sweep_with_no_finished_run_warns_nothing(tmp_path: Path) -> None:
    """Nothing to plot yet: an empty panel, no matplotlib warning about a legend without curves."""
    import warnings

    _sweep(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert aggregate_main([str(tmp_path / "sw"), "--out", str(tmp_path / "isoflop")]) == 0
    assert (tmp_path / "isoflop.png").read_bytes()[:4] == b"\x89PNG"


def test_aggregate_marks_partial_points_and_leaves_them_out(tmp_path: Path) -> None:
    """A point whose run stopped before trainer.max_steps (3) is 'partial': in the table with its step,
    not in the curve; so is a point the runner recorded as interrupted, whatever its metrics say."""
    manifest = _sweep(tmp_path)
    points = {e["name"]: e for e in manifest["points"]}
    for name, ppl in (("dense_s1", 30.0), ("mosa_s4", 28.0), ("fixed_s4", 33.0)):
        _fake_metrics(points[name], ppl)
    _fake_metrics(points["mosa_s16"], 20.0, step=2)  # stopped early: a better-looking, unfinished number
    _fake_metrics(points["fixed_s16"], 25.0)
    (tmp_path / "sw" / "status.json").write_text(json.dumps({"fixed_s16": {"status": "interrupted"}}))
    rows = collect(tmp_path / "sw")
    assert [r["status"] for r in rows] == ["done", "done", "partial", "done", "interrupted"]
    assert curves(rows) == {("micro", "mosa"): [(1, 30.0, 0.0), (4, 28.0, 0.0)],
                            ("micro", "fixed"): [(1, 30.0, 0.0), (4, 33.0, 0.0)]}
    out = tmp_path / "isoflop"
    assert aggregate_main([str(tmp_path / "sw"), "--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "| mosa | 30.00 | 28.00 | 20.00* @2/3 |" in md and "| fixed | 30.00 | 33.00 | 25.00* @3/3 |" in md


def test_seeds_give_replicas_and_mean_std_and_sweeps_are_never_pooled(tmp_path: Path) -> None:
    manifest = _sweep(tmp_path, "--seeds", "2")
    assert [(e["name"], e["seed"]) for e in manifest["points"]][:3] == [
        ("dense_s1_seed1234", 1234), ("dense_s1_seed1235", 1235), ("mosa_s4_seed1234", 1234)]
    assert lm.load_config(manifest["points"][1]["config"]).trainer.seed == 1235
    for e in manifest["points"]:
        _fake_metrics(e, {1234: 30.0, 1235: 32.0}[e["seed"]] + e["sparsity"] / 4)
    other = tmp_path / "other"  # the same size again, pure (0 dense heads): another experiment, never pooled
    other.mkdir()
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "1,4", "--dense-heads", "0",
                       "--out", str(other / "sw"), "trainer.max_steps=3"]) == 0
    pure = json.loads((other / "sw" / "sweep.json").read_text())
    for e in pure["points"]:
        _fake_metrics(e, 25.0)
    labels = sweep_labels([tmp_path / "sw", other / "sw"])
    assert labels == [f"micro ({tmp_path / 'sw'})", f"micro ({other / 'sw'})"]
    rows = collect(tmp_path / "sw", labels[0]) + collect(other / "sw", labels[1])
    assert curves(rows)[(labels[0], "mosa")] == [(1, 31.25, pytest.approx(2 ** 0.5)), (4, 32.0, pytest.approx(2 ** 0.5)),
                                               (16, 35.0, pytest.approx(2 ** 0.5))]
    assert curves(rows)[(labels[1], "mosa")] == [(1, 25.0, 0.0), (4, 25.0, 0.0)]
    out = tmp_path / "both"
    assert aggregate_main([str(tmp_path / "sw"), str(other / "sw"), "--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "| mosa | 31.25 ± 1.41 (n=2) | 32.00 ± 1.41 (n=2) | 35.00 ± 1.41 (n=2) |" in md
    assert "| mosa | 25.00 | 25.00 |" in md and f"Size {labels[1]}" in md
    from PIL import Image

    assert Image.open(out.with_suffix(".png")).size[0] > 1000  # two panels side by side


def test_a_cell_with_one_finished_seed_of_several_says_n_1(tmp_path: Path) -> None:
    """A replicated sweep's cell where only one seed finished reads 'mean (n=1)', not like a mean over seeds: beside
    a partial run of the other seed, or where the other seed has not run yet (no metrics)."""
    manifest = _sweep(tmp_path, "--seeds", "2")
    for e in manifest["points"]:
        unfinished = e["name"] == "mosa_s16_seed1235"
        if e["name"] != "fixed_s16_seed1235":  # not run
            _fake_metrics(e, {1234: 30.0, 1235: 32.0}[e["seed"]] + e["sparsity"] / 4, step=2 if unfinished else 3)
    out = tmp_path / "isoflop"
    assert aggregate_main([str(tmp_path / "sw"), "--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "| mosa | 31.25 ± 1.41 (n=2) | 32.00 ± 1.41 (n=2) | 34.00 (n=1); 36.00* @2/3 |" in md
    assert "| fixed | 31.25 ± 1.41 (n=2) | 32.00 ± 1.41 (n=2) | 34.00 (n=1) |" in md


def test_runner_forwards_sigterm_and_records_the_point_as_interrupted(tmp_path: Path) -> None:
    from tests.synthetic import write_prepared

    data = write_prepared(tmp_path / "data")
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "1", "--out", str(tmp_path / "sw"),
                       f"data.path={data}", "model.vocab_size=64", "trainer.max_steps=100000",
                       "optim.warmup_steps=10", "trainer.val_every=1000", "trainer.accelerator=cpu"]) == 0
    runner = subprocess.Popen([sys.executable, "-m", "flops.run_sweep", str(tmp_path / "sw")], cwd=ROOT,
                              env=child_env(), stdout=subprocess.PIPE, text=True)
    status_file = tmp_path / "sw" / "status.json"
    deadline = time.monotonic() + 60
    while not status_file.is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = json.loads(status_file.read_text())["dense_s1"]["pid"]  # the training process, in a session of its own
    time.sleep(0.5)
    try:
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        runner.kill()
    with pytest.raises(ProcessLookupError):  # the training process is gone (and was reaped)
        os.kill(pid, 0)
    status = json.loads(status_file.read_text())["dense_s1"]
    assert status["status"] == "interrupted" and status["signal"] == "SIGTERM"
    assert "[1/1] dense_s1: training ... (ETA after the first point" in runner.stdout.read()


def test_a_sweep_json_with_damaged_points_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Points that are no list, or a point that is no object with name, config, out_dir and causal, stop
    flops.run_sweep and flops.aggregate with one line naming the file and the point (were KeyError / TypeError); so
    does a grid's `swept` that is not [x, vary] with x another option (a string was read as a grid)."""
    manifest = _sweep(tmp_path)
    capsys.readouterr()
    path = tmp_path / "sw" / "sweep.json"
    for points, why in ((5, "points is not a list"), ([5], "point 0 is not an object with name, config, out_dir, causal"),
                        ([manifest["points"][0], {"name": "a"}], "point 1 is not an object with config, out_dir, causal")):
        path.write_text(json.dumps({**manifest, "points": points}))
        for main in (run_main, aggregate_main):
            assert main([str(tmp_path / "sw")]) == 2
            assert capsys.readouterr().err == f"error: {path} is damaged ({why}); restore it or write it again with " \
                                              "flops.sweep\n"
    for vary, swept in (("sparsity", "sparsity"), ("sparsity", ["sparsity"]), ("sparsity", ["window", "sparsity"]),
                        ("sparsity", ["sparsity", "sparsity"]), ("window", ["window", "window"]),
                        ("window", ["sparsity", "k"]), ("window", ["sparsity", "window", "k"])):  # a grid's: [x, vary]
        path.write_text(json.dumps({**manifest, "vary": vary, "swept": swept}))
        assert aggregate_main([str(tmp_path / "sw")]) == 2
        assert capsys.readouterr().err == f"error: {path} is damaged (swept is not [<x>, <vary>]); restore it " \
                                          "or write it again with flops.sweep\n"


def _fake_training(monkeypatch: pytest.MonkeyPatch, failing: str | None = None) -> tuple[list[str], list[str]]:
    """Replace training and the leak-free evaluation in flops.run_sweep by fast fakes that leave what the real ones
    leave (metrics.json at step 3, leakfree.json); the names each was called with. The leak-free evaluation of
    point `failing` raises RuntimeError("boom")."""
    import flops.run_sweep

    trained: list[str] = []
    evaluated: list[str] = []

    def train_point(entry: dict, overrides: list[str], started: Callable[[int], None]) -> dict:
        trained.append(entry["name"])
        started(os.getpid())
        _fake_metrics(entry, 30.0)
        return {"status": "done", "rc": 0, "seconds": 1.5}

    def leak_free_eval(entry: dict, windows: int | None) -> dict[str, float]:
        evaluated.append(entry["name"])
        if entry["name"] == failing:
            raise RuntimeError("boom")
        step = json.loads((Path(entry["out_dir"]) / "metrics.json").read_text())["step"]
        (Path(entry["out_dir"]) / "leakfree.json").write_text(json.dumps({"leakfree_ppl": 7.5, "step": step}))
        return {"leakfree_ppl": 7.5}

    monkeypatch.setattr(flops.run_sweep, "train_point", train_point)
    monkeypatch.setattr(flops.run_sweep, "leak_free_eval", leak_free_eval)
    return trained, evaluated


def test_a_failed_leak_free_evaluation_is_recorded_and_the_sweep_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A leak-free evaluation that raises marks its point failed with "leak-free evaluation: <Type>: <message>"
    (keeping the training's rc and seconds); the next points are still trained and evaluated, and the exit
    status is 1."""
    _sweep(tmp_path, "--option", "mosa.selection=expert_choice")
    trained, evaluated = _fake_training(monkeypatch, failing="mosa_s4")
    capsys.readouterr()
    assert run_main([str(tmp_path / "sw"), "--only", "dense_s1,mosa_s4,mosa_s16"]) == 1
    assert trained == ["dense_s1", "mosa_s4", "mosa_s16"] and evaluated == ["mosa_s4", "mosa_s16"]
    status = json.loads((tmp_path / "sw" / "status.json").read_text())
    assert status["mosa_s4"] == {"status": "failed", "rc": 0, "seconds": 1.5,
                                 "error": "leak-free evaluation: RuntimeError: boom"}
    assert status["mosa_s16"] == {"status": "done", "rc": 0, "seconds": 1.5, "leakfree_ppl": 7.5}
    out, err = capsys.readouterr()
    assert "[2/3] mosa_s4: failed in 1.5 s: leak-free evaluation: RuntimeError: boom" in out.splitlines()
    assert "[3/3] mosa_s16: done in 1.5 s, leak-free perplexity 7.50" in out.splitlines()
    assert err == f"failed points: mosa_s4 (see {tmp_path / 'sw' / 'status.json'})\n"


def test_a_rerun_evaluates_a_trained_point_without_training_it_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun after a failed leak-free evaluation trains nothing: the point whose training finished is only
    evaluated, and recorded done with its training's rc and seconds; the finished points are skipped and keep
    their status."""
    _sweep(tmp_path, "--option", "mosa.selection=expert_choice")
    sweep = [str(tmp_path / "sw"), "--only", "dense_s1,mosa_s4,mosa_s16"]
    _fake_training(monkeypatch, failing="mosa_s4")
    assert run_main(sweep) == 1
    before = json.loads((tmp_path / "sw" / "status.json").read_text())
    trained, evaluated = _fake_training(monkeypatch)
    capsys.readouterr()
    assert run_main(sweep) == 0
    assert trained == [] and evaluated == ["mosa_s4"]
    status = json.loads((tmp_path / "sw" / "status.json").read_text())
    assert status == {**before, "mosa_s4": {"status": "done", "rc": 0, "seconds": 1.5, "leakfree_ppl": 7.5}}
    assert capsys.readouterr().out.splitlines() == [
        "[1/3] dense_s1: finished, skipped", "[2/3] mosa_s4: leak-free evaluation ...",
        "[2/3] mosa_s4: done in 1.5 s, leak-free perplexity 7.50", "[3/3] mosa_s16: finished, skipped"]


def test_the_lock_file_is_held_while_a_point_trains_and_is_evaluated(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """--lock FILE: an exclusive flock on FILE while a point trains and is evaluated leak-free (another open file
    description cannot take it), released after the point."""
    import fcntl

    import flops.run_sweep

    _sweep(tmp_path, "--option", "mosa.selection=expert_choice")
    lock = tmp_path / "heavy.lock"
    held: list[str] = []

    def is_held() -> bool:
        with open(lock, "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(other, fcntl.LOCK_UN)
            return False

    trained, evaluated = _fake_training(monkeypatch)
    for step, fake in (("train_point", flops.run_sweep.train_point), ("leak_free_eval", flops.run_sweep.leak_free_eval)):
        def checked(entry: dict, *args: object, step: str = step, fake: Callable = fake) -> dict:
            held.append(f"{step} {entry['name']} {is_held()}")
            return fake(entry, *args)

        monkeypatch.setattr(flops.run_sweep, step, checked)
    assert run_main([str(tmp_path / "sw"), "--only", "mosa_s4", "--lock", str(lock)]) == 0
    assert held == ["train_point mosa_s4 True", "leak_free_eval mosa_s4 True"]
    assert (trained, evaluated) == (["mosa_s4"], ["mosa_s4"]) and not is_held()


def test_runner_argument_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory without sweep.json names the file and the command that writes it; --only naming points the
    sweep does not have lists them: exit status 2, nothing trained, no status.json."""
    assert run_main([str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'nothing' / 'sweep.json'} not found; write it with "
                                       "python -m flops.sweep\n")
    _sweep(tmp_path)
    trained, _ = _fake_training(monkeypatch)
    capsys.readouterr()
    assert run_main([str(tmp_path / "sw"), "--only", "zz_s1,dense_s1,mosa_s3"]) == 2
    assert capsys.readouterr() == ("", "error: unknown point(s) mosa_s3, zz_s1\n")
    assert trained == [] and not (tmp_path / "sw" / "status.json").exists()


def test_sweep_refuses_zero_seeds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--seeds 0 (no replica of any point) is one error line, exit status 2, and writes nothing."""
    assert sweep_main(["--size", "micro", "--heads", "mosa", "--sparsity", "1,4", "--seeds", "0",
                       "--out", str(tmp_path / "sw")]) == 2
    assert capsys.readouterr() == ("", "error: --seeds must be >= 1, got 0\n")
    assert not (tmp_path / "sw").exists()


def test_sweep_json_files_that_are_missing_or_no_object_are_one_line(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """flops.aggregate of a directory without sweep.json says the file is not found; a sweep.json without the size
    aggregate reads, and a status.json that is a JSON list, not an object, are damaged files to restore or delete."""
    assert aggregate_main([str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nothing' / 'sweep.json'} not found\n"
    manifest = _sweep(tmp_path)
    capsys.readouterr()
    sweep_json, status_json = tmp_path / "sw" / "sweep.json", tmp_path / "sw" / "status.json"
    sweep_json.write_text(json.dumps({"points": manifest["points"]}))
    assert aggregate_main([str(tmp_path / "sw")]) == 2
    assert capsys.readouterr().err == (f"error: {sweep_json} is damaged (not a JSON object with size); "
                                       "restore or delete it\n")
    status_json.write_text("[]")
    for main in (run_main, aggregate_main):
        sweep_json.write_text(json.dumps(manifest))
        assert main([str(tmp_path / "sw")]) == 2
        assert capsys.readouterr().err == f"error: {status_json} is damaged (not a JSON object); restore or delete it\n"


def test_a_resumed_point_records_its_training_time_over_all_runs(tmp_path: Path, capsys,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A point stopped early (partial, interrupted or failed) and resumed from its checkpoint by a later run_sweep
    records the seconds of both runs (the resumed run's alone before: 6.3 s for a point trained 25.7 + 6.3 s); a
    point without a checkpoint starts afresh and records its own run's."""
    manifest = _sweep(tmp_path)
    trained, _ = _fake_training(monkeypatch)
    checkpoints = Path(manifest["points"][0]["out_dir"]) / "checkpoints"  # dense_s1's
    checkpoints.mkdir(parents=True)
    (checkpoints / "step0000002.ckpt").write_bytes(b"")
    status_file = tmp_path / "sw" / "status.json"
    earlier = {"status": "interrupted", "signal": "SIGTERM", "rc": -15, "seconds": 25.7}
    status_file.write_text(json.dumps({"dense_s1": earlier, "mosa_s4": earlier}))
    capsys.readouterr()
    assert run_main([str(tmp_path / "sw"), "--only", "dense_s1,mosa_s4"]) == 0
    status = json.loads(status_file.read_text())
    assert trained == ["dense_s1", "mosa_s4"]
    assert status["dense_s1"] == {"status": "done", "rc": 0, "seconds": 27.2}
    assert status["mosa_s4"] == {"status": "done", "rc": 0, "seconds": 1.5}
    assert "[1/2] dense_s1: done in 27.2 s" in capsys.readouterr().out


def test_a_point_trained_further_is_evaluated_leak_free_again(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """leakfree.json records the step it evaluated: once the point trains further (a rerun with more steps), the
    earlier leak-free perplexity is not its result (it was kept, and reported beside the new step), so the aggregate
    has none until run_sweep evaluates the new step."""
    manifest = _sweep(tmp_path, "--option", "mosa.selection=expert_choice")
    entry = next(e for e in manifest["points"] if e["name"] == "mosa_s4")
    trained, evaluated = _fake_training(monkeypatch)
    assert run_main([str(tmp_path / "sw"), "--only", "mosa_s4"]) == 0
    assert trained == evaluated == ["mosa_s4"]
    _fake_metrics(entry, 30.0, step=4)  # trained on to step 4 (e.g. run_sweep trainer.max_steps=4)
    row = next(r for r in collect(tmp_path / "sw") if r["name"] == "mosa_s4")
    assert row["leakfree_ppl"] is None and row["status"] != "done"
    assert run_main([str(tmp_path / "sw"), "--only", "mosa_s4", "trainer.max_steps=4"]) == 0
    assert trained == ["mosa_s4"] and evaluated == ["mosa_s4", "mosa_s4"]
    assert json.loads((Path(entry["out_dir"]) / "leakfree.json").read_text())["step"] == 4


def test_a_signal_during_the_leak_free_evaluation_records_the_point_interrupted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM while run_sweep evaluates a point leak-free (after its training) records the point interrupted, phase
    the evaluation, and exits 128 + 15, as during training (the runner was killed, status.json still saying
    `running`); a rerun evaluates it and keeps the training's rc and seconds."""
    import flops.run_sweep

    _sweep(tmp_path, "--option", "mosa.selection=expert_choice")
    trained, evaluated = _fake_training(monkeypatch)
    fake_eval = flops.run_sweep.leak_free_eval

    def killed(entry: dict, windows: int | None) -> dict[str, float]:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler interrupts this
        raise AssertionError("not interrupted")

    monkeypatch.setattr(flops.run_sweep, "leak_free_eval", killed)
    handler = signal.getsignal(signal.SIGTERM)
    assert run_main([str(tmp_path / "sw"), "--only", "mosa_s4"]) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == handler
    status_file = tmp_path / "sw" / "status.json"
    assert json.loads(status_file.read_text())["mosa_s4"] == {"status": "interrupted", "rc": 0, "seconds": 1.5,
                                                             "signal": "SIGTERM", "phase": "leak-free evaluation"}
    monkeypatch.setattr(flops.run_sweep, "leak_free_eval", fake_eval)
    assert run_main([str(tmp_path / "sw"), "--only", "mosa_s4"]) == 0
    assert trained == ["mosa_s4"] and evaluated == ["mosa_s4"]
    assert json.loads(status_file.read_text())["mosa_s4"] == {"status": "done", "rc": 0, "seconds": 1.5,
                                                             "leakfree_ppl": 7.5}


def test_a_diverged_replica_is_marked_and_left_out_of_the_mean(tmp_path: Path) -> None:
    """A finished point whose perplexity is inf or NaN (a diverged run) is `diverged`: out of the mean and the curve,
    its cell says so (statistics.stdev raised AttributeError on it and the aggregate stopped before its table)."""
    manifest = _sweep(tmp_path, "--seeds", "2")
    for e in manifest["points"]:
        ppl = {"mosa_s4_seed1235": math.inf, "fixed_s4_seed1235": math.nan}.get(e["name"], 30.0 + e["seed"] - 1234)
        _fake_metrics(e, ppl)
    rows = {r["name"]: r for r in collect(tmp_path / "sw")}
    assert rows["mosa_s4_seed1235"]["status"] == rows["fixed_s4_seed1235"]["status"] == "diverged"
    assert curves(list(rows.values()))[("micro", "mosa")][1] == (4, 30.0, 0.0)
    out = tmp_path / "isoflop"
    assert aggregate_main([str(tmp_path / "sw"), "--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "| mosa | 30.50 ± 0.71 (n=2) | 30.00 (n=1); diverged | 30.50 ± 0.71 (n=2) |" in md
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
