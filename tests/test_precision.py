"""One training step of every head type under bf16-mixed and bf16-true on CPU (Lightning precision plugins)."""
from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from heads import REGISTRY
from lm.config_io import load_config
from lm.data import LMDataModule
from lm.module import LMModule
from tests.head_checks import tiny_options
from tests.synthetic import run_overrides, write_prepared


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_prepared(tmp_path_factory.mktemp("prepared"), train_tokens=4000, val_tokens=1000)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("head", sorted(REGISTRY))
@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_one_bf16_training_step(data: Path, tmp_path: Path, head: str, precision: str, impl: str) -> None:
    options = {**tiny_options(head), "impl": impl}
    heads = f"[{{type: dense, count: 1}}, {{type: {head}, count: 2, options: {options}}}]".replace("'", "")
    cfg = load_config(None, *run_overrides(data, tmp_path, max_steps=1), f"model.heads={heads}", "data.batch_size=2")
    torch.manual_seed(0)
    module = LMModule(cfg)
    before = {k: v.detach().clone() for k, v in module.named_parameters()}
    trainer = L.Trainer(accelerator="cpu", precision=precision, max_steps=1, logger=False, enable_checkpointing=False,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=LMDataModule(cfg.data, cfg.model, cfg.trainer.seed))
    assert trainer.global_step == 1
    assert torch.isfinite(torch.as_tensor(module._last_train_loss))
    moved = [k for k, v in module.named_parameters() if not torch.equal(v.detach().float(), before[k].float())]
    assert any("groups.1." in k for k in moved), f"no {head} parameter was updated"
    halved = [k for k, b in module.named_buffers() if b.dtype in (torch.bfloat16, torch.float16)]
    assert not halved, f"state buffers cast to 16 bits: {halved}"  # routing/float32_state.py
