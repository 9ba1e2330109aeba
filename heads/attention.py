"""The one attention kernel entry point shared by all heads: flash-attn when it can run, else SDPA.

Layout everywhere: q[B, H, Tq, d], k/v[B, H, Tk, d] -> out[B, H, Tq, d].
flash-attn is used only on CUDA, for fp16/bf16 inputs, with no explicit mask (plain causal or none, or
its own sliding window: `sliding_window`); everything else goes through torch's
scaled_dot_product_attention (which itself picks flash / memory-efficient / math kernels).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _import_flash_attn() -> Any:
    try:
        from flash_attn import flash_attn_interface as fa  # type: ignore[import-not-found]
    except ImportError:
        return None
    return fa


_FLASH_ATTN = _import_flash_attn()  # resolved once at import, so torch.compile sees a constant


def flash_attn_interface() -> Any:
    """flash_attn.flash_attn_interface if flash-attn is installed, else None (one import attempt)."""
    return _FLASH_ATTN


def flash_usable(q: torch.Tensor) -> bool:
    """flash-attn is installed and runs on q's kind: CUDA, fp16/bf16, head dim <= 256."""
    return (flash_attn_interface() is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """flash_attn_func in this module's [B, H, T, d] layout (flash-attn's is [B, T, H, d])."""
    out = flash_attn_interface().flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs)
    return out.transpose(1, 2)


def sliding_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Causal sliding-window attention with flash-attn's own window (only where `flash_usable(q)`): key j is
    visible to query i iff i - window < j <= i, and the kernel computes just that band."""
    return _flash(q, k, v, causal=True, window_size=(window - 1, 0))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(scale q k^T + M) v (MoSA eq. 1; scale defaults to 1 / sqrt(d)). `mask` is boolean (True = may
    attend) and broadcastable to [B, H, Tq, Tk]; `causal` means key j is visible to query i iff j <= i
    (top-left aligned, so it requires Tq == Tk)."""
    if causal and mask is not None:
        raise ValueError("attend: pass either causal=True or an explicit mask, not both")
    if causal and q.shape[-2] != k.shape[-2]:  # flash-attn aligns its causal mask bottom-right, SDPA top-left
        raise ValueError(f"attend: causal=True needs as many queries as keys, got {q.shape[-2]} and {k.shape[-2]}")
    if mask is None and flash_usable(q):
        return _flash(q, k, v, causal=causal, softmax_scale=scale)
    if mask is not None and 2 < mask.dim() < q.dim():
        # SDPA's fused CPU kernel takes only 2-D or full-rank masks; a 3-D one sends it to the math
        # kernel, which keeps the [.., Tq, Tk] probabilities for backward.
        mask = mask.view((1,) * (q.dim() - mask.dim()) + mask.shape)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
