"""bench/resources.py end to end at toy size: each config in its own worker, and with
--activation-checkpointing each config measured a second time with checkpointed blocks, next to it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench import resources

ROOT = Path(__file__).resolve().parents[1]


def test_activation_checkpointing_columns(tmp_path: Path) -> None:
    out = tmp_path / "res.md"
    code = resources.main(["--config", str(ROOT / "configs" / "quickstart.yaml"), "--seq-len", "32", "--batch", "1",
                           "--steps", "1", "--warmup", "0", "--activation-checkpointing", "--out", str(out)])
    assert code == 0
    head, rule, *rows = out.read_text().split("\n\n", 1)[1].splitlines()
    assert head.split(" | ")[1:3] == ["quickstart", "quickstart (activation checkpointing)"]
    params = next(r for r in rows if r.startswith("| Parameters (M)")).rstrip(" |").split(" | ")
    assert params[1] == params[2] and params[3] == "+0.0%"  # the same model, measured twice


def test_the_checkpointing_worker_checkpoints_every_block(monkeypatch) -> None:  # noqa: ANN001
    """measure(checkpointing=True) runs every block through lm/checkpointing.py on every step (and False never)."""
    import lm.model
    from lm.config_io import load_config

    calls: list[int] = []
    original = lm.model.checkpointed
    monkeypatch.setattr(lm.model, "checkpointed", lambda *args: calls.append(1) or original(*args))
    cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"), "model.seq_len=32").model
    for on in (False, True):
        calls.clear()
        resources.measure(cfg, batch=1, steps=2, warmup=1, device="cpu", threads=1, checkpointing=on)
        assert len(calls) == (3 * cfg.n_layers if on else 0)  # 3 training steps; decoding is never checkpointed


def test_rounds_combine_each_rounds_own_memory_above_import() -> None:
    """The memory above import is a median of each round's own peak minus that round's import RSS, not the median
    peak minus the first round's RSS (rounds in fresh processes differ in both)."""
    rounds = [{"step_ms": ms, "tokens_per_s": 1000 / ms, "peak_mem_bytes": peak, "mem_above_import": above}
              for ms, peak, above in ((10.0, 100, 60), (20.0, 200, 50), (30.0, 150, 55))]
    r = resources.combine(rounds)
    assert (r["step_ms"], r["peak_mem_bytes"], r["mem_above_import"]) == (20.0, 150, 55)
    assert r["tokens_per_s"] == 1000 / 20.0
    assert resources.combine([{**rounds[0], "mem_above_import": None}])["mem_above_import"] is None  # CUDA


def test_cpu_memory_comes_from_a_process_whose_rss_follows_the_live_tensors(monkeypatch) -> None:  # noqa: ANN001
    """On CPU each config's peak memory is measured again in a second worker with glibc's fixed mmap threshold
    (flops.cli.CPU_MEMORY_ENV) over two steps, and the table's memory is that worker's; time and KV stay the timing
    worker's. On CUDA (max_memory_allocated) one worker does both."""
    from flops.cli import CPU_MEMORY_ENV
    from lm.config_io import load_config

    calls = []

    def worker(module, spec, name, env=None):  # noqa: ANN001, ANN202
        calls.append((spec["steps"], spec["warmup"], env))
        memory = env == CPU_MEMORY_ENV
        return {"step_ms": 5.0 if memory else 7.0, "peak_mem_bytes": 1 if memory else 2,
                "mem_above_import": 3 if memory else 4, "kv_stored": None if memory else 9}

    monkeypatch.setattr(resources, "run_in_worker", worker)
    cfg = load_config(str(ROOT / "configs" / "quickstart.yaml")).model
    args = resources.argparse.Namespace(batch=1, steps=4, warmup=2, device="cpu", threads=1)
    r = resources.run_worker("q", cfg, args)
    assert calls == [(4, 2, None), (1, 1, CPU_MEMORY_ENV)]
    assert (r["step_ms"], r["peak_mem_bytes"], r["mem_above_import"], r["kv_stored"]) == (7.0, 1, 3, 9)
    calls.clear()
    resources.run_worker("q", cfg, resources.argparse.Namespace(**{**vars(args), "device": "cuda"}))
    assert calls == [(4, 2, None)]


