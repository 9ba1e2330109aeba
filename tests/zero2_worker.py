"""One rank of the ZeRO-2 check in tests/test_deepspeed.py (run as a script, RANK / WORLD_SIZE set).

Raw `deepspeed.initialize` with lm.train.deepspeed_config (plus the gradient_accumulation_steps that
Lightning adds), the LMModule's own AdamW groups and schedule, and its loss; `steps` steps on this
rank's share of each global batch (`global_batch`), the staged head state committed after each step; rank 0
saves the weights and buffers to `out`."""
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
GLOBAL_BATCH, STEPS = 8, 5


def config():
    from tests.conftest import tiny_config

    cfg = tiny_config(HEADS)
    cfg.data.batch_size = GLOBAL_BATCH
    cfg.optim.warmup_steps, cfg.trainer.max_steps = 2, STEPS
    return cfg


def global_batch(step: int, cfg) -> torch.Tensor:
    """[GLOBAL_BATCH, T + 1] tokens of step `step`, the same in every process."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, cfg.model.vocab_size, (GLOBAL_BATCH, cfg.model.seq_len + 1), generator=gen)


def main(out: str) -> None:
    import deepspeed

    from heads import commit_states
    from lm.module import LMModule
    from lm.train import deepspeed_config

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = config()
    cfg.data.batch_size = GLOBAL_BATCH // world  # per rank, as with Lightning
    torch.manual_seed(0)
    module = LMModule(cfg)
    opt = module.configure_optimizers()
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=module.model, optimizer=opt["optimizer"],
                                      lr_scheduler=opt["lr_scheduler"]["scheduler"],
                                      config={**deepspeed_config(cfg), "gradient_accumulation_steps": 1})
    assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer" and engine.zero_optimization_stage() == 2
    for step in range(STEPS):
        tokens = global_batch(step, cfg).chunk(world)[rank]
        loss, _, _ = module.losses(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        commit_states(module.model)  # the staged head state, as LMModule.optimizer_step does
    if rank == 0:
        torch.save(module.model.state_dict(), out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # a clean exit: no communication thread left behind


if __name__ == "__main__":
    main(sys.argv[1])
