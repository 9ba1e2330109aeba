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
    """Every band layout (heads/local.py band_layout): one-row blocks (window 1), blocks of 1 row and 3 key blocks
    (2, 3), of 8 rows (16 at T = 100, 257), the whole square masked (60 at T = 100, 300 > T), fewer key blocks than
    3 where the sequence has fewer (T = 5)."""
    group = make_group("local", dict(window=window), T)
    assert_match(fast_vs_reference(group, T))


def test_band_layout_scores_about_one_and_a_half_windows() -> None:
    """Blocks of ceil((w - 1) / 2) rows with two blocks back hold every key of the window; a query scores 1.5w keys
    (2w with blocks of w rows and one back, as before), or the causal square where that is less."""
    from heads.local import band_layout

    assert band_layout(1024, 256) == (128, 3) and band_layout(4096, 64) == (32, 3)  # 384 and 96 keys a query
    assert band_layout(256, 200) == (256, 1) and band_layout(100, 60) == (100, 1)  # the square: fewer keys
    assert band_layout(64, 1) == (1, 1) and band_layout(5, 2) == (1, 3)
    for T, w in ((1024, 256), (1000, 255), (333, 17), (64, 2)):
        block, blocks = band_layout(T, w)
        assert (blocks - 1) * block >= w - 1  # the earliest key of a block's first query is in the blocks taken


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
    keys (values) are overlapping views of one copy, [2b + H·T, h'] (window_blocks, b = 32 rows a block here), not
    [H, 3T, h'] (measured at T = 4096, 20 heads of h' = 64, with blocks of w rows: 167 -> 127 MiB kept, time
    unchanged)."""
    T, w, H, d = 256, 65, 4, 8
    group = make_group("local", dict(window=w), T, count=H, head_dim=d)
    saved = saved_for_backward(group, T)
    copies = saved.count(H * 3 * T * d * 4)  # the fused Q/K/V projection's output has that size too: one
    assert sum(saved) < H * T * 2 * w * 4 and copies <= 1 and (2 * 32 + H * T) * d * 4 in saved
