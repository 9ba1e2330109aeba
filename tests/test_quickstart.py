"""quickstart.py on the offline corpus, shrunk to 2 steps: --fresh deletes only the run's own outputs, and
errors name quickstart's own flags (--fresh, data.path), not train_lm.py's or data_prep's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import quickstart


def run(tmp_path: Path, *args: str) -> int:
    """quickstart.main offline (no <shared>/gutenberg: Python's documentation), tiny model, 2 steps."""
    tiny = ["model.vocab_size=512", "model.n_layers=1", "model.d_model=32", "model.head_dim=8", "model.seq_len=32",
            "model.heads=[{type: dense, count: 2}]", "data.batch_size=2", "data.val_batches=1",
            "optim.warmup_steps=1", "trainer.max_steps=2", "trainer.val_every=2", "trainer.accelerator=cpu",
            f"data.path={tmp_path / 'data'}", f"trainer.out_dir={tmp_path / 'run'}"]
    return quickstart.main(["--shared", str(tmp_path / "none"), *tiny, *args])


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    return line


def test_fresh_keeps_unrelated_files_and_errors_name_quickstarts_flags(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out, data = tmp_path / "run-builtin", tmp_path / "data-builtin"  # the offline corpus's names
    assert run(tmp_path) == 0
    assert "--resume" not in capsys.readouterr().err  # a first run resumes nothing, and says nothing about it
    (out / "notes.txt").write_text("mine")

    assert run(tmp_path, "model.n_layers=2") == 2  # the finished run has 1 layer
    line = error_line(capsys)
    assert line.startswith(f"error: resuming: {out} was trained with a different config (model.n_layers: 1 -> 2")
    assert line.endswith("use --fresh to start again")

    assert run(tmp_path, "model.vocab_size=400") == 2  # the data was prepared with 512
    line = error_line(capsys)
    assert line.startswith(f"error: data.path {data} holds a preparation with other settings (vocab_size: 512 -> 400")
    assert line.endswith("pass --fresh to replace it, or choose another data.path")

    assert run(tmp_path, "--fresh", "model.n_layers=2", "model.vocab_size=400") == 0
    assert (out / "notes.txt").read_text() == "mine"  # --fresh used to delete the whole directory
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["n_layers"] == 2
    assert json.loads((data / "index.json").read_text())["vocab_size"] == 400  # prepared again


def test_offline_validation_takes_what_fits_without_overlap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The offline corpus has ~8k validation tokens: data.val_batches is lowered to the batches of windows they hold."""
    assert run(tmp_path, "data.val_batches=100000") == 0
    val_batches = yaml.safe_load((tmp_path / "run-builtin" / "config.yaml").read_text())["data"]["val_batches"]
    val_tokens = json.loads((tmp_path / "data-builtin" / "index.json").read_text())["splits"]["val"]["tokens"]
    assert val_batches == val_tokens // (2 * 33)  # data.batch_size=2 windows of seq_len + 1 = 33 tokens
    assert "validation windows overlap" not in capsys.readouterr().err
