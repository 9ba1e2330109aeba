"""flash-attn's branch of the attention entry point (heads/attention.py): `attend` where flash-attn runs (CUDA,
16-bit, no explicit mask), as dense and Routing heads call it, and local heads' `sliding_window`.

On CPU, flash_attn_func's documented contract (below, float64) stands in for the CUDA kernel, so the layout
transposes, causal flags, windows and softmax scales each head type hands flash-attn are checked against its
reference: output and every gradient, max-abs and relative RMS error <= 1e-12. With a GPU and flash-attn
installed, the real kernel in bf16 against the fp32 reference."""
from __future__ import annotations

import types

import pytest
import torch

from heads import attention, local
from tests.head_checks import assert_match, fast_vs_reference, make_group, tiny_options

calls: list[tuple] = []  # (causal, window_size, softmax_scale) of each call to the stand-in below


def _flash_contract(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None):  # noqa: ANN001, ANN202
    """flash_attn_func as its docstring defines it, in float64 torch ([B, T, H, d] layout): query i sees keys
    i - window_size[0] <= j <= i + window_size[1] (-1 = unbounded), and j <= i when causal (Tq == Tk)."""
    calls.append((causal, window_size, softmax_scale))
    i, j = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
    ok = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool)
    if window_size[0] >= 0:
        ok &= j >= i - window_size[0]
    if window_size[1] >= 0:
        ok &= j <= i + window_size[1]
    if causal:
        ok &= j <= i
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    return torch.einsum("bhij,bjhd->bihd", s.masked_fill(~ok, float("-inf")).softmax(-1), v)


@pytest.fixture
def flash_stand_in(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """flash-attn 'installed' (the contract above) and usable for every input; the list of its calls."""
    monkeypatch.setattr(attention, "_FLASH_ATTN", types.SimpleNamespace(flash_attn_func=_flash_contract))
    monkeypatch.setattr(attention, "flash_usable", lambda q: True)
    monkeypatch.setattr(local, "flash_usable", lambda q: True)
    calls.clear()
    return calls


@pytest.mark.parametrize("T,window", [(100, 16), (37, 64), (50, 1)])
def test_flash_window_path_matches_reference(T: int, window: int, flash_stand_in: list[tuple]) -> None:
    """Local heads call flash-attn's sliding-window kernel: window_size = (window - 1, 0) with causal=True gives
    i - window < j <= i."""
    group = make_group("local", dict(window=window), T, dtype=torch.float64)
    assert_match(fast_vs_reference(group, T), 1e-12, 1e-12)
    assert flash_stand_in and all(c == (True, (window - 1, 0), None) for c in flash_stand_in)


@pytest.mark.parametrize("head_type,T", [("dense", 100), ("dense", 37), ("routing", 100), ("routing", 53)])
def test_attend_flash_branch_matches_reference(head_type: str, T: int, flash_stand_in: list[tuple]) -> None:
    """Dense heads (causal, default scale) and Routing heads (causal attention within cluster slots, their own
    scale) through `attend`'s flash branch."""
    group = make_group(head_type, tiny_options(head_type), T, dtype=torch.float64)
    assert_match(fast_vs_reference(group, T), 1e-12, 1e-12)
    scale = getattr(group, "scale", None)
    assert flash_stand_in and all(c == (True, (-1, -1), scale) for c in flash_stand_in)


def test_attend_takes_causal_or_a_mask_not_both() -> None:
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"^attend: pass either causal=True or an explicit mask, not both$"):
        attention.attend(q, q, q, causal=True, mask=torch.ones(5, 5, dtype=torch.bool).tril())


def test_attend_causal_needs_equal_query_and_key_lengths() -> None:
    """causal=True with Tq != Tk would mean different masks on flash-attn (bottom-right) and SDPA (top-left)."""
    q, kv = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"^attend: causal=True needs as many queries as keys, got 3 and 5$"):
        attention.attend(q, kv, kv, causal=True)


@pytest.mark.skipif(not torch.cuda.is_available() or attention.flash_attn_interface() is None,
                    reason="flash-attn runs on CUDA with flash-attn installed; not here")
@pytest.mark.parametrize("head_type,options", [("local", {"window": 64}), ("dense", {}), ("routing", {"sparsity": 4})])
def test_flash_on_cuda_matches_reference(head_type: str, options: dict) -> None:
    """bf16 flash-attn vs the float32 reference on the same GPU: relative RMS < 1e-2 on the output, < 2e-2 on the
    input and every parameter gradient (bf16 backward)."""
    T = 300
    group = make_group(head_type, options, T, dtype=torch.float32).cuda()
    x = torch.randn(2, T, 32, device="cuda", requires_grad=True)
    pos = torch.arange(T, device="cuda")[None].expand(2, -1)
    cot = torch.randn(2, T, 32, device="cuda")
    inputs = [x, *group.parameters()]
    ref = group.forward_reference(x, pos)
    ref_grads = torch.autograd.grad(ref, inputs, cot)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fast = group.forward_fast(x, pos).float()
    fast_grads = torch.autograd.grad(fast, inputs, cot)
    assert ((fast - ref).norm() / ref.norm()).item() < 1e-2
    for r, f in zip(ref_grads, fast_grads):
        assert ((f.float() - r).norm() / r.norm()).item() < 2e-2
