"""Settings that may change on `--resume`: applied to the restored optimizer and schedule, and reported.

A checkpoint restores AdamW's param groups and the LambdaLR's base learning rates as they were, so a
changed `optim.lr`, `optim.betas` or `optim.weight_decay` would be silently ignored; `apply_changes`
rewrites them in the checkpoint before Lightning restores it. The schedule's shape
(`optim.warmup_steps`, `optim.min_lr_ratio`, `trainer.max_steps`) and `optim.grad_clip` are read from
the current config anyway; they are reported too. A changed `data.batch_size` (or device count) changes
tokens per step from then on: `tokens_seen` continues from the checkpoint's count.
"""
from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from heads import ConfigError
from lm.config import Config
from lm.schedule import lr_factor


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value


OTHER_SETTINGS = (("trainer", "max_steps"), ("data", "batch_size"))  # besides every optim.* field
# held in the optimizer's param groups, which a DeepSpeed checkpoint keeps in its own shards: Lightning's part of it
# has no optimizer_states for apply_changes to rewrite
OPTIMIZER_GROUP_SETTINGS = ("optim.lr", "optim.betas", "optim.weight_decay")


def reported_here(key: str) -> bool:
    """Whether a change of the dotted config `key` on resume is applied and reported by this module
    (lm/run_dir.py reports the other resumable changes)."""
    section, _, name = key.partition(".")
    return section == "optim" or (section, name) in OTHER_SETTINGS


def changed_settings(saved: dict[str, Any], cfg: Config) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (saved, current)} over optim.*, trainer.max_steps and data.batch_size."""
    current = OmegaConf.to_container(OmegaConf.structured(cfg))
    keys = [("optim", k) for k in current["optim"]] + list(OTHER_SETTINGS)  # type: ignore[index]
    out = {}
    for section, key in keys:
        old, new = _plain(saved.get(section, {}).get(key)), _plain(current[section][key])  # type: ignore[index]
        if old != new:
            out[f"{section}.{key}"] = (old, new)
    return out


SCHEDULE = {"optim.lr", "optim.warmup_steps", "optim.min_lr_ratio", "trainer.max_steps"}  # what lr(step) depends on


def learning_rate(step: int, optim: dict[str, Any], max_steps: int) -> float:
    """lr at optimizer step `step` of the schedule (lm/schedule.py) with these optim settings and max_steps."""
    return optim["lr"] * lr_factor(step, optim["warmup_steps"], max_steps, optim["min_lr_ratio"])


def apply_changes(checkpoint: dict[str, Any], cfg: Config) -> list[str]:
    """Rewrite the checkpoint's optimizer/scheduler state for the current optim settings; one message per
    changed setting, saying what happens to it. One-line ConfigError for a changed lr, betas or weight decay in a
    checkpoint without optimizer_states (DeepSpeed's, checked only once a checkpoint is loaded: a --resume that
    finds none starts again with the new settings)."""
    changes = changed_settings(checkpoint["config"], cfg)
    kept = [f"{key}: {old} -> {new}" for key, (old, new) in changes.items() if key in OPTIMIZER_GROUP_SETTINGS]
    if kept and "optimizer_states" not in checkpoint:  # DeepSpeed's: it would restore the old groups, silently
        raise ConfigError(f"--resume under trainer.strategy=deepspeed_stage_2 cannot change {'; '.join(kept)}: DeepSpeed "
                          "restores the optimizer's settings from its checkpoint; resume with the saved values")
    o, step = cfg.optim, checkpoint.get("global_step", 0)
    optim = OmegaConf.to_container(OmegaConf.structured(o))
    for opt_state, sched in zip(checkpoint.get("optimizer_states", []), checkpoint.get("lr_schedulers", [])):
        for i, group in enumerate(opt_state["param_groups"]):  # the next step's rate, on the new schedule
            group.update(lr=learning_rate(step, optim, cfg.trainer.max_steps), initial_lr=o.lr, betas=tuple(o.betas))
            if i == 0:  # group 0 holds the matrices (lm/optimizer.adamw), group 1 never decays
                group["weight_decay"] = o.weight_decay
        sched["base_lrs"] = [o.lr] * len(sched.get("base_lrs", []))
        if "_last_lr" in sched:
            sched["_last_lr"] = [g["lr"] for g in opt_state["param_groups"]]
    how = {"data.batch_size": "tokens_seen continues from the checkpoint's count; later batches differ from "
                              "an uninterrupted run, and validation now averages data.val_batches batches of the new "
                              "size, another set of windows: the validation curve changes its yardstick here"}
    lines = [f"--resume: {key} changed {old} -> {new}: {how.get(key, 'applied from this step on')}"
             for key, (old, new) in changes.items()]
    if SCHEDULE & set(changes):
        saved = checkpoint["config"]
        before, after = learning_rate(step, saved["optim"], saved["trainer"]["max_steps"]), \
            learning_rate(step, optim, cfg.trainer.max_steps)
        lines.append(f"--resume: the learning rate at step {step} moves from {before:.3g} to {after:.3g} (the warm-up "
                     f"and cosine follow the new settings)")
    if step >= cfg.trainer.max_steps:
        lines.append(f"--resume: the checkpoint is at step {step}, trainer.max_steps is {cfg.trainer.max_steps}: nothing "
                     "is left to train (raise trainer.max_steps to train on)")
    return lines

