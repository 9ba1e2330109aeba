"""Slot counts of the capacity-limited routers, in exact arithmetic (no torch: flops/ uses them too).

A capacity factor or sparsity is read as the decimal it was written as (1.1 = 11/10), so ceil(1.1 * 100) is
110, not the 111 that binary floating point gives (1.1 * 100 = 110.00000000000001).
"""
from __future__ import annotations

import math
from fractions import Fraction


def decimal(x: float) -> Fraction:
    """x as the shortest decimal that round-trips (repr), exactly."""
    return Fraction(repr(float(x)))


def slot_capacity(k: int, capacity_factor: float) -> int:
    """ceil(capacity_factor * k): the slots of a MoSA head (causal selections) or a Routing cluster ("nearest")
    that holds k = T / rho tokens on average."""
    return math.ceil(decimal(capacity_factor) * k)


def prefix_quotas(k: int, capacity_factor: float, seq_len: int, capacity: int) -> list[int]:
    """MoSA's prefix quota at every position t < T: q_t = min(capacity, ceil(capacity_factor * k * (t + 1) / T)), in
    Python's unbounded integers (a capacity factor with many digits has a numerator near 1e16, which int64
    products would wrap)."""
    rate = decimal(capacity_factor) * k / seq_len
    return [min(capacity, math.ceil(rate * (t + 1))) for t in range(seq_len)]


def token_choice_capacity(seq_len: int, sparsity: float, capacity_factor: float = 1.0) -> int:
    """Slots per MoSAIC head, k = max(floor(capacity_factor * T / rho), 2): ours, as MoSA's k = T / rho times an MoE
    capacity factor (App. E gives MoSAIC no capacity formula); App. F's minimum of 2."""
    return max(math.floor(decimal(capacity_factor) * seq_len / decimal(sparsity)), 2)
