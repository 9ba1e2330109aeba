"""bench/eval_quickstart.py end to end on a tiny checkpoint and the real Gutenberg books in ../shared/data:
the perplexity rows, the unigram baseline and the lm-eval tasks all run and land in the report."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import EVAL_EXTRA
from eval_setup import prepared_corpus, save_checkpoint

pytestmark = EVAL_EXTRA


@pytest.mark.slow  # three whole books through a tiny model, and two small lm-eval tasks (~20 s)
def test_writes_the_report(shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """... and a log (stderr not a terminal; here capsys) gets no progress-bar frame ('\\r' redraws; whole progress
    lines, lm.scoring.progress_bar's past 30 s, are fine): the unigram baseline's loglikelihood is lm-eval's
    TemplateLM's, whose tokenising bar wrote frames (lm.lm_eval.bars_on_terminal_only)."""
    from bench.eval_quickstart import main

    data = prepared_corpus(tmp_path)
    ckpt, _ = save_checkpoint(tmp_path, data)
    out = tmp_path / "report.md"
    argv = ["--ckpt", str(ckpt), "--shared", str(shared_data), "--items", "4", "--work", str(tmp_path / "work"),
            "--out", str(out)]
    assert main(argv) == 0
    assert "\r" not in capsys.readouterr().err
    report = out.read_text()
    rows = [line for line in report.splitlines() if line.startswith("| 3 unseen") or line.startswith("| quickstart")]
    assert len(rows) == 2 + 4  # two perplexity rows; cloze acc + perplexity, mc acc + acc_norm
    assert all("nan" not in row for row in rows), rows
    from flops.cli import hardware

    assert f"on {hardware()}, " in report and "2-core" not in report  # the machine it ran on
    assert "(config file not recorded: 2 dense heads, " in report  # the checkpoint's, not always the quickstart's


def test_training_config_is_the_one_the_run_directory_recorded(tmp_path: Path) -> None:
    from bench.eval_quickstart import training_config

    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    assert training_config(ckpt) == "config file not recorded"
    record = {"command": ["train_lm.py", "--config", "configs/tiny.yaml", "model.n_layers=2"]}
    (tmp_path / "run" / "run.json").write_text(json.dumps(record))
    assert training_config(ckpt) == "configs/tiny.yaml"
    (tmp_path / "run" / "run.json").write_text(json.dumps({"command": ["train_lm.py", "--config=configs/a.yaml"]}))
    assert training_config(ckpt) == "configs/a.yaml"


def test_the_unigram_floor_is_add_one_smoothed_training_counts() -> None:
    """p(token) = (count + 1) / (total + vocabulary): counts (3, 0) give 4/5 and 1/5, a distribution."""
    import math

    import numpy as np

    from bench.eval_quickstart import UnigramLM

    unigram = UnigramLM(None, np.array([3, 0]))  # type: ignore[arg-type]  (the LM only lends its tokenizer)
    assert unigram.nll([0]) == pytest.approx(-math.log(4 / 5))
    assert unigram.nll([1, 1]) == pytest.approx(-2 * math.log(1 / 5))
    assert np.exp(unigram.logp).sum() == pytest.approx(1.0)
