"""lm/plots.py: several runs' validation curves in one PNG (python -m lm.plots), and its one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lm import plots


def _run(path: Path, ppl: list[float]) -> Path:
    path.mkdir(parents=True)
    history = [{"step": 10 * i, "tokens_seen": 1000 * i, "val_loss": 0.0, "val_ppl": p} for i, p in enumerate(ppl, 1)]
    (path / "metrics.json").write_text(json.dumps({"history": history}))
    return path


def test_two_runs_in_one_png_labelled_by_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn = {}
    real = plots.plot_val_curves

    def spy(histories, path, title="", min_points=2):
        drawn.update(histories)
        return real(histories, path, title, min_points)

    monkeypatch.setattr(plots, "plot_val_curves", spy)
    runs = [_run(tmp_path / "dense", [90.0, 60.0]), _run(tmp_path / "mosa", [80.0, 50.0, 40.0])]
    out = tmp_path / "curves.png"
    assert plots.main([*map(str, runs), "--out", str(out), "--title", "dense vs mosa"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(drawn) == ["dense", "mosa"] and [h["val_ppl"] for h in drawn["mosa"]] == [80.0, 50.0, 40.0]


def test_runs_with_the_same_directory_name_are_both_drawn_labelled_by_path(tmp_path: Path, monkeypatch) -> None:
    """Two sweeps' points share a name (`runs/mosa_s8`): each keeps its curve, labelled by its path (the second
    replaced the first under one label, silently)."""
    drawn = {}
    monkeypatch.setattr(plots, "plot_val_curves",
                        lambda histories, path, title="", min_points=2: drawn.update(histories) or Path(path))
    a, b = _run(tmp_path / "tiny" / "mosa_s8", [90.0, 60.0]), _run(tmp_path / "small" / "mosa_s8", [80.0, 50.0])
    dense = _run(tmp_path / "dense", [70.0, 40.0])
    assert plots.main([str(a), str(b), str(dense), "--out", str(tmp_path / "c.png")]) == 0
    assert {label: [h["val_ppl"] for h in history] for label, history in drawn.items()} == {
        str(a): [90.0, 60.0], str(b): [80.0, 50.0], "dense": [70.0, 40.0]}


def test_a_run_with_one_validation_is_drawn_and_none_at_all_is_an_error(tmp_path: Path, capsys,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep point validated once, at its end, is drawn as a lone marker next to the curves (it was left out
    without a word); a run's own val_curve.png (lm/train.py) waits for two validations; no validation at all is one
    line."""
    from matplotlib.axes import Axes

    assert plots.plot_val_curves({"a": [{"tokens_seen": 1, "val_ppl": 9.0}]}, tmp_path / "x.png") is None
    drawn = {}
    real = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, x, y, **kw: drawn.update({kw["label"]: list(y)}) or real(ax, x, y,
                                                                                                         **kw))
    runs = [_run(tmp_path / "curve", [90.0, 60.0]), _run(tmp_path / "point", [70.0])]
    assert plots.main([*map(str, runs), "--out", str(tmp_path / "x.png")]) == 0
    assert drawn == {"curve": [90.0, 60.0], "point": [70.0]}
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plots.main([str(_run(tmp_path / "short", [])), "--out", str(tmp_path / "y.png")]) == 2
    assert capsys.readouterr().err == "error: no run has a validation yet (metrics.json's history holds no val_ppl)\n"
    assert not (tmp_path / "y.png").exists()


def test_a_directory_without_metrics_is_named(tmp_path: Path, capsys) -> None:
    assert plots.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nothing'}: no metrics.json (not a training run directory, or no validation yet)\n"


def test_a_damaged_metrics_file_is_named(tmp_path: Path, capsys) -> None:
    """metrics.json cut short, or holding a list: one line naming it (a JSONDecodeError / AttributeError before)."""
    for text in ('{"history": [', "[]"):
        run = tmp_path / "run"
        run.mkdir(exist_ok=True)
        (run / "metrics.json").write_text(text)
        assert plots.main([str(run), "--out", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {run / 'metrics.json'} is damaged (") and err.count("\n") == 1


def test_an_unwritable_or_non_png_out_is_one_line_before_reading_the_runs(tmp_path: Path, capsys) -> None:
    """--out onto a directory, into a missing one, or not ending in .png (matplotlib picks the format by it) stops
    with one line (they were a matplotlib traceback after the runs were read)."""
    run = str(_run(tmp_path / "dense", [90.0, 60.0]))
    for out, message in ((tmp_path, f"--out {tmp_path} is a directory; give a file name"),
                         (tmp_path / "no" / "c.png", f"--out {tmp_path / 'no' / 'c.png'}: directory {tmp_path / 'no'} "
                                                     "does not exist"),
                         (tmp_path / "c.txt", f"--out {tmp_path / 'c.txt'}: the plot is a PNG; give a file name ending "
                                              "in .png")):
        assert plots.main([run, "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"error: {message}\n"
    assert not (tmp_path / "c.txt").exists()


def test_a_png_name_in_capitals_is_a_png(tmp_path: Path) -> None:
    """matplotlib picks the format from the suffix in any case: c.PNG is written as a PNG, not refused."""
    run = str(_run(tmp_path / "dense", [90.0, 60.0]))
    assert plots.main([run, "--out", str(tmp_path / "c.PNG")]) == 0
    assert (tmp_path / "c.PNG").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
