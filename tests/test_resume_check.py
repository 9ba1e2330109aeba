"""bench/resume_check.py: a run stopped by SIGTERM half-way and resumed is compared step by step with the
uninterrupted run; on CPU (deterministic kernels) they must be equal bit for bit."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import resume_check
from tests.synthetic import run_overrides, write_prepared


@pytest.mark.slow
def test_resume_check_stops_half_way_and_finds_the_resumed_run_equal(tmp_path: Path, capsys) -> None:
    data = write_prepared(tmp_path / "data")
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    overrides = [o for o in run_overrides(data, tmp_path / "unused") if not o.startswith("trainer.")]
    steps = 40
    out = tmp_path / "report.md"
    rc = resume_check.main(["--config", str(config), "--steps", str(steps), "--work", str(tmp_path / "work"),
                            "--out", str(out), *overrides, "trainer.accelerator=cpu"])
    report = capsys.readouterr().out
    assert rc == 0, report
    assert out.read_text() == report
    stopped = int(re.search(r"B stopped at step (\d+) of 40", report).group(1))
    assert steps // 2 <= stopped < steps
    assert "| A uninterrupted | 0 | 40 |" in report and "| B stopped (SIGTERM), then --resume | 143, 0 | 40 |" in report
    assert "Verdict: the resumed run equals the uninterrupted one, bit for bit." in report


def test_largest_difference_only_over_steps_both_logged() -> None:
    a, b = {1: 1.0, 2: 2.0, 3: 3.0}, {1: 1.5, 3: 2.0}
    assert resume_check.largest_difference(a, b, range(1, 4)) == 1.0
    assert resume_check.largest_difference(a, b, range(2, 3)) is None
    assert resume_check.largest_difference({1: 0.0, 2: 0.0}, {1: 5.0, 2: 1.0}, range(1, 3)) == 5.0  # not the last
