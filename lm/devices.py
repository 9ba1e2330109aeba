"""What a run trains on and how it is spread: the accelerator (CUDA or CPU), the precision, the strategy (DDP, or
DeepSpeed ZeRO-2 around the module's own AdamW), and the checks that the devices, nodes and host memory asked for
exist, each a one-line ConfigError instead of Lightning's or the allocator's traceback (used by lm/train.py)."""
from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision

from data_prep.cores import usable_cores
from heads import ConfigError
from lm.config import Config, TrainerConfig
from lm.model import build_model
from lm.sanity import warn


def lightning_accelerator(t: TrainerConfig) -> str:
    """What the run trains on, "cuda" or "cpu": trainer.accelerator auto (or gpu / cuda, which check_devices refuses
    without a CUDA GPU) is CUDA where there is a CUDA GPU, else CPU. (Lightning's own auto and gpu would pick Apple's
    MPS first, which this stack does not support.)"""
    return "cuda" if t.accelerator != "cpu" and torch.cuda.is_available() else "cpu"


def resolve_precision(t: TrainerConfig) -> str:
    """`auto`: bf16-mixed on a GPU, 32-true on CPU (bf16 matmuls are ~20x slower there)."""
    if t.precision != "auto":
        return t.precision
    return "bf16-mixed" if lightning_accelerator(t) == "cuda" else "32-true"


def deepspeed_config(cfg: Config) -> dict[str, Any]:
    """DeepSpeed ZeRO-2 (optimizer states and gradients partitioned over the ranks) around the
    LMModule's own AdamW and schedule, clipping by global norm at optim.grad_clip. Lightning adds
    gradient_accumulation_steps (trainer.accumulate_grad_batches) and the bf16 section from the trainer's settings."""
    return {
        "train_micro_batch_size_per_gpu": cfg.data.batch_size,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True,  # torch.optim.AdamW as DeepSpeed's client optimizer
    }


class LossDividedOnce(DeepSpeedPrecision):
    """Lightning's DeepSpeed precision plugin, with a backward that leaves the loss as Lightning gives it. Lightning
    already divides each micro-batch's loss by accumulate_grad_batches, and DeepSpeed's engine.backward divides by
    its gradient_accumulation_steps (the same number) again unless told not to (scale_wrt_gas): the gradients came
    out A times too small, and clipping at optim.grad_clip clipped a norm A times too small."""

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("scale_wrt_gas", False)
        super().backward(tensor, model, optimizer, *args, **kwargs)


def build_strategy(cfg: Config) -> Any:
    t = cfg.trainer
    if t.strategy != "deepspeed_stage_2":
        c = cfg.compression  # a full-memory batch (compression.full_prob) leaves the compression layer unused
        if (c is not None and c.mode == "compress" and c.full_prob > 0
                and (t.strategy == "ddp" or t.devices * t.num_nodes > 1)):
            return "ddp_find_unused_parameters_true"  # globally unused parameters keep grad None, as in one process
        return t.strategy  # "auto" or "ddp" (gloo on CPU, NCCL on GPU)
    if lightning_accelerator(t) == "cpu":  # before importing DeepSpeed, which logs its own accelerator warnings
        raise ConfigError("trainer.strategy=deepspeed_stage_2 needs CUDA GPUs (Lightning's DeepSpeedStrategy refuses "
                          "CPU); use strategy=ddp on CPU")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise ConfigError(
            "trainer.strategy=deepspeed_stage_2 needs DeepSpeed (CUDA machines): pip install -e '.[deepspeed]'"
        ) from None
    from lightning.pytorch.strategies import DeepSpeedStrategy

    precision = LossDividedOnce(resolve_precision(t))  # type: ignore[arg-type]
    return DeepSpeedStrategy(config=deepspeed_config(cfg), precision_plugin=precision)


def check_devices(t: TrainerConfig) -> None:
    """The devices asked for exist on this machine (a one-line ConfigError, not Lightning's traceback); more CPU
    processes than cores get a warning."""
    if t.accelerator in ("gpu", "cuda") and t.devices > torch.cuda.device_count():
        raise ConfigError(f"trainer.accelerator={t.accelerator} with trainer.devices={t.devices}, but this machine has "
                          f"{torch.cuda.device_count()} CUDA GPU(s); use trainer.accelerator=cpu or auto")
    if resolve_precision(t) == "16-mixed" and lightning_accelerator(t) == "cpu":
        raise ConfigError("trainer.precision=16-mixed needs a GPU (Lightning runs bf16-mixed on CPU instead, and the "
                          "run would record a precision it did not use); on CPU use 32-true (or bf16-mixed, ~20x slower)")
    if t.num_nodes > 1 and not cluster_launched():
        raise ConfigError(f"trainer.num_nodes={t.num_nodes}, but this process was not launched on a cluster: start it on "
                          "every node with MASTER_ADDR, MASTER_PORT and NODE_RANK set, or through SLURM, torchrun, LSF "
                          "or MPI (alone it would wait for the other nodes forever)")
    cores = usable_cores()
    if lightning_accelerator(t) == "cpu" and t.devices > cores:
        warn(f"trainer.devices={t.devices} on CPU starts {t.devices} training processes on {cores} core(s): "
            f"each gets less than a core, and the run is slower than with trainer.devices={cores}")


def cluster_launched() -> bool:
    """Whether a multi-node launch set this process up: Lightning's SLURM, torchrun, LSF or MPI environment, or the
    variables of a manual launch (MASTER_ADDR and NODE_RANK; Kubeflow sets MASTER_ADDR too)."""
    from lightning.fabric.plugins.environments import (LSFEnvironment, MPIEnvironment, SLURMEnvironment,
                                                       TorchElasticEnvironment)

    if any(env.detect() for env in (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment, MPIEnvironment)):
        return True
    return "MASTER_ADDR" in os.environ and ("NODE_RANK" in os.environ or "RANK" in os.environ)


def check_host_memory(cfg: Config) -> None:
    """The model's fp32 weights fit in this machine's memory (every run builds the whole model on the host first;
    training needs ~4x that): a one-line ConfigError, not the allocator's traceback. Counted on the meta device."""
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with torch.device("meta"):
            params = sum(p.numel() for p in build_model(cfg.model).parameters())
    except RuntimeError as err:
        if "overflow" not in str(err):
            raise
        raise ConfigError(f"model: a weight matrix alone has more than 2**63 bytes; this machine has "
                          f"{have / 2**30:,.0f} GiB of memory") from None
    if 4 * params > have:
        raise ConfigError(f"model: {params / 1e9:.3g}B parameters need {4 * params / 2**30:,.0f} GiB for their fp32 "
                          f"weights alone, more than this machine's {have / 2**30:,.0f} GiB of memory")
