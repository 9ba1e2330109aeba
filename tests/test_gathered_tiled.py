"""The tiled gathered-head path (heads/gathered_tiled.py: Triton gathers, projections and scatters over blocks of
slots around SDPA) against the plain reference and the lean core: output and every gradient at odd lengths and
ragged last tiles, MoSAIC's masks, the 16-bit tiles, several column blocks and deterministic mode, causality in a
model, its custom ops, and which core the CUDA dispatch picks. On CPU the kernels run in Triton's interpreter (fp32,
fp16); on a GPU compiled, in bf16 too."""
from __future__ import annotations

import contextlib

import pytest
import torch

from heads.gathered_lean import gathered_heads_lean
from heads.rope import RotaryEmbedding
from tests.conftest import TRITON_DEVICE, TRITON_KERNELS
from tests.head_checks import REL_MAX_TOL, REL_RMS_TOL
from tests.test_gathered import (HEAD_DIM, SCATTER_MODES, assert_compiles_fullgraph, assert_rel_rms,
                                 bf16_problem_on_cuda, in_scatter_mode, problem, record_grids, route_fast_path,
                                 run_reference)

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from heads.gathered_triton import _slot_offsets  # noqa: E402

NAMES = ["y", "dx", "dr", "dW_qkv", "dW_o"]


def run_tiled(p: dict, rope: RotaryEmbedding, visible: torch.Tensor | None = None,
              self_only: torch.Tensor | None = None) -> torch.Tensor:
    from heads.gathered_tiled import gathered_heads_tiled

    return gathered_heads_tiled(p["x"], p["positions"], p["sel"].idx, p["r"] * p["sel"].valid, p["w_qkv"], p["w_o"],
                                rope, visible, self_only)


def outputs_and_grads(p: dict, run) -> list[torch.Tensor]:  # noqa: ANN001
    """[y, dx, dr, dW^QKV, dW^O] of one run (cotangent p["cot"])."""
    y = run()
    return [y, *torch.autograd.grad((y.float() * p["cot"]).sum(), [p["x"], p["r"], p["w_qkv"], p["w_o"]])]


