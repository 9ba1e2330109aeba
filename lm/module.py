"""LightningModule: next-token cross-entropy plus the head groups' auxiliary losses, AdamW with the
MoSA App. H schedule, TensorBoard scalars, and `<trainer.out_dir>/metrics.json` after every validation.

Logged scalars: train/loss (CE), train/ppl, train/aux/<name> (each auxiliary loss, already weighted
by its head group), train/loss_total (CE + aux, the optimised loss) (these four: the mean over the step's
micro-batches under gradient accumulation), train/lr, train/grad_norm (the LM's, before clipping; under DeepSpeed
its engine's, of every parameter), train/tokens_seen,
train/tokens_per_s (mean over the run's timed training steps, the runs it resumed included: checkpointed),
train/peak_mem_mib (`peak_memory`),
val/loss, val/ppl, and every `trainer.log_every` steps the head groups' statistics
heads/<module>.<type>/<name> (scalars; per-head stats as TensorBoard histograms). Stats are tensors: reading
them is the only host sync, on logging steps.
`trainer.compile: true` runs the training forward + loss through torch.compile(fullgraph=True).
"""
from __future__ import annotations

import functools
import json
import math
import resource
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from data_prep.atomic import atomic_write
from heads import HeadGroup, commit_states
from lm.accumulation import ends_step, micro_index
from lm.checkpoint import rng_state, set_rng_state
from lm.config import Config
from lm.model import build_model, checkpoint_blocks
from lm.optimizer import adamw
from lm.run_dir import provenance
from lm.perplexity import perplexity
from lm.resume_settings import apply_changes
from lm.schedule import lr_factor
from lm.scoring import PROGRESS_LINE_SECONDS


def compiled(fn: Callable[..., Any], backend: str = "inductor") -> Callable[..., Any]:
    """torch.compile(fn, fullgraph=True): one graph, no breaks. Data-dependent sizes (MiTA's per-expert
    padding width) are captured as symbolic sizes instead of breaking the graph."""
    torch._dynamo.config.capture_scalar_outputs = True
    return torch.compile(fn, fullgraph=True, backend=backend)


