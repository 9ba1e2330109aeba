"""Command-line arguments of the flops/ and bench/ scripts (flops/cli.py): --help shows the script's whole
module docstring, and a bad number or list is one `error:` line (exit 2) before any work starts; so is every entry
point's argparse error (data_prep/cli.py)."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EVAL_EXTRA, ROOT

SCRIPTS = ["bench.causal_routing", "bench.compression_experiment", "bench.decode",
           pytest.param("bench.eval_quickstart", marks=EVAL_EXTRA),
           "bench.generalisation", "bench.gutenberg_compare", "bench.heads", "bench.mita_varlen", "bench.resources",
           "bench.throughput", "bench.triton_aot", "flops.aggregate", "flops.isoflop", "flops.mfu", "flops.sweep",
           "quickstart"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_shows_the_whole_docstring(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert stop.value.code == 0
    assert module.__doc__.strip() in capsys.readouterr().out  # verbatim: usage examples and last sentence included


SWEEP = ["--size", "micro", "--out", "{out}", "--heads", "mosa"]
POSITIVE = "expected a positive integer, got"
BAD = [
    ("flops.isoflop", ["--head", "mosa", "--sparsity", "nan"], f"argument --sparsity: {POSITIVE} 'nan'"),
    ("flops.isoflop", ["--head", "mosa", "--sparsity", "inf"], f"argument --sparsity: {POSITIVE} 'inf'"),
    ("flops.isoflop", ["--head", "local", "--sparsity", "0"], f"argument --sparsity: {POSITIVE} '0'"),
    ("flops.isoflop", ["--head", "mosa", "--sparsity", "-8"], f"argument --sparsity: {POSITIVE} '-8'"),
    ("flops.isoflop", ["--head", "mosa", "--sparsity", "8.5"], f"argument --sparsity: {POSITIVE} '8.5'"),
    ("flops.sweep", [*SWEEP, "--sparsity", "8,a"], f"argument --sparsity: {POSITIVE} 'a'"),
    ("flops.sweep", [*SWEEP, "--sparsity", "nan"], f"argument --sparsity: {POSITIVE} 'nan'"),
    ("flops.sweep", [*SWEEP, "--sparsity", "8,,16"],
     "argument --sparsity: expected comma-separated values without empty entries, got '8,,16'"),
    ("flops.sweep", [*SWEEP, "--sparsity", "4,8,4"], "argument --sparsity: 4 given more than once in '4,8,4'"),
    ("flops.sweep", ["--size", "micro", "--out", "{out}", "--heads", "", "--sparsity", "8"],
     "argument --heads: expected comma-separated values without empty entries, got ''"),
    ("flops.sweep", ["--size", "micro", "--out", "{out}", "--heads", "mosa,,fixed", "--sparsity", "8"],
     "argument --heads: expected comma-separated values without empty entries, got 'mosa,,fixed'"),
    ("bench.decode", ["--lengths", "64", "0"], f"argument --lengths: {POSITIVE} '0'"),
    ("bench.decode", ["--new-tokens", "0"], f"argument --new-tokens: {POSITIVE} '0'"),
    ("bench.resources", ["--pair", "table2-tiny", "--steps", "0"], f"argument --steps: {POSITIVE} '0'"),
    ("bench.resources", ["--pair", "table2-tiny", "--batch", "0"], f"argument --batch: {POSITIVE} '0'"),
    ("bench.resources", ["--pair", "table2-tiny", "--warmup", "-1"], "argument --warmup: expected an integer >= 0, got '-1'"),
    ("bench.heads", ["--repeats", "0"], f"argument --repeats: {POSITIVE} '0'"),
    ("bench.heads", ["--dense-heads", "0"], f"argument --dense-heads: {POSITIVE} '0'"),
    ("bench.mita_varlen", ["--block", "0"], f"argument --block: {POSITIVE} '0'"),
    ("bench.throughput", ["--config", "configs/tiny.yaml", "--steps", "0"], f"argument --steps: {POSITIVE} '0'"),
    ("bench.generalisation", ["--ckpt", "none.ckpt", "--val-windows", "0"], f"argument --val-windows: {POSITIVE} '0'"),
    pytest.param("bench.eval_quickstart", ["--items", "0"], f"argument --items: {POSITIVE} '0'", marks=EVAL_EXTRA),
    ("bench.compression_experiment", ["--compressed", "a", "--baseline", "b", "--data", "c", "--tolerances", "0.1,inf"],
     "argument --tolerances: expected a finite number, got 'inf'"),
]


@pytest.mark.parametrize("name,argv,message", BAD)
def test_bad_numbers_are_one_line_before_any_work(name: str, argv: list[str], message: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(name).main([arg.replace("{out}", str(out)) for arg in argv])
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert not out.exists()  # flops.sweep: no configs, no sweep.json


def test_sweep_bad_sparsity_list_in_a_subprocess(tmp_path: Path) -> None:
    argv = [arg.replace("{out}", str(tmp_path / "sw")) for arg in SWEEP]
    proc = subprocess.run([sys.executable, "-m", "flops.sweep", *argv, "--sparsity", "8,a"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, f"error: argument --sparsity: {POSITIVE} 'a'\n")


def test_results_stem_keeps_dots_in_the_name_and_drops_a_result_suffix(tmp_path: Path) -> None:
    """--out STEM of bench.gutenberg_compare / bench.causal_routing: STEM.csv etc. are STEM + suffix (with_suffix
    would turn run_lr0.003 into run_lr0.csv); `--out x.md` names the same files as `--out x`; a missing directory is
    refused when the arguments are parsed."""
    import argparse

    from flops.cli import in_results, results_stem

    assert in_results(results_stem(str(tmp_path / "run_lr0.003")), ".csv") == tmp_path / "run_lr0.003.csv"
    assert results_stem(str(tmp_path / "x.md")) == results_stem(str(tmp_path / "x.csv")) == tmp_path / "x"
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        results_stem(str(tmp_path / "missing" / "x"))


# every command line of the stack: an invalid choice, a missing argument, exclusive options together
ARGPARSE_ERRORS = [
    ("data_prep.prepare", ["--source", "foo", "--out", "{out}"], "argument --source: invalid choice: 'foo'"),
    ("data_prep.verify", [], "the following arguments are required: out"),
    ("lm.evaluate", ["--ckpt", "x", "--input", "y", "--format", "bogus"], "argument --format: invalid choice: 'bogus'"),
    ("lm.evaluate", ["--ckpt", "x", "--input", "y", "--leak-free", "maybe"], "argument --leak-free: invalid choice"),
    ("lm.generate", [], "the following arguments are required: --ckpt, --prompt"),
    ("lm.compressed_evaluate", ["--ckpt", "x", "--split", "test"], "argument --split: invalid choice: 'test'"),
    ("lm.compressed_generate", ["--ckpt", "x"], "the following arguments are required: --prompt"),
    ("lm.consolidate", [], "the following arguments are required: directory, out"),
    ("lm.export_hf", [], "the following arguments are required"),
    pytest.param("lm.lm_eval", [], "the following arguments are required", marks=EVAL_EXTRA),  # imports lm-eval
    ("lm.plots", [], "the following arguments are required"),
    ("lm.ratio_data", [], "the following arguments are required"),
    ("lm.ratio_predictor", ["train", "--bogus"], "the following arguments are required: --data, --out"),
    ("train_lm", ["--config", "x", "--resume", "--overwrite"], "argument --overwrite: not allowed with argument --resume"),
    ("lm.compressed_training", [], "the following arguments are required: --config"),
    ("quickstart", ["--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("name,argv,message", ARGPARSE_ERRORS)
def test_every_entry_points_argument_errors_are_one_line(name: str, argv: list[str], message: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's own errors were its usage block and then the error (4 to 16 lines): now the one `error:` line the
    stack's other bad inputs give, exit status 2, nothing written."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(name).main([arg.replace("{out}", str(out)) for arg in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    assert not out.exists()
