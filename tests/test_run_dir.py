"""Run directories (lm/run_dir.py): one run per directory, its provenance saved, resume checks,
keep_last_k, and checkpoints that carry their tokenizer."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from heads import ConfigError
from lm.config_io import load_config
from lm.errors import DataError
from lm.run_dir import claim, holds_run, read_provenance
from tests.synthetic import run_overrides, write_prepared

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10


def tokenizer(data: Path, vocab: int = 64) -> str:
    """A real SentencePiece model of the synthetic data's vocabulary size at <data>/tokenizer.model, recorded in
    its index.json as a preparation records it; returns its SHA-256."""
    import sentencepiece as spm

    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "home", "tree", "big"]
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(words[i] for i in torch.randint(0, len(words), (12,), generator=g).tolist()) for _ in range(300)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(data / "tokenizer"),
                                   vocab_size=vocab, model_type="bpe", minloglevel=2)
    sha = hashlib.sha256((data / "tokenizer.model").read_bytes()).hexdigest()
    index = json.loads((data / "index.json").read_text())
    (data / "index.json").write_text(json.dumps({**index, "tokenizer_sha256": sha}))
    return sha


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(data, out) of one 10-step run with a checkpoint every 2 steps, keeping the newest 2."""
    from lm.train import train

    data = write_prepared(tmp_path_factory.mktemp("data"))
    tokenizer(data)
    out = tmp_path_factory.mktemp("run")
    train(load_config(None, *overrides(data, out)))
    return data, out


def overrides(data: Path, out: Path, *extra: str) -> list[str]:
    return [*run_overrides(data, out, max_steps=STEPS, ckpt_every=2, val_every=5, keep_last_k=2), *extra]


def test_run_saves_config_tokenizer_and_data_hash(run: tuple[Path, Path]) -> None:
    data, out = run
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["d_model"] == 32 and saved["trainer"]["max_steps"] == STEPS
    assert load_config(out / "config.yaml") == load_config(None, *overrides(data, out))
    record = json.loads((out / "run.json").read_text())
    assert len(record["data_sha256"]) == 64 and record["command"]
    sha = hashlib.sha256((data / "tokenizer.model").read_bytes()).hexdigest()
    assert record["tokenizer_sha256"] == sha and record["data_path"] == str(data.resolve())
    assert (out / "tokenizer.model").read_bytes() == (data / "tokenizer.model").read_bytes()
    hparams = yaml.safe_load((out / "tb" / "hparams.yaml").read_text())  # TensorBoard's copy (was {})
    assert hparams["model"]["d_model"] == 32


