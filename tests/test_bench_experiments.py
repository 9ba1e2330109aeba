"""The two Gutenberg experiments of bench/ run end to end at tiny sizes: bench/gutenberg_compare.py (data prepared
once, every variant trained by train_lm.py in its own process and evaluated, FLOP ratios as the IsoFLOP solver
gives them, csv and markdown written; a finished run reused, a changed config or --force retrained, a variant in
the csv skipped, rows of other processes kept) and bench/causal_routing.py (every (variant, seed) run trained and
probed, csv / markdown / png aggregated over seeds; finished runs skipped, a run cut off after training
re-evaluated without retraining, a run claimed by a live process left alone).

Each test writes a settings file from the committed one with the same variant specs but a tiny `base` (2 layers,
h = 32, T = 32, 4 steps), its runs and data under tmp_path, and passes a results stem there (--out)."""
from __future__ import annotations

import csv
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT
from eval_setup import english
from synthetic import write_prepared

STEPS, BATCH, SEQ_LEN, WINDOWS = 4, 4, 32, 4


@pytest.fixture(autouse=True)
def torch_threads() -> Iterator[None]:
    """train_and_evaluate sets this process's torch threads to 1; give the next tests back what they had."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny_settings(tmp_path: Path, experiment: str, variants: list[str], data: Path, vocab_size: int) -> Path:
    """configs/experiments/<experiment>.yaml with only `variants` (their committed specs) and a tiny `base`
    training on `data` into tmp_path/runs; the path of the written settings file."""
    settings = OmegaConf.load(ROOT / "configs" / "experiments" / f"{experiment}.yaml")
    settings.base.model = {"vocab_size": vocab_size, "d_model": 32, "n_layers": 2, "head_dim": 8, "ffn_mult": 4,
                           "seq_len": SEQ_LEN, "heads": [{"type": "dense", "count": 6}]}
    settings.base.data = {"path": str(data), "batch_size": BATCH, "val_batches": 1}
    settings.base.optim.warmup_steps = 1
    settings.base.trainer = {"max_steps": STEPS, "val_every": 2, "ckpt_every": STEPS, "log_every": 2, "seed": 7,
                             "out_dir": str(tmp_path / "runs"), "accelerator": "cpu"}
    settings.eval.windows = WINDOWS
    settings.variants = {name: settings.variants[name] for name in variants}
    OmegaConf.save(settings, tmp_path / "settings.yaml")
    return tmp_path / "settings.yaml"


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def table(markdown: Path) -> dict[str, list[str]]:
    """The rows of the markdown table, by their first cell (the variant)."""
    rows = [line.strip("|").split(" | ") for line in markdown.read_text().splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells] for cells in rows[1:]}  # rows[0]: the header


def mtime(path: Path) -> int:
    return path.stat().st_mtime_ns


def dead_pid() -> int:
    """The pid of a process that has exited."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


