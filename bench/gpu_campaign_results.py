"""The GPU campaign's output (bench/gpu_campaign.sh: $OUT/campaign.tgz) as the committed result files.

    python -m bench.gpu_campaign_results CALL1/campaign.tgz [CALL2/campaign.tgz] [--results bench/results]

Writes, each headed by the machine, the library versions and the campaign's own command lines for it:
gpu_tests.md (the CUDA test run from pytest's junit file: counts, every failure and error with its message,
skips grouped by reason, whether the session ran to its end, the files whose collected tests did not all run),
gpu_table2.md (bench/resources.py, Tiny pair), gpu_isoflop_heads.md (the IsoFLOP pair and bench/heads.py),
gpu_mfu.md (flops.mfu of the MFU runs), gpu_deepspeed.md (bench/resume_check.py for ZeRO-2 and DDP), gpu_c4.md with
gpu_c4_dense_vs_mosa.png (the short C4 run), gpu_profile.md (the IsoFLOP pair's operator tables from Lightning's
PyTorch profiler). A part the campaign did not produce is written as missing, with the
step's status line, never left out (gpu_mfu.md keeps, marked, the earlier report's rows of runs this campaign did
not measure); but where these calls produced none of a report's inputs (a phase not run, or
every step of it skipped for time) and the results folder already holds that report from an earlier campaign, the
earlier report is kept and the reason printed, so that a later session running part of the campaign does not
overwrite earlier measurements with "missing".
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from flops.cli import ROOT, script_parser


def read(path: Path) -> str | None:
    return path.read_text(errors="replace") if path.is_file() else None


def header(title: str, c: Path, steps: list[str]) -> list[str]:
    """Title, environment.txt, and each step's command line and status line (status.txt): the command is the first
    line of the step's own log for a training run (`== NAME (run): python3 train_lm.py ...`, where the campaign log
    has the shell function's call), else the campaign log's."""
    paths = [c.parent / "campaign.log", c / "tests.log", *(c / f"{step}.log" for step in steps)]  # make-test: tests.log
    log = "\n".join(read(path) or "" for path in paths)
    commands = {m.group(1): m.group(2) for m in re.finditer(r"^== (\S+) \((?:limit \d+s|run)\): (.*)$", log, re.M)}
    status = (read(c / "status.txt") or "").splitlines()
    lines = [f"# {title}", "", "Machine and versions (environment.txt of `bash bench/gpu_campaign.sh`):", "", "```",
             (read(c / "environment.txt") or "missing").strip(), "```", ""]
    for step in steps:
        command = f"`{commands[step]}`" if step in commands else "(bench/gpu_campaign.sh, not a timed step)"
        done = [line for line in status if line.startswith(step + " ")]
        lines.append(f"- {step}: {command}; status: {'; '.join(done) if done else 'not run'}")
    return lines + [""]


def pytest_id(classname: str, name: str) -> str:
    """pytest's id of a junit test case: classname "tests.test_a" or "tests.test_a.TestK" (a test class, its name
    capitalised as pytest requires of collected classes) -> tests/test_a.py[::TestK]::name."""
    parts = classname.split(".")
    classes = []
    while parts and parts[-1][:1].isupper():
        classes.insert(0, parts.pop())
    return "::".join(["/".join(parts) + ".py", *classes, name])


def tests_report(c: Path) -> list[str]:
    lines = header("The test suite on a GPU (`make test`, Triton compiled, pytest-xdist)", c, ["make-test"])
    xml, log = c / "tests.xml", read(c / "tests.log") or ""
    try:
        cases = ET.parse(xml).getroot().iter("testcase")
    except (OSError, ET.ParseError) as err:  # not written, or cut off mid-write
        why = "no junit file" if not xml.is_file() else f"the junit file does not parse ({err})"
        return lines + [f"**Missing**: {why}; the end of the log:", "", "```", log[-3000:], "```"]
    outcome: Counter[str] = Counter()
    failures, skips, per_file, module_skips = [], Counter(), Counter(), set()
    for case in cases:
        name = pytest_id(case.get("classname", ""), case.get("name", ""))
        if not case.get("classname"):  # a whole module skipped at collection: name "tests.test_x"
            module_skips.add(case.get("name", ""))
        per_file[name.split("::")[0]] += 1
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        kind = kinds[0] if kinds else "passed"
        outcome[kind] += 1
        if kind in ("failure", "error"):
            message = (case.find(kind).get("message") or "").strip().splitlines()
            failures.append(f"- {kind}: `{name}`: {message[0][:300] if message else '(no message)'}")
        elif kind == "skipped":
            skips[(case.find("skipped").get("message") or "").strip()] += 1
    exits = re.findall(r"^make-test exit (\d+)", read(c / "status.txt") or "", re.M)
    ended = ("session-timeout" not in log and "KeyboardInterrupt" not in log
             and all(code in ("0", "1") for code in exits))  # pytest: 0 passed, 1 tests failed; else stopped
    lines += [f"passed {outcome['passed']}, failed {outcome['failure']}, errors {outcome['error']}, skipped "
              f"{outcome['skipped']}" + ("" if ended else " (**the session was cut short**: the tests not listed did not run)"),
              "", "## Failures and errors", "", *(failures or ["none"]), "", "## Skipped, by reason", ""]
    lines += [f"- {n} x {reason}" for reason, n in skips.most_common()] or ["none"]
    collected = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(tests/\S+\.py): (\d+)$",
                                                                   read(c / "collected.txt") or "", re.M)}
    whole = {name.replace(".", "/") + ".py" for name in module_skips}  # skipped at collection there: accounted for
    short = [f"- `{path}`: {per_file[path]} of {n}" for path, n in collected.items()
             if per_file[path] < n and path not in whole]
    if collected:  # collected.txt: `pytest --collect-only -q -q` before the run
        lines += ["", "## Not run (results of the tests each file collected)", "", *(short or ["none: every collected "
                                                                                              "test has a result"])]
    slowest = re.search(r"=+ slowest \d+ durations =+\n(.*?)(?:\n\n|\n=)", log, re.S)
    if slowest:
        lines += ["", "## Slowest", "", "```", slowest.group(1).strip(), "```"]
    return lines


def copied(title: str, c: Path, steps: list[str], files: list[str]) -> list[str]:
    """A report made of benchmark outputs: each file of the campaign in `files`, or 'missing'."""
    lines = header(title, c, steps)
    for name in files:
        text = read(c / name)
        lines += [text.strip() if text else f"**Missing**: `{name}` was not written (see the status above).", ""]
    return lines


EARLIER = " (earlier campaign)"  # marks an MFU row kept from the previous gpu_mfu.md


def mfu_run(row: str) -> str:
    """The run of a row of flops.mfu's table, e.g. "mfu_tiny_compiled" of "| /tmp/campaign_runs/mfu_tiny_compiled |
    ..." (a row kept earlier keeps its name)."""
    return row.split("|")[1].strip().removesuffix(EARLIER).rsplit("/", 1)[-1]


