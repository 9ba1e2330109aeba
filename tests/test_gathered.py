"""The gathered-head core (heads/gathered.py): memory-lean path vs the plain reference, directly on
random selections (odd T, several ρ and head counts, chunked and unchunked), all gradients including
the router scores; and what the lean path keeps in memory."""
from __future__ import annotations

import contextlib

import pytest
import torch

from heads.gathered import gathered_heads_reference
from heads import gathered_lean
from heads.gathered_lean import gathered_heads_lean, heads_per_chunk
from heads.rope import RotaryEmbedding
from routing.selection import Selection, earliest_first
from tests.conftest import TRITON_DEVICE, TRITON_KERNELS
from tests.head_checks import REL_MAX_TOL, REL_RMS_TOL

D_MODEL, HEAD_DIM, BATCH = 32, 8, 2


def gapped_positions(T: int, device: str) -> torch.Tensor:
    """[BATCH, T] increasing positions with gaps, another offset per row: not token index + a constant, a shift
    that RoPE's relative scores would not show (rotating at the token index instead passed with arange + 7)."""
    t = torch.arange(T, device=device)
    return 7 + t + t // 3 + 5 * torch.arange(BATCH, device=device)[:, None]


def problem(T: int, sparsity: int, heads: int, seed: int = 0, device: str = "cpu", head_dim: int = HEAD_DIM,
            d_model: int = D_MODEL) -> dict:
    """Random x, weights, selection (about T/ρ candidates per head, capacity T/ρ: overflow and padding)
    and raw router scores, on `device` (the same draws on any device); every float tensor requires grad."""
    g = torch.Generator().manual_seed(seed)
    c = max(T // sparsity, 2)
    sel = earliest_first(torch.rand(BATCH, heads, T, generator=g) < 1.2 / sparsity, c)
    leaf = lambda *shape, std=1.0: (torch.randn(*shape, generator=g) * std).to(device).requires_grad_()  # noqa: E731
    return dict(x=leaf(BATCH, T, d_model), r=torch.rand(BATCH, heads, c, generator=g).to(device).requires_grad_(),
                w_qkv=leaf(3 * heads * head_dim, d_model, std=0.3), w_o=leaf(d_model, heads * head_dim, std=0.3),
                sel=Selection(sel.idx.to(device), sel.valid.to(device)),
                positions=gapped_positions(T, device),
                cot=torch.randn(BATCH, T, d_model, generator=g).to(device))


def run_lean(p: dict, rope: RotaryEmbedding) -> torch.Tensor:
    gate = p["r"] * p["sel"].valid  # r_I on valid slots, 0 on padding (as heads/mosa.py builds it)
    return gathered_heads_lean(p["x"], p["positions"], p["sel"].idx, gate, p["w_qkv"], p["w_o"], rope)


def run_reference(p: dict, rope: RotaryEmbedding) -> torch.Tensor:
    sel: Selection = p["sel"]
    B, H = sel.idx.shape[:2]
    index_sets = [[sel.idx[b, i][sel.valid[b, i]] for i in range(H)] for b in range(B)]
    gates = [[p["r"][b, i][sel.valid[b, i]] for i in range(H)] for b in range(B)]
    return gathered_heads_reference(p["x"], p["positions"], index_sets, gates, p["w_qkv"], p["w_o"], rope)


def lean_vs_reference(p: dict) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, reference, lean) for the output and the gradients w.r.t. x, r, W^QKV and W^O (cotangent p["cot"])."""
    rope = RotaryEmbedding(HEAD_DIM, 0.5)
    leaves = [p["x"], p["r"], p["w_qkv"], p["w_o"]]
    results = []
    for run in (run_reference, run_lean):
        y = run(p, rope)
        results.append([y, *torch.autograd.grad((y * p["cot"]).sum(), leaves)])
    return list(zip(["y", "dx", "dr", "dW_qkv", "dW_o"], *results))


@pytest.mark.parametrize("T", [100, 257])
@pytest.mark.parametrize("sparsity", [2, 8, 32])
@pytest.mark.parametrize("heads", [3, 42])  # 42 heads: several chunks of T // (4c) heads (and a ragged last one)
@pytest.mark.parametrize("min_chunk", [0, gathered_lean.MIN_CHUNK_ELEMENTS])  # 0: chunks by rows; default: one
def test_lean_matches_reference(T: int, sparsity: int, heads: int, min_chunk: int,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gathered_lean, "MIN_CHUNK_ELEMENTS", min_chunk)
    for name, ref, lean in lean_vs_reference(problem(T, sparsity, heads)):
        assert ref.abs().max() > 0, name
        rel_rms = ((lean - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
        rel_max = ((lean - ref).abs().max() / ref.abs().max()).item()
        assert rel_rms < REL_RMS_TOL and rel_max < REL_MAX_TOL, f"{name}: rel RMS {rel_rms:.2e}, rel max {rel_max:.2e}"


def test_lean_keeps_fp64_precision() -> None:
    """fp64 inputs are summed over heads in fp64 (not the fp32 accumulator of 16/32-bit inputs): lean and
    reference agree to fp64 rounding, output and every gradient (an fp32 sum gave ~1e-7 relative error)."""
    p = problem(257, 8, 42)
    for key in ("x", "r", "w_qkv", "w_o"):
        p[key] = p[key].detach().double().requires_grad_()
    p["cot"] = p["cot"].double()
    for name, ref, lean in lean_vs_reference(p):
        assert lean.dtype == torch.float64, name
        rel_max = ((lean - ref).abs().max() / ref.abs().max()).item()
        assert rel_max < 1e-12, f"{name}: rel max {rel_max:.2e}"


def test_chunking_is_exercised(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 42-head cases above really run in several chunks, including a ragged one, when the element floor
    is 0; with the default floor they run in one."""
    cases = [(max(T // sparsity, 2), T) for T in (100, 257) for sparsity in (2, 8, 32)]
    assert all(heads_per_chunk(42, c, T, BATCH * c * D_MODEL) == 42 for c, T in cases)
    monkeypatch.setattr(gathered_lean, "MIN_CHUNK_ELEMENTS", 0)
    sizes = [heads_per_chunk(42, c, T, BATCH * c * D_MODEL) for c, T in cases]
    assert all(n < 42 for n in sizes) and any(42 % n for n in sizes), sizes


def test_chunk_floor_merges_tiny_heads_only() -> None:
    """Micro scale (24 heads, c = 32, h = 64, B = 16) runs in chunks of MIN_CHUNK_ELEMENTS, not one head each;
    the IsoFLOP Tiny point (276 heads, T = 1024, c = 32, h = 512) keeps its T/(4c) rule at batch 4 and 64."""
    assert heads_per_chunk(24, 32, 128, 16 * 32 * 64) == gathered_lean.MIN_CHUNK_ELEMENTS // (16 * 32 * 64) > 1
    assert heads_per_chunk(276, 32, 1024, 4 * 32 * 512) == heads_per_chunk(276, 32, 1024, 64 * 32 * 512) == 8


def test_a_gpu_runs_larger_chunks() -> None:
    """On CUDA the floor is CUDA_CHUNK_ELEMENTS: the H200's 639 heads of c = 128 at T = 4096, B = 4 (h = 512) run in
    chunks of 64 heads, not 8 (80 chunks of ~70 kernel launches each took 72x the dense group's time)."""
    assert heads_per_chunk(639, 128, 4096, 4 * 128 * 512) == 8
    assert heads_per_chunk(639, 128, 4096, 4 * 128 * 512, "cuda") == 64
    assert heads_per_chunk(24, 32, 128, 16 * 32 * 64, "cuda") == 24  # all heads: never more than there are


def test_saves_no_gathered_tensor() -> None:
    """Autograd keeps nothing of size [B, H, c, h] (the gathered X^s or per-head outputs): the largest
    saved activation is one of x, the weights or the rotated Q/K/V [H, B, c, h']."""
    p = problem(100, 2, 12)
    B, H, c = p["sel"].idx.shape
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        run_lean(p, RotaryEmbedding(HEAD_DIM, 0.5))
    gathered = B * H * c * D_MODEL
    assert saved and max(t.numel() for t in saved) <= max(p["x"].numel(), p["w_qkv"].numel(), H * B * c * HEAD_DIM)
    assert max(t.numel() for t in saved) < gathered / 3


GRADS = ["y", "dx", "dr", "dW_qkv", "dW_o"]  # the output, then the gradients w.r.t. x, r, W^QKV, W^O


def assert_rel_rms(got: list[torch.Tensor], expected: list[torch.Tensor], tol: float) -> None:
    """Each of GRADS within relative RMS error `tol` of its expected value (compared in fp64)."""
    for name, fast, ref in zip(GRADS, got, expected):
        fast, ref = fast.double(), ref.double()
        rel_rms = ((fast - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
        assert rel_rms < tol, f"{name}: rel RMS {rel_rms:.2e}"


def fused_against_reference(T: int, sparsity: int, heads: int, head_dim: int, fraction: float) -> None:
    """The fused kernels (heads/gathered_triton.py) on TRITON_DEVICE in fp32 vs the reference: output and, through the
    fused backward, every gradient including the router scores."""
    from heads.gathered_triton import gathered_heads_triton

    p = problem(T, sparsity, heads, device=TRITON_DEVICE, head_dim=head_dim)
    rope = RotaryEmbedding(head_dim, fraction).to(TRITON_DEVICE)
    leaves = [p["x"], p["r"], p["w_qkv"], p["w_o"]]
    gate = p["r"] * p["sel"].valid
    results = []
    for run in (lambda: run_reference(p, rope),
                lambda: gathered_heads_triton(p["x"], p["positions"], p["sel"].idx, gate, p["w_qkv"], p["w_o"], rope)):
        y = run()
        results.append([y, *torch.autograd.grad((y * p["cot"]).sum(), leaves, retain_graph=True)])
    for name, ref, fast in zip(["y", "dx", "dr", "dW_qkv", "dW_o"], *results):
        rel_rms = ((fast - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
        rel_max = ((fast - ref).abs().max() / ref.abs().max()).item()
        assert rel_rms < REL_RMS_TOL and rel_max < REL_MAX_TOL, f"{name}: rel RMS {rel_rms:.2e}, rel max {rel_max:.2e}"


@TRITON_KERNELS
@pytest.mark.parametrize("T,sparsity,heads,head_dim,fraction", [
    (100, 8, 3, 8, 0.5), (257, 32, 42, 8, 0.5), (100, 4, 5, 8, 0.5), (257, 8, 3, 8, 0.5), (256, 8, 2, 64, 0.5),
    (100, 8, 3, 12, 0.5), (100, 8, 3, 12, 1.0), (100, 8, 3, 12, 0.0)])
def test_triton_matches_reference(T: int, sparsity: int, heads: int, head_dim: int, fraction: float) -> None:
    """The fused kernels (fp32: interpreted on CPU, compiled on a GPU) vs the reference. 256 / 8 = 32 slots of
    h' = 64: the largest fp32 tile the kernels take (heads/gathered_triton.fits). h' = 12 (padded to a 16-column tile)
    rotates 6, all 12 or none of its dimensions: RoPE's partner columns within the tile."""
    from heads.gathered_triton import fits

    assert fits(max(T // sparsity, 2), head_dim, torch.float32)
    fused_against_reference(T, sparsity, heads, head_dim, fraction)


@pytest.mark.skipif(TRITON_DEVICE != "cpu", reason="Triton's interpreter only (TRITON_INTERPRET=1): a GPU takes heads "
                    "of 128 slots in 16 bits only (test_cuda_bf16_matches_reference), fp32 ones exceed its shared memory")
def test_triton_kernels_at_128_slots() -> None:
    """The kernels' logic at BLOCK_C = 128 (the 16-bit heads H100 takes, heads/gathered_triton.WIDE_SLOTS: 8 warps),
    in fp32 under the interpreter: 256 / 2 = 128 slots, and 100 / 1 = 100 slots padded to 128."""
    fused_against_reference(256, 2, 2, 16, 0.5)
    fused_against_reference(100, 1, 2, 16, 0.5)


@pytest.mark.skipif(TRITON_DEVICE != "cpu", reason="Triton's interpreter only (TRITON_INTERPRET=1): on a GPU the "
                    "16-bit kernels are checked in bf16 (test_cuda_bf16_matches_reference)")
@pytest.mark.parametrize("T,sparsity,heads,head_dim", [(100, 8, 3, 8), (256, 8, 3, 64), (256, 2, 2, 16)])
def test_triton_16bit_tiles_match_reference(T: int, sparsity: int, heads: int, head_dim: int) -> None:
    """The kernels' 16-bit path (the forward's X W^QKV dots take their tiles as stored, 16-bit MMA) in fp16, which the
    interpreter computes right (its bf16 tl.dot is wrong): output and every gradient vs the fp64 reference on the same
    fp16 values within rel-RMS 2e-3, four fp16 rounding units (2^-11; measured 2e-4 to 8e-4, the lean path in fp16
    8e-4 to 1.5e-3). Cases: ragged h' = 8; 32 slots of h' = 64 (IsoFLOP Tiny's heads); 128 slots (WIDE_SLOTS)."""
    from heads.gathered_triton import gathered_heads_triton

    p = problem(T, sparsity, heads, head_dim=head_dim)
    names = ("x", "r", "w_qkv", "w_o")
    half = {k: p[k].detach().half().requires_grad_() for k in names}
    exact = {**p, **{k: half[k].detach().double().requires_grad_() for k in names}, "cot": p["cot"].double()}
    rope = RotaryEmbedding(head_dim, 0.5)
    ref = run_reference(exact, rope)
    ref_grads = torch.autograd.grad((ref * exact["cot"]).sum(), [exact[k] for k in names])
    y = gathered_heads_triton(half["x"], p["positions"], p["sel"].idx, half["r"] * p["sel"].valid, half["w_qkv"],
                              half["w_o"], rope)
    assert y.dtype == torch.float16
    grads = torch.autograd.grad((y.float() * p["cot"]).sum(), [half[k] for k in names])
    assert_rel_rms([y, *grads], [ref, *ref_grads], 2e-3)


@pytest.mark.skipif(TRITON_DEVICE != "cpu", reason="Triton's interpreter only (TRITON_INTERPRET=1): fp16 stands in "
                    "for bf16, whose tl.dot the interpreter computes wrong; on a GPU test_cuda_bf16_matches_reference")
def test_fused_forward_attends_on_the_qkv_it_saves() -> None:
    """In 16 bits the fused forward's output is attention over exactly the rounded Q, K, V it saves for _attn_bwd,
    so the backward differentiates the forward that ran: y recomputed in fp64 from the saved Q, K, V, the gates and
    W^O as stored, within rel-RMS 1e-5 (fp32 accumulation: measured 1.3e-7; attending on the unrounded fp32 tiles,
    as the kernel did before, put y 3.2e-4 away, fp16's rounding of Q, K, V)."""
    import heads.gathered_triton as gt

    T, heads, head_dim = 100, 3, 16
    p = problem(T, 8, heads, head_dim=head_dim)
    x, w_qkv, w_o = (p[k].detach().half() for k in ("x", "w_qkv", "w_o"))
    gate = (p["r"] * p["sel"].valid).detach().half()
    idx, rope = p["sel"].idx, RotaryEmbedding(head_dim, 0.5)
    y, q, k, v = gt.fused_forward(x, gate, w_qkv, w_o, idx, p["positions"], rope.inv_freq, rope.rot_dim, None, None)
    q, k, v = q.double(), k.double(), v.double()  # [H, B, c, h'], rotated
    c = idx.shape[-1]
    scores = (q @ k.transpose(-1, -2) * head_dim ** -0.5).masked_fill(~torch.ones(c, c, dtype=torch.bool).tril(),
                                                                      float("-inf"))  # valid slots first, in order
    g = scores.softmax(-1) @ v * gate.double().transpose(0, 1)[..., None]  # G = diag(r) A, [H, B, c, h']
    expected = torch.zeros(BATCH * T, x.shape[-1], dtype=torch.float64)
    rows = (idx + T * torch.arange(BATCH)[:, None, None]).transpose(0, 1)  # [H, B, c] rows of [B*T, h]
    for i in range(heads):
        expected.index_add_(0, rows[i].flatten(), g[i].reshape(-1, head_dim) @ w_o.double()[:, i * head_dim:(i + 1) *
                                                                                           head_dim].T)
    assert_rel_rms([y], [expected], 1e-5)


def record_grids(monkeypatch: pytest.MonkeyPatch, *kernels: str) -> dict[str, list[tuple[int, ...]]]:
    """heads.gathered_triton's `kernels` launched through kernel[grid](...) with each grid recorded, by name."""
    from heads import gathered_triton

    grids: dict[str, list[tuple[int, ...]]] = {name: [] for name in kernels}

    class Recording:
        def __init__(self, name: str) -> None:
            self.name, self.kernel = name, getattr(gathered_triton, name)

        def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204
            grids[self.name].append(tuple(grid))
            return self.kernel[grid]

    for name in kernels:
        monkeypatch.setattr(gathered_triton, name, Recording(name))
    return grids


SCATTER_MODES = ["default", "deterministic", "column-grid"]


def in_scatter_mode(mode: str, run):  # noqa: ANN001, ANN201
    """run() in torch's deterministic mode, inside heads.gathered_triton.column_loop_disabled(), or as it is."""
    from heads.gathered_triton import column_loop_disabled

    torch.use_deterministic_algorithms(mode == "deterministic")
    try:
        with column_loop_disabled() if mode == "column-grid" else contextlib.nullcontext():
            return run()
    finally:
        torch.use_deterministic_algorithms(False)


@TRITON_KERNELS
@pytest.mark.parametrize("mode", SCATTER_MODES)
def test_triton_kernels_over_several_column_blocks(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Model width h = 272: nine column blocks of BLOCK_H = 32 in the kernels' loops or grids over h and three of the
    weight gradient's 128 columns (h' = 8), the last ones ragged (the other tests have h = 32, one block). Output and
    every gradient vs the reference in the scatter's three grids, which the interpreter's one-at-a-time programs let
    the test pin: by default one program per (sequence, head) looping over the column blocks; in deterministic mode
    one per (sequence, column block) walking all heads (bitwise equal over two runs); inside column_loop_disabled()
    one per (sequence, column block, head). The weight gradient: a program per (head, block of 128 columns, term)."""
    from heads.gathered_triton import BLOCK_H, gathered_heads_triton, weight_grad_columns

    grids = record_grids(monkeypatch, "_scatter", "_weight_grad")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    p = problem(100, 8, 3, device=TRITON_DEVICE, d_model=272)
    assert 8 * BLOCK_H < 272 < 9 * BLOCK_H and 2 * weight_grad_columns(16) < 272 < 3 * weight_grad_columns(16)
    rope = RotaryEmbedding(HEAD_DIM, 0.5).to(TRITON_DEVICE)
    leaves = [p["x"], p["r"], p["w_qkv"], p["w_o"]]
    ref = run_reference(p, rope)
    expected = [ref, *torch.autograd.grad((ref * p["cot"]).sum(), leaves)]

    def run() -> list[torch.Tensor]:
        y = gathered_heads_triton(p["x"], p["positions"], p["sel"].idx, p["r"] * p["sel"].valid, p["w_qkv"], p["w_o"],
                                  rope)
        return [y, *torch.autograd.grad((y * p["cot"]).sum(), leaves)]

    runs = [in_scatter_mode(mode, run) for _ in range(2 if mode == "deterministic" else 1)]
    assert_rel_rms(runs[0], expected, REL_RMS_TOL)
    B, H = p["sel"].idx.shape[:2]
    scatter = {"default": (B, 1, H), "deterministic": (B, 9, 1), "column-grid": (B, 9, H)}[mode]
    assert grids["_scatter"] == [scatter] * 2 * len(runs)  # Y's and dX's
    assert grids["_weight_grad"] == [(H, 3, 3), (H, 3, 1)] * len(runs)  # dW^QKV, dW^O
    if mode == "deterministic":
        assert all(torch.equal(a, b) for a, b in zip(*runs))


@TRITON_KERNELS
def test_triton_padding_masks_match_lean() -> None:
    """MoSAIC's padding rules (visible keys, self-only queries) in the kernels equal the lean path's, forward
    and every gradient."""
    from heads.gathered_triton import gathered_heads_triton

    p = problem(100, 4, 5, device=TRITON_DEVICE)
    g = torch.Generator().manual_seed(3)
    visible = p["sel"].valid & (torch.rand(p["sel"].idx.shape, generator=g) < 0.7).to(TRITON_DEVICE)
    self_only = p["sel"].valid & ~visible & (torch.rand(p["sel"].idx.shape, generator=g) < 0.5).to(TRITON_DEVICE)
    assert visible.any() and self_only.any() and (p["sel"].valid & ~visible & ~self_only).any()
    rope = RotaryEmbedding(HEAD_DIM, 0.5).to(TRITON_DEVICE)
    args = (p["x"], p["positions"], p["sel"].idx, p["r"] * p["sel"].valid, p["w_qkv"], p["w_o"], rope, visible, self_only)
    leaves = [p["x"], p["r"], p["w_qkv"], p["w_o"]]
    results = []
    for run in (gathered_heads_lean, gathered_heads_triton):
        y = run(*args)
        results.append([y, *torch.autograd.grad((y * p["cot"]).sum(), leaves, retain_graph=True)])
    for name, lean, fused in zip(["y", "dx", "dr", "dW_qkv", "dW_o"], *results):
        assert lean.abs().max() > 0, name
        rel_rms = ((fused - lean).pow(2).mean() / lean.pow(2).mean()).sqrt().item()
        assert rel_rms < REL_RMS_TOL, f"{name}: rel RMS {rel_rms:.2e}"


def bf16_problem_on_cuda(T: int, sparsity: int, heads: int, head_dim: int) -> tuple[dict, RotaryEmbedding]:
    """`problem` on CUDA with x, r and the weights rounded to bf16 values (kept in fp32, for the fp32 reference) and
    its RoPE."""
    p = problem(T, sparsity, heads, device="cuda", head_dim=head_dim)
    for key in ("x", "r", "w_qkv", "w_o"):
        p[key] = p[key].detach().bfloat16().float().requires_grad_()
    return p, RotaryEmbedding(head_dim, 0.5).cuda()


@pytest.mark.skipif(TRITON_DEVICE != "cuda",
                    reason="bf16 kernel check needs a GPU and compiled Triton (TRITON_INTERPRET unset); no GPU here")
@pytest.mark.parametrize("T,sparsity,heads,head_dim", [(100, 8, 3, 8), (257, 32, 42, 8), (512, 8, 2, 64),
                                                       (1024, 8, 2, 64)])
def test_cuda_bf16_matches_reference(T: int, sparsity: int, heads: int, head_dim: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA dispatch (fused forward and backward kernels: checked taken) under bf16 autocast vs the fp32 reference
    on the same bf16-rounded inputs: output and every gradient within rel-RMS 5e-3, or, where bf16's own roundings
    (of the saved Q/K/V, of Y and dY, of dX and the weight gradients: 2^-9 each) add up to more, no further from it
    than PyTorch's bf16 computation of the same maths (the lean path, side by side on the same inputs). On the H200,
    dX was 6.1e-3 and 5.8e-3 from the reference (the lean path's, on CPU: 1.4e-2 and 1.1e-2). 512 / 8 = 64 slots of
    h' = 64: the largest 16-bit tile, 1024 / 8 = 128 slots of h' = 64 on a GPU with 227 KB of shared memory per block
    (H100, H200: heads/gathered_triton.WIDE_SLOTS)."""
    import heads.gathered_triton as gt
    from heads.gathered import fused_disabled, gathered_heads_fast

    shared = gt.shared_memory(torch.cuda.current_device())
    if not gt.fits(max(T // sparsity, 2), head_dim, torch.bfloat16, shared):
        pytest.skip(f"this GPU's {shared // 1024} KB of shared memory per block take 16-bit heads up to 64 slots "
                    f"(heads/gathered_triton.fits), not {T // sparsity}")

    calls: list[int] = []
    fused = gt.gathered_heads_triton
    monkeypatch.setattr(gt, "gathered_heads_triton", lambda *a, **k: calls.append(1) or fused(*a, **k))
    p, rope = bf16_problem_on_cuda(T, sparsity, heads, head_dim)
    leaves = [p["x"], p["r"], p["w_qkv"], p["w_o"]]
    ref = run_reference(p, rope)
    ref_grads = torch.autograd.grad((ref * p["cot"]).sum(), leaves)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = gathered_heads_fast(p["x"], p["positions"], p["sel"], p["r"] * p["sel"].valid, p["w_qkv"], p["w_o"], rope)
    assert calls, "the fused kernels were not taken"
    grads = torch.autograd.grad((y.float() * p["cot"]).sum(), leaves)
    taken = len(calls)
    with torch.autocast("cuda", dtype=torch.bfloat16), fused_disabled():  # the lean core, on the same GPU
        y_lean = gathered_heads_fast(p["x"], p["positions"], p["sel"], p["r"] * p["sel"].valid, p["w_qkv"], p["w_o"],
                                     rope)
    assert len(calls) == taken, "fused_disabled() left the fused kernels on"
    lean_grads = torch.autograd.grad((y_lean.float() * p["cot"]).sum(), leaves)
    rel = lambda a, b: ((a.float() - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()  # noqa: E731
    for name, fast, lean, r in zip(["y", "dx", "dr", "dW_qkv", "dW_o"], (y, *grads), (y_lean, *lean_grads),
                                   (ref, *ref_grads)):
        assert rel(fast, r) <= max(5e-3, rel(lean, r)), f"{name}: {rel(fast, r):.2e}, lean bf16 {rel(lean, r):.2e}"


def route_fast_path(monkeypatch: pytest.MonkeyPatch, core) -> list[int]:  # noqa: ANN001
    """Route mosa/fixed/mosaic's fast path through `core` (a gathered-head core with the lean contract, e.g. the
    Triton kernels on CPU tensors under the interpreter); the list counts the calls."""
    calls: list[int] = []

    def fast(x, positions, sel, gate, qkv_weight, out_weight, rope, visible=None, self_only=None):  # noqa: ANN001
        calls.append(1)
        return core(x, positions, sel.idx, gate, qkv_weight, out_weight, rope, visible, self_only)

    for module in ("heads.mosa", "heads.fixed", "heads.mosaic"):
        monkeypatch.setattr(f"{module}.gathered_heads_fast", fast)
    return calls


@pytest.fixture
def kernel_path(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """mosa/fixed/mosaic's fast path through the fused kernels (route_fast_path)."""
    from heads.gathered_triton import gathered_heads_triton

    return route_fast_path(monkeypatch, gathered_heads_triton)


@TRITON_KERNELS
def test_triton_path_is_causal(kernel_path: list[int]) -> None:
    """A model of MoSA (causal threshold selection), fixed and MoSAIC heads on the kernel path: new tokens after
    position t change no logit at positions <= t."""
    import lm
    from lm.causality import future_leak
    from tests.conftest import tiny_config

    cfg = tiny_config([{"type": "dense", "count": 1}, {"type": "mosa", "count": 2, "options": {"sparsity": 4}},
                       {"type": "fixed", "count": 2, "options": {"sparsity": 4}},
                       {"type": "mosaic", "count": 2, "options": {"sparsity": 4}}], init_std=0.3, seq_len=48)
    model = lm.build_model(cfg.model).to(TRITON_DEVICE)
    assert model.causal
    assert future_leak(model, torch.randint(0, 97, (2, 48), device=TRITON_DEVICE), t=20, vocab_size=97) <= 1e-5
    assert len(kernel_path) >= 3 * cfg.model.n_layers * 2  # every sparse group of both passes ran the kernels


@TRITON_KERNELS
def test_triton_deterministic_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.use_deterministic_algorithms(True) the scatter kernel runs one program per (sequence, column block)
    walking the heads in order: same results as the default grid (to rounding) and bitwise equal from run to run (on a
    GPU, where the default grid's atomics make the order vary, with cuBLAS's deterministic workspace, as Lightning
    sets)."""
    import heads.gathered_triton as gt

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    p = problem(257, 8, 7, device=TRITON_DEVICE)
    rope = RotaryEmbedding(HEAD_DIM, 0.5).to(TRITON_DEVICE)
    leaves = [p["x"], p["r"], p["w_qkv"], p["w_o"]]
    args = (p["x"], p["positions"], p["sel"].idx, p["r"] * p["sel"].valid, p["w_qkv"], p["w_o"], rope)
    grids: list[tuple] = []
    kernel = gt._scatter

    class Recorder:  # kernel[grid](...) with the grid noted
        def __getitem__(self, grid: tuple):  # noqa: ANN204
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(gt, "_scatter", Recorder())

    def run() -> list[torch.Tensor]:
        y = gt.gathered_heads_triton(*args)
        return [y, *torch.autograd.grad((y * p["cot"]).sum(), leaves, retain_graph=True)]

    default = run()
    B = p["x"].shape[0]
    assert grids == [(B, 1, 7)] * 2  # Y and dX, one program per (sequence, head) over every column
    grids.clear()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = run(), run()
    finally:
        torch.use_deterministic_algorithms(False)
    assert grids == [(B, 1, 1)] * 4  # one program per (sequence, column block: h = 32 is one) walks all 7 heads
    for a, b, ref in zip(first, second, default):
        assert torch.equal(a, b)
        assert ((a - ref).pow(2).mean() / ref.pow(2).mean()).sqrt() < REL_RMS_TOL


@TRITON_KERNELS
def test_fused_ops_pass_opcheck() -> None:
    """The kernels are torch.library custom ops: schema, fake (shape) implementations, autograd registration
    and AOT dispatch are consistent with the real ones (torch.library.opcheck), with and without MoSAIC masks."""
    from heads.gathered_triton import fused_forward

    p = problem(37, 4, 3, device=TRITON_DEVICE)
    rope = RotaryEmbedding(HEAD_DIM, 0.5).to(TRITON_DEVICE)
    draw = torch.rand(p["sel"].idx.shape, generator=torch.Generator().manual_seed(5)).to(TRITON_DEVICE)
    visible = p["sel"].valid & (draw < 0.7)
    for masks in ((None, None), (visible, p["sel"].valid & ~visible)):
        args = (p["x"], (p["r"] * p["sel"].valid).detach().requires_grad_(), p["w_qkv"], p["w_o"], p["sel"].idx,
                p["positions"], rope.inv_freq, rope.rot_dim, *masks)
        torch.library.opcheck(fused_forward, args)


@pytest.mark.slow  # dynamo + AOT tracing of a 2-layer model, kernels interpreted (~20 s)
@TRITON_KERNELS
def test_kernel_path_compiles_fullgraph(kernel_path: list[int]) -> None:
    """trainer.compile with the fused kernels (what CUDA runs): the training loss of a dense + MoSA + MoSAIC model
    compiles with fullgraph=True (the ops are opaque to dynamo) and equals eager, loss and every gradient."""
    assert_compiles_fullgraph(kernel_path)


def assert_compiles_fullgraph(calls: list[int]) -> None:
    """The training loss of a dense + MoSA + MoSAIC model compiles with fullgraph=True and equals eager, loss and every
    gradient; `calls` (route_fast_path's) shows both sparse groups of both layers took the routed core in both runs."""
    from lm.module import LMModule, compiled
    from tests.conftest import tiny_config

    cfg = tiny_config([{"type": "dense", "count": 1}, {"type": "mosa", "count": 2, "options": {"sparsity": 4}},
                       {"type": "mosaic", "count": 2, "options": {"sparsity": 4}}], n_layers=2, seq_len=32)
    module = LMModule(cfg).to(TRITON_DEVICE).train()
    x, y = (torch.randint(0, 97, (2, 32), device=TRITON_DEVICE) for _ in range(2))
    torch._dynamo.reset()
    results = []
    for fn in (module.losses, compiled(module.losses, backend="aot_eager")):
        torch.manual_seed(0)
        loss = fn(x, y)[0]
        results.append([loss.detach(), *torch.autograd.grad(loss, list(module.parameters()))])
    torch._dynamo.reset()
    assert len(calls) >= 2 * 2 * 2  # both sparse groups of both layers, in both runs
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=1e-4, atol=1e-5)


def test_kernel_dot_precision_follows_torch() -> None:
    """fp32 inputs get exact fp32 dots unless torch allows TF32 (as torch.matmul); 16-bit inputs get TF32: in the
    gathered-head kernels and in the varlen kernels (heads/dot_precision.py)."""
    pytest.importorskip("triton")
    from heads.gathered_triton import _sizes
    from heads.varlen_triton import _meta

    x, idx, w = torch.zeros(1, 8, 16), torch.zeros(1, 2, 4, dtype=torch.long), torch.zeros(3 * 2 * 4, 16)
    dots = lambda x: (_sizes(x, idx, w)["consts"]["DOT"], _meta(x[0])["DOT"])  # noqa: E731
    assert dots(x) == ("ieee", "ieee")
    assert dots(x.bfloat16()) == ("tf32", "tf32")
    previous = torch.get_float32_matmul_precision()
    try:
        for allowed in ("high", "medium"):  # both let torch.matmul use TF32
            torch.set_float32_matmul_precision(allowed)
            assert dots(x) == ("tf32", "tf32"), allowed
    finally:
        torch.set_float32_matmul_precision(previous)
    matmul = torch.backends.cuda.matmul  # the per-backend setting (the global getter raised after it)
    try:
        for setting, dot in (("tf32", "tf32"), ("ieee", "ieee")):
            matmul.fp32_precision = setting
            assert dots(x) == (dot, dot), setting
    finally:
        matmul.fp32_precision = "none"
        torch.set_float32_matmul_precision(previous)
    assert dots(x) == ("ieee", "ieee")


def test_shared_memory_is_a_constant_under_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """heads/gathered.py asks the GPU's shared memory per block inside the traced forward: torch.compile(fullgraph)
    (trainer.compile) takes it as a constant instead of tracing into Triton's driver (here a function dynamo refuses
    to trace, as it refuses the driver's C call)."""
    pytest.importorskip("triton")
    import heads.gathered_triton as gt

    monkeypatch.setattr(gt, "_device_shared_memory", torch.compiler.disable(lambda device: 227 * 1024))
    takes = lambda x: x * gt.fits(128, 64, torch.bfloat16, gt.shared_memory(0))  # noqa: E731
    torch._dynamo.reset()
    assert torch.compile(takes, fullgraph=True, backend="eager")(torch.ones(2)).tolist() == [1.0, 1.0]


def test_fused_kernels_take_only_heads_that_fit_on_chip() -> None:
    """heads/gathered_triton.fits: in 16 bits, c x h' blocks up to 64 x 64 (or 32 x 128) go to the fused kernels;
    larger heads, such as c = 128 slots (rho = 8 at T = 1024, whose backward kernel needs 192 KB of shared memory),
    take the tiled kernels (heads/gathered_tiled.py), except on GPUs with 227 KB per block (H100, H200) at h' <= 64. fp32 heads stop at half that
    tile (the fp32 backward spills registers at 64 x 64). The c x c tiles count as well: narrow heads (h' = 16) stop
    at the same c (c = 256 passed and needed 352 KB). The dtype is the one the core computes in: autocast's.
    Compiled at the limits: tests/test_triton_aot.py."""
    pytest.importorskip("triton")
    from heads.gathered_lean import compute_dtype
    from heads.gathered_triton import fits

    bf16, fp32, fp16 = torch.bfloat16, torch.float32, torch.float16
    a100, h100 = 163 * 1024, 227 * 1024  # shared memory per block (opt-in), CUDA programming guide
    for shared in (0, a100, h100):
        assert fits(64, 64, bf16, shared) and fits(17, 64, bf16, shared) and fits(32, 128, bf16, shared)
        assert fits(8, 8, bf16, shared) and fits(64, 16, bf16, shared) and fits(16, 256, bf16, shared)
        assert not fits(33, 128, bf16, shared) and not fits(1024, 16, bf16, shared)
        assert not fits(256, 16, bf16, shared)  # c x c: 320 KB at c = 256
        assert fits(32, 16, fp32, shared) and not fits(33, 16, fp32, shared) and not fits(16, 256, fp32, shared)
        assert fits(32, 64, fp32, shared) and fits(16, 128, fp32, shared) and not fits(33, 64, fp32, shared)
        assert not fits(64, 64, fp32, shared) and not fits(8, 8, torch.float64, shared)
    for shared in (0, a100):
        assert not fits(65, 64, bf16, shared) and not fits(128, 64, bf16, shared) and not fits(65, 16, bf16, shared)
    assert fits(128, 64, bf16, h100) and fits(100, 16, fp16, h100) and fits(128, 32, bf16, h100)
    assert not fits(129, 64, bf16, h100) and not fits(128, 65, bf16, h100) and not fits(128, 64, fp32, h100)
    assert not fits(64, 128, bf16, h100)  # 64 x 128 tiles: 0.8-1.5 KB of spills per thread
    x = torch.zeros(2, 3)
    assert compute_dtype(x) == fp32
    with torch.autocast("cpu", dtype=bf16):
        assert compute_dtype(x) == bf16
