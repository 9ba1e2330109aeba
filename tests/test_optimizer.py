"""lm/optimizer.py: training's AdamW (fused kernel, two weight-decay groups), and resuming an older checkpoint."""
from __future__ import annotations

import copy

import torch
from torch import nn

from lm.config import OptimConfig
from lm.optimizer import adamw


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(11, 8), nn.LayerNorm(8), nn.Linear(8, 5))
    m[0].weight.requires_grad_(False)  # frozen: left out
    return m


def train(opt: torch.optim.Optimizer, m: nn.Module, steps: int, seed: int = 1) -> None:
    torch.manual_seed(seed)
    for _ in range(steps):
        for p in m.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
        opt.step()


def test_two_groups_of_the_trainable_parameters_fused() -> None:
    """Weight decay on matrices only (here the Linear's weight), none on vectors (norm weight and bias, the Linear's
    bias); a frozen parameter is in no group; torch's fused kernel."""
    m = model()
    opt = adamw(m, OptimConfig(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1))
    decayed, plain = opt.param_groups
    assert [id(p) for p in decayed["params"]] == [id(m[2].weight)] and decayed["weight_decay"] == 0.1
    assert {id(p) for p in plain["params"]} == {id(m[1].weight), id(m[1].bias), id(m[2].bias)}
    assert plain["weight_decay"] == 0.0
    assert all(g["fused"] and g["lr"] == 1e-3 and g["betas"] == (0.8, 0.95) for g in opt.param_groups)


def test_fused_steps_are_adamws() -> None:
    """Six steps of the fused kernel equal torch's per-parameter AdamW with the same settings (fp32 rounding)."""
    a, b = model(), model()
    o = OptimConfig(lr=1e-2, weight_decay=0.1)
    train(adamw(a, o), a, 6)
    loop = adamw(b, o)
    for g in loop.param_groups:
        g["fused"], g["foreach"] = None, False
    train(loop, b, 6)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
    assert not torch.equal(a[2].weight, model()[2].weight)  # the steps moved the weights


def test_an_older_checkpoint_resumes_with_its_own_kernel() -> None:
    """An optimizer state saved before the fused kernel (AdamW's default then) loads into `adamw` and continues
    bitwise as the optimizer that saved it would have: its param groups, fused None included, come with it."""
    o = OptimConfig(lr=1e-2, weight_decay=0.1)
    old, resumed = model(), model()
    before = torch.optim.AdamW([{"params": [old[2].weight], "weight_decay": 0.1},
                                {"params": [old[1].weight, old[1].bias, old[2].bias], "weight_decay": 0.0}], lr=1e-2)
    train(before, old, 3)
    resumed.load_state_dict(old.state_dict())
    opt = adamw(resumed, o)
    opt.load_state_dict(copy.deepcopy(before.state_dict()))  # as from a file (load_state_dict shares tensors)
    assert not any(g["fused"] for g in opt.param_groups)
    train(before, old, 3, seed=2)
    train(opt, resumed, 3, seed=2)
    assert all(torch.equal(pa, pb) for pa, pb in zip(old.parameters(), resumed.parameters()))