def mfu_rows(text: str) -> list[str]:
    """The data rows of flops.mfu's table in a report or its output."""
    return [line for line in text.splitlines() if line.startswith("| ") and mfu_run(line).startswith("mfu_")]


def mfu_report(title: str, c: Path, steps: list[str], earlier: str | None) -> list[str]:
    """The MFU runs of this campaign (flops.mfu's table); rows of the `earlier` report for runs this one did not
    measure are kept, marked, below this campaign's (a partial MFU phase measures the missing run first)."""
    lines = "\n".join(copied(title, c, steps, ["gpu_mfu.md"])).splitlines()
    new = mfu_rows(read(c / "gpu_mfu.md") or "")
    measured = {mfu_run(row) for row in new}
    kept = [row if EARLIER in row else row.replace(" |", EARLIER + " |", 1)
            for row in mfu_rows(earlier or "") if mfu_run(row) not in measured]
    if not (measured and kept):
        return lines
    last = max(i for i, line in enumerate(lines) if line in new)
    note = ["", f"Rows marked{EARLIER} are kept from the previous gpu_mfu.md: this campaign did not measure those runs "
            "(the status lines above); their machine, versions and commands are in that file's git history."]
    return lines[: last + 1] + kept + note + lines[last + 1:]


def c4_report(c: Path, results: Path) -> list[str]:
    lines = header("Short C4 run: dense Tiny vs the IsoFLOP MoSA hybrid", c, ["c4_dense", "c4_mosa_isoflop"])
    lines += ["Both trained side by side during the test run (the same GPU contention), with the settings of "
              "`c4_runs` in bench/gpu_campaign.sh.", "",
              "| run | steps | tokens | final val loss | val ppl | tokens/s (contended) | peak memory (GB) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for run in ("c4_dense", "c4_mosa_isoflop"):
        text = read(c / f"{run}.metrics.json")
        if text is None:
            lines.append(f"| {run} | missing: {((read(c / f'{run}.log') or 'no log').strip().splitlines() or [''])[-1][:200]} |||||")
            continue
        m = json.loads(text)
        lines.append(f"| {run} | {m.get('step')} | {m.get('tokens_seen'):,} | {m.get('val_loss', float('nan')):.4f} | "
                     f"{m.get('val_ppl', float('nan')):.1f} | {m.get('tokens_per_s', float('nan')):,.0f} | "
                     f"{(m.get('peak_mem_bytes') or 0) / 1e9:.2f} |")
    png = c / "c4_dense_vs_mosa.png"
    if png.is_file():
        shutil.copy(png, results / "gpu_c4_dense_vs_mosa.png")
        lines += ["", "![validation curves](gpu_c4_dense_vs_mosa.png)"]
    else:
        lines += ["", "**Missing**: no curve PNG (a run had fewer than two validations, or did not run)."]
    return lines


class NotACampaign(ValueError):
    """A path given as a campaign output that is not one: the message is one line."""


def gather(sources: list[Path], into: Path) -> Path:
    """Each call's output (campaign.tgz with campaign.log beside it, or the unpacked campaign folder) merged into
    `into`/campaign, later calls' files over earlier ones', status and environment lines once each; the folder."""
    c = into / "campaign"
    c.mkdir()
    status, environments, logs = [], [], []
    for source in sources:
        if not source.exists():
            raise NotACampaign(f"{source} not found")
        with tempfile.TemporaryDirectory() as one:
            folder = source
            if source.is_file():
                try:
                    with tarfile.open(source) as tar:
                        tar.extractall(one, filter="data")
                except tarfile.TarError as err:
                    raise NotACampaign(f"{source}: not a campaign.tgz ({str(err).splitlines()[0]})") from None
                folder = Path(one) / "campaign"
            if not (folder / "environment.txt").is_file():
                raise NotACampaign(f"{source}: not a campaign output (no campaign/environment.txt)")
            for path in folder.iterdir():
                if path.name == "status.txt":
                    status += path.read_text().splitlines()
                elif path.name == "environment.txt":
                    environments.append(path.read_text().strip())
                elif path.is_file():
                    shutil.copy(path, c / path.name)
        log = source.parent / "campaign.log"
        logs.append(log.read_text(errors="replace") if log.is_file() else "")
    (c / "status.txt").write_text("".join(line + "\n" for line in dict.fromkeys(status)))
    later = "\n--- a later call (the same machine when it stayed warm between calls):\n"
    (c / "environment.txt").write_text(later.join(dict.fromkeys(environments)) + "\n")
    (into / "campaign.log").write_text("".join(logs))
    return c


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("campaign", type=Path, nargs="+",
                        help="each device call's campaign.tgz (campaign.log beside it), or the folder it unpacks to")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="where the reports go")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            c = gather(args.campaign, Path(tmp))
        except NotACampaign as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        args.results.mkdir(parents=True, exist_ok=True)
        Report = tuple[list[str], list[str], Callable[[], list[str]]]  # its inputs, its steps, the report

        def benchmark(title: str, steps: list[str], files: list[str]) -> Report:
            return files, steps, lambda: copied(title, c, steps, files)

        mfu = [f"mfu_{size}_{mode}" for size in ("tiny", "small") for mode in ("eager", "compiled")]
        c4_runs = ["c4_dense", "c4_mosa_isoflop"]
        reports: dict[str, Report] = {
            "gpu_tests.md": (["tests.xml", "tests.log"], ["make-test"], lambda: tests_report(c)),
            "gpu_table2.md": benchmark("MoSA Table 2, Tiny, T = 1024, batch 64, bf16: 9 dense vs 4 dense + 17 MoSA "
                                       "(rho 32)", ["table2"], ["gpu_table2.md"]),
            "gpu_isoflop_heads.md": benchmark("IsoFLOP Tiny (4 dense + 276 MoSA, rho 32) vs dense, and head groups at "
                                              "T = 1k/4k/8k", ["isoflop", "heads"],
                                              ["gpu_isoflop_resources.md", "gpu_heads.md"]),
            "gpu_mfu.md": (["gpu_mfu.md"], mfu, lambda: mfu_report(
                "Training MFU, dense Tiny and Small, bf16, eager and compiled (flops.mfu)", c, mfu,
                read(args.results / "gpu_mfu.md"))),
            "gpu_deepspeed.md": benchmark("DeepSpeed ZeRO-2 and DDP on one GPU: stopped by SIGTERM, resumed, compared",
                                          ["resume_check", "consolidate"],
                                          ["resume_deepspeed_stage_2.md", "resume_ddp.md", "deepspeed_consolidate.md"]),
            "gpu_c4.md": ([f"{run}.{kind}" for run in c4_runs for kind in ("metrics.json", "log")], c4_runs,
                          lambda: c4_report(c, args.results)),
            "gpu_profile.md": benchmark("Where the IsoFLOP pair's training step goes: Lightning's PyTorch profiler, 3 "
                                        "steps of Tiny dense and 4 dense + 276 MoSA (rho 32), batch 64, T = 1024, bf16",
                                        ["profile"], ["profile_dense.md", "profile_mosa_isoflop.md"]),
        }
        status = (read(c / "status.txt") or "").splitlines()
        for name, (inputs, steps, report) in reports.items():
            if (args.results / name).is_file() and not any((c / part).is_file() for part in inputs):
                ran = [line for line in status if line.split(" ")[0] in steps]
                print(f"kept {args.results / name}: these calls produced none of its inputs ("
                      + ("; ".join(ran) if ran else "its steps did not run") + ")")
                continue
            (args.results / name).write_text("\n".join(report()).rstrip() + "\n")
            print(f"wrote {args.results / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