@TRITON_KERNELS
@pytest.mark.parametrize("T,sparsity,heads,head_dim,fraction,tiles", [
    (257, 2, 3, 8, 0.5, 2),  # c = 128: two tiles of 64
    (100, 1, 2, 12, 1.0, 2),  # c = 100: a ragged second tile; h' = 12 in a 16-column tile, all of it rotated
    (100, 8, 3, 8, 0.0, 1),  # c = 12: one partial tile, no RoPE
    (300, 1, 2, 64, 0.5, 10),  # fp32 h' = 64: tiles of 32 slots, c = 300 in ten (the last ragged)
    (65, 1, 2, 8, 0.5, 2),  # c = 65: a last tile of one slot (every kernel's slot loop or grid reaches slot c - 1)
])
def test_tiled_matches_reference(T: int, sparsity: int, heads: int, head_dim: int, fraction: float,
                                 tiles: int) -> None:
    """Output and every gradient (x, router scores, W^QKV, W^O) vs the reference, fp32, heads of more slots than
    one tile (heads/gathered_tiled.tile_slots) and of fewer."""
    from heads.gathered_tiled import tile_slots

    p = problem(T, sparsity, heads, device=TRITON_DEVICE, head_dim=head_dim)
    rope = RotaryEmbedding(head_dim, fraction).to(TRITON_DEVICE)
    assert -(-p["sel"].idx.shape[-1] // tile_slots(head_dim, torch.float32)) == tiles
    expected = outputs_and_grads(p, lambda: run_reference(p, rope))
    got = outputs_and_grads(p, lambda: run_tiled(p, rope))
    for name, ref, fast in zip(NAMES, expected, got):
        rel_rms = ((fast - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
        rel_max = ((fast - ref).abs().max() / ref.abs().max()).item()
        assert rel_rms < REL_RMS_TOL and rel_max < REL_MAX_TOL, f"{name}: rel RMS {rel_rms:.2e}, rel max {rel_max:.2e}"


def padding_masks(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MoSAIC padding rules for `problem` p: (visible keys, self-only queries), on p's device; every kind of
    slot occurs (visible, self-only, neither)."""
    g, device = torch.Generator().manual_seed(3), p["x"].device
    visible = p["sel"].valid & (torch.rand(p["sel"].idx.shape, generator=g) < 0.7).to(device)
    self_only = p["sel"].valid & ~visible & (torch.rand(p["sel"].idx.shape, generator=g) < 0.5).to(device)
    assert visible.any() and self_only.any() and (p["sel"].valid & ~visible & ~self_only).any()
    return visible, self_only


@TRITON_KERNELS
@pytest.mark.parametrize("with_self_only", [True, False])
def test_tiled_padding_masks_match_lean(with_self_only: bool) -> None:
    """MoSAIC's padding rules (visible keys, self-only queries) as SDPA's slot mask equal the lean path's, forward and
    every gradient, over two tiles of slots; also `visible` alone (MoSAIC's padded="ignore" passes no self_only)."""
    p = problem(100, 1, 3, device=TRITON_DEVICE)
    visible, self_only = padding_masks(p)
    if not with_self_only:
        self_only = None
    rope = RotaryEmbedding(HEAD_DIM, 0.5).to(TRITON_DEVICE)
    lean = outputs_and_grads(p, lambda: gathered_heads_lean(p["x"], p["positions"], p["sel"].idx,
                                                            p["r"] * p["sel"].valid, p["w_qkv"], p["w_o"], rope,
                                                            visible, self_only))
    unmasked = outputs_and_grads(p, lambda: run_tiled(p, rope))
    tiled = outputs_and_grads(p, lambda: run_tiled(p, rope, visible, self_only))
    assert ((unmasked[0] - lean[0]).pow(2).mean() / lean[0].pow(2).mean()).sqrt() > 1e-2  # the masks matter here
    for name, want, got in zip(NAMES, lean, tiled):
        assert want.abs().max() > 0, name
        rel_rms = ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt().item()
        assert rel_rms < REL_RMS_TOL, f"{name}: rel RMS {rel_rms:.2e}"


@pytest.mark.skipif(TRITON_DEVICE != "cpu", reason="Triton's interpreter only (TRITON_INTERPRET=1): on a GPU the "
                    "16-bit tiles are checked in bf16 (test_cuda_tiled_bf16_matches_reference)")
@pytest.mark.parametrize("T,sparsity,heads,head_dim", [(257, 2, 2, 16), (300, 2, 2, 64)])
def test_tiled_16bit_matches_reference(T: int, sparsity: int, heads: int, head_dim: int) -> None:
    """fp16 inputs (the interpreter's fp16 tl.dot is right, its bf16 one is not): output and every gradient vs the
    fp64 reference on the same fp16 values within rel-RMS 2e-3, four fp16 rounding units (as the fused kernels' test).
    Q, K, V, A and dQ/dK/dV are rounded to fp16 between the steps (as SDPA computes dense heads), where the fused
    kernels keep them in fp32 on chip. 128 slots of h' = 16 (tiles of 64), 150 of h' = 64 (tiles of 64, ragged)."""
    p = problem(T, sparsity, heads, head_dim=head_dim)
    names = ("x", "r", "w_qkv", "w_o")
    half = {**p, **{k: p[k].detach().half().requires_grad_() for k in names}}
    exact = {**p, **{k: half[k].detach().double().requires_grad_() for k in names}, "cot": p["cot"].double()}
    rope = RotaryEmbedding(head_dim, 0.5)
    expected = outputs_and_grads(exact, lambda: run_reference(exact, rope))
    got = outputs_and_grads(half, lambda: run_tiled(half, rope))
    assert got[0].dtype == torch.float16
    assert_rel_rms(got, expected, 2e-3)


@TRITON_KERNELS
@pytest.mark.parametrize("mode", SCATTER_MODES)
def test_tiled_over_several_column_blocks(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Model width h = 272 (nine column blocks of BLOCK_H and three of the weight gradient's 128 columns at h' = 8, the
    last ones ragged) and c = 100 slots (two tiles): output and every gradient vs the reference. Tiles of slots keep
    the scatter's program per (sequence, column block, head), whose slot loop prefetches (column_loop_disabled()
    changes nothing); deterministic mode walks heads and tiles in order (bitwise equal over two runs)."""
    from heads.gathered_triton import BLOCK_H, weight_grad_columns

    grids = record_grids(monkeypatch, "_scatter", "_weight_grad")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    p = problem(100, 1, 3, device=TRITON_DEVICE, d_model=272)
    assert 8 * BLOCK_H < 272 < 9 * BLOCK_H and 2 * weight_grad_columns(16) < 272 < 3 * weight_grad_columns(16)
    rope = RotaryEmbedding(HEAD_DIM, 0.5).to(TRITON_DEVICE)
    expected = outputs_and_grads(p, lambda: run_reference(p, rope))
    runs = [in_scatter_mode(mode, lambda: outputs_and_grads(p, lambda: run_tiled(p, rope)))
            for _ in range(2 if mode == "deterministic" else 1)]
    assert_rel_rms(runs[0], expected, REL_RMS_TOL)
    B, H = p["sel"].idx.shape[:2]
    assert grids["_scatter"] == [(B, 9, 1 if mode == "deterministic" else H)] * 2 * len(runs)  # Y's and dX's
    assert grids["_weight_grad"] == [(H, 3, 1), (H, 3, 3)] * len(runs)  # dW^O, then dW^QKV
    if mode == "deterministic":
        assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.fixture
def tiled_path(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """mosa/fixed/mosaic's fast path through the tiled kernels (tests.test_gathered.route_fast_path)."""
    from heads.gathered_tiled import gathered_heads_tiled

    return route_fast_path(monkeypatch, gathered_heads_tiled)


@TRITON_KERNELS
def test_tiled_path_is_causal(tiled_path: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A model of MoSA (causal threshold selection), fixed and MoSAIC heads on the tiled path, with tiles of 16 slots
    so that their 24-slot heads span two: new tokens after position t change no logit at positions <= t."""
    import lm
    from heads import gathered_tiled
    from lm.causality import future_leak
    from tests.conftest import tiny_config

    monkeypatch.setattr(gathered_tiled, "MAX_SLOTS_PER_TILE", 16)
    assert gathered_tiled.tile_slots(HEAD_DIM, torch.float32) == 16
    cfg = tiny_config([{"type": "dense", "count": 1}, {"type": "mosa", "count": 2, "options": {"sparsity": 2}},
                       {"type": "fixed", "count": 2, "options": {"sparsity": 2}},
                       {"type": "mosaic", "count": 2, "options": {"sparsity": 2}}], init_std=0.3, seq_len=48)
    assert cfg.model.head_dim == HEAD_DIM
    model = lm.build_model(cfg.model).to(TRITON_DEVICE)
    assert model.causal
    assert future_leak(model, torch.randint(0, 97, (2, 48), device=TRITON_DEVICE), t=20, vocab_size=97) <= 1e-5
    assert len(tiled_path) >= 3 * cfg.model.n_layers * 2  # every sparse group of both passes ran the tiled path


@TRITON_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tiled_ops_pass_opcheck(dtype: torch.dtype) -> None:
    """The two Triton steps are torch.library custom ops: schema, fake shapes (and dtypes: y is fp32 for 16-bit
    inputs, Q, K, V in x's dtype), autograd registration and AOT dispatch agree with the real ones
    (torch.library.opcheck)."""
    from heads.gathered_tiled import tiled_output, tiled_project

    p = problem(100, 1, 3, device=TRITON_DEVICE)
    rope = RotaryEmbedding(HEAD_DIM, 0.5).to(TRITON_DEVICE)
    cast = lambda t: t.detach().to(dtype).requires_grad_()  # noqa: E731
    x, idx = cast(p["x"]), p["sel"].idx
    torch.library.opcheck(tiled_project, (x, idx, p["positions"], cast(p["w_qkv"]), rope.inv_freq, rope.rot_dim))
    a = torch.randn(3, 2, idx.shape[-1], HEAD_DIM, device=TRITON_DEVICE, dtype=dtype, requires_grad=True)
    torch.library.opcheck(tiled_output, (a, cast(p["r"] * p["sel"].valid), idx, cast(p["w_o"]), 100))


@TRITON_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tiled_backward_strides_match_the_fakes(dtype: torch.dtype) -> None:
    """The backward ops return the shapes, dtypes and strides their fake implementations promise (inductor asserts a
    custom op's output strides against the fakes': trainer.compile's backward failed when dA and dr followed a
    transposed gate's layout), also for inputs in another memory layout, as SDPA returns A and its gradients
    ([B, c, H, h'] order here)."""
    from heads import gathered_tiled as gtl

    p = problem(100, 1, 3, device=TRITON_DEVICE)
    rope = RotaryEmbedding(HEAD_DIM, 0.5).to(TRITON_DEVICE)
    idx, c = p["sel"].idx, p["sel"].idx.shape[-1]
    strided = lambda: torch.randn(2, c, 3, HEAD_DIM, dtype=dtype).permute(2, 0, 1, 3).to(TRITON_DEVICE)  # noqa: E731
    x, w_qkv, w_o, gate = (t.detach().to(dtype) for t in (p["x"], p["w_qkv"], p["w_o"], p["r"] * p["sel"].valid))
    out_args = (torch.randn(200, 32, device=TRITON_DEVICE), strided(), gate, idx, w_o, 100)
    proj_args = (strided(), strided(), strided(), x, idx, p["positions"], w_qkv, rope.inv_freq, rope.rot_dim)
    for real, fake in ((gtl.tiled_output_backward(*out_args), gtl._output_backward_shapes(*out_args)),
                       (gtl.tiled_project_backward(*proj_args), gtl._project_backward_shapes(*proj_args))):
        assert [(t.shape, t.stride(), t.dtype) for t in real] == [(t.shape, t.stride(), t.dtype) for t in fake]


def test_cuda_dispatch_picks_the_core() -> None:
    """heads/gathered.cuda_core: heads that fit on chip take the fused kernels, larger ones of h' <= 256 in 16 bits
    (h' <= 128 in fp32) the tiled kernels (c = 256 at T = 8192, rho = 32: the lean core before), the rest (fp64, wider
    heads) the lean core; inside whole_head_disabled() the tiled kernels take the heads that fit on chip too."""
    from heads.gathered import cuda_core, whole_head_disabled

    bf16, fp32 = torch.bfloat16, torch.float32
    a100, h100 = 163 * 1024, 227 * 1024
    assert cuda_core(32, 64, bf16, a100) == "fused" and cuda_core(128, 64, bf16, h100) == "fused"
    assert cuda_core(128, 64, bf16, a100) == "tiled" and cuda_core(256, 64, bf16, h100) == "tiled"
    assert cuda_core(4096, 256, bf16, h100) == "tiled" and cuda_core(64, 64, fp32, h100) == "tiled"
    assert cuda_core(64, 128, fp32, h100) == "tiled" and cuda_core(64, 256, fp32, h100) == "lean"
    assert cuda_core(64, 512, bf16, h100) == "lean" and cuda_core(8, 8, torch.float64, h100) == "lean"
    with whole_head_disabled():
        assert cuda_core(32, 64, bf16, a100) == "tiled" and cuda_core(8, 8, torch.float64, h100) == "lean"
    assert cuda_core(32, 64, bf16, a100) == "fused"


def test_tile_sizes() -> None:
    """Slots per tile: the fused kernels' MAX_TILE divided by the head width, 16 to 64 (64 x 64 in 16 bits, 32 x 64 and
    16 x 128 in fp32, 16 x 256 in 16 bits)."""
    from heads.gathered_tiled import tile_slots

    assert tile_slots(64, torch.bfloat16) == 64 and tile_slots(8, torch.bfloat16) == 64
    assert tile_slots(128, torch.bfloat16) == 32 and tile_slots(256, torch.float16) == 16
    assert tile_slots(64, torch.float32) == 32 and tile_slots(128, torch.float32) == 16
    # widths that are no power of two take the tile of the next one (BLOCK_D): BLOCK_C is a power of two too
    assert tile_slots(96, torch.bfloat16) == 32 and tile_slots(48, torch.float32) == 32
    assert tile_slots(12, torch.float32) == 64 and tile_slots(200, torch.float16) == 16


@pytest.mark.skipif(TRITON_DEVICE != "cuda",
                    reason="bf16 kernel check needs a GPU and compiled Triton (TRITON_INTERPRET unset); no GPU here")
@pytest.mark.parametrize("T,sparsity,heads,head_dim,tile_all,masks", [
    (2048, 8, 2, 64, False, False), (1000, 4, 3, 8, False, False), (1024, 32, 4, 64, True, False),
    (1000, 4, 3, 12, False, True)])  # h' = 12: not a multiple of 8 (SDPA pads or falls back); MoSAIC's masks
def test_cuda_tiled_bf16_matches_reference(T: int, sparsity: int, heads: int, head_dim: int, tile_all: bool,
                                           masks: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA dispatch under bf16 autocast takes the tiled kernels (c = 256 and 250 slots; c = 32 inside
    whole_head_disabled) and stays as close to the fp32 reference on the same bf16-rounded inputs (with MoSAIC's
    masks: the lean core in fp32, which the CPU tests hold to the reference) as PyTorch's bf16 computation of the same
    maths (the lean core side by side), or within rel-RMS 5e-3."""
    import heads.gathered_tiled as gtl
    from heads.gathered import fused_disabled, gathered_heads_fast, whole_head_disabled

    calls: list[int] = []
    tiled = gtl.gathered_heads_tiled
    monkeypatch.setattr(gtl, "gathered_heads_tiled", lambda *a, **k: calls.append(1) or tiled(*a, **k))
    p, rope = bf16_problem_on_cuda(T, sparsity, heads, head_dim)
    visible, self_only = padding_masks(p) if masks else (None, None)

    def fast(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            return gathered_heads_fast(p["x"], p["positions"], p["sel"], p["r"] * p["sel"].valid, p["w_qkv"], p["w_o"],
                                       rope, visible, self_only)

    if masks:
        with fused_disabled():
            expected = outputs_and_grads(p, lambda: fast(torch.float32))
    else:
        expected = outputs_and_grads(p, lambda: run_reference(p, rope))

    with whole_head_disabled() if tile_all else contextlib.nullcontext():
        got = outputs_and_grads(p, fast)
    assert calls, "the tiled kernels were not taken"
    with fused_disabled():
        lean = outputs_and_grads(p, fast)
    rel = lambda a, b: ((a.float() - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()  # noqa: E731
    for name, g, ln, r in zip(NAMES, got, lean, expected):
        assert rel(g, r) <= max(5e-3, rel(ln, r)), f"{name}: {rel(g, r):.2e}, lean bf16 {rel(ln, r):.2e}"


@TRITON_KERNELS
def test_tiled_saves_no_gathered_tensor() -> None:
    """Autograd keeps nothing of size [B, H, c, h] or [B, H, c, c]: the largest saved tensor is x, a weight or one of
    the [H, B, c, h'] tensors (Q, K, V, A)."""
    p = problem(100, 2, 12, device=TRITON_DEVICE)
    B, H, c = p["sel"].idx.shape
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        run_tiled(p, RotaryEmbedding(HEAD_DIM, 0.5).to(TRITON_DEVICE))
    largest = max(t.numel() for t in saved)
    assert largest <= max(p["x"].numel(), p["w_qkv"].numel(), H * B * c * HEAD_DIM), [tuple(t.shape) for t in saved]
    assert largest < B * H * c * min(c, p["x"].shape[-1]) / 3


@pytest.mark.slow  # dynamo + AOT tracing of a 2-layer model, kernels interpreted
@TRITON_KERNELS
def test_tiled_path_compiles_fullgraph(tiled_path: list[int]) -> None:
    """trainer.compile on the tiled path: the training loss of a dense + MoSA + MoSAIC model compiles with
    fullgraph=True (the Triton steps are opaque custom ops, SDPA is traced) and equals eager, loss and every
    gradient."""
    assert_compiles_fullgraph(tiled_path)


@pytest.mark.skipif(TRITON_DEVICE != "cuda", reason="needs a GPU and compiled Triton (TRITON_INTERPRET unset); no GPU "
                    "here (on CPU: test_tiled_path_compiles_fullgraph routes the fast path to the kernels by hand)")
def test_cuda_tiled_dispatch_compiles_fullgraph(monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.compile as on a GPU: inductor, fullgraph, through the real dispatch (gathered_heads_fast -> cuda_core ->
    the tiled kernels, imported inside the trace) for MoSA and MoSAIC heads of 128 slots in fp32 (past the fused
    kernels' fp32 limit); loss and every gradient equal eager within fp32 rounding."""
    import heads.gathered_tiled as gtl
    from lm.module import LMModule, compiled
    from tests.conftest import tiny_config

    calls: list[int] = []
    tiled = gtl.gathered_heads_tiled
    monkeypatch.setattr(gtl, "gathered_heads_tiled", lambda *a, **k: calls.append(1) or tiled(*a, **k))
    cfg = tiny_config([{"type": "dense", "count": 1}, {"type": "mosa", "count": 2, "options": {"sparsity": 2}},
                       {"type": "mosaic", "count": 2, "options": {"sparsity": 2}}], n_layers=2, seq_len=256)
    module = LMModule(cfg).cuda().train()
    x, y = (torch.randint(0, 97, (2, 256), device="cuda") for _ in range(2))
    torch._dynamo.reset()
    results = []
    for fn in (module.losses, compiled(module.losses)):
        torch.manual_seed(0)
        loss = fn(x, y)[0]
        results.append([loss.detach(), *torch.autograd.grad(loss, list(module.parameters()))])
    torch._dynamo.reset()
    assert calls, "the tiled kernels were not taken"
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=1e-4, atol=1e-5)


@triton.jit
def _offsets(OUT, t, i, b, H, B, C, D, BLOCK: tl.constexpr):
    """The element offsets of the last BLOCK slots of (term t, head i, sequence b) in a [TERMS, H, B, C, D] tensor."""
    slots = C - BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + tl.arange(0, BLOCK), _slot_offsets(t, i, b, H, B, C, slots) * D)


@TRITON_KERNELS
def test_kernel_offsets_do_not_wrap_at_2_to_the_31() -> None:
    """heads/gathered_triton._slot_offsets, which every gathered kernel (fused and tiled) uses for Q/K/V, G and dQKV:
    the offsets are int64, so a problem with H*B*C*h' >= 2^31 (here term 2 of B = 256 sequences, 1200 heads of 128
    slots, h' = 64: offsets up to 7.5e9, which the tiled path can reach) addresses its last elements instead of
    wrapping as int32 products would (the interpreter's int32 arithmetic wraps as the GPU's does)."""
    t, i, b, H, B, C, D = 2, 1199, 255, 1200, 256, 128, 64
    out = torch.zeros(16, dtype=torch.int64, device=TRITON_DEVICE)
    _offsets[(1,)](out, t, i, b, H, B, C, D, BLOCK=16)
    expected = [(((t * H + i) * B + b) * C + s) * D for s in range(C - 16, C)]
    assert expected[-1] > 2**32 and out.tolist() == expected


@TRITON_KERNELS
@pytest.mark.parametrize("kernel", ["fused", "tiled"])
def test_kernels_on_heads_that_selected_nothing(kernel: str) -> None:
    """A (sequence, head) whose slots are all padding (a MoSA head no token passed in a short window, an empty
    MoSAIC head): exactly zero output and gradient from it, no NaN, and the other heads as the lean core computes
    them, in the fused and the tiled kernels (the random selections of `problem` never leave a head empty)."""
    from heads.gathered_triton import gathered_heads_triton

    p = problem(33, 4, 3, device=TRITON_DEVICE)
    empty = torch.zeros_like(p["sel"].valid)
    empty[0, 1] = empty[1, 0] = True
    p["sel"] = type(p["sel"])(p["sel"].idx, p["sel"].valid & ~empty)
    rope = RotaryEmbedding(HEAD_DIM, 0.5).to(TRITON_DEVICE)

    def args() -> tuple:  # the gate built anew for each run (the graph is freed by each backward)
        return p["x"], p["positions"], p["sel"].idx, p["r"] * p["sel"].valid, p["w_qkv"], p["w_o"], rope

    fast = (lambda: gathered_heads_triton(*args())) if kernel == "fused" else (lambda: run_tiled(p, rope))
    lean, got = outputs_and_grads(p, lambda: gathered_heads_lean(*args())), outputs_and_grads(p, fast)
    assert all(g.isfinite().all() for g in got)
    assert (got[2][empty] == 0).all()  # no gradient reaches an empty head's router scores
    assert all(want.abs().max() > 0 for want in lean)
    assert_rel_rms(got, lean, REL_RMS_TOL)
    alone = p["sel"].valid.clone()
    alone[0, [0, 2]] = False  # sequence 0 with only its empty head 1: nothing reaches its output
    p["sel"] = type(p["sel"])(p["sel"].idx, alone)
    assert (fast()[0] == 0).all()


@TRITON_KERNELS
@pytest.mark.parametrize("kernel", ["fused", "tiled"])
@pytest.mark.parametrize("head_type,options", [
    ("mosa", {"sparsity": 4, "selection": "expert_choice"}), ("mosa", {"sparsity": 4, "selection": "threshold"}),
    ("fixed", {"sparsity": 3}), ("mosaic", {"sparsity": 2, "padded": "include"}),
    ("mosaic", {"sparsity": 2, "padded": "identity"}),
])
def test_head_groups_on_the_kernels_match_their_reference(kernel: str, head_type: str, options: dict,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole head groups (selection, gates, MoSAIC's padding rules, auxiliary losses) with their fast path routed
    through the fused or the tiled kernels: output and every gradient vs impl=reference at an odd length (the
    kernels were compared with the reference only as bare cores, and in models only for causality)."""
    from heads.gathered_tiled import gathered_heads_tiled
    from heads.gathered_triton import gathered_heads_triton
    from tests.head_checks import assert_match, fast_vs_reference, make_group

    calls = route_fast_path(monkeypatch, gathered_heads_triton if kernel == "fused" else gathered_heads_tiled)
    group = make_group(head_type, options, 37).to(TRITON_DEVICE)
    assert_match(fast_vs_reference(group, 37))
    assert calls
