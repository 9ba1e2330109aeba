"""Compile the stack's Triton kernels for a GPU architecture on a machine without a GPU (ahead of time).

    python -m bench.triton_aot --arch 90 --out bench/results/triton_aot_sm90.md
    python -m bench.triton_aot --arch 80 --quick --json        # tests/test_triton_aot.py's cases

Triton lowers a kernel to PTX and, with the ptxas it ships, to a cubin without a CUDA driver. This script
points Triton at a compile-only driver for sm_<arch> and runs the real launch code on CPU tensors: the fused
gathered-head forward and backward (heads/gathered_triton.py), the tiled gathered-head kernels (heads/gathered_tiled.py)
and the varlen kernels (heads/varlen_triton.py).
Every launch compiles its kernel and launches nothing. It shows that each kernel variant the dispatchers can
pick compiles for that architecture, and how much shared memory per block it needs. A launch that needs more
than the device has fails with Triton's OutOfResources. It cannot show that results are right (tests/, in
Triton's interpreter) or fast (bench/ on a GPU).

Cases: the gathered kernels at the largest heads heads/gathered_triton.fits lets through, in fp32 (exact dots, no
tensor cores) and bf16 (bf16 MMAs where both tiles are stored in bf16, TF32 ones on fp32 intermediates) at h' = 16,
32, 64, 128 and 256, and, with --quick off, smaller heads, MoSAIC's padding masks, deterministic mode and three heads
beyond the limits (to show why they are there). Tiled kernels at c = 256 slots (several tiles) at every h' they take,
in fp32 and bf16. Varlen kernels at h' = 64, 128 and 256 in fp32 and bf16. Registers and spills per thread come from
ptxas -v, the MMA instructions (by input type) and atomics (by memory order) from the PTX. Each process compiles for
one architecture (Triton caches a kernel's target per process).
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

from flops.cli import output_file, script_parser

# Opt-in shared memory per block (bytes), cudaDevAttrMaxSharedMemoryPerBlockOptin, of each architecture's GPUs.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
GPUS = {80: "A100", 86: "RTX 30xx / A40", 89: "RTX 40xx / L40S", 90: "H100 / H200", 100: "B200", 120: "RTX 50xx"}


@contextlib.contextmanager
def compile_only(arch: int, record: list[dict]) -> Iterator[None]:
    """Within: every Triton launch compiles its kernel for sm_<arch> and appends what it needs to `record`,
    launching nothing (outputs stay uninitialised)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import jit
    from triton.runtime.driver import driver

    class CompileOnlyDriver:
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

    launch, previous = jit.JITFunction.run, driver._active

    def compile_run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202 (Triton's signature)
        start = time.perf_counter()
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        seconds = round(time.perf_counter() - start, 1)
        record.append(dict(kernel=self.fn.__name__, shared=kernel.metadata.shared, warps=kernel.metadata.num_warps,
                           stages=kernel.metadata.num_stages, cubin="cubin" in kernel.asm, seconds=seconds,
                           mma=mma_inputs(kernel.asm["ptx"]), atomics=atomic_orders(kernel.asm["ptx"]),
                           **registers(kernel.asm["ptx"], arch)))
        return kernel

    driver.set_active(CompileOnlyDriver())
    jit.JITFunction.run = compile_run
    try:
        yield
    finally:
        jit.JITFunction.run = launch
        driver.set_active(previous)


def registers(ptx: str, arch: int) -> dict:
    """Registers per thread and spilled bytes (stores, loads) per thread of a kernel, from `ptxas -v` (Triton's
    ptxas) on its PTX; spilled registers go to slow local memory."""
    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target (\S+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        report = subprocess.run([get_ptxas(arch).path, f"-arch={target}", "-v", str(source), "-o", str(source) + ".o"],
                                capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return dict(registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)))


def _counted(pattern: str, ptx: str) -> dict[str, int]:
    """How often each value of `pattern`'s group occurs in the PTX, by value (static counts: a loop body counts
    once)."""
    return dict(sorted(Counter(re.findall(pattern, ptx)).items()))


def mma_inputs(ptx: str) -> dict[str, int]:
    """Tensor-core MMA instructions in a kernel's PTX (mma.sync, Hopper's wgmma), counted by their input type
    ("bf16", "tf32", ...): which of its dots run at the 16-bit rate."""
    return _counted(r"\b(?:wgmma\.mma_async|mma)\.sync\.aligned\.m\d+n\d+k\d+(?:\.row\.col)?\.\w+\.(\w+)\.", ptx)


def atomic_orders(ptx: str) -> dict[str, int]:
    """Atomic instructions in a kernel's PTX counted by memory order ("relaxed", "acq_rel", ...): on sm_90 an acq_rel
    add compiles to a fence, a returning atomic and an L1 invalidation, a relaxed one to a bare reduction (RED)."""
    return _counted(r"\b(?:atom|red)\.global\.(?:\w+\.)?(relaxed|acquire|release|acq_rel)\.", ptx)


def dispatched(case: dict, arch: int) -> bool:
    """Whether heads/gathered_triton.fits sends such gathered heads to the fused kernels on an sm_<arch> GPU."""
    from heads.gathered_triton import fits

    return fits(case["c"], case["d"], getattr(torch, case["dtype"]), SHARED_LIMIT[arch])


def gathered_cases(quick: bool, arch: int) -> list[dict]:
    """(c, h', dtype, masks, deterministic) of the gathered kernels: in each dtype, the largest heads `fits`
    admits on sm_<arch> at h' = 16 .. 256 (narrow heads: the c x c tiles bound them; wide ones: the c x h' tiles),
    then (full run) smaller heads, the mode variants and heads too large for every GPU or only for some."""
    case = lambda c, d, dtype, masks=False, deterministic=False: dict(  # noqa: E731
        c=c, d=d, dtype=dtype, masks=masks, deterministic=deterministic)
    largest = {(d, dt): max((c for c in range(1, 257) if dispatched(case(c, d, dt), arch)), default=None)
               for dt in ("float32", "bfloat16") for d in (16, 32, 64, 128, 256)}
    cases = [case(c, d, dt) for (d, dt), c in largest.items() if c is not None]
    if not quick:
        cases += [case(17, 32, dt) for dt in ("float32", "bfloat16")]
        cases += [case(32, 64, "bfloat16")]  # IsoFLOP Tiny's heads (rho = 32 at T = 1024)
        top = largest[(64, "bfloat16")]  # MoSAIC's masks and deterministic mode at the largest 16-bit heads of h' = 64
        cases += [case(top, 64, "bfloat16", masks=True), case(top, 64, "bfloat16", deterministic=True)]
        cases += [case(c, d, dt) for c, d, dt in ((64, 64, "float32"), (128, 64, "bfloat16"), (128, 128, "bfloat16"),
                                                  (256, 16, "bfloat16")) if case(c, d, dt) not in cases]
    return cases


def run_gathered(case: dict) -> None:
    """One forward and backward of the fused gathered-head op (heads/gathered_triton.py) on CPU tensors."""
    from heads.gathered_triton import gathered_heads_triton

    with deterministic(case["deterministic"]):
        y = gathered_heads_triton(*gathered_inputs(case))
        y.backward(torch.ones_like(y))


def gathered_inputs(case: dict) -> tuple:
    """Random (x, positions, idx, gate, W^QKV, W^O, rope, visible, self_only) of a gathered-head case, on the CPU."""
    from heads.rope import RotaryEmbedding
    from routing.selection import earliest_first

    B, T, h, H, c, d = 2, 4 * case["c"], 256, 2, case["c"], case["d"]
    dtype = getattr(torch, case["dtype"])
    leaf = lambda *shape: torch.randn(*shape, dtype=dtype).requires_grad_()  # noqa: E731
    x, gate, w, wo = leaf(B, T, h), leaf(B, H, c), leaf(3 * H * d, h), leaf(h, H * d)
    sel = earliest_first(torch.rand(B, H, T) < 0.3, c)
    masks = (sel.valid, sel.valid) if case["masks"] else (None, None)
    return x, torch.arange(T).expand(B, T), sel.idx, gate, w, wo, RotaryEmbedding(d), *masks


@contextlib.contextmanager
def deterministic(on: bool) -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def tiled_cases(quick: bool) -> list[dict]:
    """The tiled gathered-head kernels (heads/gathered_tiled.py) at c = 256 slots (several tiles; their tile size
    depends on h' and the dtype only), at every h' = 16 .. 256 they take in fp32 and bf16, and (full run) in
    deterministic mode at h' = 64 in bf16 (the scatter's acq_rel adds, one program walking every head)."""
    from heads.gathered_tiled import tiled_fits

    cases = [dict(c=256, d=d, dtype=dt, masks=False, deterministic=False) for dt in ("float32", "bfloat16")
             for d in (16, 32, 64, 128, 256) if tiled_fits(d, getattr(torch, dt))]
    return cases + ([] if quick else [dict(c=256, d=64, dtype="bfloat16", masks=False, deterministic=True)])


def run_tiled(case: dict) -> None:
    """One forward and backward of the tiled gathered-head path on CPU tensors (SDPA runs on the CPU between the
    compiled, unlaunched kernels)."""
    from heads.gathered_tiled import gathered_heads_tiled

    with deterministic(case["deterministic"]):
        gathered_heads_tiled(*gathered_inputs(case)).sum().backward()


def varlen_cases() -> list[dict]:
    return [dict(d=d, dtype=dt) for d in (64, 128, 256) for dt in ("float32", "bfloat16")]


def run_varlen(case: dict) -> None:
    """Forward and backward of the Triton varlen kernels (heads/varlen_triton.py) on two segments."""
    from heads.varlen import Segments
    from heads.varlen_triton import TritonVarlen

    dtype, d = getattr(torch, case["dtype"]), case["d"]
    seg = Segments.from_counts(torch.tensor([40, 70]), torch.tensor([64, 33]))
    q, k, v = (torch.randn(n, d, dtype=dtype) for n in (110, 97, 97))
    kernels = TritonVarlen()
    out, lse = kernels.forward(q, k, v, seg, d**-0.5)
    kernels.backward(torch.randn_like(out), q, k, v, out, lse, seg, d**-0.5)


def compile_all(arch: int, quick: bool) -> list[dict]:
    """One row per compiled kernel: the case, the kernel, shared bytes, warps, stages, cubin, seconds, whether
    the dispatcher sends such heads to it, ok (a cubin within the shared-memory limit)."""
    rows = []
    for family, cases, runner in (("gathered", gathered_cases(quick, arch), run_gathered),
                                  ("tiled", tiled_cases(quick), run_tiled), ("varlen", varlen_cases(), run_varlen)):
        for case in cases:
            record: list[dict] = []
            with compile_only(arch, record):
                runner(case)
            taken = family != "gathered" or dispatched(case, arch)
            for r in record:
                ok = r["cubin"] and r["shared"] <= SHARED_LIMIT[arch]
                rows.append(dict(arch=arch, family=family, **case, **r, dispatched=taken, ok=ok))
    return rows


def format_table(rows: list[dict], arch: int, command: str) -> str:
    import triton

    limit = SHARED_LIMIT[arch]
    lines = [f"# Triton kernels compiled for sm_{arch} ({GPUS.get(arch, 'GPU')}) without a GPU (bench/triton_aot.py)", "",
             f"Command: `{command}`  ",
             f"Machine: {platform.machine()} CPU, no GPU; Python {platform.python_version()}, torch {torch.__version__}, "
             f"triton {triton.__version__}  ",
             f"Shared-memory limit per block on sm_{arch}: {limit} bytes ({limit / 1024:.0f} KB). Registers and spills "
             "per thread from `ptxas -v`; MMA instructions = tensor-core instructions in the PTX by input type "
             "(static counts: a loop body counts once; none = FMA dots, e.g. exact fp32); atomics = atomic "
             "instructions by memory order (acq_rel fences every add). ok = compiled to a cubin "
             "and within that limit. dispatched = the stack sends such heads to this kernel (gathered: "
             "heads/gathered_triton.fits; larger heads of h' <= 256 in 16 bits, 128 in fp32, run the tiled kernels, "
             "heads/gathered_tiled.py, and wider ones the lean PyTorch path).", "",
             "| family | case | kernel | dispatched | shared KB | warps | stages | registers | spill stores / loads B "
             "| MMA instructions by input type | atomics by memory order | compile s | ok |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---|---|---:|---|"]
    for r in rows:
        if r["family"] in ("gathered", "tiled"):
            case = f"c={r['c']} h'={r['d']} {r['dtype']}" + (" masks" if r["masks"] else "") + (
                " deterministic" if r["deterministic"] else "")
        else:
            case = f"h'={r['d']} {r['dtype']}"
        lines.append(f"| {r['family']} | {case} | {r['kernel']} | {'yes' if r['dispatched'] else 'no'} | "
                     f"{r['shared'] / 1024:.0f} | {r['warps']} | {r['stages']} | {r['registers']} | "
                     f"{r['spill_stores']} / {r['spill_loads']} | "
                     f"{', '.join(f'{kind} {n}' for kind, n in r['mma'].items()) or '-'} | "
                     f"{', '.join(f'{order} {n}' for order, n in r['atomics'].items()) or '-'} | {r['seconds']} | "
                     f"{'yes' if r['ok'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT), help="compute capability x10")
    parser.add_argument("--quick", action="store_true", help="only the largest heads the dispatcher admits")
    parser.add_argument("--json", action="store_true", help="print one JSON object per compiled kernel")
    parser.add_argument("--out", type=output_file, help="write a markdown table here")
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels: set before heads/ (and so triton.jit) is imported
    rows = compile_all(args.arch, args.quick)
    table = format_table(rows, args.arch, "python -m bench.triton_aot " + " ".join(sys.argv[1:] if argv is None else argv))
    print("\n".join(json.dumps(r) for r in rows) if args.json else table)
    if args.out:
        args.out.write_text(table)
    return 0 if all(r["ok"] for r in rows if r["dispatched"]) else 1


if __name__ == "__main__":
    sys.exit(main())