def peak_memory(device: torch.device) -> int:
    """Peak bytes so far: torch.cuda.max_memory_allocated on a GPU (no sync), else the process's peak RSS
    (which includes the Python and torch runtime)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def saved_tokens_seen(checkpoint: dict[str, Any]) -> int:
    """Training tokens up to a checkpoint's step: as saved, or for a checkpoint written before tokens_seen was
    saved (no gradient accumulation yet then), step x batch_size x seq_len x devices x nodes of its config."""
    if "tokens_seen" in checkpoint:
        return int(checkpoint["tokens_seen"])
    saved = checkpoint["config"]
    world = saved["trainer"].get("devices", 1) * saved["trainer"].get("num_nodes", 1)
    return checkpoint["global_step"] * saved["data"]["batch_size"] * saved["model"]["seq_len"] * world


class LMModule(L.LightningModule):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = self.build(cfg)
        self.val_history: list[dict[str, float]] = []  # one entry per validation, kept across resumes
        self._resume_rng: dict[str, Any] | None = None
        self._last_time: float | None = None  # end of the previous timed training step
        self._timed = [0, 0.0]  # [tokens, seconds] of the timed training (micro-)batches, resumed runs' included
        self._peak_mem = 0  # peak_memory() after the last training batch
        self._last_train_loss: torch.Tensor | float = math.nan  # the last step's mean training CE
        self._step_sums: dict[str, torch.Tensor] = {}  # this step's logged losses, summed over its micro-batches
        self._head_stats: dict[str, torch.Tensor] = {}  # this step's head_stats(), when it logs them
        self._val_sums = torch.zeros(2, dtype=torch.float64)  # [sum of token CE, token count]
        self._tokens_at = (0, 0)  # (step, tokens seen by then): tokens_seen counts on from the resumed step
        self._last_line = time.perf_counter()  # when progress_line last printed (or training started)
        self.train_losses = compiled(self.losses) if cfg.trainer.compile else self.losses

    def build(self, cfg: Config) -> torch.nn.Module:
        """The model this module trains (a subclass trains another, e.g. lm/compressed_training.py)."""
        return build_model(cfg.model)

    def setup(self, stage: str) -> None:
        if self.cfg.trainer.activation_checkpointing:
            checkpoint_blocks(self.model)  # also the blocks of a model built around a DecoderLM (compression)

    # ---- loss -------------------------------------------------------------------------------
    def losses(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(optimised loss = CE + sum(aux), mean token CE, aux losses) for inputs x and targets y [B, T]."""
        logits = self.model(x)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        aux = self.model.aux_losses
        return ce + sum(aux.values()), ce, aux

    @property
    def tokens_per_batch(self) -> int:
        """Tokens per training (micro-)batch over all devices."""
        return self.cfg.data.batch_size * self.cfg.model.seq_len * self.trainer.world_size

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step over all devices: its accumulated micro-batches."""
        return self.tokens_per_batch * self.trainer.accumulate_grad_batches

    @property
    def tokens_seen(self) -> int:
        """Training tokens up to the current step (exact across resumes with another batch size)."""
        step, tokens = self._tokens_at
        return tokens + (self.trainer.global_step - step) * self.tokens_per_step

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, ce, aux = self.train_losses(*batch)
        micro = micro_index(self.trainer, batch_idx)
        if micro == 0 and self.global_step % self.cfg.trainer.log_every == 0:
            self._head_stats = self.head_stats()  # logged once the step is taken (lm/step_logger.py)
        values = {"train/loss": ce, **{f"train/aux/{name}": value for name, value in aux.items()}}
        if aux:
            values["train/loss_total"] = loss
        if micro == 0:
            self._step_sums = {}
        for name, value in values.items():  # the step's mean over its micro-batches (tensors: no host sync)
            self._step_sums[name] = self._step_sums.get(name, 0.0) + value.detach()
        if ends_step(self.trainer, batch_idx):  # the mean over every rank's micro-batches: the whole global batch
            names = list(self._step_sums)
            sums = torch.stack([self._step_sums[name].float() for name in names])
            means = dict(zip(names, self.trainer.strategy.reduce(sums / self.trainer.accumulate_grad_batches,
                                                                 reduce_op="mean")))
            self._last_train_loss = means.pop("train/loss")
            self.log("train/loss", self._last_train_loss, prog_bar=True)
            self.log("train/ppl", self._last_train_loss.exp())
            self.log_dict(means)
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def head_stats(self) -> dict[str, torch.Tensor]:
        """Every head group's `stats` of the last forward pass, as `heads/<module>.<type>/<name>`."""
        return {f"heads/{name}.{group.type_name}/{stat}": value.detach()
                for name, group in self.model.named_modules() if isinstance(group, HeadGroup)
                for stat, value in group.stats.items()}

    def log_head_stats(self, stats: dict[str, torch.Tensor]) -> None:
        """Write `stats` to the loggers at this step: scalars, and TensorBoard histograms of the others."""
        for logger in self.loggers:
            logger.log_metrics({tag: float(v) for tag, v in stats.items() if v.dim() == 0}, step=self.global_step)
            if isinstance(logger, TensorBoardLogger):
                for tag, value in stats.items():
                    if value.dim() > 0:
                        logger.experiment.add_histogram(tag, value.float().cpu(), self.global_step)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """The optimizer step, then the head groups' staged state updates (heads.commit_states): outside the
        compiled forward, and before any callback checkpoints the step. Under DeepSpeed, which accumulates
        gradients itself, Lightning calls this after every micro-batch: the state moves after the step's last.
        A step that 16-mixed's GradScaler or DeepSpeed's loss scaler skipped (inf gradients) drops what it staged,
        as the weights stay too (the non-finite guard's skip does the same: lm/nonfinite.py)."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)  # 16-mixed: GradScaler
        scale = scaler.get_scale() if scaler is not None else None
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if ends_step(self.trainer, batch_idx):
            deepspeed = self.cfg.trainer.strategy == "deepspeed_stage_2"
            if deepspeed:
                applied = self.trainer.model.was_step_applied()  # trainer.model: the DeepSpeed engine
            else:  # the scaler lowers its scale exactly when it skips a step
                applied = scale is None or scaler.get_scale() >= scale
            commit_states(self.model, keep=applied)  # a CompressedLM's groups too (lm/compressed_training.py)
            if deepspeed:  # its engine clipped, by the norm it took
                norm = self.trainer.model.get_global_grad_norm()  # trainer.model: the DeepSpeed engine
                if norm is not None:
                    self.log("train/grad_norm", norm)

    def on_train_start(self) -> None:
        """Lightning's logging step counts optimizer steps but is advanced after validation, so a checkpoint saved at
        the end of a validation that was not a scheduled one (a time-limit stop) holds step - 1, which a resume kept:
        every training scalar landed one step late (x = kn + 1). Under automatic optimisation it is global_step."""
        self.trainer.fit_loop.epoch_loop._batches_that_stepped = self.trainer.global_step

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._resume_rng is not None:  # first step after a resume: continue the saved RNG streams
            set_rng_state(self._resume_rng)
            self._resume_rng = None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_time is not None:  # the first batch after start or validation is not timed
            self._timed[0] += self.tokens_per_batch
            self._timed[1] += now - self._last_time
        self._last_time = now
        if self._head_stats and ends_step(self.trainer, batch_idx):
            self.log_head_stats(self._head_stats)
            self._head_stats = {}
        self.log("train/tokens_seen", float(self.tokens_seen))
        self._peak_mem = peak_memory(self.device)
        self.log("train/peak_mem_mib", self._peak_mem / 2**20)
        if self._timed[0]:
            self.log("train/tokens_per_s", self.tokens_per_s(), prog_bar=True)
        if ends_step(self.trainer, batch_idx):
            self.progress_line()

    def progress_line(self) -> None:
        """Without a progress bar (stderr not a terminal: a log file, a batch job), one line at a
        trainer.log_every step, at most every PROGRESS_LINE_SECONDS: step, training loss, tokens/s and the training
        time left at that rate (validations and checkpoints not counted), so that a log shows a run is alive
        between validations (the presets validate every 1000 steps: hours apart on a CPU)."""
        step, now = self.trainer.global_step, time.perf_counter()
        if (self.trainer.progress_bar_callback is not None or step % self.cfg.trainer.log_every
                or now - self._last_line < PROGRESS_LINE_SECONDS or not self._timed[0]):
            return
        self._last_line = now
        rate = self.tokens_per_s()
        left = (self.trainer.max_steps - step) * self.tokens_per_step / rate
        self.print(f"step {step:>6}/{self.trainer.max_steps} | train loss {float(self._last_train_loss):.4f} | "
                   f"{rate:8.0f} tokens/s | training left {timedelta(seconds=round(left))}")

    def tokens_per_s(self) -> float:
        tokens, seconds = self._timed
        return tokens / seconds if seconds > 0 else math.nan

    # ---- validation -------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_sums = torch.zeros(2, dtype=torch.float64, device=self.device)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        ce = F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten(), reduction="sum")
        self._val_sums += torch.stack([ce.double(), torch.tensor(y.numel(), dtype=torch.float64, device=self.device)])

    def on_validation_epoch_end(self) -> None:
        total, count = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum").tolist()
        loss = total / count
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", perplexity(loss))
        if self.trainer.sanity_checking:
            return
        step = self.trainer.global_step
        if not self.val_history or self.val_history[-1]["step"] != step:
            self.val_history.append({"step": step, "tokens_seen": self.tokens_seen,
                                     "val_loss": loss, "val_ppl": perplexity(loss)})
        speed = f" | {self.tokens_per_s():8.0f} tokens/s" if self._timed[0] else ""
        self.print(f"step {step:>6} | val loss {loss:.4f} | val ppl {perplexity(loss):9.2f} | "
                   f"{self.tokens_seen / 1e6:7.2f}M tokens{speed}")
        if self.trainer.is_global_zero:
            self.write_metrics()

    def on_validation_end(self) -> None:
        self._last_time = None  # do not count validation time as training time

    def metrics(self) -> dict[str, Any]:
        """The last validation, throughput, size, and the validation history (metrics.json)."""
        last = self.val_history[-1] if self.val_history else {}
        return {
            "step": self.trainer.global_step,
            "tokens_seen": self.tokens_seen,
            "val_loss": last.get("val_loss"),
            "val_ppl": last.get("val_ppl"),
            "val_step": last.get("step"),
            "train_loss": float(self._last_train_loss),
            "tokens_per_s": self.tokens_per_s(),  # all devices together
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type,
            "world_size": self.trainer.world_size,
            "precision": str(self.trainer.precision),
            "peak_mem_bytes": self._peak_mem,  # as of the last training batch (of the last process that trained)
            "params": self.model.num_params(),
            "kv_total": self.model.kv_total(),
            "causal": self.model.causal,  # False: val_loss / val_ppl are teacher-forced and see future tokens
            "seq_len": self.cfg.model.seq_len,
            "history": self.val_history,
        }

    def write_metrics(self) -> None:
        """Write `metrics()` to `<trainer.out_dir>/metrics.json` (atomically)."""
        text = json.dumps(self.metrics(), indent=1)
        atomic_write(Path(self.cfg.trainer.out_dir) / "metrics.json", lambda f: f.write(text.encode()))

    # ---- optimisation -----------------------------------------------------------------------
    @functools.cached_property
    def _own_loss_parameters(self) -> set[int]:
        """ids of the parameters clipped apart from the LM's (HeadGroup.own_loss_parameters), collected once."""
        return {id(p) for g in self.model.modules() if isinstance(g, HeadGroup) for p in g.own_loss_parameters()}

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip to the global L2 norm optim.grad_clip (Lightning's "norm" clipping) and log that norm, taken before
        clipping, as train/grad_norm: one reduction serves both (read on logging steps only). Parameters that only
        their own auxiliary loss trains (HeadGroup.own_loss_parameters: MoSA's predictor) are clipped apart, to
        the same bound, so that their gradient does not scale the LM's. Nothing to do under DeepSpeed, which keeps
        its own gradient partitions and clips them all together itself (its norm, of every parameter, is logged
        after the step: `optimizer_step`), or on a skipped step."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if params and gradient_clip_val:
            own = self._own_loss_parameters
            lm_params = [p for p in params if id(p) not in own]
            norm = torch.nn.utils.get_total_norm([p.grad for p in lm_params], 2.0)
            self.log("train/grad_norm", norm)
            torch.nn.utils.clip_grads_with_norm_(lm_params, gradient_clip_val, norm)
            if len(lm_params) < len(params):
                torch.nn.utils.clip_grad_norm_([p for p in params if id(p) in own], gradient_clip_val)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (lm/optimizer.py) with linear warmup + cosine (lm/schedule.py); torch's fused kernel unless a
        GradScaler scales the gradients (16-mixed), which Lightning unscales before `configure_gradient_clipping` only
        for an optimizer that does not unscale them itself."""
        o = self.cfg.optim
        scaler = getattr(self._trainer.precision_plugin, "scaler", None) if self._trainer is not None else None
        optimizer = adamw(self.model, o, fused=scaler is None)
        factor = functools.partial(lr_factor, warmup_steps=o.warmup_steps, max_steps=self.cfg.trainer.max_steps,
                                   min_lr_ratio=o.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- checkpoints ------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._last_time = None  # do not count checkpoint writing as training time (the save precedes on_train_batch_end)
        checkpoint["config"] = OmegaConf.to_container(OmegaConf.structured(self.cfg))
        # a resumed run that has not trained yet (e.g. one already at max_steps, saved again) keeps the saved streams
        checkpoint["rng"] = self._resume_rng if self._resume_rng is not None else rng_state()
        checkpoint["val_history"] = self.val_history
        checkpoint["run"] = provenance(self.cfg)  # data hashes and tokenizer bytes: usable elsewhere
        checkpoint["tokens_seen"] = self.tokens_seen
        checkpoint["timed"] = list(self._timed)  # tokens_per_s goes on over a resume
        checkpoint["train_last"] = {"loss": float(self._last_train_loss), "peak_mem": self._peak_mem}  # metrics.json

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._resume_rng = checkpoint["rng"]
        self.val_history = list(checkpoint["val_history"])
        self._tokens_at = (checkpoint["global_step"], saved_tokens_seen(checkpoint))
        self._timed = list(checkpoint.get("timed", (0, 0.0)))  # checkpoints before 2026-11-30 did not keep it
        last = checkpoint.get("train_last", {})  # a resume that only validates reports the last step's (2026-12-02)
        self._last_train_loss, self._peak_mem = last.get("loss", math.nan), last.get("peak_mem", 0)
        for message in apply_changes(checkpoint, self.cfg):
            self.print(message)
