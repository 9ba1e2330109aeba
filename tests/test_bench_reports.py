"""What the experiment reports of bench/ state about their runs: the command that reproduces them (every argument
given, OMP_NUM_THREADS only where set), the machine and budget the rows were measured with (not text written
into the script), and conclusions that match the committed results."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, tiny_config
from flops.cli import command_line, cpu_model, hardware
from lm.config import Config


def test_command_line_and_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert command_line(["-m", "bench.x"], ["--a", "b c"]) == "python -m bench.x --a 'b c'"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert command_line(["bench/x.py"], []) == "OMP_NUM_THREADS=3 python bench/x.py"
    assert hardware("cpu").startswith(cpu_model()) and "cores" in hardware("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert hardware("cuda") == hardware("cuda:0") == "NVIDIA H100 80GB HBM3"


def compressed_config(**compression: object) -> Config:
    """A tiny compression model's validated config (3 blocks, h = 32, P = 16, r = 0.25, S = 8) for the
    compression_experiment tests."""
    from lm.config import CompressionConfig, validate

    cfg = tiny_config([{"type": "dense", "count": 2}], n_layers=3, d_model=32, head_dim=8, seq_len=8, vocab_size=50)
    cfg.compression = CompressionConfig(layer=1, n_heads=2, prefix_len=16, ratio=0.25, **compression)
    return validate(cfg)


def test_compression_experiment_writes_the_command_it_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every argument, --batches, --batch, --predictor-batches and --tolerances included, and the CPU's model.
    (The measured sections are stubbed: this checks the report's header only.)"""
    from bench import compression_experiment as ce
    from lm.compression import CompressedLM

    cfg = compressed_config()
    monkeypatch.setattr(ce, "load_compressed", lambda path: (CompressedLM(cfg.model, cfg.compression), cfg))
    monkeypatch.setattr(ce, "document_windows", lambda *args: None)
    monkeypatch.setattr(ce, "fixed_windows", lambda *args, **kwargs: [torch.zeros(2, 100, dtype=torch.long)])
    for section in ("perplexity_table", "online_generation", "adaptive_generation"):
        monkeypatch.setattr(ce, section, lambda *args, **kwargs: [])
    monkeypatch.setattr(ce, "predictor_section", lambda *args: ([], None))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = tmp_path / "c.md"
    argv = ["--compressed", "runs/c", "--baseline", "runs/b", "--data", "data/d", "--out", str(out), "--batches", "2",
            "--batch", "3", "--predictor-batches", "4", "--tolerances", "0.1,0.2"]
    assert ce.main(argv) == 0
    lines = out.read_text().splitlines()
    assert f"python bench/compression_experiment.py {' '.join(argv)}" in lines
    assert lines[2].startswith(f"Machine: {hardware()}, ")


def _rows() -> list[dict]:
    """Two finished runs of one variant as train_and_evaluate + causal_routing.run_one write them, the second from
    before machine and command were recorded."""
    row = dict(variant="dense", heads="6 dense", causal=True, params=1, fwd_gflop=0.04, flop_ratio=1.0, kv_total=8,
               steps=7, tokens=7168, train_s=1.0, val_ppl=200.0, leakfree_ppl=200.0, windows=4, torch="2.x",
               code="abc", history=[{"tokens_seen": 7168, "val_ppl": 200.0}])
    return [{**row, "seed": 1, "machine": "Some CPU (4 cores)", "command": "python -m bench.causal_routing --seeds 1"},
            {**row, "seed": 2, "leakfree_ppl": 202.0}]


def test_causal_routing_report_states_what_the_runs_were(tmp_path: Path) -> None:
    """Budget, machine and commands come from the runs' results, not from the settings file or the script."""
    from bench import causal_routing

    settings = OmegaConf.load(ROOT / "configs" / "experiments" / "causal_routing.yaml")
    settings.base.trainer.out_dir = str(tmp_path / "runs")
    for r in _rows():
        (tmp_path / "runs" / f"s{r['seed']}" / "dense").mkdir(parents=True)
        (tmp_path / "runs" / f"s{r['seed']}" / "dense" / "result.json").write_text(json.dumps(r))
    (tmp_path / "out").mkdir()
    causal_routing.write_report(settings, "python -m bench.causal_routing --report", tmp_path / "out" / "causal_routing")
    header = (tmp_path / "out" / "causal_routing.md").read_text().split("\n\n")[1]
    assert "Machine: Some CPU (4 cores); not recorded, 1 thread per run, fp32, torch 2.x." in header
    assert ("Runs trained by: `python -m bench.causal_routing --seeds 1`; not recorded; this report written by: "
            "`python -m bench.causal_routing --report`.") in header
    assert "Training: 7 steps (7,168 tokens) per run," in header and "seeds [1, 2]" in header
    assert "2-core" not in header and "nice -n 10" not in header
    csv = (tmp_path / "out" / "causal_routing.csv").read_text().splitlines()
    assert "Overrides of the settings file: not recorded (runs under " in header  # results from before the column
    assert csv[0].endswith(",machine,command,overrides")
    assert csv[1].endswith(",Some CPU (4 cores),python -m bench.causal_routing --seeds 1,")


