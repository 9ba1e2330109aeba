"""The non-finite guard: a NaN/inf loss or gradient never reaches the weights.

Before every optimizer step (after the step's backward passes, one per accumulated micro-batch, and
before gradient clipping) the guard checks the optimised loss of the step's micro-batches, every
gradient and every buffer (the head state: routing EMAs, thresholds, and the statistics this step staged for
them). On a bad step it either
- stops the run (`trainer.max_bad_steps: 0`, the default): NonFiniteError naming the step, the
  first offending parameter (and its head group) and the newest checkpoint on disk, which was
  written before the bad step and so holds finite weights; or
- skips the update (up to `trainer.max_bad_steps` bad steps over the whole run, as large-scale
  stacks do after a loss spike): the gradients are dropped so AdamW leaves weights and moments
  untouched, and the head state the step staged is dropped (heads.commit_states(keep=False)), so the state
  stays as it was too; the step still counts (data order and LR schedule stay a function of the step).
  A non-finite committed state buffer (one a checkpoint keeps) cannot be undone by skipping and always stops
  the run.
A non-finite validation loss also stops the run, before that step's checkpoint is written; a huge
finite one is reported as perplexity inf (lm/perplexity.py). StepCheckpoints refuses NaN/inf weights.
Under `16-mixed` the GradScaler already skips steps with inf gradients, so only the loss is checked; under DeepSpeed
ZeRO-2 the gradients live in the engine's partitions (no `.grad`), so only the loss is checked too, and the engine
skips a step whose gradient norm is not finite by itself, leaving weights and moments as they were. Either skip leaves
the head state as it was (LMModule.optimizer_step drops what the step staged). A loss scaler's skips (16-mixed,
DeepSpeed fp16) are how it finds its scale and do not count. Under DeepSpeed the engine's skip is the skip: a bad step
is one the engine skipped in bf16 or fp32 (`engine_skips`: its gradient was not finite) or, in any precision, one whose
loss was not finite (its gradient then is not either); it counts against `max_bad_steps` or stops the run after the
micro-batch that ends it, so weights, moments and head state are still the last good step's. A step with a non-finite
loss that the engine applied all the same (finite gradients) cannot be undone and stops the run.
The skip count is saved in checkpoints (callback state), so a resumed run keeps its budget.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch

from heads import HeadGroup, commit_states
from lm.accumulation import ends_step
from lm.errors import NonFiniteError


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """No NaN/inf entry in any tensor: one fused max-abs over all of them (torch's foreach norm, which
    propagates NaN and cannot overflow), one device sync."""
    tensors = [t for t in tensors if t.numel()]  # e.g. RoPE's inv_freq with model.rope_fraction=0: the norm refuses them
    return not tensors or bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors, norm_type=math.inf)))


def first_nonfinite(named: list[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor with a NaN/inf entry, or None (for the message once a check failed)."""
    if not named:
        return None
    finite = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist()
    return next((n for (n, _), ok in zip(named, finite) if not ok), None)


def owner(module: torch.nn.Module, name: str) -> str:
    """`name` plus the head group that holds it, e.g. `model.blocks.0.attn.groups.1.qkv.weight (mosa heads)`."""
    groups = {n: m.type_name for n, m in module.named_modules() if isinstance(m, HeadGroup)}
    prefix = max((n for n in groups if name.startswith(n + ".")), key=len, default=None)
    return f"{name} ({groups[prefix]} heads)" if prefix else name


