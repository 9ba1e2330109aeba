"""State buffers stay fp32 in a 16-bit model (routing/float32_state.py): MoSA's threshold, k-means centroids, RoPE."""
from __future__ import annotations

import pytest
import torch

from heads.rope import RotaryEmbedding
from routing.kmeans import OnlineKMeans
from routing.threshold import RunningQuantileThreshold


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_cast_keeps_buffers_fp32_and_exact(dtype: torch.dtype) -> None:
    rope, kmeans = RotaryEmbedding(16), OnlineKMeans(2, 3, 8, 0.999)
    freqs, means = rope.inv_freq.clone(), kmeans.means.clone()
    rope.to(dtype), kmeans.to(dtype)
    assert rope.inv_freq.dtype == kmeans.means.dtype == torch.float32
    assert torch.equal(rope.inv_freq, freqs) and torch.equal(kmeans.means, means)  # not a rounded copy
    kmeans.double()  # other casts apply as usual
    assert kmeans.means.dtype == torch.float64


def test_threshold_keeps_moving_in_a_bf16_model() -> None:
    """A small EMA step (momentum 0.02 on a drift of 0.2 at tau ~ 2.25) is below half a bf16 step: a bf16 tau
    would stay put; the fp32 one moves as in an fp32 model."""
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 512) + 1.1
    fp32, half = RunningQuantileThreshold(3, 8, 0.02), RunningQuantileThreshold(3, 8, 0.02).to(torch.bfloat16)
    for t in (fp32, half):
        t.stage(logits)
        t.commit()
    start = half.tau.clone()
    for step in range(20):
        drifted = logits + 0.01 * (step + 1)
        for t, batch in ((fp32, drifted), (half, drifted.bfloat16())):
            t.stage(batch)
            t.commit()
    assert half.tau.dtype == torch.float32
    assert (half.tau - start).min() > 0.03  # a bf16 tau (step 0.0156 at 2.25) would not move at all
    torch.testing.assert_close(half.tau, fp32.tau, rtol=0, atol=0.005)  # only the logits were rounded


def test_kmeans_centroids_move_in_a_bf16_model() -> None:
    """1000 EMA steps (decay 0.999) toward a fixed direction: in bf16, mu * 0.999 rounds back to mu."""
    torch.manual_seed(0)
    kmeans = OnlineKMeans(1, 1, 8, 0.999).to(torch.bfloat16)
    target = torch.nn.functional.normalize(torch.randn(8), dim=0)
    u = target.expand(1, 1, 4, 8).bfloat16()
    before = kmeans.means[0, 0] @ target
    for _ in range(1000):
        nearest = torch.zeros(1, 1, 4, dtype=torch.long)
        kmeans.stage(kmeans.cluster_sums(u, nearest), kmeans.cluster_counts(nearest))
        kmeans.commit()
    after = kmeans.means[0, 0] @ target
    assert kmeans.similarity(u).dtype == torch.bfloat16
    assert after > before + 0.3, (before, after)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_built_under_a_half_default_dtype_the_buffers_are_fp32(dtype: torch.dtype) -> None:
    """Hugging Face's from_pretrained(dtype=torch.bfloat16) builds the model under a 16-bit default dtype: the state
    buffers are still registered in fp32, so an fp32 checkpoint's threshold loads exactly (a bf16 tau rounded onto a
    router logit flips which tokens a MoSA head takes)."""
    saved = RunningQuantileThreshold(3, 8, 0.02).state_dict()
    saved["tau"] = torch.tensor([0.76015627, -1.3, 2.0001])  # none of them a bf16 / fp16 number
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        threshold, kmeans = RunningQuantileThreshold(3, 8, 0.02), OnlineKMeans(2, 3, 8, 0.999, "ema_counts")
    finally:
        torch.set_default_dtype(default)
    assert {b.dtype for m in (threshold, kmeans) for b in m.buffers() if b.is_floating_point()} == {torch.float32}
    threshold.load_state_dict(saved)
    assert torch.equal(threshold.tau, saved["tau"])
