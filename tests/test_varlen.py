"""Packed varlen attention and its log-sum-exp merge (heads/varlen.py), the Triton kernels of the same
contract (heads/varlen_triton.py), and MiTA's routed experts through it (heads/mita.py `_routed_varlen`,
the path MiTA takes on CUDA).

`TorchVarlen` is the reference of the contract; its backward takes the *merged* output and log-sum-exp
exactly as flash-attn's and the Triton backward do, so the merge tests check the identity those paths
rely on. The Triton kernels run under TRITON_INTERPRET=1 on CPU (set by conftest.py when there is no
GPU) and for real on CUDA; flash-attn's kernels only on CUDA with flash-attn installed."""
from __future__ import annotations

import contextlib
import os
import sys
import types

import pytest
import torch
from tests.conftest import TRITON_DEVICE, TRITON_KERNELS
from tests.head_checks import REL_RMS_TOL, assert_match, fast_vs_reference, make_group

from heads import varlen
from heads.varlen import Segments, TorchVarlen, flash_backend, merge_varlen

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton kernels on CPU tensors, in Python (conftest.py)

TOL = 1e-12  # float64: max-abs error relative to the reference's max-abs, outputs and all gradients


def _packed(q_counts: list[int], k_counts: list[int], d: int, dtype: torch.dtype = torch.float64, device: str = "cpu"):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(c), d, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
               for c in (q_counts, k_counts, k_counts))
    seg = Segments.from_counts(torch.tensor(q_counts, device=device), torch.tensor(k_counts, device=device))
    return q, k, v, seg


def _block_diagonal(q_counts: list[int], k_counts: list[int], device: str = "cpu") -> torch.Tensor:
    """[Nq, Nk] bool: query row and key row belong to the same segment."""
    qs, ks = (torch.repeat_interleave(torch.arange(len(c)), torch.tensor(c)).to(device) for c in (q_counts, k_counts))
    return qs[:, None] == ks[None, :]


def _rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()


Q_COUNTS, K_COUNTS = [5, 0, 17, 1, 9], [3, 7, 20, 1, 33]  # an empty query segment, odd sizes


def test_torch_varlen_matches_block_diagonal_attention() -> None:
    """Forward (out, lse) against one masked softmax; the backward given (out, lse) against autograd."""
    q, k, v, seg = _packed(Q_COUNTS, K_COUNTS, 8)
    scale = 8**-0.5
    s = (q @ k.T * scale).masked_fill(~_block_diagonal(Q_COUNTS, K_COUNTS), float("-inf"))
    ref_out, ref_lse = s.softmax(-1) @ v, s.logsumexp(-1)
    out, lse = TorchVarlen().forward(q.detach(), k.detach(), v.detach(), seg, scale)
    assert _rel_max(out, ref_out) < TOL and _rel_max(lse, ref_lse) < TOL
    dout = torch.randn_like(out)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    grads = TorchVarlen().backward(dout, q.detach(), k.detach(), v.detach(), out, lse, seg, scale)
    for g, r in zip(grads, ref_grads):
        assert _rel_max(g, r) < TOL