@pytest.mark.slow
def test_gutenberg_compare_trains_and_reports_every_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """main with no options: the data directory is prepared once (data_prep.prepare on tiny texts: the `prepare`
    section points at them, source `text`), then the dense baseline, the 4 kept dense heads alone and faithful MoSA
    FLOP-matched by the solver are each trained and evaluated: one csv row each in the settings' order, with the
    solver's FLOP ratio, parameters and KV total, the trained steps and tokens, finite perplexities = exp(loss),
    leak-free = teacher-forced for the causal models; the markdown table shows the same numbers."""
    from bench import gutenberg_compare
    from bench.gutenberg_compare import base_config
    from flops.isoflop import solve

    for i in range(12):
        (tmp_path / "texts").mkdir(exist_ok=True)
        (tmp_path / "texts" / f"doc{i:02d}.txt").write_text(english(i, 30), encoding="utf-8")
    path = tiny_settings(tmp_path, "gutenberg_compare", ["dense", "dense_kept", "mosa_faithful"],
                         tmp_path / "data", vocab_size=400)
    settings = OmegaConf.load(path)
    settings.prepare = {"source": "text", "src": str(tmp_path / "texts"), "vocab_size": 400, "sample_chars": 100_000}
    OmegaConf.save(settings, path)

    assert gutenberg_compare.main(["--config", str(path), "--out", str(tmp_path / "gutenberg_compare")]) == 0
    assert capsys.readouterr().out.count("preparing data:") == 1
    assert json.loads((tmp_path / "data" / "index.json").read_text())["vocab_size"] == 400
    rows = read_csv(tmp_path / "gutenberg_compare.csv")
    assert [r["variant"] for r in rows] == ["dense", "dense_kept", "mosa_faithful"]
    dense, kept, mosa = rows
    solved = solve(base_config(settings, []).model, "mosa", 8, 4, {"selection": "expert_choice"})
    assert (dense["heads"], float(dense["flop_ratio"])) == ("6 dense", 1.0)
    assert (int(dense["params"]), int(dense["kv_total"])) == (solved.baseline_params, solved.baseline_kv_total)
    assert float(dense["fwd_gflop"]) == round(solved.baseline_flops_per_pass / 1e9, 4)
    assert mosa["heads"] == f"4 dense + {solved.sparse_heads} mosa {{'selection': 'expert_choice', 'sparsity': 8}}"
    assert float(mosa["flop_ratio"]) == pytest.approx(solved.budget_used, abs=1e-4) and 0.95 < solved.budget_used <= 1
    assert (int(mosa["params"]), int(mosa["kv_total"])) == (solved.params, solved.kv_total)
    assert kept["heads"] == "4 dense" and 0.5 < float(kept["flop_ratio"]) < 0.95
    assert int(kept["params"]) < int(dense["params"]) and int(kept["kv_total"]) == 4 * int(dense["kv_total"]) // 6
    assert [r["causal"] for r in rows] == ["True", "True", "False"]
    for r in rows:
        assert (int(r["steps"]), int(r["tokens"]), int(r["windows"])) == (STEPS, STEPS * BATCH * SEQ_LEN, WINDOWS)
        for kind in ("val", "leakfree"):
            loss = float(r[f"{kind}_loss"])
            assert 0 < loss < 2 * math.log(400) and float(r[f"{kind}_ppl"]) == pytest.approx(math.exp(loss), rel=1e-3)
        assert float(r["train_s"]) > 0 and int(r["tokens_per_s"]) > 0 and r["machine"] and r["torch"] == torch.__version__
        if r["causal"] == "True":
            assert r["leakfree_loss"] == r["val_loss"]
        run = tmp_path / "runs" / r["variant"]
        assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "code_version.txt").read_text().strip() == r["code"]
    shown = table(tmp_path / "gutenberg_compare.md")
    assert list(shown) == ["dense", "dense_kept", "mosa_faithful"]
    for r in rows:
        cells = shown[r["variant"]]
        assert cells[1:3] == [r["heads"], r["causal"]] and cells[4].endswith(f"({float(r['flop_ratio']):.3f})")
        assert cells[8:10] == [f"{float(r['val_ppl']):.2f}", f"{float(r['leakfree_ppl']):.2f}"]


@pytest.mark.slow
def test_gutenberg_compare_skips_reuses_and_retrains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """One variant, on a write_prepared directory (nothing to prepare), through the calls of an experiment's life:
    a variant in the csv is skipped; `--only` re-evaluates its finished run without retraining it (train.log kept)
    and keeps the row another process wrote meanwhile (train_and_evaluate wrapped to append it to the csv first);
    a changed config (another learning rate, same steps) retrains, and so does `--force` of an unchanged one;
    `--report` rewrites the markdown from the csv alone. Command-line overrides train under a directory of their own
    (the run without them is neither reused nor deleted), are refused into a stem of other overrides, and are stated in
    their report."""
    from bench import gutenberg_compare

    path = tiny_settings(tmp_path, "gutenberg_compare", ["dense"], write_prepared(tmp_path / "data"), vocab_size=64)
    results, log = tmp_path / "gc.csv", tmp_path / "runs" / "dense" / "train.log"
    main = lambda *argv: gutenberg_compare.main(["--config", str(path), "--out", str(tmp_path / "gc"), *argv])  # noqa: E731

    assert main("--lock", str(tmp_path / "lock"), "--hold-lock") == 0
    assert (tmp_path / "lock").is_file() and "reusing" not in capsys.readouterr().out
    [first] = read_csv(results)
    trained, written = mtime(log), mtime(results)

    assert main() == 0
    assert capsys.readouterr().out == f"dense: already in {results}, skipped (--force to rerun)\n"
    assert mtime(results) == written

    def other_worker_meanwhile(*args: object, **kwargs: object) -> dict[str, object]:
        with open(results, "a", newline="") as f:
            csv.DictWriter(f, gutenberg_compare.COLUMNS).writerow({**first, "variant": "other"})
        return train_and_evaluate(*args, **kwargs)

    train_and_evaluate = gutenberg_compare.train_and_evaluate
    monkeypatch.setattr(gutenberg_compare, "train_and_evaluate", other_worker_meanwhile)
    assert main("--only", "dense", "--lock", str(tmp_path / "lock")) == 0
    monkeypatch.setattr(gutenberg_compare, "train_and_evaluate", train_and_evaluate)
    assert f"dense: reusing the finished run in {tmp_path / 'runs' / 'dense'}" in capsys.readouterr().out
    assert mtime(log) == trained
    reused, other = read_csv(results)
    assert other["variant"] == "other" and reused == first  # the same checkpoint, the same windows: the same row

    assert main("--only", "dense", "optim.lr=0.001") == 2
    assert capsys.readouterr().err == (f"error: {results} holds results run with overrides [], not ['optim.lr=0.001']: "
                                       "give these their own --out\n")
    settings = OmegaConf.load(path)
    settings.base.optim.lr = 0.001
    OmegaConf.save(settings, path)
    assert main("--only", "dense") == 0
    assert "reusing" not in capsys.readouterr().out and mtime(log) > trained
    assert OmegaConf.load(log.parent / "config.yaml").optim.lr == 0.001
    retrained = mtime(log)

    assert gutenberg_compare.main(["--config", str(path), "--out", str(tmp_path / "steps3"), "trainer.max_steps=3"]) == 0
    [tagged] = (tmp_path / "runs").glob("o-*/dense/config.yaml")
    assert OmegaConf.load(tagged).trainer.max_steps == 3 and mtime(log) == retrained  # the run without it untouched
    assert "Overrides of the settings file: [\"trainer.max_steps=3\"]" in (tmp_path / "steps3.md").read_text()
    assert read_csv(tmp_path / "steps3.csv")[0]["steps"] == "3"

    assert main("--force") == 0
    assert "reusing" not in capsys.readouterr().out and mtime(log) > retrained
    assert [r["variant"] for r in read_csv(results)] == ["dense", "other"]
    forced = mtime(log)

    (tmp_path / "gc.md").unlink()
    assert main("--report") == 0
    assert list(table(tmp_path / "gc.md")) == ["dense", "other"] and mtime(log) == forced


