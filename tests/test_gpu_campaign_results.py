"""bench/gpu_campaign_results.py: the campaign's output becomes the result files; what is missing says so."""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from bench import gpu_campaign_results as results

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_ok" time="0.1" />
<testcase classname="tests.test_a" name="test_bad[3]" time="0.2"><failure message="AssertionError: 2 != 3&#10;more">x</failure></testcase>
<testcase classname="tests.test_b" name="test_gpu" time="0.0"><skipped message="no flash-attn here" /></testcase>
<testcase classname="tests.test_c" name="test_gpu2" time="0.0"><skipped message="no flash-attn here" /></testcase>
</testsuite></testsuites>"""


def _campaign(tmp_path: Path) -> Path:
    c = tmp_path / "campaign"
    c.mkdir(parents=True)
    (c / "environment.txt").write_text("NVIDIA H100 80GB HBM3, 580.1\npython 3.12.3 | torch 2.11.0\n")
    (c / "tests.xml").write_text(JUNIT)
    (c / "tests.log").write_text("== make-test (limit 240s): make test VENV=/tmp/gpu_venv\n4 tests, 1 failed\n")
    (c / "status.txt").write_text("make-test exit 1 80s\ntable2 exit 0 50s\nc4_dense exit 0\n")
    (c / "gpu_table2.md").write_text("| Wall-time/step | 100 | 90 |\n")
    (c / "resume_ddp.md").write_text("Verdict: the resumed run equals the uninterrupted one, bit for bit.\n")
    (c / "c4_dense.metrics.json").write_text(json.dumps({"step": 250, "tokens_seen": 4_096_000, "val_loss": 5.0,
                                                         "val_ppl": 148.4, "tokens_per_s": 1e5, "peak_mem_bytes": 3e9}))
    (c / "c4_dense.log").write_text("== c4_dense (run): python3 train_lm.py --config configs/tiny.yaml\nok\n")
    (c / "c4_mosa_isoflop.log").write_text("loading\nRuntimeError: CUDA out of memory\n")
    (c / "profile_dense.md").write_text("## profile_dense\n\n```\nFIT Profiler Report\n  aten::mm  41.0%\n```\n")
    (tmp_path / "campaign.log").write_text("== table2 (limit 120s): python3 -m bench.resources --pair table2-tiny\n")
    return c


def test_reports_from_a_packed_campaign(tmp_path: Path) -> None:
    c = _campaign(tmp_path)
    with tarfile.open(tmp_path / "campaign.tgz", "w:gz") as tar:
        tar.add(c, arcname="campaign")
    out = tmp_path / "results"
    assert results.main([str(tmp_path / "campaign.tgz"), "--results", str(out)]) == 0

    tests = (out / "gpu_tests.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in tests and "make-test: `make test VENV=/tmp/gpu_venv`; status: make-test exit 1 80s" in tests
    assert "passed 1, failed 1, errors 0, skipped 2\n" in tests
    assert "- failure: `tests/test_a.py::test_bad[3]`: AssertionError: 2 != 3\n" in tests
    assert "- 2 x no flash-attn here" in tests

    table2 = (out / "gpu_table2.md").read_text()
    assert "table2: `python3 -m bench.resources --pair table2-tiny`; status: table2 exit 0 50s" in table2
    assert "| Wall-time/step | 100 | 90 |" in table2

    deepspeed = (out / "gpu_deepspeed.md").read_text()
    assert "**Missing**: `resume_deepspeed_stage_2.md` was not written" in deepspeed and "bit for bit" in deepspeed
    assert "**Missing**: `gpu_mfu.md`" in (out / "gpu_mfu.md").read_text()

    c4 = (out / "gpu_c4.md").read_text()
    assert "| c4_dense | 250 | 4,096,000 | 5.0000 | 148.4 | 100,000 | 3.00 |" in c4
    assert "- c4_dense: `python3 train_lm.py --config configs/tiny.yaml`; status: c4_dense exit 0" in c4
    assert "- c4_mosa_isoflop: (bench/gpu_campaign.sh, not a timed step); status: not run" in c4
    assert "| c4_mosa_isoflop | missing: RuntimeError: CUDA out of memory |" in c4
    assert "**Missing**: no curve PNG" in c4

    profile = (out / "gpu_profile.md").read_text()
    assert "## profile_dense\n\n```\nFIT Profiler Report\n  aten::mm  41.0%\n```" in profile
    assert "**Missing**: `profile_mosa_isoflop.md` was not written" in profile and "- profile: " in profile


@pytest.mark.parametrize("log", ["!!!! session-timeout: 88.0 sec exceeded !!!!\n",  # pytest-timeout's session end
                                 "!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!\n"])  # SIGINT (timeout -s INT)
def test_a_cut_short_session_says_so(tmp_path: Path, log: str) -> None:
    c = _campaign(tmp_path)
    (c / "tests.log").write_text(log)
    assert results.main([str(c), "--results", str(tmp_path / "r")]) == 0
    assert "(**the session was cut short**: the tests not listed did not run)" in (tmp_path / "r" / "gpu_tests.md").read_text()


def test_a_stopped_make_test_is_cut_short_and_the_files_not_run_are_listed(tmp_path: Path) -> None:
    """make-test stopped at its limit (exit 124/137; the H200 run's log said neither session-timeout nor
    KeyboardInterrupt) is a cut-short session; with collected.txt, each file whose tests did not all run is listed."""
    c = _campaign(tmp_path)
    (c / "status.txt").write_text("make-test exit 137 250s\n")
    (c / "tests.xml").write_text(JUNIT.replace("</testsuite>", '<testcase classname="" name="tests.test_e" time="0">'
                                                             '<skipped message="collection skipped" /></testcase></testsuite>'))
    (c / "collected.txt").write_text("tests/test_a.py: 2\ntests/test_b.py: 3\ntests/test_c.py: 1\ntests/test_d.py: 4\n"
                                     "tests/test_e.py: 5\n")  # test_e: skipped whole where it ran, not "1 of 5"
    assert results.main([str(c), "--results", str(tmp_path / "r")]) == 0
    report = (tmp_path / "r" / "gpu_tests.md").read_text()
    assert "skipped 3 (**the session was cut short**: the tests not listed did not run)" in report
    assert report.endswith("- `tests/test_b.py`: 1 of 3\n- `tests/test_d.py`: 0 of 4\n") and "test_a.py`: " not in report
    (c / "status.txt").write_text("make-test exit 1 80s\n")  # tests failed, the session ended
    (c / "collected.txt").write_text("tests/test_a.py: 2\n")
    assert results.main([str(c), "--results", str(tmp_path / "r")]) == 0
    report = (tmp_path / "r" / "gpu_tests.md").read_text()
    assert "skipped 3\n" in report and "none: every collected test has a result" in report


def test_a_truncated_junit_file_is_reported_missing_and_the_other_reports_written(tmp_path: Path) -> None:
    c = _campaign(tmp_path)
    (c / "tests.xml").write_text(JUNIT[:200])  # cut off mid-write
    assert results.main([str(c), "--results", str(tmp_path / "r")]) == 0
    assert "**Missing**: the junit file does not parse (" in (tmp_path / "r" / "gpu_tests.md").read_text()
    assert "| Wall-time/step | 100 | 90 |" in (tmp_path / "r" / "gpu_table2.md").read_text()
    (c / "tests.xml").unlink()
    assert results.main([str(c), "--results", str(tmp_path / "r2")]) == 0
    assert "**Missing**: no junit file; the end of the log:" in (tmp_path / "r2" / "gpu_tests.md").read_text()


def test_a_report_these_calls_produced_nothing_for_keeps_the_earlier_one(tmp_path: Path, capsys) -> None:
    """A later session that runs part of the campaign (no MFU runs, every MFU step skipped for time; no timing phase)
    keeps the earlier campaign's reports of those parts instead of overwriting them with "missing", and says so; the
    parts it did produce are rewritten."""
    c = _campaign(tmp_path)
    (c / "status.txt").write_text((c / "status.txt").read_text() + "mfu_tiny_eager skipped\n")
    out = tmp_path / "r"
    out.mkdir()
    for name in ("gpu_mfu.md", "gpu_isoflop_heads.md", "gpu_table2.md"):
        (out / name).write_text(f"earlier {name}\n")
    assert results.main([str(c), "--results", str(out)]) == 0
    assert (out / "gpu_mfu.md").read_text() == "earlier gpu_mfu.md\n"
    assert (out / "gpu_isoflop_heads.md").read_text() == "earlier gpu_isoflop_heads.md\n"
    assert "| Wall-time/step | 100 | 90 |" in (out / "gpu_table2.md").read_text()  # produced: rewritten
    assert results.main([str(c), "--results", str(tmp_path / "fresh")]) == 0  # nothing earlier: written as missing
    assert "**Missing**: `gpu_mfu.md`" in (tmp_path / "fresh" / "gpu_mfu.md").read_text()
    printed = capsys.readouterr().out
    assert f"kept {out / 'gpu_mfu.md'}: these calls produced none of its inputs (mfu_tiny_eager skipped)\n" in printed
    assert f"kept {out / 'gpu_isoflop_heads.md'}: these calls produced none of its inputs (its steps did not run)\n" \
        in printed


def test_not_a_campaign_is_one_line(tmp_path: Path, capsys) -> None:
    assert results.main([str(tmp_path), "--results", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}: not a campaign output (no campaign/environment.txt)\n"
    assert results.main([str(tmp_path / "campaign.tgz"), "--results", str(tmp_path / "r")]) == 2  # a mistyped path
    assert capsys.readouterr().err == f"error: {tmp_path / 'campaign.tgz'} not found\n"


def test_two_calls_are_merged(tmp_path: Path) -> None:
    """Call 1 (timing, mfu) and call 2 (tests, on the same warm machine: its status.txt repeats call 1's lines)."""
    first = _campaign(tmp_path / "call1")
    (first / "tests.xml").unlink()
    (first / "status.txt").write_text("table2 exit 0 50s\n")
    second = tmp_path / "call2" / "campaign"
    second.mkdir(parents=True)
    (second / "environment.txt").write_text((first / "environment.txt").read_text())
    (second / "status.txt").write_text("table2 exit 0 50s\nmake-test exit 0 120s\n")
    (second / "tests.xml").write_text(JUNIT)
    packed = []
    for call in (first, second):
        with tarfile.open(call.parent / "campaign.tgz", "w:gz") as tar:
            tar.add(call, arcname="campaign")
        packed.append(str(call.parent / "campaign.tgz"))
    out = tmp_path / "results"
    assert results.main([*packed, "--results", str(out)]) == 0
    tests = (out / "gpu_tests.md").read_text()
    assert "passed 1, failed 1" in tests and "status: make-test exit 0 120s" in tests
    assert tests.count("NVIDIA H100 80GB HBM3") == 1  # one machine, said once
    table2 = (out / "gpu_table2.md").read_text()
    assert "`python3 -m bench.resources --pair table2-tiny`; status: table2 exit 0 50s\n" in table2


def test_a_damaged_archive_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "campaign.tgz").write_bytes(b"not a tar")
    assert results.main([str(tmp_path / "campaign.tgz"), "--results", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'campaign.tgz'}: not a campaign.tgz (") and err.count("\n") == 1


def test_junit_cases_get_pytest_ids() -> None:
    """A test in a class keeps its class after the file (it was read as a directory: tests/test_a/TestK.py)."""
    assert results.pytest_id("tests.test_a", "test_ok[3]") == "tests/test_a.py::test_ok[3]"
    assert results.pytest_id("tests.test_a.TestK", "test_y") == "tests/test_a.py::TestK::test_y"


def test_the_campaigns_make_test_keeps_its_stand_in_venv(tmp_path: Path) -> None:
    """The GPU image has its own Python: the campaign's stand-in venv (a python that execs python3) must not be
    rebuilt by `make test` (the Makefile's install-settings rule would remake it: python3 -m venv over the stand-in,
    then pip installs without a network), so the campaign runs make with -o on the install stamp."""
    import os
    import re
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    root = Path(__file__).resolve().parents[1]
    script = (root / "bench" / "gpu_campaign.sh").read_text()
    (call,) = re.findall(r"step make-test \S+ (make test [^>]*?)\s*>", script)
    assert call == "make test VENV=$VENV -o $VENV/.installed"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # run by make test
    dry = subprocess.run(["make", "--no-print-directory", "-n", "test", f"VENV={venv}", "-o", f"{venv}/.installed"],
                         cwd=root, env=env, capture_output=True, text=True, check=True).stdout.strip().splitlines()
    assert len(dry) == 1 and dry[0].endswith(f"{venv}/bin/python -m pytest tests"), dry


@pytest.mark.parametrize("gpu", [True, False])
def test_on_a_gpu_the_tests_with_cuda_paths_run_first(gpu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A campaign's test step can stop at its time limit: on a GPU, conftest's collection hook puts the test files
    with CUDA paths of their own first, and single tests marked `cuda` in other files (each part in its collected
    order), so their results come back; on CPU the order is pytest's."""
    from types import SimpleNamespace

    import conftest

    names = ["test_a.py", "test_varlen.py", "test_b.py", "test_gathered.py", "test_attention.py", "test_varlen.py",
             "test_c.py"]
    marked = {"test_b.py"}  # e.g. test_train.py's deterministic kernels on a GPU

    def item(i: int, name: str) -> SimpleNamespace:
        return SimpleNamespace(path=Path("tests") / name, nodeid=f"{name}::{i}",
                               get_closest_marker=lambda mark: object() if mark == "cuda" and name in marked else None)

    items = [item(i, name) for i, name in enumerate(names)]
    monkeypatch.setattr(conftest.torch.cuda, "is_available", lambda: gpu)
    conftest.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    order = [item.nodeid for item in items]
    assert order == (["test_varlen.py::1", "test_b.py::2", "test_gathered.py::3", "test_attention.py::4",
                      "test_varlen.py::5", "test_a.py::0", "test_c.py::6"] if gpu
                     else [f"{name}::{i}" for i, name in enumerate(names)])
    assert set(conftest.CUDA_FILES) <= {path.name for path in Path(__file__).parent.glob("test_*.py")}


MFU_HEAD = ("| run | device | precision | compiled | params (M) | tokens/s | GFLOP / token | achieved TFLOP/s "
            "| peak TFLOP/s per device | MFU |\n|---|---|---|---|---:|---:|---:|---:|---:|---:|\n")


def mfu_row(run: str, mfu: str) -> str:
    return (f"| /tmp/campaign_runs/{run} | 1 x NVIDIA H200 | bf16-mixed | True | 27.87 | 1,000 | 0.185 | 175.2 | 989 "
            f"| {mfu} |")


def test_a_partial_mfu_phase_keeps_the_earlier_rows_of_the_runs_it_did_not_measure(tmp_path: Path) -> None:
    """The missing run measured alone (mfu_tiny_compiled) is added to the earlier table; the earlier rows of the other
    runs stay, marked; a row this campaign measured again replaces the earlier one; a third campaign keeps the marks."""
    c = _campaign(tmp_path)
    (c / "gpu_mfu.md").write_text(MFU_HEAD + mfu_row("mfu_tiny_compiled", "25.0%") + "\n"
                                  + mfu_row("mfu_tiny_eager", "18.0%") + "\n")
    (c / "status.txt").write_text("mfu_tiny_compiled exit 0 60s\nmfu_tiny_eager exit 0 30s\nmfu_small_eager skipped\n")
    out = tmp_path / "r"
    out.mkdir()
    earlier = [mfu_row("mfu_small_compiled", "41.4%"), mfu_row("mfu_small_eager", "31.9%"),
               mfu_row("mfu_tiny_eager", "17.7%")]
    (out / "gpu_mfu.md").write_text("# earlier\n\n" + MFU_HEAD + "\n".join(earlier) + "\n")
    assert results.main([str(c), "--results", str(out)]) == 0
    report = (out / "gpu_mfu.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| /tmp/")]
    marked = [row.replace(" |", " (earlier campaign) |", 1) for row in earlier[:2]]
    assert rows == [mfu_row("mfu_tiny_compiled", "25.0%"), mfu_row("mfu_tiny_eager", "18.0%"), *marked]
    assert "Rows marked (earlier campaign) are kept from the previous gpu_mfu.md" in report
    assert "mfu_small_eager: (bench/gpu_campaign.sh, not a timed step); status: mfu_small_eager skipped" in report

    (c / "gpu_mfu.md").write_text(MFU_HEAD + mfu_row("mfu_small_eager", "32.0%") + "\n")  # a third campaign
    assert results.main([str(c), "--results", str(out)]) == 0
    rows = [line for line in (out / "gpu_mfu.md").read_text().splitlines() if line.startswith("| /tmp/")]
    runs = ["mfu_small_eager", "mfu_tiny_compiled", "mfu_tiny_eager", "mfu_small_compiled"]
    assert [results.mfu_run(r) for r in rows] == runs
    assert rows[0].endswith("| 32.0% |") and all(r.count("(earlier campaign)") == 1 for r in rows[1:])