class NonFiniteGuard(L.Callback):
    """See the module doc. `newest_checkpoint()` names the checkpoint a stopped run can resume from."""

    def __init__(self, max_bad_steps: int, newest_checkpoint: Callable[[], Path | None], deepspeed: bool = False,
                 engine_skips: bool = False) -> None:
        """`deepspeed`: the DeepSpeed engine steps (and skips); `engine_skips`: a step it skipped is a bad step (bf16 or
        fp32; not fp16's loss scaler)."""
        self.max_bad_steps, self.newest_checkpoint = max_bad_steps, newest_checkpoint
        self.deepspeed, self.engine_skips = deepspeed, engine_skips
        self.skipped = 0
        self._loss: torch.Tensor | None = None  # the step's loss: the sum of its micro-batches' (each already / A)
        self._bad: str | None = None  # DeepSpeed: what was wrong with the step under way, judged once it ends

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        step_loss, self._loss = self._loss, None  # set by the step's backward passes
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # 16-mixed: inf grads are the scaler's job
        grads = [] if scaler is not None else [(n, p.grad) for n, p in pl_module.named_parameters() if p.grad is not None]
        buffers = [(n, b) for n, b in pl_module.named_buffers() if b.is_floating_point()]
        bad = not all_finite([step_loss, *(t for _, t in grads), *(t for _, t in buffers)])  # one sync per step
        if not trainer.strategy.reduce_boolean_decision(bad, all=False):  # any rank: all act
            return
        loss = float(step_loss)
        grad = first_nonfinite(grads)
        kept = pl_module.state_dict(keep_vars=True).keys()  # committed state; staged statistics can be dropped
        buffer = first_nonfinite([(n, b) for n, b in buffers if n in kept])
        staged = first_nonfinite([(n, b) for n, b in buffers if n not in kept])
        step = trainer.global_step + 1  # the step this update would have made
        what = f"loss {loss}" + (f", first non-finite gradient in {owner(pl_module, grad)}" if grad else "") + \
               (f", non-finite buffer {owner(pl_module, buffer)}" if buffer else "") + \
               (f", non-finite staged statistics {owner(pl_module, staged)}" if staged else "")
        if buffer is not None or self.skipped >= self.max_bad_steps:
            self.stop(f"non-finite training at step {step}: {what}")
        if self.deepspeed:  # the engine will skip it (its gradient is not finite either): counted once the step ends
            self._bad = what
            return
        self.count(pl_module, step, what)
        for p in pl_module.parameters():
            p.grad = None  # AdamW skips parameters without a gradient: weights and moments stay as they were
        commit_states(pl_module, keep=False)  # nor does the head state move

    def count(self, pl_module: L.LightningModule, step: int, what: str) -> None:
        """Bad step `step` uses one of `max_bad_steps` (a warning line), or stops the run when none is left."""
        if self.skipped >= self.max_bad_steps:
            self.stop(f"non-finite training at step {step}: {what}")
        self.skipped += 1
        pl_module.print(f"warning: skipped step {step} ({what}); {self.skipped} of trainer.max_bad_steps="
                        f"{self.max_bad_steps} used")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Finite weights can still compute NaN: a non-finite validation loss stops the run before that
        step is checkpointed (this callback runs before StepCheckpoints)."""
        loss = trainer.callback_metrics.get("val/loss")
        if trainer.state.fn == "fit" and loss is not None and not math.isfinite(float(loss)):
            self.stop(f"non-finite validation loss {float(loss)} at step {trainer.global_step}")

    def stop(self, what: str) -> None:
        ckpt = self.newest_checkpoint()
        raise NonFiniteError(
            f"{what}; stopped" + (f" after skipping {self.skipped} bad steps" if self.skipped else "")
            + (f"; last finite checkpoint: {ckpt}" if ckpt else "; no checkpoint written yet")
            + " (lower optim.lr, or set trainer.max_bad_steps to skip a few bad steps)")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.deepspeed and ends_step(trainer, batch_idx):
            bad, self._bad = self._bad, None
            step, applied = trainer.global_step, trainer.model.was_step_applied()  # trainer.model: the engine
            if applied and bad:
                self.stop(f"non-finite training at step {step}: {bad}, but DeepSpeed's engine applied the update "
                          "(every gradient finite)")
            if not applied and (bad or self.engine_skips):
                self.count(pl_module, step, (bad + "; DeepSpeed's engine skipped the update") if bad else
                           "DeepSpeed's engine found the global gradient norm non-finite and skipped the update")
        if self.max_bad_steps:
            pl_module.log("train/skipped_steps", float(self.skipped))

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict["skipped"])
