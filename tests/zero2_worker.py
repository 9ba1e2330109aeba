"""One rank of the ZeRO-2 check in tests/test_deepspeed.py (run as a script, RANK / WORLD_SIZE set).

Raw `deepspeed.initialize` with lm.devices.deepspeed_config (plus the gradient_accumulation_steps that
Lightning adds: MICRO), the LMModule's own AdamW groups and schedule, and its loss; `steps` steps on this
rank's share of each global batch (`global_batch`) in MICRO micro-batches, each loss divided by MICRO and passed to
the backward of lm.train's DeepSpeed precision plugin, and the engine stepped after each, as Lightning does; the
staged head state committed after each step; rank 0 saves the weights, buffers and the engine's gradient norms
to `out`. Then every rank saves the engine's checkpoint as Lightning's DeepSpeedStrategy does (engine around the
LightningModule, tag "checkpoint", Lightning's entries as client state) into `checkpoint_dir(out)`, and rank 0 marks it
complete (lm/checkpoint.mark_complete), for lm.consolidate."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADS = [{"type": "dense", "count": 2}, {"type": "fixed", "count": 3, "options": {"sparsity": 4}},
         # state moved by batch statistics, fast, so that a per-rank update would show (routing/distributed.py)
         {"type": "mosa", "count": 2, "options": {"sparsity": 4, "threshold_momentum": 0.5}},
         {"type": "routing", "count": 2, "options": {"sparsity": 4, "decay": 0.5}}]
GLOBAL_BATCH, STEPS, MICRO = 8, 5, 2


def config():
    from tests.conftest import tiny_config

    cfg = tiny_config(HEADS)
    cfg.data.batch_size = GLOBAL_BATCH
    cfg.optim.warmup_steps, cfg.trainer.max_steps = 2, STEPS
    return cfg


def checkpoint_dir(out: str | Path) -> Path:
    """Where the ranks save their DeepSpeed checkpoint directory, beside `out`."""
    return Path(out).with_name(f"step{STEPS:07d}.ckpt")


def global_batch(step: int, cfg) -> torch.Tensor:
    """[GLOBAL_BATCH, T + 1] tokens of step `step`, the same in every process."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, cfg.model.vocab_size, (GLOBAL_BATCH, cfg.model.seq_len + 1), generator=gen)


class Trainer:
    """The one attribute of Lightning's Trainer that DeepSpeedPrecision.backward uses."""

    def __init__(self, engine: object) -> None:
        self.model = engine


def main(out: str) -> None:
    import deepspeed

    from omegaconf import OmegaConf

    from heads import commit_states
    from lm.checkpoint import COMPLETE
    from lm.module import LMModule
    from lm.devices import LossDividedOnce, deepspeed_config

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = config()
    cfg.data.batch_size = GLOBAL_BATCH // world  # per rank, as with Lightning
    torch.manual_seed(0)
    module = LMModule(cfg)
    opt = module.configure_optimizers()
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt["optimizer"],
                                      lr_scheduler=opt["lr_scheduler"]["scheduler"],
                                      config={**deepspeed_config(cfg), "gradient_accumulation_steps": MICRO})
    assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer" and engine.zero_optimization_stage() == 2
    module.trainer = Trainer(engine)  # what the precision plugin's backward reads: trainer.model, the engine
    precision, norms = LossDividedOnce("32-true"), []
    for step in range(STEPS):
        for tokens in global_batch(step, cfg).chunk(world)[rank].chunk(MICRO):
            loss, _, _ = module.losses(tokens[:, :-1], tokens[:, 1:])
            precision.backward(loss / MICRO, module, None)  # Lightning's closure divides by accumulate_grad_batches
            engine.step()  # Lightning steps the engine after every micro-batch; it updates at the last one
        norms.append(float(engine.get_global_grad_norm()))
        commit_states(module.model)  # the staged head state, as LMModule.optimizer_step does
    if rank == 0:
        torch.save({"state": module.model.state_dict(), "grad_norms": norms}, out)
    lightning_entries = {"epoch": 0, "global_step": STEPS, "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
                         "val_history": [], "run": {}}  # what LMModule.on_save_checkpoint and Lightning add, in part
    engine.save_checkpoint(str(checkpoint_dir(out)), client_state=lightning_entries, tag="checkpoint")
    torch.distributed.barrier()  # every rank's shards are saved: rank 0 marks the directory, as mark_complete does
    if rank == 0:
        (checkpoint_dir(out) / COMPLETE).write_text(f"step {STEPS}, {world} rank(s)\n")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # a clean exit: no communication thread left behind


if __name__ == "__main__":
    main(sys.argv[1])