def test_keep_last_k(run: tuple[Path, Path]) -> None:
    names = sorted(p.name for p in (run[1] / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step0000008.ckpt", "step0000010.ckpt"]
    assert torch.load(run[1] / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == STEPS


def test_a_directory_holding_a_run_is_refused(run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    import train_lm

    data, out = run
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert train_lm.main(["--config", str(ROOT / "configs" / "quickstart.yaml"), *overrides(data, out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: trainer.out_dir {out} already holds a run; pass --resume to continue it or --overwrite " \
                  f"to start again"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # nothing touched


def test_overrides_stand_on_either_side_of_the_options(run: tuple[Path, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Overrides before and after --overwrite all apply, and one right after --resume is an override, not
    a checkpoint path (`--resume [PATH]` took `trainer.max_steps=4` for one; argparse refused the later ones)."""
    import train_lm

    data, _ = run
    out = tmp_path / "run"
    shutil.copytree(run[1], out)  # a finished 10-step run
    config = str(ROOT / "configs" / "quickstart.yaml")
    first, rest = overrides(data, out)[:5], overrides(data, out)[5:]
    assert train_lm.main(["--config", config, *first, "--overwrite", *rest, "trainer.max_steps=2"]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["d_model"] == 32 and saved["trainer"]["max_steps"] == 2  # both sides applied
    assert json.loads((out / "metrics.json").read_text())["step"] == 2  # started again
    capsys.readouterr()
    assert train_lm.main(["--config", config, *first, *rest, "--resume", "trainer.max_steps=4"]) == 0
    assert f"--resume: continuing from {out / 'checkpoints' / 'step0000002.ckpt'}" in capsys.readouterr().err
    assert json.loads((out / "metrics.json").read_text())["step"] == 4


def test_resume_checks_data_tokenizer_and_config(run: tuple[Path, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    data, out = run
    record = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**record, "started": "2000-01-01T00:00:00Z", "command": ["first"]}))
    claim(load_config(None, *overrides(data, out, "trainer.max_steps=20", "optim.lr=1e-3", "trainer.val_every=7")),
          True, False)
    resumed = json.loads((out / "run.json").read_text())  # the run's own record, with when it was resumed
    assert resumed["started"] == "2000-01-01T00:00:00Z" and resumed["command"] == ["first"]
    assert resumed["resumed"] != resumed["started"]  # now
    # optim.lr and max_steps are reported where they are applied (lm/resume_settings.py), not twice
    assert capsys.readouterr().err.splitlines() == ["resume: trainer.val_every: 5 -> 7"]
    assert yaml.safe_load((out / "config.yaml").read_text())["trainer"]["max_steps"] == 20  # as trained now
    claim(load_config(None, *overrides(data, out)), True, False)  # back to the run's own config

    other = write_prepared(tmp_path / "other", seed=1)  # same format and tokenizer, other tokens
    shutil.copy(data / "tokenizer.model", other / "tokenizer.model")
    other_index = json.loads((other / "index.json").read_text())
    sha = json.loads((data / "index.json").read_text())["tokenizer_sha256"]
    (other / "index.json").write_text(json.dumps({**other_index, "tokenizer_sha256": sha}))
    with pytest.raises(ConfigError, match=r"trained on another data \(sha256 "):
        claim(load_config(None, *overrides(other, out)), True, False)
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)  # the same data elsewhere: allowed
    claim(load_config(None, *overrides(moved, out)), True, False)
    index = json.loads((moved / "index.json").read_text())
    (moved / "index.json").write_text(json.dumps({**index, "tokenizer_sha256": "retrained"}))
    (moved / "tokenizer.model").unlink()  # (with its tokenizer, the index's hash would not be that file's)
    with pytest.raises(ConfigError, match=r"trained on another tokenizer \(sha256 [0-9a-f]{12}, .* has retrained\)"):
        claim(load_config(None, *overrides(moved, out)), True, False)
    (moved / "index.json").write_text(json.dumps(index))
    (moved / "tokenizer.model").write_bytes(b"another tokenizer")  # not the one index.json records: refused
    with pytest.raises(DataError, match=r"^data.path: .*tokenizer.model is not the tokenizer .* was prepared with "
                                        r"\(SHA-256 [0-9a-f]{12}, index.json's [0-9a-f]{12}\); rerun data_prep.prepare"):
        claim(load_config(None, *overrides(moved, out)), True, False)
    # ... but only training refuses it: the evaluation's training-data lookup (lm/training_overlap.py) reads it
    assert read_provenance(moved.resolve())["data_sha256"] is not None
    with pytest.raises(ConfigError, match=r"different config \(model.n_layers: 2 -> 3; trainer.seed: 1234 -> 5\)"):
        claim(load_config(None, *overrides(data, out, "model.n_layers=3", "trainer.seed=5")), True, False)
    with pytest.raises(ConfigError, match="exclude each other"):
        claim(load_config(None, *overrides(data, out)), True, True)


def test_a_damaged_run_record_or_config_is_one_line_on_resume(run: tuple[Path, Path], tmp_path: Path) -> None:
    """run.json or config.yaml edited by hand into no JSON / no YAML / a list: --resume says which file, in one line
    (a JSONDecodeError or ParserError traceback before), and leaves both as they were."""
    data, out = run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    cfg = load_config(None, *overrides(data, copy))
    for name, text, why in (("run.json", '{"started": ', "Expecting value"), ("run.json", "[]", "not a JSON object"),
                            ("config.yaml", "model: [unclosed\n", "expected ',' or ']'"),
                            ("config.yaml", "- model\n", "holds a list, not a config"),
                            ("config.yaml", "", "holds no settings, not a config")):  # not the defaults
        kept = (copy / name).read_text()
        (copy / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"^--resume: {copy / name} is damaged \(.*{why}.*\); restore it, or "
                                              r"pass --overwrite to start again$"):
            claim(cfg, True, False)
        assert (copy / name).read_text() == text
        (copy / name).write_text(kept)
    claim(cfg, True, False)  # restored: resumes


def test_overwrite_deletes_only_the_runs_outputs(run: tuple[Path, Path], tmp_path: Path) -> None:
    data, _ = run
    out = tmp_path / "run"
    shutil.copytree(run[1], out)
    (out / "notes.txt").write_text("mine")
    (out / "train.log").write_text("sweep log")
    claim(load_config(None, *overrides(data, out)), False, True)
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "notes.txt", "run.json", "tokenizer.model",
                                                      "train.log"]
    assert not holds_run(out / "nothing") and holds_run(out)
    for i, part in enumerate(("run.json", "metrics.json", "checkpoints/step0000010.ckpt")):  # any one is (part of) a run
        only = tmp_path / f"only{i}"
        (only / part).parent.mkdir(parents=True)
        (only / part).write_text("{}")
        assert holds_run(only), part


def test_checkpoint_carries_its_tokenizer(run: tuple[Path, Path], tmp_path: Path) -> None:
    """Decoding elsewhere: the checkpoint alone, without the data directory it was trained on."""
    from lm.loading import load_for_generation

    data, out = run
    ckpt = tmp_path / "copy.ckpt"
    shutil.copy(out / "checkpoints" / "last.ckpt", ckpt)
    carried = torch.load(ckpt, weights_only=True)["run"]
    assert carried["tokenizer_model"] == (data / "tokenizer.model").read_bytes()
    assert carried["data_sha256"] == json.loads((out / "run.json").read_text())["data_sha256"]
    hidden = data.with_name(data.name + "_hidden")
    data.rename(hidden)
    try:
        model, sp, _ = load_for_generation(ckpt)
    finally:
        hidden.rename(data)
    assert sp.get_piece_size() == 64 and sp.encode("the cat")


def test_data_without_a_tokenizer_warns_that_checkpoints_carry_none(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Shards made elsewhere (no tokenizer.model beside them) train, with one warning once the run has passed every
    check that can refuse it: decoding and evaluating the checkpoints will need --tokenizer. With the tokenizer: none."""
    from lm.train import train

    data = write_prepared(tmp_path / "data")
    for run in ("a", "b"):
        train(load_config(None, *run_overrides(data, tmp_path / run, max_steps=2, val_every=2, ckpt_every=2)))
        warnings = [line for line in capsys.readouterr().err.splitlines() if "tokenizer" in line]
        assert warnings == ([f"warning: data.path {data} has no tokenizer.model: checkpoints will carry no tokenizer, "
                             "so decoding and evaluating them (lm.generate, lm.evaluate) will need --tokenizer"]
                            if run == "a" else [])
        tokenizer(data)
