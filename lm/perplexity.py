"""Perplexity = exp(mean token cross-entropy in nats), inf where exp overflows (loss > ~709.78)."""
from __future__ import annotations

import math


def perplexity(loss: float) -> float:
    """exp(loss); inf instead of an OverflowError for a huge finite loss, nan for a nan loss."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf
