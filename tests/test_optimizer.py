"""lm/optimizer.py: training's AdamW (fused kernel, two weight-decay groups), and resuming an older checkpoint."""
from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import torch
from torch import nn

from lm.config import OptimConfig
from lm.config_io import load_config
from lm.optimizer import adamw
from tests.synthetic import run_overrides, write_prepared


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


def test_clipping_sees_the_gradient_unscaled_under_a_grad_scaler(tmp_path: Path) -> None:
    """16-mixed (a GradScaler, 2^16): LMModule's optimizer is not fused, so Lightning unscales the gradients before
    the clipping, whose norm (logged as train/grad_norm) is then the gradient's, as in a 32-true run of the same step,
    not 2^16 times it (with the fused kernel Lightning leaves them scaled until the step). Without a scaler: fused."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lm.data import LMDataModule
    from lm.module import LMModule

    data = write_prepared(tmp_path / "data", train_tokens=4000, val_tokens=1000)
    cfg = load_config(None, *run_overrides(data, tmp_path / "run", max_steps=1))
    seen = {}
    for name, plugins in [("32-true", []),
                          ("16-mixed", [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", 2.0**16))])]:
        torch.manual_seed(0)
        trainer = L.Trainer(accelerator="cpu", plugins=plugins, max_steps=1, logger=False, enable_checkpointing=False,
                            limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                            gradient_clip_val=cfg.optim.grad_clip)
        trainer.fit(LMModule(cfg), datamodule=LMDataModule(cfg.data, cfg.model, cfg.trainer.seed))
        seen[name] = (trainer.optimizers[0].param_groups[0]["fused"], float(trainer.callback_metrics["train/grad_norm"]))
    assert seen["32-true"][0] is True and not seen["16-mixed"][0]
    assert 0.5 < seen["16-mixed"][1] / seen["32-true"][1] < 2, seen  # bf16 autocast on CPU: close, not equal
