"""Run an entry point (train_lm.py, or -m MODULE) with Lightning's DeepSpeedStrategy on CPU (gloo), for
tests/test_deepspeed.py: Lightning and lm.devices refuse DeepSpeed without CUDA, so their four refusals are patched
here, and Lightning's launcher command for ranks > 0, nothing else: DeepSpeedStrategy.setup_environment (CUDA
accelerator check; DDP's set-up instead), Lightning's device-index check (CPU devices have index None), the
device_rank=None Lightning hands deepspeed.initialize on CPU (DeepSpeed compares it with 0), and
lm.devices.build_strategy's CUDA check (patched where lm.train calls it). With
trainer.devices > 1, Lightning starts the other ranks by running this process's command line again, which after
runpy is the bare entry point: they run this harness around it instead. NAN_GRADIENT_AT_STEP=n[,m...] (environment)
poisons one gradient at those steps, NAN_LOSS_AT_STEP=n[,m...] the loss (`poison`).

    python tests/deepspeed_on_cpu.py train_lm.py --config ... trainer.strategy=deepspeed_stage_2
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def patch() -> None:
    import deepspeed
    import lightning.pytorch.strategies.deepspeed as lightning_deepspeed
    import torch
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    import lm.train

    DeepSpeedStrategy.setup_environment = lambda self: DDPStrategy.setup_environment(self)
    lightning_deepspeed._validate_device_index_selection = lambda devices: None
    initialize = deepspeed.initialize

    def initialize_on_cpu(*args: Any, **kwargs: Any) -> Any:
        if getattr(kwargs.get("args"), "device_rank", 0) is None:
            kwargs["args"] = argparse.Namespace(device_rank=0)
        return initialize(*args, **kwargs)

    deepspeed.initialize = initialize_on_cpu
    build_strategy = lm.train.build_strategy

    def cpu_strategy(cfg: Any) -> Any:
        available, accelerator = torch.cuda.is_available, cfg.trainer.accelerator
        torch.cuda.is_available, cfg.trainer.accelerator = (lambda: True), "auto"
        try:
            return build_strategy(cfg)
        finally:
            torch.cuda.is_available, cfg.trainer.accelerator = available, accelerator

    lm.train.build_strategy = cpu_strategy

    import lightning.pytorch.strategies.launchers.subprocess_script as launcher

    def harness_command() -> list[str]:  # ranks > 0: this harness around the entry point rank 0 runs
        import __main__

        spec = getattr(__main__, "__spec__", None)
        entry = ["-m", spec.name] if spec is not None else [sys.argv[0]]
        return [sys.executable, __file__, *entry, *sys.argv[1:]]

    launcher._basic_subprocess_cmd = harness_command
    poison(*({int(n) for n in os.environ.get(name, "").split(",") if n} for name in ("NAN_GRADIENT_AT_STEP",
                                                                                     "NAN_LOSS_AT_STEP")))


def poison(gradient_steps: set[int], loss_steps: set[int]) -> None:
    """For tests of the non-finite guard: while trainer.global_step is in `gradient_steps`, the model's first parameter
    gets a NaN gradient (a tensor hook, before DeepSpeed's reduction) and the loss stays finite; in `loss_steps` the
    optimised loss is NaN (and so is every gradient)."""
    from lm.module import LMModule

    setup, losses = LMModule.setup, LMModule.losses

    def poisoned_setup(self: Any, stage: str) -> None:
        setup(self, stage)
        next(self.model.parameters()).register_hook(
            lambda grad: grad * float("nan") if self.trainer.global_step in gradient_steps else grad)

    def poisoned_losses(self: Any, *batch: Any) -> Any:  # LMModule.train_losses and validation's
        loss, ce, aux = losses(self, *batch)
        return (loss * float("nan") if self.training and self.trainer.global_step in loss_steps else loss), ce, aux

    LMModule.setup, LMModule.losses = poisoned_setup, poisoned_losses


if __name__ == "__main__":
    patch()
    if sys.argv[1] == "-m":
        module, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(str(ROOT / sys.argv[0]), run_name="__main__")
