"""Causal sliding-window heads (heads/local.py)."""
from __future__ import annotations

import pytest
import torch

import lm
from heads import ConfigError
from lm.causality import future_leak
from tests.conftest import tiny_config
from tests.head_checks import assert_match, fast_vs_reference, make_group, saved_for_backward


@pytest.mark.parametrize("T", [100, 257, 5])
@pytest.mark.parametrize("window", [1, 2, 3, 16, 60, 300])
def test_fast_matches_reference(T: int, window: int) -> None:
    """Every band layout (heads/local.py band_layout): one-row blocks (window 1), blocks of the window's rows and one
    block back (2, 3, 16), the whole square masked (60 at T = 100, 300 > T), one key block where the sequence has
    one block (T = 5, window 3)."""
    group = make_group("local", dict(window=window), T)
    assert_match(fast_vs_reference(group, T))


def test_band_layout_holds_every_key_and_takes_the_square_where_it_is_cheaper() -> None:
    """Blocks of w rows with one block back hold every key of the window (2w keys a query); with 3 key blocks,
    blocks of ceil(w / 2) rows (1.5w keys); the masked causal square where that scores fewer keys (a window near
    T: it scored 2.6x the formula's FLOPs in blocks at w = 200, T = 256)."""
    from heads.local import band_layout

    assert band_layout(1024, 256) == (256, 2) and band_layout(1024, 256, blocks=3) == (128, 3)
    assert band_layout(256, 200) == (256, 1) and band_layout(100, 60) == (100, 1)  # the square: fewer keys
    assert band_layout(64, 1) == (1, 1) and band_layout(5, 2) == (2, 2) and band_layout(5, 3) == (5, 1)
    for T, w, blocks in ((1024, 256, 2), (1000, 255, 3), (333, 17, 2), (333, 17, 5), (64, 2, 3)):
        block, taken = band_layout(T, w, blocks)
        assert (taken - 1) * block >= w - 1  # the earliest key of a block's first query is in the blocks taken


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
