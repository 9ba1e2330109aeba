"""Causal sliding-window heads (heads/local.py)."""
from __future__ import annotations

import pytest
import torch

import lm
from heads import ConfigError
from heads.attention import flash_attn_interface as attention_flash
from lm.causality import future_leak
from tests.conftest import tiny_config
from tests.head_checks import assert_match, fast_vs_reference, make_group, saved_for_backward


@pytest.mark.parametrize("T", [100, 257, 5])
@pytest.mark.parametrize("window", [1, 16, 300])
def test_fast_matches_reference(T: int, window: int) -> None:
    group = make_group("local", dict(window=window), T)
    assert_match(fast_vs_reference(group, T))


def test_window_limits_receptive_field() -> None:
    """Output at i depends on x_j only for i - window < j <= i."""
    T, w = 40, 6
    group = make_group("local", dict(window=w), T)
    x = torch.randn(1, T, 32, requires_grad=True)
    y = group(x, torch.arange(T)[None])
    (grad,) = torch.autograd.grad(y[0, 25].sum(), x)
    touched = (grad[0].abs().sum(-1) > 0).nonzero()[:, 0]
    assert torch.equal(touched, torch.arange(25 - w + 1, 26))
    assert group.kv_entries(T) == 3 * w and group.kv_entries(4) == 3 * 4


def test_causal_and_bad_window() -> None:
    cfg = tiny_config([{"type": "local", "count": 2, "options": {"window": 8}}], init_std=0.3)
    model = lm.build_model(cfg.model)
    assert future_leak(model, torch.randint(0, 97, (2, 64)), t=20, vocab_size=97) <= 1e-5
    with pytest.raises(ConfigError, match="window"):
        tiny_config([{"type": "local", "count": 2, "options": {"window": 0}}])


def test_fast_path_keeps_no_score_or_mask_per_head() -> None:
    """The band mask has no batch/head dimension, so SDPA's fused kernel runs and keeps O(T·h') per
    head for backward: less than one [T, 2w] fp32 score (or float-bias) tensor per head in all. The
    old [B·H·nb, w, 2w] mask kept 4·H·T·2w bytes as a float bias; a 3-D mask ran the math kernel. The blocks'
    keys (values) are overlapping views of one copy, [w + H·T, h'] (window_blocks), not [H, 2T, h'] (measured at
    T = 4096, 20 heads of h' = 64: 167 -> 127 MiB kept, time unchanged)."""
    T, w, H, d = 256, 64, 4, 8
    group = make_group("local", dict(window=w), T, count=H, head_dim=d)
    saved = saved_for_backward(group, T)
    assert sum(saved) < H * T * 2 * w * 4 and H * 2 * T * d * 4 not in saved and (w + H * T) * d * 4 in saved


calls: list[tuple] = []  # (causal, window_size, softmax_scale) of each call to the stand-in below


def _flash_contract(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None):  # noqa: ANN001, ANN202
    """flash_attn_func as its docstring defines it, in float64 torch ([B, T, H, d] layout): query i sees keys
    i - window_size[0] <= j <= i + window_size[1] (-1 = unbounded), and j <= i when causal (Tq == Tk)."""
    calls.append((causal, window_size, softmax_scale))
    T = q.shape[1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    ok = torch.ones(T, T, dtype=torch.bool)
    if window_size[0] >= 0:
        ok &= j >= i - window_size[0]
    if window_size[1] >= 0:
        ok &= j <= i + window_size[1]
    if causal:
        ok &= j <= i
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    return torch.einsum("bhij,bjhd->bihd", s.masked_fill(~ok, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("T,window", [(100, 16), (37, 64), (50, 1)])
def test_flash_window_path_matches_reference(T: int, window: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where flash-attn runs, local heads call its sliding-window kernel: window_size = (window - 1, 0) with
    causal=True gives i - window < j <= i. Checked on CPU with flash_attn_func's documented contract standing in
    for the CUDA kernel (float64; outputs and all gradients)."""
    import types

    from heads import attention, local

    monkeypatch.setattr(attention, "_FLASH_ATTN", types.SimpleNamespace(flash_attn_func=_flash_contract))
    monkeypatch.setattr(local, "flash_usable", lambda q: True)
    calls.clear()
    group = make_group("local", dict(window=window), T, dtype=torch.float64)
    assert_match(fast_vs_reference(group, T), 1e-12, 1e-12)
    assert calls and all(c == (True, (window - 1, 0), None) for c in calls)


@pytest.mark.skipif(not torch.cuda.is_available() or attention_flash() is None,
                    reason="flash-attn's sliding window runs on CUDA with flash-attn installed; not here")
def test_flash_window_on_cuda_matches_reference() -> None:
    """bf16 flash-attn window vs the float32 reference on the same GPU: relative RMS < 1e-2 on the output, < 2e-2
    on the input and every parameter gradient (bf16 backward)."""
    T = 300
    group = make_group("local", dict(window=64), T, dtype=torch.float32).cuda()
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
