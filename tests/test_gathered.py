"""The gathered-head core (heads/gathered.py): memory-lean path vs the plain reference, directly on
random selections (odd T, several ρ and head counts, chunked and unchunked), all gradients including
the router scores; and what the lean path keeps in memory."""
from __future__ import annotations

import pytest
import torch

from heads.gathered import gathered_heads_reference
from heads.gathered_lean import gathered_heads_lean, heads_per_chunk
from heads.rope import RotaryEmbedding
from routing.selection import Selection, earliest_first
from tests.head_checks import REL_MAX_TOL, REL_RMS_TOL

D_MODEL, HEAD_DIM, BATCH = 32, 8, 2


def problem(T: int, sparsity: int, heads: int, seed: int = 0) -> dict:
    """Random x, weights, selection (about T/ρ candidates per head, capacity T/ρ: overflow and padding)
    and raw router scores; every float tensor requires grad."""
    g = torch.Generator().manual_seed(seed)
    c = max(T // sparsity, 2)
    sel = earliest_first(torch.rand(BATCH, heads, T, generator=g) < 1.2 / sparsity, c)
    leaf = lambda *shape, std=1.0: (torch.randn(*shape, generator=g) * std).requires_grad_()  # noqa: E731
    return dict(x=leaf(BATCH, T, D_MODEL), r=torch.rand(BATCH, heads, c, generator=g).requires_grad_(),
                w_qkv=leaf(3 * heads * HEAD_DIM, D_MODEL, std=0.3), w_o=leaf(D_MODEL, heads * HEAD_DIM, std=0.3),
                sel=sel, positions=torch.arange(T).expand(BATCH, T) + 7, cot=torch.randn(BATCH, T, D_MODEL, generator=g))


def run_lean(p: dict, rope: RotaryEmbedding) -> torch.Tensor:
    gate = p["r"] * p["sel"].valid  # r_I on valid slots, 0 on padding (as heads/mosa.py builds it)
    return gathered_heads_lean(p["x"], p["positions"], p["sel"].idx, gate, p["w_qkv"], p["w_o"], rope)


def run_reference(p: dict, rope: RotaryEmbedding) -> torch.Tensor:
    sel: Selection = p["sel"]
    B, H = sel.idx.shape[:2]
    index_sets = [[sel.idx[b, i][sel.valid[b, i]] for i in range(H)] for b in range(B)]
    gates = [[p["r"][b, i][sel.valid[b, i]] for i in range(H)] for b in range(B)]
    return gathered_heads_reference(p["x"], p["positions"], index_sets, gates, p["w_qkv"], p["w_o"], rope)


@pytest.mark.parametrize("T", [100, 257])
@pytest.mark.parametrize("sparsity", [2, 8, 32])
@pytest.mark.parametrize("heads", [3, 42])  # 42 heads: several chunks of T // (4c) heads (and a ragged last one)
def test_lean_matches_reference(T: int, sparsity: int, heads: int) -> None:
    p = problem(T, sparsity, heads)
    rope = RotaryEmbedding(HEAD_DIM, 0.5)
    leaves = [p["x"], p["r"], p["w_qkv"], p["w_o"]]
    results = []
    for run in (run_reference, run_lean):
        y = run(p, rope)
        results.append([y, *torch.autograd.grad((y * p["cot"]).sum(), leaves)])
    for name, ref, lean in zip(["y", "dx", "dr", "dW_qkv", "dW_o"], *results):
        assert ref.abs().max() > 0, name
        rel_rms = ((lean - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
        rel_max = ((lean - ref).abs().max() / ref.abs().max()).item()
        assert rel_rms < REL_RMS_TOL and rel_max < REL_MAX_TOL, f"{name}: rel RMS {rel_rms:.2e}, rel max {rel_max:.2e}"


def test_chunking_is_exercised() -> None:
    """The 42-head cases above really run in several chunks, including a ragged one."""
    sizes = [heads_per_chunk(42, max(T // sparsity, 2), T) for T in (100, 257) for sparsity in (2, 8, 32)]
    assert all(n < 42 for n in sizes) and any(42 % n for n in sizes), sizes


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
