"""bench/decode.py end to end at toy size: eager and compiled decoding of the three models in one table."""
from __future__ import annotations

import re

from bench.decode import main


def test_decode_bench_reports_eager_and_compiled_side_by_side(tmp_path) -> None:
    out = tmp_path / "decode.md"
    assert main(["--lengths", "40", "--new-tokens", "3", "--d-model", "32", "--head-dim", "8", "--layers", "1",
                 "--vocab", "50", "--repeats", "1", "--compile", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 40 |")]
    header = next(line for line in text.splitlines() if line.startswith("| prompt |")).split(" | ")
    assert len(rows) == 3 and all(len(r) == len(header) for r in rows)
    col = header.index("compiled tok/s / dense")
    assert rows[0][col] == "1.00" and all(float(r[header.index("compiled tok/s")]) > 0 for r in rows)
    assert "lm.generate.decode_step" in text
    names = [h.strip("| ") for h in header]
    cell = lambda r, name: r[names.index(name)].strip("| ")  # noqa: E731
    assert cell(rows[0], "cache / dense") == "1.000"  # allocated bytes over the dense model's allocated bytes
    for r in rows:  # the measured fill, of the slots allocated: the per-type column's numerators and denominators
        fill = re.findall(r"(\d+)/(\d+)", cell(r, "stored / slots per head type"))
        assert int(cell(r, "KV entries stored (measured)")) == sum(int(n) for n, _ in fill)
        assert int(cell(r, "slots allocated")) == sum(int(c) for _, c in fill)
    assert int(cell(rows[0], "KV entries stored (measured)")) == 9 * (40 + 3)  # dense: every head keeps every token
    assert int(cell(rows[1], "KV entries stored (measured)")) < int(cell(rows[1], "slots allocated"))  # MoSA: fewer


def test_decode_feeds_each_new_token_at_its_own_position() -> None:
    """Prefill at positions 0..L-1, then the i-th greedy step's token at position L + i."""
    import torch

    from bench.decode import configs, decode
    from lm.model import build_model

    model = build_model(configs(16, 8, 1, 20, 12, 4)["dense (9 heads)"]).eval()
    positions = []

    def step(tokens, pos, cache):
        positions.append(pos.tolist())
        return model(tokens, pos, cache)

    with torch.no_grad():
        decode(model, torch.randint(0, 20, (2, 8)), 4, step)
    assert positions == [[[t], [t]] for t in range(8, 12)]


def test_report_states_the_real_command_and_machine(tmp_path, monkeypatch) -> None:
    """OMP_NUM_THREADS in the command only as it was set (it was always written as 1), and the CPU's model."""
    from flops.cli import hardware

    out = tmp_path / "decode.md"
    argv = ["--lengths", "16", "--new-tokens", "1", "--sparsity", "16", "--d-model", "16", "--head-dim", "8", "--layers",
            "1", "--vocab", "20", "--repeats", "1", "--out", str(out)]  # rho and MoSAIC's 17 within T = 17
    for threads, prefix in [(None, ""), ("2", "OMP_NUM_THREADS=2 ")]:
        if threads is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", threads)
        assert main(argv) == 0
        lines = out.read_text().splitlines()
        assert lines[2] == f"Command: `{prefix}python -m bench.decode {' '.join(argv)}`  "
        assert lines[3].startswith(f"Machine: {hardware('cpu')}, ") and "device cpu" in lines[3]
