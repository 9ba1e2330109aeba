"""The non-finite guard (lm/nonfinite.py): a NaN/inf step stops the run or is skipped, never applied."""
from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from heads import commit_states
from lm.checkpoint import read_checkpoint
from lm.config_io import load_config
from lm.nonfinite import NonFiniteError, NonFiniteGuard
from lm.perplexity import perplexity
from tests.synthetic import run_overrides, write_prepared


class Toy(L.LightningModule):
    """A linear regression whose loss is NaN at the steps in `bad` and whose running-statistic buffer turns NaN at
    the steps in `bad_buffer` (the loss stays finite); records the weights after every step."""

    def __init__(self, bad: set[int], bad_buffer: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.lin, self.bad, self.bad_buffer = torch.nn.Linear(4, 1), bad, bad_buffer
        self.register_buffer("ema", torch.zeros(()))
        self.after: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = (self.lin(batch[0]) - batch[1]).pow(2).mean()
        if self.global_step in self.bad_buffer:
            self.ema.fill_(math.nan)
        return loss * math.nan if self.global_step in self.bad else loss

    def on_train_batch_end(self, *args: object) -> None:
        self.after.append(self.lin.weight.detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader([(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(6)],
                          batch_size=None)


def fit(module: L.LightningModule, max_bad_steps: int) -> NonFiniteGuard:
    guard = NonFiniteGuard(max_bad_steps, lambda: None)
    trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[guard])
    trainer.fit(module)
    return guard


def test_a_bad_step_is_skipped_within_the_budget() -> None:
    toy = Toy(bad={2})
    guard = fit(toy, max_bad_steps=1)
    assert guard.skipped == 1 and len(toy.after) == 6
    assert torch.equal(toy.after[2], toy.after[1])  # the NaN step changed nothing ...
    assert not torch.equal(toy.after[3], toy.after[2])  # ... and training went on
    assert all(torch.isfinite(w).all() for w in toy.after)
    state = toy.trainer.optimizers[0].state[toy.lin.weight]
    assert int(state["step"]) == 5  # AdamW made 5 updates in 6 steps: its moments never saw the NaN


def test_a_bad_step_beyond_the_budget_stops_the_run_with_one_line() -> None:
    toy = Toy(bad={1, 3})
    with pytest.raises(NonFiniteError) as err:
        fit(toy, max_bad_steps=1)
    message = str(err.value)
    assert "\n" not in message and "step 4" in message and "lin.weight" in message and "after skipping 1" in message
    assert len(toy.after) == 3 and all(torch.isfinite(w).all() for w in toy.after)


def test_a_non_finite_buffer_stops_even_within_the_skip_budget() -> None:
    """Skipping drops gradients, which cannot undo a state buffer (routing EMA, threshold) gone NaN."""
    toy = Toy(bad=set(), bad_buffer=frozenset({2}))
    with pytest.raises(NonFiniteError, match=r"^non-finite training at step 3: loss [0-9.]+, non-finite buffer ema;"):
        fit(toy, max_bad_steps=5)
    assert len(toy.after) == 2


class StatefulToy(L.LightningModule):
    """A MoSA and a Routing group (head state staged in the forward pass, committed after the optimizer step, as
    LMModule does) whose input is NaN at the steps in `bad`; records the state after every step."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__()
        from tests.head_checks import make_group

        self.bad, self.T = bad, 16
        self.mosa = make_group("mosa", {"sparsity": 4, "threshold_momentum": 0.5}, self.T).train()
        self.routing = make_group("routing", {"sparsity": 4, "decay": 0.5}, self.T).train()
        self.after: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = batch * math.nan if self.global_step in self.bad else batch
        positions = torch.arange(self.T).expand(len(x), self.T)
        return (self.mosa(x, positions) + self.routing(x, positions)).pow(2).mean()

    def optimizer_step(self, *args: object, **kwargs: object) -> None:
        super().optimizer_step(*args, **kwargs)
        commit_states(self)

    def on_train_batch_end(self, *args: object) -> None:
        self.after.append({k: v.clone() for k, v in self.state_dict().items() if k.endswith(("tau", "means"))})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader([torch.randn(2, self.T, 32, generator=g) for _ in range(6)], batch_size=None)


def test_a_skipped_step_leaves_the_head_state_as_it_was() -> None:
    """A NaN step in a model with MoSA and Routing heads is skipped like any other: the statistics it staged (NaN)
    are dropped, so the thresholds and centroids neither move nor turn NaN, and later steps move them again.
    (Were the staged statistics a state buffer, the run would stop: a NaN state cannot be undone.)"""
    toy = StatefulToy(bad={2})
    guard = fit(toy, max_bad_steps=1)
    assert guard.skipped == 1 and len(toy.after) == 6
    assert all(torch.isfinite(v).all() for state in toy.after for v in state.values())
    for name, value in toy.after[2].items():
        assert torch.equal(value, toy.after[1][name]), name  # the skipped step moved nothing ...
        assert not torch.equal(toy.after[3][name], value), name  # ... and the next one did


def test_the_skip_budget_survives_a_checkpoint() -> None:
    """The guard's state (bad steps used so far) round-trips through the checkpoint's callback state, so a resumed
    run does not get a fresh budget."""
    toy = Toy(bad={1})
    guard = fit(toy, max_bad_steps=2)
    resumed = NonFiniteGuard(2, lambda: None)
    resumed.load_state_dict(guard.state_dict())
    assert guard.skipped == resumed.skipped == 1


def test_a_step_the_grad_scaler_skips_leaves_the_head_state_as_it_was(tmp_path: Path) -> None:
    """16-mixed: an inf gradient under a finite loss is the GradScaler's to skip (the guard checks the loss only);
    LMModule then drops what the step staged, so MoSA's thresholds stay with the weights (they used to move), and
    the next step moves both again."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lm.data import LMDataModule
    from lm.module import LMModule

    data = write_prepared(tmp_path / "data", train_tokens=4000, val_tokens=1000)
    heads = "[{type: dense, count: 1}, {type: mosa, count: 2, options: {sparsity: 4, threshold_momentum: 0.5}}]"
    cfg = load_config(None, *run_overrides(data, tmp_path / "run", max_steps=4), f"model.heads={heads}",
                      "data.batch_size=2")
    torch.manual_seed(0)
    module = LMModule(cfg)
    after: list[dict[str, torch.Tensor]] = []

    class InfGradientAtStep2(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
            if trainer.global_step == 2:
                weight = pl_module.model.embed.weight
                self.hook = weight.register_hook(lambda g: g * math.inf)

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
            if trainer.global_step == 3:
                self.hook.remove()
            after.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    guard = NonFiniteGuard(0, lambda: None)
    fp16 = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))  # Lightning's 16-mixed, which on CPU
    trainer = L.Trainer(accelerator="cpu", plugins=[fp16], max_steps=4, logger=False,  # it turns into bf16-mixed
                        enable_checkpointing=False, limit_val_batches=0, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[guard, InfGradientAtStep2()])
    trainer.fit(module, datamodule=LMDataModule(cfg.data, cfg.model, cfg.trainer.seed))
    assert trainer.global_step == 4 and guard.skipped == 0
    state = [k for k in after[0] if k.endswith("threshold.tau")]
    assert state and all(torch.equal(after[2][k], after[1][k]) for k in [*state, "model.embed.weight"])
    assert all(not torch.equal(after[3][k], after[2][k]) for k in [*state, "model.embed.weight"])


def test_a_diverging_run_stops_and_names_its_last_finite_checkpoint(tmp_path: Path) -> None:
    """lr 1e6 without clipping: step 1's update makes step 2's loss NaN (measured). Every checkpoint on
    disk holds finite weights, and the error names the newest."""
    from lm.train import train

    data = write_prepared(tmp_path / "data", train_tokens=4000, val_tokens=1000)
    out = tmp_path / "run"
    cfg = load_config(None, *run_overrides(data, out, ckpt_every=1, val_every=100), "optim.lr=1e6",
                      "optim.grad_clip=1e9", "optim.warmup_steps=0")
    with pytest.raises(NonFiniteError, match=r"^non-finite training at step 2: loss nan, first non-finite gradient "
                                             r"in model\.\S+; stopped; last finite checkpoint: \S+step0000001\.ckpt"):
        train(cfg)
    saved = sorted((out / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in saved] == ["last.ckpt", "step0000001.ckpt"]
    for path in saved:
        assert all(torch.isfinite(v).all() for v in read_checkpoint(path)["state_dict"].values())


def test_perplexity_of_a_huge_finite_loss_is_inf() -> None:
    assert perplexity(800.0) == math.inf and perplexity(1.0) == math.e and math.isnan(perplexity(math.nan))


class ValidatedToy(Toy):
    """Toy with a validation pass whose loss is NaN from optimizer step `nan_from` on (the weights stay finite)."""

    def __init__(self, nan_from: int) -> None:
        super().__init__(bad=set())
        self.nan_from = nan_from

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = (self.lin(batch[0]) - batch[1]).pow(2).mean()
        self.log("val/loss", loss * math.nan if self.global_step >= self.nan_from else loss)

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


def test_a_non_finite_validation_loss_stops_fit_naming_the_last_finite_checkpoint(tmp_path: Path) -> None:
    """Validation every 2 steps; its loss turns NaN at step 4: fit stops there with one line (the step, the loss, the
    checkpoint to resume from), having trained 4 steps. A plain trainer.validate of the same model is not stopped:
    only training has a checkpoint to protect."""
    toy, ckpt = ValidatedToy(nan_from=4), tmp_path / "step0000002.ckpt"
    guard = NonFiniteGuard(0, lambda: ckpt)
    trainer = L.Trainer(accelerator="cpu", max_steps=6, val_check_interval=2, limit_val_batches=1,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[guard])
    with pytest.raises(NonFiniteError, match=rf"^non-finite validation loss nan at step 4; stopped; last finite "
                                             rf"checkpoint: {ckpt} \(lower optim\.lr"):
        trainer.fit(toy)
    assert len(toy.after) == 4
    trainer = L.Trainer(accelerator="cpu", limit_val_batches=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[guard])
    assert math.isnan(trainer.validate(ValidatedToy(nan_from=0), verbose=False)[0]["val/loss"])


def test_non_finite_weights_are_never_checkpointed(tmp_path: Path) -> None:
    """StepCheckpoints refuses a model with a NaN weight before writing anything, naming the step, the parameter
    and its head group."""
    from types import SimpleNamespace

    from lm.checkpoint import StepCheckpoints
    from lm.module import LMModule
    from tests.conftest import tiny_config

    module = LMModule(tiny_config([{"type": "dense", "count": 2}, {"type": "local", "count": 2,
                                                                   "options": {"window": 8}}]))
    name, weight = next((n, p) for n, p in module.named_parameters() if "groups.1" in n)
    with torch.no_grad():
        weight.view(-1)[3] = math.inf
    trainer = SimpleNamespace(global_step=7, lightning_module=module)
    with pytest.raises(NonFiniteError, match=rf"^non-finite weights after step 7 in {re.escape(name)} \(local heads\); "
                                             r"not checkpointed \(lower optim\.lr\)$"):
        StepCheckpoints(tmp_path, every=1, val_every=1).save(trainer)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_a_run_whose_validation_turns_nan_keeps_only_finite_checkpoints(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """train_lm's callbacks in order: the guard sees step 2's NaN validation loss before StepCheckpoints would write
    step 2 (validated steps are checkpointed after their validation), so the newest checkpoint stays step 1's."""
    from lm.module import LMModule
    from lm.train import train

    real = LMModule.validation_step

    def nan_from_step_2(self: LMModule, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        real(self, batch, batch_idx)
        if self.global_step >= 2:
            self._val_sums[0] = math.nan

    monkeypatch.setattr(LMModule, "validation_step", nan_from_step_2)
    data = write_prepared(tmp_path / "data", train_tokens=4000, val_tokens=1000)
    out = tmp_path / "run"
    cfg = load_config(None, *run_overrides(data, out, ckpt_every=1, val_every=2))
    with pytest.raises(NonFiniteError, match=r"^non-finite validation loss nan at step 2; stopped; last finite "
                                             r"checkpoint: \S+step0000001\.ckpt"):
        train(cfg)
    assert sorted(p.name for p in (out / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step0000001.ckpt"]


def test_a_nonfinite_loss_deepspeed_applied_all_the_same_stops_the_run() -> None:
    """Under DeepSpeed the engine's skip is the skip, so a step with a NaN loss within the budget is judged once it
    ends; had the engine applied it (every gradient finite), nothing undoes it: the run stops, naming that. The
    engine is a stand-in here (its real skips: tests/test_deepspeed.py)."""
    module = Toy(bad=set())
    trainer = SimpleNamespace(precision_plugin=object(), global_step=3, accumulate_grad_batches=1,
                              strategy=SimpleNamespace(reduce_boolean_decision=lambda bad, all: bad),
                              model=SimpleNamespace(was_step_applied=lambda: True))
    guard = NonFiniteGuard(1, lambda: Path("step0000003.ckpt"), deepspeed=True, engine_skips=True)
    guard.on_before_backward(trainer, module, torch.tensor(math.nan))
    guard.on_before_optimizer_step(trainer, module, None)  # within the budget: not judged yet
    trainer.global_step = 4  # the engine stepped
    with pytest.raises(NonFiniteError) as err:
        guard.on_train_batch_end(trainer, module, None, None, 0)
    assert str(err.value) == ("non-finite training at step 4: loss nan, but DeepSpeed's engine applied the update "
                              "(every gradient finite); stopped; last finite checkpoint: step0000003.ckpt (lower "
                              "optim.lr, or set trainer.max_bad_steps to skip a few bad steps)")
    assert guard.skipped == 0
