"""bench/heads.py: every variant is FLOP-matched to the dense budget (within one head's cost) and its worker
runs a forward + backward and reports time and memory."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from bench.heads import VARIANTS, matched_count, worker
from flops.formulas import group_cost


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_is_flop_matched_and_runs(variant: str) -> None:
    args = argparse.Namespace(d_model=32, head_dim=8, dense_heads=2, sparsity=4)
    T = 256  # the variants' default options fit it (local's window of 256 tokens is refused at any shorter T)
    budget = group_cost("dense", 32, 8, T, 2).flops
    count, flops, options = matched_count(variant, T, args)
    head_type = VARIANTS[variant][0]
    per_head = group_cost(head_type, 32, 8, T, 1, options).flops
    assert count >= 1 and flops <= budget < flops + per_head, (count, flops, budget)
    assert ("sparsity" in options) == (head_type in ("mosa", "mosaic", "fixed", "routing"))
    out = worker(dict(type=head_type, options=options, count=count, T=T, d_model=32, head_dim=8, batch=2,
                      repeats=1, device="cpu"))
    assert out["seconds"] > 0 and out["grad_bytes"] > 0 and out["saved_bytes"] > 0


def test_main_writes_a_table_with_time_and_memory_from_separate_workers(tmp_path) -> None:
    """The CLI end to end on CPU: a timed worker and a memory worker (fixed glibc mmap threshold) per variant."""
    from bench.heads import main

    out = tmp_path / "heads.md"
    argv = ["--T", "64", "--d-model", "32", "--head-dim", "8", "--dense-heads", "2", "--repeats", "1",
            "--variants", "dense", "mita", "--out", str(out)]
    assert main(argv) == 0
    assert f"python -m bench.heads {' '.join(argv)}`" in out.read_text()  # the arguments given, not pytest's
    rows = [line.split("|") for line in out.read_text().splitlines() if line.startswith("| 64 |")]
    assert [r[2].strip() for r in rows] == ["dense", "mita"]
    # ms, saved MiB (> 0); peak MiB only parses to a number: an RSS rise, which may be 0 for so small a step
    assert all(float(r[5]) > 0 and math.isfinite(float(r[7])) and float(r[11]) > 0 for r in rows)
    assert "MALLOC_MMAP_THRESHOLD_=131072" in out.read_text()


def test_memory_worker_runs_with_the_fixed_mmap_threshold() -> None:
    """run_worker passes the environment to the fresh process: the memory worker sees the fixed threshold, the
    timed worker the caller's environment (normally glibc's default)."""
    import os

    from bench.heads import run_worker
    from flops.cli import CPU_MEMORY_ENV

    spec = dict(type="dense", options={}, count=1, T=16, d_model=16, head_dim=8, batch=1, repeats=0, device="cpu")
    assert run_worker(spec, CPU_MEMORY_ENV)["mmap_threshold"] == "131072"
    assert run_worker(spec)["mmap_threshold"] == os.environ.get("MALLOC_MMAP_THRESHOLD_")


def test_core_variants_force_their_gathered_head_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """mosa-lean is mosa-threshold inside heads.gathered.fused_disabled() (on a GPU: the lean core instead of the
    Triton kernels), mosa-tiled inside whole_head_disabled() (the tiled kernels for every head), mosa-column-grid
    inside heads.gathered_triton.column_loop_disabled() (the scatter's earlier grid), to compare them; every other
    variant, and the code after the block, has every switch on. The switches hold in the backward pass too (the
    scatter's grid is chosen at each launch, the backward's as well)."""
    import heads.gathered as gathered
    import heads.gathered_lean as gathered_lean
    import heads.gathered_triton as gathered_triton
    from bench.heads import CORES, VARIANTS, worker

    def switches() -> tuple[bool, bool, bool]:
        return gathered._FUSED.on, gathered._WHOLE_HEAD.on, gathered_triton._COLUMN_LOOP.on

    seen: list[tuple[bool, bool, bool]] = []
    passes: list[str] = []
    lean, backward = gathered.gathered_heads_lean, gathered_lean.lean_backward
    monkeypatch.setattr(gathered, "gathered_heads_lean",
                        lambda *a, **k: seen.append(switches()) or passes.append("fwd") or lean(*a, **k))
    monkeypatch.setattr(gathered_lean, "lean_backward",
                        lambda *a, **k: seen.append(switches()) or passes.append("bwd") or backward(*a, **k))
    assert CORES == {"mosa-lean": "lean", "mosa-tiled": "tiled", "mosa-column-grid": "column-grid"}
    assert all(VARIANTS[variant] == VARIANTS["mosa-threshold"] for variant in CORES)
    for core, expected in ((None, (True, True, True)), ("lean", (False, True, True)), ("tiled", (True, False, True)),
                           ("column-grid", (True, True, False))):
        seen.clear()
        passes.clear()
        spec = dict(type="mosa", options={"sparsity": 4}, count=2, T=32, d_model=16, head_dim=8, batch=1, repeats=1,
                    device="cpu", core=core)
        worker(spec)
        assert {"fwd", "bwd"} <= set(passes) and set(seen) == {expected}, core
        assert switches() == (True, True, True)
    with pytest.raises(RuntimeError), gathered.fused_disabled():
        raise RuntimeError
    assert gathered._FUSED.on  # restored however the block ends


def test_saved_bytes_counts_what_backward_keeps() -> None:
    """saved_bytes: a dense group keeps at least q, k, v and the attention output ([B, T, h'] each per head) and
    nothing of the parameters or the input; a group under no_grad keeps nothing."""
    from bench.heads import saved_bytes
    from heads import GroupContext, head_class, make_options

    ctx = GroupContext(32, 8, 64)
    group = head_class("dense")(ctx, 2, make_options("dense", {}, ctx))
    x, positions = torch.randn(3, 64, 32, requires_grad=True), torch.arange(64).expand(3, 64)
    per_tensor = 3 * 64 * 2 * 8 * 4  # [B, T, H*h'] fp32
    assert saved_bytes(group, x, positions) >= 4 * per_tensor
    with torch.no_grad():
        assert saved_bytes(group, x, positions) == 0


@pytest.mark.parametrize("head_type,options", [("dense", {}), ("mosa", {"sparsity": 4})])
def test_saved_bytes_leave_out_autocast_copies_of_the_weights(head_type: str, options: dict) -> None:
    """Under autocast every weight is cast to bf16 and the copy saved for backward: a parameter in another dtype, not
    the implementation's activations (a MoSA group at equal FLOPs has ~55x dense's parameters, so the copies would
    dominate its GPU column). Exactly 2 bytes per parameter are left out; the input's bf16 copies stay counted."""
    from bench.heads import saved_bytes, saved_storages
    from tests.head_checks import make_group

    group = make_group(head_type, options, 32, count=4).train()
    x, positions = torch.randn(2, 32, 32, requires_grad=True), torch.arange(32).expand(2, 32)
    params = tuple(group.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        without, everything = saved_bytes(group, x, positions), sum(saved_storages(group, x, positions, (x, *params)))
    assert everything - without == 2 * sum(p.numel() for p in params)  # the input's bf16 copies are activations
    assert without > 0


def test_saved_bytes_count_only_what_the_pass_leaves_saved() -> None:
    """An intermediate saved by a branch the forward pass drops is freed with it: not counted (counting at save time
    did, unless a later tensor reused its memory, so MoSAIC's figure moved between runs)."""
    import torch

    from bench.heads import saved_bytes

    class Dropping(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            ((x + 1) * self.w).sum()  # the product saves the [1000, 4] x + 1, then the branch is dropped
            return x * self.w  # saves x (excluded) and w (excluded): nothing counted

    x = torch.randn(1000, 4, requires_grad=True)
    assert saved_bytes(Dropping(), x, torch.zeros(1)) == 0


def test_table_names_the_cpu_model_and_the_command() -> None:
    """The Machine line names the CPU's model and cores (was platform.processor(), often just "x86_64")."""
    from bench.heads import format_table
    from flops.cli import hardware

    args = argparse.Namespace(d_model=32, head_dim=8, dense_heads=2, sparsity=4, batch=1, tokens=None, repeats=1,
                              rounds=1, device="cpu")
    lines = format_table([], args, "python -m bench.heads --T 64").splitlines()
    assert lines[2].startswith(f"Machine: {hardware('cpu')}, ")


def test_table_ratios_are_each_variant_over_dense_at_its_own_T() -> None:
    """time, peak, peak − grads and saved of a variant, each divided by the dense row of the same T."""
    from bench.heads import format_table

    args = argparse.Namespace(d_model=32, head_dim=8, dense_heads=2, sparsity=4, batch=1, tokens=None, repeats=1,
                              rounds=1, device="cpu")

    def row(T: int, variant: str, seconds: float, peak: int, grad: int, saved: int) -> dict:  # sizes in MiB
        return dict(T=T, variant=variant, heads=2, gflops=1.0, seconds=seconds, peak_bytes=peak * 2**20,
                    grad_bytes=grad * 2**20, saved_bytes=saved * 2**20)

    rows = [row(64, "dense", 0.010, 40, 8, 16), row(64, "mosa", 0.020, 30, 4, 4),
            row(128, "dense", 0.040, 100, 8, 64), row(128, "mosa", 0.010, 50, 4, 32)]
    table = [line.split("|")[1:-1] for line in format_table(rows, args, "cmd").splitlines()
             if line.startswith(("| 64 |", "| 128 |"))]
    ratios = [[c.strip() for c in (r[5], r[7], r[9], r[11])] for r in table]
    assert ratios == [["1.00"] * 4, ["2.00", "0.75", "0.81", "0.25"],  # (30 - 4) / (40 - 8) = 0.8125
                      ["1.00"] * 4, ["0.25", "0.50", "0.50", "0.50"]]  # (50 - 4) / (100 - 8) = 0.5


def test_cpu_memory_is_measured_by_a_worker_with_the_fixed_mmap_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_all: each timed worker is followed by a memory worker (repeats 0) run with CPU_MEMORY_ENV, and the
    row's peak is that worker's."""
    import bench.heads as heads
    from flops.cli import CPU_MEMORY_ENV

    calls = []

    def run_worker(spec: dict, env: dict | None = None) -> dict:
        calls.append((spec["repeats"], env))
        return dict(seconds=1.0, peak_bytes=7 if env else 3, grad_bytes=1, saved_bytes=1)

    monkeypatch.setattr(heads, "run_worker", run_worker)
    args = argparse.Namespace(T=[64], variants=["dense"], d_model=32, head_dim=8, dense_heads=2, sparsity=4, batch=1,
                              tokens=None, repeats=5, rounds=1, device="cpu")
    rows = heads.measure_all(args)
    assert calls == [(5, None), (0, CPU_MEMORY_ENV)] and rows[0]["peak_bytes"] == 7


def test_tokens_per_step_sets_each_lengths_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """--tokens N: every T runs max(1, N // T) sequences (training's 65536 tokens: batch 64 at T = 1024, 8 at 8192),
    its FLOP column counts that batch, and the setup line states the batch at each T; --batch with it is refused."""
    import bench.heads as heads

    batches = []

    def run_worker(spec: dict, env: dict | None = None) -> dict:
        if env is None:  # the timed worker (the memory worker after it runs the same spec)
            batches.append((spec["T"], spec["batch"]))
        return dict(seconds=1.0, peak_bytes=1, grad_bytes=1, saved_bytes=1)

    monkeypatch.setattr(heads, "run_worker", run_worker)
    args = argparse.Namespace(T=[64, 256, 512], variants=["dense"], d_model=32, head_dim=8, dense_heads=2, sparsity=4,
                              batch=1, tokens=300, repeats=1, rounds=1, device="cpu")
    rows = heads.measure_all(args)
    assert batches == [(64, 4), (256, 1), (512, 1)]  # 300 // 512 = 0 -> one sequence
    per_sequence = heads.matched_count("dense", 64, args)[1]
    assert rows[0]["gflops"] == pytest.approx(4 * per_sequence / 1e9)
    assert "batch 4 at T = 64, 1 at T = 256, 1 at T = 512 (max(1, 300 // T))" in heads.format_table(rows, args, "c")
    with pytest.raises(SystemExit):
        heads.main(["--batch", "2", "--tokens", "300"])