@pytest.mark.slow
def test_causal_routing_runs_every_seed_and_aggregates_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense and causal MoSA with the learned predictor, seeds 1 and 2 (of the settings' 1, 2, 3): one result.json
    per run in <out_dir>/s<seed>/<variant> trained with that seed, a csv row each (variant order, then seed) with
    the command, the coverage by quarter (four shares in [0, 1]) and predictor accuracy for MoSA only; the markdown
    row states the mean ± std over the seeds and the resolution line the pooled std of the csv's numbers; the png
    of the validation curves is an image."""
    import matplotlib.image

    from bench import causal_routing

    path = tiny_settings(tmp_path, "causal_routing", ["dense", "mosa_predictor"], write_prepared(tmp_path / "data"),
                         vocab_size=64)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    argv = ["--config", str(path), "--seeds", "1,2", "--out", str(tmp_path / "cr")]

    assert causal_routing.main(argv) == 0
    rows = read_csv(tmp_path / "cr.csv")
    assert [(r["variant"], r["seed"]) for r in rows] == [("dense", "1"), ("dense", "2"),
                                                         ("mosa_predictor", "1"), ("mosa_predictor", "2")]
    for r in rows:
        run = tmp_path / "runs" / f"s{r['seed']}" / r["variant"]
        result = json.loads((run / "result.json").read_text())
        assert OmegaConf.load(run / "config.yaml").trainer.seed == int(r["seed"]) == result["seed"]
        assert [h["tokens_seen"] for h in result["history"]] == [2 * BATCH * SEQ_LEN, STEPS * BATCH * SEQ_LEN]
        assert r["command"] == f"python -m bench.causal_routing {' '.join(argv)}"
        assert float(r["val_ppl"]) == float(r["leakfree_ppl"]) == result["val_ppl"] and math.isfinite(result["val_ppl"])
        if r["variant"] == "dense":
            assert r["cover_cand"] == r["cover_topk"] == r["predictor_acc"] == ""
        else:
            for key in ("cover_cand", "cover_topk"):
                shares = json.loads(r[key])
                assert len(shares) == 4 and all(0 <= v <= 1 for v in shares) and shares == pytest.approx(result[key], abs=1e-4)
            assert 0 <= float(r["predictor_acc"]) <= 1
    assert rows[0]["val_ppl"] != rows[1]["val_ppl"]  # the seeds differ

    ppl = {n: [float(r["leakfree_ppl"]) for r in rows if r["variant"] == n] for n in ("dense", "mosa_predictor")}
    shown = table(tmp_path / "cr.md")
    assert list(shown) == ["dense", "mosa_predictor"]
    for name, values in ppl.items():
        assert shown[name][5] == f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f}"
        assert shown[name][-1] == "2"
    assert shown["dense"][7:10] == ["-", "-", "-"] and len(shown["mosa_predictor"][7].split(" / ")) == 4
    pooled = math.sqrt(statistics.fmean(statistics.variance(v) for v in ppl.values()))
    assert f"Resolution: pooled seed std of the leak-free perplexity {pooled:.2f} (2 degrees of freedom)" in \
        (tmp_path / "cr.md").read_text()
    image = matplotlib.image.imread(tmp_path / "cr.png")
    assert image.ndim == 3 and image.shape[0] > 100


def test_causal_routing_resumes_without_retraining(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--report` before any run writes nothing; a finished run (result.json) is skipped by the next call (its
    worker gone); a run whose result.json is missing while a live process holds its claim is left to that process;
    once the claim's process is dead, the run is taken over and only re-evaluated (its training reused, train.log
    kept), giving the same result."""
    from bench import causal_routing

    path = tiny_settings(tmp_path, "causal_routing", ["dense"], write_prepared(tmp_path / "data"), vocab_size=64)
    run, claim = tmp_path / "runs" / "s1" / "dense", tmp_path / "runs" / "s1" / "dense.claim"
    main = lambda *argv: causal_routing.main(["--config", str(path), "--seeds", "1", "--out", str(tmp_path / "cr"),  # noqa: E731
                                              *argv])

    assert main("--report") == 0
    assert not list(tmp_path.glob("cr.*"))
    assert main() == 0
    first = json.loads((run / "result.json").read_text())
    trained, finished = mtime(run / "train.log"), mtime(run / "result.json")
    assert [r["variant"] for r in read_csv(tmp_path / "cr.csv")] == ["dense"] and "reusing" not in capsys.readouterr().out

    assert claim.read_text() == str(os.getpid())
    claim.write_text(str(dead_pid()))  # that worker has exited: its claim does not stop the next call
    assert main() == 0
    assert "training" not in capsys.readouterr().out and mtime(run / "result.json") == finished

    (run / "result.json").unlink()
    claim.write_text(str(os.getpid()))  # a live worker of this run
    assert main() == 0
    assert "training" not in capsys.readouterr().out and not (run / "result.json").exists()

    claim.write_text(str(cut_off := dead_pid()))  # that worker was cut off after training
    assert main() == 0
    assert f"dense: reusing the finished run in {run}" in capsys.readouterr().out and mtime(run / "train.log") == trained
    assert json.loads((run / "result.json").read_text()) == first and claim.read_text() == str(os.getpid()) != str(cut_off)

    # overrides: refused into the stem of the runs without them; with their own stem, trained under their own directory
    assert main("trainer.max_steps=3") == 2 and "give these their own --out" in capsys.readouterr().err
    assert causal_routing.main(["--config", str(path), "--seeds", "1", "--out", str(tmp_path / "cr3"),
                                "trainer.max_steps=3"]) == 0
    [tagged] = (tmp_path / "runs").glob("o-*/s1/dense/result.json")
    assert json.loads(tagged.read_text())["steps"] == 3 and json.loads((run / "result.json").read_text()) == first
    assert [r["steps"] for r in read_csv(tmp_path / "cr3.csv")] == ["3"]


def test_gutenberg_compare_report_before_any_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--report` before any variant has a result row: one line saying so, exit status 2, nothing written (it raised
    IndexError: the report names the first row's evaluation windows)."""
    from bench import gutenberg_compare

    config = str(ROOT / "configs" / "experiments" / "gutenberg_compare.yaml")
    assert gutenberg_compare.main(["--config", config, "--report", "--out", str(tmp_path / "gc")]) == 2
    assert capsys.readouterr().err == f"error: --report: {tmp_path / 'gc.csv'} has no results yet; run a variant first\n"
    assert list(tmp_path.iterdir()) == []


def test_causal_routing_claims_hold_their_pid_and_yield_to_live_owners(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim file is linked into place with its pid already written (one left empty, by a worker killed between
    creating and writing it, blocked its run forever: pid 0 is this process group, always alive) and no temporary
    file stays; a live owner keeps its claim, another user's too (os.kill's PermissionError was a traceback); an
    empty or dead claim is taken over."""
    from bench.causal_routing import claim

    settings = OmegaConf.create({"base": {"trainer": {"out_dir": str(tmp_path / "runs")}}})
    path = tmp_path / "runs" / "s1" / "dense.claim"
    assert claim(settings, 1, "dense") and path.read_text() == str(os.getpid())
    assert not claim(settings, 1, "dense")  # held by this (live) process
    assert [p.name for p in path.parent.iterdir()] == ["dense.claim"]
    for stale in ("", str(dead_pid())):
        path.write_text(stale)
        assert claim(settings, 1, "dense") and path.read_text() == str(os.getpid())

    def another_users(pid: int, signal: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    path.write_text("1")
    monkeypatch.setattr(os, "kill", another_users)
    assert not claim(settings, 1, "dense") and path.read_text() == "1"
