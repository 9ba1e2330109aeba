"""The Triton kernels compile for A100 (sm_80), RTX 30xx / A6000 (sm_86; sm_89's RTX 40xx / L40S have the same 99 KB
per block) and H100 (sm_90) on this GPU-less machine (bench/triton_aot.py):
every kernel, at the largest heads the dispatcher sends it, becomes a cubin within the GPU's shared memory per
block, spilling at most 4 KB of registers per thread. Before heads/gathered_triton.fits, heads of c = 128 slots
(rho = 8 at T = 1024) went to a backward kernel needing 256-272 KB on H100 (227 KB): Triton's OutOfResources at
the first backward. Since the backward takes RoPE's partner columns from registers it needs 192 KB there, and
`fits` sends them to the kernels on H100 only (A100: 163 KB). sm_86 is the tightest: the forward runs two pipeline
stages (heads/gathered_triton.FWD_STAGES) so that the largest fp32 head fits its 99 KB (three needed 108 KB).
Exact fp32 kernels use no tensor cores; in bf16 the dots of stored 16-bit tiles are bf16 MMAs (the gathered kernels'
X W^QKV and dY W^O ran as TF32 MMAs of upcast tiles, at half the rate, before 2026-11-30). The scatter's atomic adds
are relaxed (before 2026-11-30 acq_rel: on sm_90 a MEMBAR.ALL.GPU, a returning ATOMG and a CCTL.IVALL L1 invalidation
per add instruction, where relaxed adds compile to bare REDG reductions). The tiled kernels (heads/gathered_tiled.py,
heads of any number of slots) compile at 256 slots for every h' they take; their slot loops prefetch one tile
(heads/gathered_triton.TILE_STAGES: three stages took the backward's scatter to 176 KB on sm_90)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytest.importorskip("triton")

# shared memory per block a kernel may opt into (CUDA programming guide, compute capabilities table): 163 KB on
# A100, 99 KB on sm_86, 227 KB on H100; written here, not read from the module under test
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 90: 227 * 1024}
KERNELS = {("gathered", k) for k in ("_attn_fwd", "_attn_bwd", "_scatter", "_weight_grad")} | {
    ("tiled", k) for k in ("_project", "_out_grad", "_scatter", "_weight_grad")} | {
    ("varlen", k) for k in ("_fwd", "_bwd_dkdv", "_bwd_dq")}


def test_kernels_compile_for_sm80_sm86_and_sm90_within_shared_memory(tmp_path: Path) -> None:
    runs = {arch: subprocess.Popen([sys.executable, "-m", "bench.triton_aot", "--arch", str(arch), "--quick", "--json"],
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / f"sm{arch}")})  # a real compile
            for arch in SHARED_LIMIT}  # at once: ~45 s of one core each
    for arch, run in runs.items():
        out, err = run.communicate(timeout=1200)
        assert run.returncode == 0, f"sm_{arch}: {err[-3000:]}"
        rows = [json.loads(line) for line in out.splitlines()]
        assert {(r["family"], r["kernel"]) for r in rows} == KERNELS
        slots = 128 if arch == 90 else 64  # H100's 227 KB per block take 16-bit heads of 128 slots at h' <= 64
        assert {(r["c"], r["d"], r["dtype"]) for r in rows if r["family"] == "gathered"} == {
            (slots, 16, "bfloat16"), (slots, 32, "bfloat16"), (slots, 64, "bfloat16"), (32, 128, "bfloat16"),
            (16, 256, "bfloat16"),
            (32, 16, "float32"), (32, 32, "float32"), (32, 64, "float32"), (16, 128, "float32")}
        # the tiled kernels at 256 slots (several tiles) of every h' they take: up to 256 in bf16, 128 in fp32
        assert {(r["c"], r["d"], r["dtype"]) for r in rows if r["family"] == "tiled"} == {
            (256, d, dt) for d in (16, 32, 64, 128, 256) for dt in ("bfloat16", "float32") if (d, dt) != (256, "float32")}
        assert {r["dtype"] for r in rows if r["family"] == "varlen"} == {"float32", "bfloat16"}
        for r in rows:
            assert r["cubin"] and r["dispatched"], r
            assert r["shared"] <= SHARED_LIMIT[arch], f"sm_{arch}: {r}"
            assert r["spill_stores"] <= 4096, f"sm_{arch}: {r}"  # A100 bf16 at c = 64: 1.8 KB; fp32 at c = 64: 70 KB
            if r["dtype"] == "float32":  # exact fp32 dots (torch's default matmul precision): FMA, no tensor cores
                assert not r["mma"], f"sm_{arch}: {r}"
            elif (r["family"], r["kernel"]) in {("gathered", "_attn_fwd"), ("gathered", "_attn_bwd"),
                                                ("tiled", "_project"), ("tiled", "_out_grad"), ("varlen", "_fwd")}:
                # 16-bit tiles as stored: X W^QKV, dY W^O (and varlen's Q K^T) at the 16-bit MMA rate
                assert r["mma"].get("bf16", 0) > 0, f"sm_{arch}: {r}"
            # the scatters' adds (default mode: the test's set) are relaxed: no fence per add; nothing else is atomic
            assert set(r["atomics"]) == ({"relaxed"} if r["kernel"] == "_scatter" else set()), f"sm_{arch}: {r}"