def test_causal_routing_notes_are_the_committed_conclusions() -> None:
    """The conclusions the report appends (settings `notes`) are those of the committed report, which was
    edited by hand for the third seeds of MoSAIC and fixed: rewriting it must not bring back the two-seed text."""
    from bench.causal_routing import notes

    settings = OmegaConf.load(ROOT / "configs" / "experiments" / "causal_routing.yaml")
    committed = (ROOT / "bench" / "results" / "causal_routing.md").read_text()
    assert committed.endswith("\n" + notes(settings)) and "3 seeds for every variant" in notes(settings)


def test_gutenberg_compare_names_the_machine_of_the_rows(tmp_path: Path) -> None:
    from bench import gutenberg_compare

    settings = OmegaConf.load(ROOT / "configs" / "experiments" / "gutenberg_compare.yaml")
    rows = {r["variant"] + str(r["seed"]): {**r, "variant": r["variant"] + str(r["seed"])} for r in _rows()}
    gutenberg_compare.write_results(rows, settings, [], tmp_path / "gutenberg_compare")
    text = (tmp_path / "gutenberg_compare.md").read_text()
    assert "Machine: Some CPU (4 cores); not recorded, 1 thread per run; torch 2.x, fp32." in text
    assert "2-core" not in text
    assert gutenberg_compare.read_rows(tmp_path / "gutenberg_compare")["dense1"]["machine"] == "Some CPU (4 cores)"



def test_compression_experiment_runs_every_section_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """bench.compression_experiment on tiny random-weight models (loading and data stubbed, every measured section
    real): the perplexity table has a row per model and depth with finite numbers, the online decoder reproduces
    the training-time forward pass, the predictor table has a row per tolerance, and adaptive decoding reports."""
    import re

    from bench import compression_experiment as ce
    from lm.compression import CompressedLM

    cfg = compressed_config()
    mixed = compressed_config(full_prob=0.5)

    def load(path: Path) -> tuple[CompressedLM, object]:
        run = Path(path).parts[-3]
        torch.manual_seed(len(run))
        config = mixed if run == "m" else cfg
        return CompressedLM(config.model, config.compression).eval(), config

    def windows(docs: object, n_batches: int, batch: int, n: int, seed: int = 0) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, 50, (batch, n), generator=g) for _ in range(n_batches)]

    monkeypatch.setattr(ce, "load_compressed", load)
    monkeypatch.setattr(ce, "document_windows", lambda *args: None)
    monkeypatch.setattr(ce, "fixed_windows", windows)
    out = tmp_path / "c.md"
    assert ce.main(["--compressed", "runs/c", "--baseline", "runs/b", "--mixed", "runs/m", "--data", "d", "--out",
                    str(out), "--batches", "2", "--batch", "2", "--predictor-batches", "1", "--tolerances",
                    "0.0,0.01"]) == 0  # (inside the Deltas these models measure, about -0.012 .. 0.018)
    text = out.read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and line[2].isalpha()]
    body = [r for r in rows if r[1].isdigit()]
    assert [(r[0][2:], int(r[1])) for r in body] == [(name, k) for name in ("baseline", "compressed", ce.MIXED)
                                                     for k in range(4)] + \
        [(f"{ce.MIXED}, uncompressed memory", k) for k in (1, 2, 3)]
    assert all(float(r[3]) > 0 and float(r[4]) > 1 for r in body)
    error = float(re.search(r"max \|logit difference\| vs the training-time forward pass with layout .*?: (\S+)",
                            text).group(1))
    assert error < 1e-4
    assert [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| +")] == ["| +0.0000", "| +0.0100"]
    assert "  - adaptive: t per window" in text and "## Adaptive ratio while decoding (compressed, full_prob model" in text
    out.unlink()  # a tolerance beyond every Delta the predictor is fit on: one line, before the longer sections
    assert ce.main(["--compressed", "runs/c", "--baseline", "runs/b", "--data", "d", "--out", str(out), "--batches", "2",
                    "--batch", "2", "--predictor-batches", "1", "--tolerances", "0.0,0.5"]) == 2
    err = capsys.readouterr().err
    assert "error: the tolerance Delta* = 0.5 is outside the Deltas the predictor was fit on [" in err, err
    assert err.count("\n") == 1 and not out.exists()