@pytest.mark.parametrize("dtype,tol", [(torch.float64, TOL), (torch.bfloat16, 2e-2)])
def test_merge_is_one_softmax_over_both_key_sets(dtype: torch.dtype, tol: float) -> None:
    """Part A: each of N rows attends to its own 6 keys (a plain autograd computation); packed queries
    (a subset of the rows, in shuffled order) add their segment's keys. The merge must equal one softmax
    over the union, in output and in every gradient (part A's through its out and lse). bf16: the merge
    accumulates in float32; tolerance on relative RMS error for bf16 operands."""
    N, d, scale = sum(Q_COUNTS) + 4, 8, 0.4  # 4 rows with no packed part
    gen = torch.Generator().manual_seed(1)
    ka, va = (torch.randn(N, 6, d, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    q, k, v, seg = _packed(Q_COUNTS, K_COUNTS, d)
    rows = torch.randperm(N, generator=gen)[: sum(Q_COUNTS)]
    q_rows = torch.zeros(N, d, dtype=torch.float64).index_put((rows,), q)  # the packed query is row r's query

    def part_a(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        s_a = (q_rows.to(dtype)[:, None, :] * ka.to(dtype)).sum(-1) * scale  # [N, 6] part A logits
        return (s_a.softmax(-1)[..., None] * va.to(dtype)).sum(1), s_a.logsumexp(-1)

    merged = merge_varlen(*part_a(dtype), q.to(dtype), k.to(dtype), v.to(dtype), rows, seg, scale, TorchVarlen())
    s_b = (q_rows @ k.T * scale).masked_fill(
        ~torch.zeros(N, k.shape[0], dtype=torch.bool).index_put((rows,), _block_diagonal(Q_COUNTS, K_COUNTS)),
        float("-inf"))  # [N, Nk] each row's packed keys
    s_a = (q_rows[:, None, :] * ka).sum(-1) * scale
    p = torch.cat((s_a, s_b), -1).softmax(-1)  # one softmax over both key sets
    ref = (p[:, :6, None] * va).sum(1) + p[:, 6:] @ v
    cot = torch.randn_like(ref)
    inputs = (q, k, v, ka, va)
    fast = [merged, *torch.autograd.grad(merged, inputs, cot.to(dtype), retain_graph=True)]
    for name, a, b in zip(["out", "dq", "dk", "dv", "dka", "dva"], fast, [ref, *torch.autograd.grad(ref, inputs, cot)]):
        err = _rel_max(a.double(), b) if dtype == torch.float64 else _rel_rms(a.double(), b)
        assert err < tol, (name, err)


def _triton():
    from heads.varlen_triton import TritonVarlen

    return TritonVarlen()


MITA_CASES = [
    (100, {"block": 8, "k": 6}),
    (257, {"block": 16, "k": 300}),  # k > T: young experts have fewer valid keys than k
    (101, {"block": 8, "k": 5, "shared": False}),
    (100, {"block": 8, "k": 6, "local_blocks": 2}),
    (90, {"block": 8, "k": 6, "variant": "published"}),  # every query routed, merged with the shared expert alone
    (90, {"block": 8, "k": 6, "shared": False, "variant": "published"}),  # ... with an empty part (lse -inf)
]


def _force_backend(monkeypatch: pytest.MonkeyPatch, backend: varlen.VarlenBackend) -> list:
    calls: list = []
    monkeypatch.setattr(varlen, "cuda_backend", lambda q: calls.append(q.shape) or backend)
    return calls


@pytest.mark.parametrize("T,options", MITA_CASES)
def test_mita_routed_varlen_matches_reference(T: int, options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """MiTA (s = 1) with its routed experts as packed varlen segments (TorchVarlen standing in for the CUDA
    kernels) against the explicit-mask reference, float64: outputs, d/dx and all parameter gradients."""
    calls = _force_backend(monkeypatch, TorchVarlen())
    errors = fast_vs_reference(make_group("mita", {**options, "s": 1}, T, std=None, dtype=torch.float64), T)
    assert calls, "the varlen path was not taken"
    assert_match(errors, TOL, TOL)


@TRITON_KERNELS
@pytest.mark.parametrize("T,options", MITA_CASES)
def test_mita_routed_triton_matches_reference(T: int, options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through the Triton kernels (interpreted on CPU, compiled on a GPU), float32: relative RMS < 1e-5 and
    max-abs < 1e-4 (relative to the reference's max), as for every fp32 fast path (tests/head_checks.py)."""
    calls = _force_backend(monkeypatch, _triton())
    errors = fast_vs_reference(make_group("mita", {**options, "s": 1}, T, std=None).to(TRITON_DEVICE), T)
    assert calls, "the varlen path was not taken"
    assert_match(errors)


def test_flash_attn_before_2_7_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn 2.6's private varlen functions take window_size=(l, r) and return 8 values, not 4: FlashVarlen
    would fail there, so only 2.7 and later count as installed."""
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    for version, expected in (("2.6.3", (2, 6)), ("2.7.4.post1", (2, 7)), ("2.8.3", (2, 8)), ("3.0.0b1", (3, 0))):
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__=version))
        assert varlen.flash_version(interface) == expected
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace())
    assert varlen.flash_version(interface) == (0, 0)  # no version: not trusted
    assert varlen.flash_version(None) == (0, 0)


def _flash_installed(monkeypatch: pytest.MonkeyPatch, forward: object = None) -> types.ModuleType:
    """A stand-in flash-attn 2.8 interface (its varlen forward: `forward`) that heads/varlen.py sees as installed."""
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_varlen_forward = forward
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.8.3"))
    monkeypatch.setattr(varlen, "flash_attn_interface", lambda: interface)
    return interface


def test_cuda_backend_is_only_offered_where_it_can_run(capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert varlen.cuda_backend(torch.zeros(4, 8)) is None  # CPU: MiTA keeps its padded PyTorch path
    assert flash_backend(torch.zeros(4, 8)) is None  # CPU, fp32
    _flash_installed(monkeypatch)

    def cuda_like(d: int, dtype: torch.dtype = torch.bfloat16) -> types.SimpleNamespace:
        return types.SimpleNamespace(is_cuda=True, dtype=dtype, shape=(4, d))

    assert isinstance(flash_backend(cuda_like(64)), varlen.FlashVarlen)
    for q in (cuda_like(12), cuda_like(264), cuda_like(64, torch.float32)):  # head dim not a multiple of 8, > 256; fp32
        assert flash_backend(q) is None, q
    assert flash_backend(torch.zeros(4, 64, dtype=torch.bfloat16)) is None  # installed, but a CPU tensor
    if not CUDA:
        from bench.mita_varlen import main

        assert main(["--T", "64"]) == 2  # the benchmark times CUDA kernels only, and says so in one line
        assert capsys.readouterr().err.strip().count("\n") == 0


@pytest.mark.skipif(not CUDA, reason="the varlen kernels are offered on CUDA only; no GPU here")
def test_disabled_turns_the_cuda_kernels_off() -> None:
    q = torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")
    assert varlen.cuda_backend(q) is not None
    with varlen.disabled():
        assert varlen.cuda_backend(q) is None
    assert varlen.cuda_backend(q) is not None


def _backend(name: str, dtype: torch.dtype, d: int) -> varlen.VarlenBackend:
    if name == "triton":
        if dtype == torch.bfloat16 and INTERPRET:
            pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly; fp32 and fp16 are checked on CPU")
        if not (CUDA or INTERPRET):
            pytest.skip("no GPU for compiled Triton kernels, and TRITON_INTERPRET is off")
        return _triton()
    if not CUDA:
        pytest.skip("flash-attn varlen runs on CUDA only; no GPU here")
    backend = flash_backend(torch.zeros(1, d, dtype=dtype, device="cuda"))
    if backend is None:
        pytest.skip("flash-attn (>= 2.7) is not installed")
    return backend


# relative RMS error vs the float64 contract: bf16/fp16 operands; fp32 with exact fp32 dots (heads/dot_precision.py)
KERNEL_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-6}


@pytest.mark.parametrize("name,dtype,d", [("triton", torch.float32, 24), ("triton", torch.float32, 72),
                                          ("triton", torch.bfloat16, 64), ("triton", torch.float16, 64),
                                          ("flash", torch.bfloat16, 64), ("flash", torch.float16, 64)])
def test_kernels_match_torch_varlen(name: str, dtype: torch.dtype, d: int) -> None:
    """A backend's kernels against the float64 contract: forward out and lse, and the backward given the
    same (out, lse); empty, one-row and multi-block segments, head dims padded inside the kernel (24, 72); fp32 at
    h' = 72 (padded to 128) takes the kernels' 16-row blocks (heads/varlen_triton._meta). Triton in fp16 runs in the
    interpreter too (the 16-bit dots; rel RMS 2e-4 to 3e-4 there), bf16 on a GPU only."""
    backend = _backend(name, dtype, d)
    if name == "triton":
        from heads.varlen_triton import _meta

        assert _meta(torch.zeros(1, d, dtype=dtype))["BLOCK_M"] == (16 if (dtype, d) == (torch.float32, 72) else 32)
    q_counts, k_counts = [130, 0, 57, 1, 64, 3], [70, 9, 100, 1, 128, 40]
    q, k, v, seg = _packed(q_counts, k_counts, d, dtype, "cuda" if CUDA and not (name == "triton" and INTERPRET) else "cpu")
    q, k, v, scale, ref = q.detach(), k.detach(), v.detach(), d**-0.5, TorchVarlen()
    out, lse = backend.forward(q, k, v, seg, scale)
    ref_out, ref_lse = ref.forward(q.double(), k.double(), v.double(), seg, scale)
    dout = torch.randn_like(out)
    grads = backend.backward(dout, q, k, v, out, lse, seg, scale)
    ref_grads = ref.backward(dout.double(), q.double(), k.double(), v.double(), ref_out, ref_lse, seg, scale)
    for label, a, b in zip(["out", "lse", "dq", "dk", "dv"], [out, lse, *grads], [ref_out, ref_lse, *ref_grads]):
        assert a.dtype == (torch.float32 if label == "lse" else dtype), label
        assert _rel_rms(a.double(), b) < KERNEL_TOL[dtype], (label, _rel_rms(a.double(), b))


def test_flash_lse_of_a_row_without_keys_is_minus_inf(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn writes lse = +inf for a query row whose key segment is empty (its kernel's early exit); the merge
    would then give that row exp(inf - inf) = NaN. FlashVarlen returns the contract's -inf, so the row keeps part A."""
    def flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, **_):  # TorchVarlen's results, laid out as flash-attn's
        out, lse = TorchVarlen().forward(q[:, 0], k[:, 0], v[:, 0], Segments(cu_q, cu_k, max_q, max_k), _["softmax_scale"])
        return out[:, None], lse.masked_fill(lse == float("-inf"), float("inf"))[None], None, None

    backend = varlen.FlashVarlen(_flash_installed(monkeypatch, flash_forward))
    q, k, v, seg = _packed([2, 3], [0, 4], 8)
    out_a, lse_a = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    merged = merge_varlen(out_a, lse_a, q.detach(), k.detach(), v.detach(), torch.arange(5), seg, 0.5, backend)
    assert torch.equal(backend.forward(q, k, v, seg, 0.5)[1][:2], torch.full((2,), float("-inf"), dtype=torch.float64))
    assert torch.equal(merged[:2], out_a[:2]) and merged.isfinite().all()


def test_triton_launch_grid_takes_more_segments_than_cuda_grid_axis_1() -> None:
    """MiTA packs B * H * T / block segments (65,536 at B = 64, H = 16, T = 4096, block 64); CUDA refuses a
    launch grid over 65,535 on axes 1 and 2, so the segments go on axis 0 (recorded here, not launched)."""
    from heads import varlen_triton

    grids = []

    class Recorder:
        def __getitem__(self, grid: tuple) -> object:
            grids.append(grid)
            return lambda *args, **kwargs: None

    S = 70_000
    q = k = v = torch.zeros(S, 16)
    seg = Segments.from_counts(torch.ones(S, dtype=torch.long), torch.ones(S, dtype=torch.long))
    with pytest.MonkeyPatch.context() as mp:
        for kernel in ("_fwd", "_bwd_dkdv", "_bwd_dq"):
            mp.setattr(varlen_triton, kernel, Recorder())
        backend = varlen_triton.TritonVarlen()
        out, lse = backend.forward(q, k, v, seg, 1.0)
        backend.backward(q, q, k, v, out, lse, seg, 1.0)
    assert grids == [(S, 1)] * 3


def mita_runs(device: str, dtype: torch.dtype, cases: list[tuple[str, bool]]) -> list[list[torch.Tensor]]:
    """MiTA (b = 32, k = 48, s = 1, T = 300, one set of weights) per case (impl, varlen allowed) on `device` in
    `dtype`: [output, d/dx, every parameter gradient] in float64 on the CPU."""
    gen = torch.Generator().manual_seed(3)
    x, cot = torch.randn(2, 300, 128, generator=gen), torch.randn(2, 300, 128, generator=gen)
    positions = torch.arange(300, device=device).expand(2, 300)
    group = make_group("mita", {"block": 32, "k": 48, "s": 1}, 300, d_model=128, head_dim=32, std=None)
    group = group.to(device, dtype)
    results = []
    for impl, allow_varlen in cases:
        group.options.impl = impl
        xi = x.to(device, dtype).requires_grad_()
        with contextlib.nullcontext() if allow_varlen else varlen.disabled():
            y = group(xi, positions)
            grads = torch.autograd.grad((y * cot.to(device, dtype)).sum(), [xi, *group.parameters()])
        results.append([z.double().cpu() for z in (y, *grads)])
    return results


def backend_spy(monkeypatch: pytest.MonkeyPatch, backend: object = None) -> list:
    """Record what varlen.cuda_backend gives MiTA (or make it give `backend`)."""
    used: list = []
    real = varlen.cuda_backend
    monkeypatch.setattr(varlen, "cuda_backend", lambda q: used.append(backend or real(q)) or used[-1])
    return used


def test_varlen_and_grouped_paths_take_the_same_routing_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The design of the CUDA test below, checked on CPU with the PyTorch varlen backend: in bf16 the varlen
    path and the grouped path take the same routing decisions (computed by the same code before the paths
    part), so they differ only by arithmetic (< 2e-2 relative RMS), while the float64 reference differs by
    far more: bf16 rounding flips some top-k choices and moves those rows entirely."""
    used = backend_spy(monkeypatch, TorchVarlen())
    (varlen_run,) = mita_runs("cpu", torch.bfloat16, [("fast", True)])
    assert used and all(isinstance(b, TorchVarlen) for b in used)
    (grouped_run,) = mita_runs("cpu", torch.bfloat16, [("fast", False)])
    (reference,) = mita_runs("cpu", torch.float64, [("reference", False)])
    for a, b in zip(varlen_run, grouped_run):
        assert _rel_rms(a, b) < 2e-2
    assert _rel_rms(grouped_run[0], reference[0]) > 2e-2  # why the CUDA test compares paths, not the reference


@pytest.mark.skipif(not CUDA or INTERPRET,
                    reason="MiTA's CUDA path needs a GPU and compiled kernels (TRITON_INTERPRET unset)")
def test_mita_on_cuda_matches_grouped_path_and_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """MiTA's CUDA path (routed experts through flash-attn, or the Triton kernels without it). bf16: against
    the grouped path (`varlen.disabled()`) on the same GPU, weights and inputs, relative RMS error < 2e-2 on
    the output and all gradients (same routing, see the CPU test above). fp32 (Triton kernels, exact fp32 dots):
    against the float64 reference on the CPU, < 1e-5 as every fp32 fast path (fp32 routing agrees with float64's)."""
    used = backend_spy(monkeypatch)
    (varlen_run,) = mita_runs("cuda", torch.bfloat16, [("fast", True)])
    (fp32_run,) = mita_runs("cuda", torch.float32, [("fast", True)])
    assert used and all(b is not None for b in used)  # both took the varlen kernels
    (grouped_run,) = mita_runs("cuda", torch.bfloat16, [("fast", False)])
    for a, b in zip(varlen_run, grouped_run):
        assert _rel_rms(a, b) < 2e-2
    (reference,) = mita_runs("cpu", torch.float64, [("reference", False)])
    for a, b in zip(fp32_run, reference):
        assert _rel_rms(a, b) < REL_RMS_TOL
