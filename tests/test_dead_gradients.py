"""The one-time all-zero-gradient check (lm/dead_gradients.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import lm
from heads import REGISTRY, HeadGroup
from lm.dead_gradients import DeadGradientCheck, zero_gradient_params
from tests.conftest import tiny_config
from tests.head_checks import tiny_options


def _backward(model: torch.nn.Module, T: int = 64) -> None:
    tokens = torch.randint(0, 97, (2, T + 1), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    (loss + sum(model.aux_losses.values())).backward()


@pytest.mark.parametrize("head_type", sorted(REGISTRY))
def test_every_head_type_trains_every_parameter(head_type: str) -> None:
    """One LM backward through a dense + <type> model reaches every parameter (no false warning)."""
    heads = [{"type": "dense", "count": 1}, {"type": head_type, "count": 2, "options": tiny_options(head_type)}]
    model = lm.build_model(tiny_config(heads).model)
    _backward(model)
    unreached = [name for name, p in model.named_parameters() if p.grad is None]  # cut off from the graph
    assert unreached == [] and zero_gradient_params(model) == []


def test_a_group_that_contributes_nothing_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """A head group whose output is multiplied by 0 (as if its gradient path were cut) gets all-zero gradients:
    the check names exactly its parameters, once, in one warning line."""
    model = lm.build_model(tiny_config([{"type": "dense", "count": 1}, {"type": "mosa", "count": 2}], n_layers=1).model)
    group = next(m for m in model.modules() if isinstance(m, HeadGroup) and m.type_name == "mosa")
    group.register_forward_hook(lambda module, args, out: out * 0)
    _backward(model)
    dead = zero_gradient_params(model)
    assert dead == [f"blocks.0.attn.groups.1.{p}" for p, _ in group.named_parameters()]
    check = DeadGradientCheck()
    for _ in range(2):
        check.on_before_optimizer_step(SimpleNamespace(global_step=0), model, None)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: step 1: 3 parameter tensor(s) got an all-zero gradient")
    assert "blocks.0.attn.groups.1.router.weight (mosa heads)" in err[0]


def test_a_gradient_with_no_positive_entry_is_alive() -> None:
    """Only an all-zero gradient is dead: one whose entries are all <= 0 with some exact zeros (an unused bias
    bucket beside used ones) is not, and one of exact zeros is, whatever its sign bit (-0.0)."""
    layer = torch.nn.Linear(3, 1, bias=False)
    layer.weight.grad = torch.tensor([[-0.5, 0.0, -0.2]])
    assert zero_gradient_params(layer) == []
    layer.weight.grad = torch.tensor([[-0.0, 0.0, 0.0]])
    assert zero_gradient_params(layer) == ["weight"]
