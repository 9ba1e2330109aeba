"""Config sanity warnings (lm/sanity.py): one line on stderr each, never an error."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from lm.config_io import load_config
from lm.data import LMDataModule
from tests.synthetic import run_overrides, write_prepared


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: ")]


def test_shrunk_run_warns_about_warmup_validation_and_logging(capsys: pytest.CaptureFixture[str]) -> None:
    load_config("configs/tiny.yaml", "trainer.max_steps=30")
    lines = warnings_of(capsys.readouterr().err)
    assert len(lines) == 3
    assert "optim.warmup_steps=4000 >= trainer.max_steps=30" in lines[0]
    assert "trainer.val_every=1000 > trainer.max_steps=30" in lines[1]
    assert "trainer.log_every=50 > trainer.max_steps=30: the training scalars (train/loss" in lines[2]
    load_config("configs/tiny.yaml", "trainer.max_steps=30", "optim.warmup_steps=30", "trainer.val_every=10",
                "trainer.log_every=10")  # warm-up ends at the last step: the rate never gets past it either
    assert warnings_of(capsys.readouterr().err) == [
        "warning: optim.warmup_steps=30 >= trainer.max_steps=30: the learning rate never leaves warm-up (set "
        "optim.warmup_steps to a fraction of max_steps)"]


def test_sensible_config_is_silent(capsys: pytest.CaptureFixture[str]) -> None:
    load_config("configs/tiny.yaml", "trainer.max_steps=30", "optim.warmup_steps=3", "trainer.val_every=10",
                "trainer.log_every=10")
    assert warnings_of(capsys.readouterr().err) == []
    load_config("configs/tiny.yaml", "trainer.max_steps=30", "optim.warmup_steps=3", "trainer.val_every=30",
                "trainer.log_every=30")  # validating and logging at the last step only: they do run
    assert warnings_of(capsys.readouterr().err) == []


def test_non_causal_mix_warns_that_validation_leaks(capsys: pytest.CaptureFixture[str]) -> None:
    load_config("configs/experiments/mosa_hybrid_faithful.yaml", "trainer.max_steps=30", "optim.warmup_steps=3",
                "trainer.val_every=10", "trainer.log_every=10")
    (line,) = warnings_of(capsys.readouterr().err)
    assert "mosa (model.heads) not causal" in line and "leak-free" in line
    load_config("configs/experiments/mosa_hybrid.yaml", "trainer.max_steps=30", "optim.warmup_steps=3",
                "trainer.val_every=10", "trainer.log_every=10")  # the causal selection: silent
    assert warnings_of(capsys.readouterr().err) == []


def test_a_compression_prefix_other_than_the_suffix_length_warns(capsys: pytest.CaptureFixture[str]) -> None:
    """Generation decodes windows of prefix_len tokens that are first a suffix, then a compressed span: the post
    trains both at seq_len. The shipped compression configs (P = S = 128) and the default (P = model.seq_len) are
    silent."""
    sensible = ("trainer.max_steps=30", "optim.warmup_steps=3", "trainer.val_every=10", "trainer.log_every=10")
    load_config("configs/experiments/compression.yaml", *sensible)
    load_config("configs/tiny.yaml", *sensible, "compression.ratio=0.25")
    assert warnings_of(capsys.readouterr().err) == []
    load_config("configs/experiments/compression.yaml", *sensible, "compression.prefix_len=256")
    (line,) = warnings_of(capsys.readouterr().err)
    assert "compression.prefix_len=256 != model.seq_len=128" in line


def test_a_rope_fraction_that_rounds_to_no_rotation_warns(capsys: pytest.CaptureFixture[str]) -> None:
    """rope_fraction 0.05 of head_dim 16 rotates floor(0.8) = 0 dimensions: RoPE silently off (a fuzzing audit);
    the smallest fraction that rotates a pair, and 0 itself (no RoPE, asked for), are silent."""
    load_config(None, "model.head_dim=16", "model.rope_fraction=0.05")
    assert capsys.readouterr().err == ("warning: model.rope_fraction=0.05 rotates 0 of head_dim 16 dimensions (rounded "
                                       "down to an even count): the heads get no position information; use at least "
                                       "2/16, or 0\n")
    for fraction in ("0.125", "0.0"):
        load_config(None, "model.head_dim=16", f"model.rope_fraction={fraction}")
        assert capsys.readouterr().err == ""
    load_config(None, "model.head_dim=1", "model.d_model=9")  # no fraction rotates a pair: the advice says what does
    assert "the heads get no position information; a head_dim of at least 2 (RoPE rotates pairs of dimensions), or " \
           "rope_fraction 0\n" in capsys.readouterr().err


def test_a_sparsity_that_does_not_divide_the_length_warns(capsys: pytest.CaptureFixture[str]) -> None:
    """Training accepts it (k is rounded, App. F), the IsoFLOP solver refuses it: say so instead of silently
    differing."""
    shrunk = ["trainer.max_steps=30", "optim.warmup_steps=3", "trainer.val_every=10", "trainer.log_every=10"]
    load_config("configs/experiments/mosa_hybrid.yaml", *shrunk, "model.heads.1.options.sparsity=3")
    (line,) = warnings_of(capsys.readouterr().err)
    assert line.startswith("warning: model.heads: mosa sparsity 3 does not divide model.seq_len 1024") and "refuse" in line
    load_config("configs/experiments/mosa_hybrid.yaml", *shrunk, "model.heads.1.options.sparsity=4")
    assert warnings_of(capsys.readouterr().err) == []
    # a mix written in model.layer_heads is named there, not as model.heads (a walkthrough found it misnamed)
    load_config(None, *shrunk, "model.seq_len=100", "model.layer_heads.1=[{type: fixed, count: 2, options: "
                "{sparsity: 8}}]", "model.layer_heads.0=[{type: mosa, count: 2, options: {selection: expert_choice}}]")
    lines = warnings_of(capsys.readouterr().err)
    assert any(line.startswith("warning: model.layer_heads.1: fixed sparsity 8 does not divide model.seq_len 100")
               for line in lines), lines
    assert any("mosa (model.layer_heads.0) not causal" in line for line in lines), lines


@pytest.mark.parametrize(("val_tokens", "expected"), [
    (4000, None),  # 16 windows of 33 tokens = 528 <= 4000
    (400, "validation windows overlap: data.val_batches x data.batch_size = 16 windows of 33 tokens need 528"),
    (527, "need 528 but the validation split has 527 (lower data.val_batches to 1)"),  # 527 // (8 x 33), not // (8 x 32)
    (528, None),
    (200, "the validation split has 200 tokens, fewer than one batch of windows (data.batch_size=8 x 33)"),
])
def test_validation_windows(tmp_path: Path, capsys: pytest.CaptureFixture[str], val_tokens: int,
                            expected: str | None) -> None:
    cfg = load_config(None, *run_overrides(write_prepared(tmp_path, val_tokens=val_tokens), tmp_path / "run"))
    capsys.readouterr()
    LMDataModule(cfg.data, cfg.model, cfg.trainer.seed).check()
    lines = warnings_of(capsys.readouterr().err)
    if expected is None:
        assert lines == []
    else:
        assert len(lines) == 1 and expected in lines[0], lines


@pytest.mark.parametrize("model_vocab,expected", [
    (64, None), (128, None),  # the data's 64 ids, or padded up to a multiple of 128: silent
    (1000, "model.vocab_size 1000 > the data's vocabulary 64: 936 ids are never a target; set model.vocab_size=64"),
])
def test_a_model_vocabulary_far_beyond_the_datas_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       model_vocab: int, expected: str | None) -> None:
    cfg = load_config(None, *run_overrides(write_prepared(tmp_path), tmp_path / "run"), f"model.vocab_size={model_vocab}")
    capsys.readouterr()
    LMDataModule(cfg.data, cfg.model, cfg.trainer.seed).check()
    lines = warnings_of(capsys.readouterr().err)
    assert lines == ([] if expected is None else [f"warning: {expected} (padding up to a multiple of 128 is not warned "
                                                  "about)"]), lines


def test_warnings_print_on_rank_zero_only(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning.pytorch.utilities import rank_zero_only

    from lm.sanity import warn

    monkeypatch.setattr(rank_zero_only, "rank", 1)  # as Lightning's strategies set it on the other ranks
    warn("from rank 1")
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    warn("from rank 0")
    assert warnings_of(capsys.readouterr().err) == ["warning: from rank 0"]


def test_the_config_and_the_flop_calculator_load_without_lightning() -> None:
    """Lightning's import takes seconds; the IsoFLOP calculator (flops.isoflop) and config loading do not need it
    (lm.sanity imports it when a warning is printed)."""
    code = ("import sys, flops.isoflop, lm.config, lm.config_io; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
