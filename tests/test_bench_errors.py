"""Bad input to the bench/ scripts is one `error: ...` line on stderr and exit status 2, found before any work:
a device this machine lacks, a variant that gets no head, a failed worker, missing checkpoints, data or
settings, and bad overrides."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import EVAL_EXTRA, ROOT

TINY_HEADS = ["--T", "64", "--d-model", "32", "--head-dim", "8", "--dense-heads", "1", "--repeats", "1"]
DEVICE_SCRIPTS = [("bench.heads", TINY_HEADS), ("bench.decode", ["--lengths", "16", "--new-tokens", "1"]),
                  ("bench.resources", ["--pair", "table2-tiny"])]


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("name,argv", DEVICE_SCRIPTS)
def test_a_device_this_machine_lacks_is_one_line(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    main = importlib.import_module(name).main
    for device, message in [("cuda", f"cuda: this machine has 0 CUDA GPU(s) (torch {torch.__version__})"),
                            ("bogus", "expected cpu, cuda or cuda:N, got 'bogus'"),
                            ("mps", "expected cpu, cuda or cuda:N, got 'mps'")]:
        with pytest.raises(SystemExit) as stop:
            main([*argv, "--device", device])
        assert stop.value.code == 2
        assert one_error_line(capsys) == f"error: argument --device: {message}"


REPORTING = ["bench.compression_experiment", "bench.decode", pytest.param("bench.eval_quickstart", marks=EVAL_EXTRA),
             "bench.generalisation", "bench.heads", "bench.mita_varlen", "bench.resources", "bench.resume_check",
             "bench.throughput", "bench.triton_aot"]


@pytest.mark.parametrize("name", REPORTING)
def test_an_unwritable_report_is_refused_before_the_work(name: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """--out into a missing directory, or onto a directory, stops at parsing (it crashed after the whole benchmark)."""
    main = importlib.import_module(name).main
    for out, message in ((tmp_path / "nodir" / "x.md", f"{tmp_path / 'nodir' / 'x.md'}: directory {tmp_path / 'nodir'} "
                                                         "does not exist"),
                         (tmp_path, f"{tmp_path} is a directory; give a file name")):
        with pytest.raises(SystemExit) as stop:
            main(["--out", str(out)])
        assert stop.value.code == 2
        assert one_error_line(capsys) == f"error: argument --out: {message}"


def test_heads_variant_without_a_head_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.heads import main

    assert main([*TINY_HEADS, "--variants", "dense", "mita"]) == 2
    assert one_error_line(capsys) == "error: mita: not even one head fits the FLOP budget of 1 dense head(s) at T = 64"


def test_options_that_do_not_fit_the_length_are_one_line_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    """rho > T (k < 1 token per head), as a config load refuses it: bench.heads and bench.decode published tables for
    such heads (a fuzzing audit)."""
    from bench.decode import main as decode_main
    from bench.heads import main as heads_main

    assert heads_main([*TINY_HEADS, "--variants", "dense", "mosa-threshold", "--sparsity", "128"]) == 2
    assert one_error_line(capsys) == "error: mosa: options.sparsity = 128 > model.seq_len 64"
    assert decode_main(["--lengths", "16", "--new-tokens", "1", "--sparsity", "64", "--d-model", "32", "--head-dim",
                        "8", "--layers", "1"]) == 2
    assert one_error_line(capsys) == "error: model.heads: mosa: options.sparsity = 64 > model.seq_len 17"


def test_heads_failed_worker_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The worker's own last stderr line reaches the caller (was: CalledProcessError, the worker's stderr lost)."""
    from bench import heads

    spec = dict(type="mita", options={}, count=0, T=64, d_model=32, head_dim=8, batch=1, repeats=1, device="cpu")
    with pytest.raises(RuntimeError, match=r"^T = 64, 0 mita head\(s\): worker failed: \S*ConfigError: mita: head "
                                           r"count must be >= 1, got 0$"):
        heads.run_worker(spec)
    monkeypatch.setattr(heads, "matched_count", lambda variant, T, args: (0, 0, {}))  # a worker that fails in main
    assert heads.main([*TINY_HEADS, "--variants", "mita"]) == 2
    assert one_error_line(capsys).endswith("worker failed: heads.base.ConfigError: mita: head count must be >= 1, got 0")


@EVAL_EXTRA
def test_eval_quickstart_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.eval_quickstart import main

    assert main(["--ckpt", str(tmp_path / "none.ckpt"), "--work", str(tmp_path / "w"),
                 "--out", str(tmp_path / "r.md")]) == 2
    assert one_error_line(capsys) == f"error: checkpoint not found: {tmp_path / 'none.ckpt'}"
    assert not (tmp_path / "r.md").exists()


def test_compression_experiment_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.compression_experiment import main

    assert main(["--compressed", str(tmp_path / "x"), "--baseline", str(tmp_path / "y"), "--data", str(tmp_path / "z"),
                 "--out", str(tmp_path / "r.md")]) == 2
    assert one_error_line(capsys) == f"error: checkpoint {tmp_path / 'y' / 'checkpoints' / 'last.ckpt'} not found"


@pytest.mark.parametrize("name", ["bench.gutenberg_compare", "bench.causal_routing"])
def test_settings_that_cannot_be_read(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(name).main
    (tmp_path / "bad.yaml").write_text("base: [1,\nvariants: 2\n")
    (tmp_path / "list.yaml").write_text("- base\n- variants\n")
    for path, message in [("none.yaml", "settings file not found"), ("bad.yaml", "not valid YAML (ParserError)"),
                          ("list.yaml", "expected a mapping with sections base, variants")]:
        assert main(["--config", str(tmp_path / path), "--report"]) == 2
        assert one_error_line(capsys).startswith(f"error: --config {tmp_path / path}: {message}")


@pytest.mark.parametrize("name", ["gutenberg_compare", "causal_routing"])
def test_bad_override_before_any_run(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad override is reported before any run starts (causal_routing: before a run is claimed)."""
    settings = OmegaConf.load(ROOT / "configs" / "experiments" / f"{name}.yaml")
    settings.base.trainer.out_dir = str(tmp_path / "runs")
    OmegaConf.save(settings, tmp_path / "settings.yaml")
    main = importlib.import_module(f"bench.{name}").main
    assert main(["--config", str(tmp_path / "settings.yaml"), "--only", "dense", "trainer.max_steps=abc"]) == 2
    assert one_error_line(capsys) == "error: trainer.max_steps: Value 'abc' of type 'str' could not be converted to Integer"
    assert not (tmp_path / "runs").exists()


def test_resume_check_refuses_a_bad_config_before_its_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config the runs cannot train is one line (the three runs each failed and the verdict blamed the resume)."""
    from bench.resume_check import main

    assert main(["--config", str(tmp_path / "nope.yaml"), "--work", str(tmp_path / "work")]) == 2
    assert one_error_line(capsys) == f"error: config file not found: {tmp_path / 'nope.yaml'}"
    assert not (tmp_path / "work").exists()
