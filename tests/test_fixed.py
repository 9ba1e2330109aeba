"""Fixed strided heads (heads/fixed.py, MoSA App. A): I = [0, ρ, 2ρ, ...], r = 1."""
from __future__ import annotations

import pytest
import torch

import lm
from lm.causality import future_leak
from tests.conftest import tiny_config
from tests.head_checks import assert_match, fast_vs_reference, make_group


@pytest.mark.parametrize("T", [100, 257, 3])
@pytest.mark.parametrize("sparsity", [1, 4, 32])
def test_fast_matches_reference(T: int, sparsity: int) -> None:
    group = make_group("fixed", dict(sparsity=sparsity), T)
    errors = fast_vs_reference(group, T)
    assert set(errors) == {"output", "grad_x", "grad_qkv.weight", "grad_out.weight"}
    assert_match(errors)


def test_only_strided_positions_get_output() -> None:
    T, rho = 50, 8
    group = make_group("fixed", dict(sparsity=rho), T)
    y = group(torch.randn(2, T, 32), torch.arange(T).expand(2, T))
    got = (y.abs().sum(-1) > 0).any(0).nonzero()[:, 0]
    assert torch.equal(got, torch.arange(0, T, rho))
    assert group.kv_entries(T) == 3 * 7  # ceil(50 / 8) tokens per head


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_equals_mosa_with_fixed_selection_and_constant_router(impl: str) -> None:
    """Fixed = MoSA with I = [0, ρ, ...] and r = 1 (App. A): a MoSA group with the same projections, its selection
    forced to the strided set and a zero router (r = σ(0) = 1/2, which scales every head's output, so the model
    output and its input gradient are exactly half the fixed group's). MoSA runs its fast path, whose `select` can
    be forced; its reference is compared with that path in tests/test_mosa.py."""
    from routing.selection import Selection

    T, rho = 40, 4
    fixed = make_group("fixed", dict(sparsity=rho, impl=impl), T)
    mosa = make_group("mosa", dict(sparsity=rho, selection="expert_choice"), T)
    mosa.qkv.weight.data.copy_(fixed.qkv.weight), mosa.out.weight.data.copy_(fixed.out.weight)
    torch.nn.init.zeros_(mosa.router.weight)
    idx = torch.arange(0, T, rho).expand(2, 3, -1)
    mosa.select = lambda scores: Selection(idx, torch.ones_like(idx, dtype=torch.bool))
    x, pos = torch.randn(2, T, 32, requires_grad=True), torch.arange(T).expand(2, T)
    y_fixed, y_mosa = fixed(x, pos), mosa(x, pos)
    torch.testing.assert_close(y_mosa, 0.5 * y_fixed)
    cot = torch.randn_like(y_fixed)
    (g_fixed,), (g_mosa,) = torch.autograd.grad(y_fixed, x, cot), torch.autograd.grad(y_mosa, x, cot)
    torch.testing.assert_close(g_mosa, 0.5 * g_fixed)


def test_causal() -> None:
    cfg = tiny_config([{"type": "dense", "count": 1}, {"type": "fixed", "count": 3, "options": {"sparsity": 4}}], init_std=0.3)
    model = lm.build_model(cfg.model)
    assert model.causal
    assert future_leak(model, torch.randint(0, 97, (2, 64)), t=30, vocab_size=97) <= 1e-5


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_selection_follows_positions_not_indices(impl: str) -> None:
    """The pattern is a function of position: with positions 0..T-1 in one row and 3..T+2 in the other (a window
    that starts mid-sequence), exactly the tokens at multiples of ρ get an output, the two paths agree, and
    decoding token by token (which tests each position) gives the full pass's output (fp64)."""
    T, rho, B = 21, 4, 2
    group = make_group("fixed", dict(sparsity=rho, impl=impl), T, dtype=torch.float64)
    x = torch.randn(B, T, 32, dtype=torch.float64)
    pos = torch.stack([torch.arange(T), torch.arange(T) + 3])
    y = group(x, pos)
    for b in range(B):
        assert torch.equal((y[b].abs().sum(-1) > 0).nonzero()[:, 0], (pos[b] % rho == 0).nonzero()[:, 0])
    other = make_group("fixed", dict(sparsity=rho, impl="fast" if impl == "reference" else "reference"), T,
                       dtype=torch.float64)
    other.load_state_dict(group.state_dict())
    torch.testing.assert_close(other(x, pos), y, rtol=0, atol=1e-12)
    cache = group.new_cache(B, T + 3, dtype=torch.float64)
    steps = [group(x[:, :5], pos[:, :5], cache)] + [group(x[:, t : t + 1], pos[:, t : t + 1], cache) for t in range(5, T)]
    torch.testing.assert_close(torch.cat(steps, 1), y, rtol=0, atol=1e-12)