def test_a_per_layer_mix_is_measured_and_shown_per_layer(tmp_path: Path) -> None:
    """model.layer_heads reaches the worker (its config travels as JSON, whose keys are strings: layer "1" was
    refused) and the table shows every layer's mix and KV (layer 0's alone before)."""
    config = tmp_path / "hybrid.yaml"
    mixes = ("    - {type: dense, count: 5}\n  layer_heads:\n"
             "    1: [{type: dense, count: 2}, {type: local, count: 3, options: {window: 8}}]\n")
    config.write_text((ROOT / "configs" / "quickstart.yaml").read_text().replace("    - {type: dense, count: 5}\n", mixes))
    out = tmp_path / "res.md"
    assert resources.main(["--config", str(config), "--seq-len", "32", "--batch", "1", "--steps", "1", "--warmup", "0",
                           "--out", str(out)]) == 0
    rows = {r.split(" | ")[0].strip("| "): r.rstrip(" |").split(" | ")[1] for r in out.read_text().splitlines()
            if r.startswith("| ")}
    assert rows["Heads per layer"] == "5 dense; layer 1: 2 dense + 3 local"
    assert rows["KV Total per layer (Table 2)"] == "160 / 88 / 160 / 160"  # 5 x 32; 2 x 32 + 3 x 8


def test_the_change_column_is_each_config_against_the_first() -> None:
    """+20.0% for 120 ms against 100, -50.0% for half the memory, the first config's own column without a change;
    unscaled rows (head counts, text) get no change."""
    first = {"name": "dense", "heads": "9 dense", "step_ms": 100.0, "peak_mem_bytes": 2e9}
    second = {"name": "mosa", "heads": "4 dense + 17 mosa", "step_ms": 120.0, "peak_mem_bytes": 1e9}
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in resources.table([first, second]).splitlines()[2:]]
    rows = {label: rest for label, *rest in cells}
    assert rows["Wall-time/step (ms, median)"] == ["100.0", "120.0", "+20.0%"]
    assert rows["Peak memory (MB)"] == ["2000", "1000", "-50.0%"]
    assert rows["Heads per layer"] == ["9 dense", "4 dense + 17 mosa", ""]


def test_the_isoflop_pair_is_the_solvers_point() -> None:
    """--pair isoflop-tiny (measured by bench/gpu_campaign.sh) is MoSA Table 5's IsoFLOP Tiny point as this repository's
    solver finds it: 4 dense + 276 MoSA heads at rho 32 in place of the 9 dense heads."""
    from flops.isoflop import solve

    (_, dense), (name, hybrid) = resources.PAIRS["isoflop-tiny"]()
    point = solve(dense, "mosa", 32, 4)
    assert name == f"tiny 4+{point.sparse_heads} MoSA rho=32" and point.sparse_heads == 276
    assert [(g.type, g.count, g.options) for g in hybrid.heads] == [("dense", 4, {}), ("mosa", 276, {"sparsity": 32})]


@pytest.mark.slow
def test_the_table2_pair_end_to_end(tmp_path: Path) -> None:
    """--pair table2-tiny, as bench/gpu_campaign.sh's timing step runs it (at T = 128 here): the Tiny dense baseline
    (9 heads) beside 4 dense + 17 MoSA heads at rho 32, each in its own worker; parameters as the models have them,
    KV per layer as Table 2 counts it (9 T and 4 T + 17 k, k = T / rho)."""
    from lm.model import build_model

    out = tmp_path / "t2.md"
    assert resources.main(["--pair", "table2-tiny", "--seq-len", "128", "--batch", "1", "--steps", "1", "--warmup", "0",
                           "--out", str(out)]) == 0
    rows = {r.split(" | ")[0].strip("| "): r.rstrip(" |").split(" | ")[1:] for r in out.read_text().splitlines()
            if r.startswith("| ")}
    assert rows[""][:2] == ["tiny dense", "tiny 4+17 MoSA rho=32"]
    assert rows["Heads per layer"][:2] == ["9 dense", "4 dense + 17 mosa"]
    assert rows["KV Total per layer (Table 2)"][:2] == [f"{9 * 128:,}", f"{4 * 128 + 17 * 4:,}"]
    params = [sum(p.numel() for p in build_model(dataclasses.replace(cfg, seq_len=128)).parameters()) / 1e6
              for _, cfg in resources.PAIRS["table2-tiny"]()]
    assert rows["Parameters (M)"][:2] == [f"{p:.2f}" for p in params]
