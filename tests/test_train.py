"""Training (lm/data.py, lm/module.py, lm/train.py, train_lm.py) on tiny synthetic prepared directories."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from heads import ConfigError
from heads.dense import DenseHeads
from lm.checkpoint import load_model
from lm.config_io import load_config
from lm.data import DataError, LMDataModule, TrainBatches, ValWindows, open_split
from lm.module import LMModule
from lm.run_logs import tb_scalars
from lm.schedule import lr_factor
from tests.synthetic import run_overrides, write_prepared

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_prepared(tmp_path_factory.mktemp("prepared"))


@pytest.fixture(scope="module")
def trained(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One 30-step run (val and checkpoint every 10 steps), shared by the tests below."""
    from lm.train import train

    out = tmp_path_factory.mktemp("run")
    metrics = train(load_config(None, *run_overrides(data, out)))
    return out, metrics


def test_run_writes_metrics_json(trained: tuple[Path, dict]) -> None:
    out, returned = trained
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics == json.loads(json.dumps(returned))
    assert metrics["step"] == 30 and metrics["tokens_seen"] == 30 * 8 * 32
    assert [h["step"] for h in metrics["history"]] == [10, 20, 30]
    assert metrics["params"] > 0 and metrics["kv_total"] == 2 * 4 * 32 and metrics["tokens_per_s"] > 0 and metrics["causal"]
    assert metrics["device"] == "cpu" and metrics["world_size"] == 1 and metrics["precision"] == "32-true"
    assert 100 * 2**20 < metrics["peak_mem_bytes"] < 8 * 2**30  # the process's peak RSS: torch runtime included
    assert math.isclose(metrics["val_ppl"], math.exp(metrics["val_loss"]))


def test_val_loss_is_the_cross_entropy_of_the_validation_windows(trained: tuple[Path, dict], data: Path) -> None:
    """metrics.json's val_loss (step 30) is the mean next-token cross-entropy of the last checkpoint over the
    data.val_batches x data.batch_size validation windows, computed here in one batch."""
    import torch.nn.functional as F

    out, metrics = trained
    model, cfg = load_model(out / "checkpoints" / "last.ckpt")
    windows = ValWindows(open_split(data, "val", cfg.model), cfg.model.seq_len, cfg.data.val_batches * cfg.data.batch_size)
    x, y = (torch.stack(t).long() for t in zip(*(windows[i] for i in range(len(windows)))))
    with torch.no_grad():
        ref = F.cross_entropy(model.eval()(x).flatten(0, 1), y.flatten()).item()
    assert x.shape == (16, 32) and metrics["val_loss"] == pytest.approx(ref, rel=1e-5)


def test_val_loss_weighs_every_token_alike_over_batches_of_different_sizes(tmp_path: Path) -> None:
    """A rank's validation windows need not fill whole batches (ValWindows gives 2 ranks 3 and 2 of 5 windows): with
    batches of 3 and 1 windows, val/loss is the mean cross-entropy over all 4 x 32 targets, not the mean of the two
    batches' means (which would weigh the lone window's tokens 3 times as much). Tolerance 1e-5 relative (fp32)."""
    import lightning as L
    import torch.nn.functional as F

    torch.manual_seed(0)
    module = LMModule(load_config(None, *run_overrides(Path("unused"), tmp_path)))
    x, y = torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))
    with torch.no_grad():
        per_window = F.cross_entropy(module.model.eval()(x).transpose(1, 2), y, reduction="none").mean(1)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, dataloaders=torch.utils.data.DataLoader(list(zip(x, y)), batch_size=3), verbose=False)
    assert trainer.callback_metrics["val/loss"].item() == pytest.approx(per_window.mean().item(), rel=1e-5)
    assert abs(per_window[:3].mean() - per_window[3]).item() > 1e-3  # the batch-mean average would differ


def test_applied_learning_rate_follows_the_schedule(data: Path, tmp_path: Path) -> None:
    """The rate each optimizer step ran at (train/lr, logged every step at steps 1..8): optim.lr = 3e-3 times a
    linear warmup over 5 steps, then the cosine toward 0.1 x peak over the remaining 3, written out by hand."""
    from lm.train import train

    train(load_config(None, *run_overrides(data, tmp_path / "run", max_steps=8, val_every=8, ckpt_every=8,
                                           log_every=1)))
    cos = [0.1 + 0.9 * (1 + math.cos(math.pi * p)) / 2 for p in (0, 1 / 3, 2 / 3)]
    expected = [3e-3 * f for f in (0.2, 0.4, 0.6, 0.8, 1.0, *cos)]
    logged = tb_scalars(tmp_path / "run", "train/lr")
    assert sorted(logged) == list(range(1, 9)) and [logged[s] for s in range(1, 9)] == pytest.approx(expected, rel=1e-6)


def test_loss_falls(trained: tuple[Path, dict]) -> None:
    """The synthetic chain is learnable: validation loss starts near ln 64 = 4.16 and falls clearly."""
    history = json.loads((trained[0] / "metrics.json").read_text())["history"]
    losses = [h["val_loss"] for h in history]
    assert losses[0] > losses[1] > losses[2], losses
    assert losses[-1] < math.log(64) - 1.0, losses


def test_validation_curve_png(trained: tuple[Path, dict]) -> None:
    png = trained[0] / "val_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_end_of_run_summary_names_only_written_files(data: Path, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The curve needs two validations: a run with one names no curve (it named a missing val_curve.png)."""
    from lm.train import train

    caplog.set_level("INFO", logger="lightning.pytorch.utilities.rank_zero")
    for name, val_every, curve in (("one", 100, False), ("two", 1, True)):
        out = tmp_path / name
        train(load_config(None, *run_overrides(data, out, max_steps=2, val_every=val_every)))
        (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("outputs: ")]
        caplog.clear()
        assert f"checkpoint {out / 'checkpoints' / 'last.ckpt'} | metrics {out / 'metrics.json'}" in summary
        assert (out / "val_curve.png").is_file() == curve
        assert summary.endswith(f" | curve {out / 'val_curve.png'}") == curve, summary


def test_tensorboard_scalars(trained: tuple[Path, dict]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in (trained[0] / "tb").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    expected = {"train/loss", "train/ppl", "train/lr", "train/grad_norm", "train/tokens_seen", "train/tokens_per_s",
                "train/peak_mem_mib", "val/loss", "val/ppl"}
    assert expected <= tags, expected - tags


def test_tensorboard_x_axis_counts_optimizer_steps(data: Path, tmp_path: Path) -> None:
    """Every scalar sits at the number of optimizer steps taken: a validation at its metrics.json step, whether
    Lightning ran it within fit (it passed x = N - 1) or on its own (validate_first, the final one: x = N), and
    train/tokens_seen at x reads x steps' tokens."""
    from lm.train import train

    cfg = load_config(None, *run_overrides(data, tmp_path / "run", max_steps=7, log_every=3, val_every=5))
    cfg.trainer.validate_first = True
    metrics = train(cfg)
    val = tb_scalars(tmp_path / "run", "val/loss")
    assert sorted(val) == [h["step"] for h in metrics["history"]] == [0, 5, 7]
    assert all(val[h["step"]] == pytest.approx(h["val_loss"], rel=1e-6) for h in metrics["history"])
    tokens = tb_scalars(tmp_path / "run", "train/tokens_seen")
    assert sorted(tokens) == sorted(tb_scalars(tmp_path / "run", "train/loss")) == [3, 6]
    assert all(seen == x * cfg.data.batch_size * cfg.model.seq_len for x, seen in tokens.items())


def test_logged_gradient_norm_is_the_first_steps(data: Path, tmp_path: Path) -> None:
    """train/grad_norm at step 1 = the L2 norm of the gradient of the freshly seeded model on batch 0 (before
    clipping: larger than optim.grad_clip here)."""
    import lightning as L

    from lm.train import train

    cfg = load_config(None, *run_overrides(data, tmp_path / "run", max_steps=2, log_every=1))
    train(cfg)
    logged = tb_scalars(tmp_path / "run", "train/grad_norm")
    L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)  # as lm.train.train does
    module = LMModule(cfg)
    stream = open_split(data, "train", cfg.model)
    module.losses(*TrainBatches(stream, cfg.model.seq_len, cfg.data.batch_size, cfg.trainer.seed).batch(0))[0].backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in module.parameters()], 2.0).item()
    assert sorted(logged) == [1, 2] and norm > cfg.optim.grad_clip
    assert logged[1] == pytest.approx(norm, rel=1e-5) and logged[2] != logged[1]


def test_gradients_are_clipped_to_grad_clip(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After configure_gradient_clipping the global L2 norm of the gradient is optim.grad_clip (it was larger)."""
    cfg = load_config(None, *run_overrides(data, Path("unused")))
    module = LMModule(cfg)
    monkeypatch.setattr(module, "log", lambda *args, **kwargs: None)  # no trainer to log to
    stream = open_split(data, "train", cfg.model)
    module.losses(*TrainBatches(stream, cfg.model.seq_len, cfg.data.batch_size, cfg.trainer.seed).batch(0))[0].backward()
    grads = [p.grad for p in module.parameters()]
    assert torch.nn.utils.get_total_norm(grads, 2.0) > 2 * cfg.optim.grad_clip
    module.configure_gradient_clipping(module.configure_optimizers()["optimizer"], cfg.optim.grad_clip)
    torch.testing.assert_close(torch.nn.utils.get_total_norm(grads, 2.0), torch.tensor(cfg.optim.grad_clip), rtol=1e-5, atol=0)


def test_the_mosa_predictors_gradient_does_not_scale_the_lms(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MoSA's predictor is trained by its own loss only; clipped apart, its weight leaves the LM's first update
    exactly as it is (in one global clipping norm, a 50x heavier predictor loss shrank the LM's step)."""
    params = {}
    for weight in (1.0, 50.0):
        heads = f"[{{type: dense, count: 2}}, {{type: mosa, count: 4, options: {{sparsity: 4, selection: predictor, predictor_weight: {weight}}}}}]"
        cfg = load_config(None, *run_overrides(data, Path("unused")), f"model.heads={heads}")
        torch.manual_seed(0)
        module = LMModule(cfg)
        monkeypatch.setattr(module, "log", lambda *args, **kwargs: None)  # no trainer to log to
        optimizer = module.configure_optimizers()["optimizer"]
        stream = open_split(data, "train", cfg.model)
        module.losses(*TrainBatches(stream, cfg.model.seq_len, cfg.data.batch_size, cfg.trainer.seed).batch(0))[0].backward()
        lm_grads = [p.grad for name, p in module.named_parameters() if ".predictor." not in name]
        assert torch.nn.utils.get_total_norm(lm_grads, 2.0) > cfg.optim.grad_clip  # clipping is active
        module.configure_gradient_clipping(optimizer, cfg.optim.grad_clip)
        optimizer.step()
        params[weight] = {name: p.detach().clone() for name, p in module.named_parameters()}
    predictor = {name for name in params[1.0] if ".predictor." in name}
    assert predictor and all(not torch.equal(params[1.0][n], params[50.0][n]) for n in predictor)
    assert all(torch.equal(params[1.0][n], params[50.0][n]) for n in params[1.0] if n not in predictor)


def test_weight_decay_reaches_every_parameter_of_two_or_more_dimensions(data: Path) -> None:
    """optim.weight_decay (and optim.betas) reach AdamW: the parameters of 2+ dimensions (matrices, embeddings,
    agent attention's DWC filters and bias tables) shrink by (1 - lr wd) on a zero gradient, vectors (norms, the
    DWC bias) do not move. The two groups' layout is what older checkpoints' optimizer states hold."""
    heads = "[{type: dense, count: 2}, {type: agent, count: 2, options: {block: 8, window: 8, dwc: 3, bias: 4}}]"
    module = LMModule(load_config(None, *run_overrides(data, Path("unused")), f"model.heads={heads}", "optim.weight_decay=0.5",
                                  "optim.betas=[0.8,0.95]", "optim.lr=0.1", "optim.warmup_steps=0"))
    optimizer = module.configure_optimizers()["optimizer"]
    assert all(tuple(g["betas"]) == (0.8, 0.95) for g in optimizer.param_groups)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()  # non-zero everywhere (the agent bias tables start at 0)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    for p in module.parameters():
        p.grad = torch.zeros_like(p)  # only the decay moves a weight: w <- w (1 - lr wd)
    optimizer.step()
    decayed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    for n in decayed:
        torch.testing.assert_close(dict(module.named_parameters())[n].detach(), before[n] * (1 - 0.1 * 0.5))
    assert {n for n in before if before[n].ndim >= 2} == decayed
    assert {"model.embed.weight"} | {n for n in before if n.endswith(("dwc.weight", "agent_bias"))} <= decayed


def test_checkpoint_writing_is_not_training_time(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tokens_per_s counts training steps only: a checkpoint every step that takes 1000 s to write leaves it at the
    steps' own speed (counting the writes once held it below one batch per write). The module's clock is a fake one
    (1 ms per reading, plus each write's 1000 s), so that the check does not depend on the machine's load."""
    import types

    import lightning as L

    import lm.module
    from lm.train import train

    clock = [0.0]

    def perf_counter() -> float:
        clock[0] += 1e-3
        return clock[0]

    save = L.Trainer.save_checkpoint

    def slow_save(self, *args, **kwargs):
        clock[0] += 1000.0
        return save(self, *args, **kwargs)

    monkeypatch.setattr(lm.module, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(L.Trainer, "save_checkpoint", slow_save)
    cfg = load_config(None, *run_overrides(data, tmp_path / "run", max_steps=4, ckpt_every=1, val_every=4))
    metrics = train(cfg)
    # the timed steps took a few fake ms each; counted, each write would hold the rate below one batch per 1000 s
    assert metrics["tokens_per_s"] > 10 * cfg.data.batch_size * cfg.model.seq_len


def test_checkpoints_hold_config_and_rebuild_the_model(trained: tuple[Path, dict], data: Path) -> None:
    ckpts = trained[0] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step0000010.ckpt", "step0000020.ckpt",
                                                        "step0000030.ckpt"]
    ckpt = torch.load(ckpts / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 30 and ckpt["optimizer_states"] and {"config", "rng"} <= set(ckpt)
    model, cfg = load_model(ckpts / "last.ckpt")
    assert cfg.model.d_model == 32 and cfg.data.path == str(data)
    tokens = torch.randint(0, 64, (1, 16))
    reference = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    assert model(tokens).shape == (1, 16, 64)


def test_no_progress_bar_when_stderr_is_not_a_terminal(data: Path, tmp_path: Path) -> None:
    """A log file (flops.run_sweep's train.log) gets validation lines, not progress-bar frames."""
    import sys

    from lm.checkpoint import StepCheckpoints
    from lm.train import build_trainer

    cfg = load_config(None, *run_overrides(data, tmp_path))
    assert not sys.stderr.isatty()  # pytest captures it
    assert build_trainer(cfg, StepCheckpoints(tmp_path, 10, 10), "auto").progress_bar_callback is None


def test_a_start_the_trainer_set_up_refuses_leaves_the_run_directory_unclaimed(data: Path, tmp_path: Path) -> None:
    """The device check runs before the directory is claimed: the corrected rerun starts without --overwrite."""
    from lm.run_dir import holds_run
    from lm.train import train

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"trainer\.devices=64, but this machine has \d+ CUDA GPU"):
        train(load_config(None, *run_overrides(data, out, accelerator="gpu", devices=64)))
    assert not holds_run(out) and not (out / "config.yaml").exists()
    assert train(load_config(None, *run_overrides(data, out, max_steps=2, val_every=2)))["step"] == 2


def test_lr_schedule() -> None:
    """Linear warmup to the peak, then cosine down to min_lr_ratio at max_steps (warmup: MoSA App. H; the cosine is ours)."""
    f = [lr_factor(s, 10, 110, 0.1) for s in range(120)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[60] == pytest.approx(0.55) and f[110] == pytest.approx(0.1) and f[119] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))


def test_aux_losses_are_added_and_logged_separately() -> None:
    class AuxHeads(DenseHeads):
        def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            self.aux_losses = {"balance": x.new_tensor(0.125), "commitment": x.new_tensor(0.5)}
            return super().forward_fast(x, positions)

    cfg = load_config(None, *run_overrides(Path("unused"), Path("unused")))
    module = LMModule(cfg)
    for block in module.model.blocks:
        g = block.attn.groups[0]
        block.attn.groups[0] = AuxHeads(g.ctx, g.count, g.options)
    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    loss, ce, aux = module.losses(x, y)
    assert aux == {"balance": pytest.approx(0.25), "commitment": pytest.approx(1.0)}  # 2 layers each, summed
    assert loss.item() == pytest.approx(ce.item() + 1.25)  # every auxiliary loss added, none averaged


# ---- data ----------------------------------------------------------------------------------------
class _Stream:
    """A token stream of 0 .. n - 1 (TokenStream's len and read)."""

    def __init__(self, n: int) -> None:
        self.tokens = np.arange(n, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, length: int) -> np.ndarray:
        return self.tokens[start : start + length]


def test_training_windows_cover_the_stream_to_its_last_token() -> None:
    """Every window of T + 1 tokens that fits is drawn: a stream of exactly T + 1 tokens is one window (its last
    token the last target), and in a longer one every start 0 .. len - T - 1 comes up."""
    T = 8
    x, y = TrainBatches(_Stream(T + 1), T, 2, seed=0).batch(0)
    assert x.tolist() == [list(range(T))] * 2 and y.tolist() == [list(range(1, T + 1))] * 2
    batches = TrainBatches(_Stream(T + 5), T, 4, seed=0)
    assert {int(batches.batch(step)[0][row, 0]) for step in range(50) for row in range(4)} == set(range(5))


def test_train_order_is_a_pure_function_of_seed_and_step(data: Path) -> None:
    cfg = load_config(None, *run_overrides(data, Path("unused")))
    stream = open_split(data, "train", cfg.model)
    a = TrainBatches(stream, 32, 4, seed=7)
    resumed = iter(TrainBatches(stream, 32, 4, seed=7, start_step=5))
    batches = [b for _, b in zip(range(8), iter(a))]
    assert all(torch.equal(batches[5 + i][0], next(resumed)[0]) for i in range(3))
    x, y = batches[0]
    assert x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(batches[0][0], batches[1][0])
    assert not torch.equal(TrainBatches(stream, 32, 4, seed=8).batch(0)[0], x)
    # 2 ranks x 4 windows = the first 8 windows of one process with batch 8 (same global batch)
    ranks = [TrainBatches(stream, 32, 4, seed=7, rank=r, world_size=2).batch(3)[0] for r in (0, 1)]
    assert torch.equal(torch.cat(ranks), TrainBatches(stream, 32, 8, seed=7).batch(3)[0])


def test_different_seeds_draw_unrelated_streams_not_shifted_ones() -> None:
    """The runs of a multi-seed experiment (seeds 0, 1, 2, ...) draw independent window streams: no step of one seed
    repeats any step of another (a stream seeded by seed + step would give seed s + 1 at step k the windows of seed s
    at step k + 1, the same data one step apart). 16 starts of 10**6 per step: a chance repeat has probability ~0."""
    drawn = {(seed, step): tuple(TrainBatches(_Stream(10**6 + 9), 8, 16, seed=seed).batch(step)[0][:, 0].tolist())
             for seed in range(3) for step in range(4)}
    assert len(set(drawn.values())) == len(drawn)


def test_workers_keep_the_order(data: Path) -> None:
    cfg = load_config(None, *run_overrides(data, Path("unused")))
    stream = open_split(data, "train", cfg.model)
    loader = torch.utils.data.DataLoader(TrainBatches(stream, 32, 4, seed=1, start_step=3), batch_size=None,
                                         num_workers=2)
    got = [x for _, (x, _) in zip(range(4), loader)]
    single = TrainBatches(stream, 32, 4, seed=1)
    assert all(torch.equal(got[i], single.batch(3 + i)[0]) for i in range(4))


def test_windows_cross_shards_and_val_windows_are_fixed(data: Path) -> None:
    cfg = load_config(None, *run_overrides(data, Path("unused")))
    train = open_split(data, "train", cfg.model)
    flat = np.concatenate([np.fromfile(p, dtype=np.uint16) for p in train.paths])
    boundary = int(train.starts[1])
    for start in (0, boundary - 5, boundary, len(flat) - 10):  # first token, across and at a boundary, the end
        assert np.array_equal(train.read(start, 10), flat[start : start + 10])
    val = ValWindows(open_split(data, "val", cfg.model), 32, 5)
    assert val.starts[0] == 0 and val.starts[-1] == 4000 - 33 and np.all(np.diff(val.starts) > 0)
    assert torch.equal(val[2][0], ValWindows(open_split(data, "val", cfg.model), 32, 5)[2][0])
    whole = val.tokens()  # [N, T+1] for lm.leakfree.evaluate: window i's inputs, then its last target
    assert whole.shape == (5, 33) and whole.dtype == torch.int64
    assert all(torch.equal(whole[i], torch.cat([val[i][0], val[i][1][-1:]]).long()) for i in range(5))
    # over 2 ranks every window is validated once, also when 2 does not divide the count (Lightning's
    # DistributedSampler would pad rank 1 with a repeat of window 0; use_distributed_sampler is off)
    ranks = [ValWindows(open_split(data, "val", cfg.model), 32, 5, rank=r, world_size=2).starts for r in (0, 1)]
    assert sorted(np.concatenate(ranks).tolist()) == val.starts.tolist() and [len(r) for r in ranks] == [3, 2]
    from lm.checkpoint import StepCheckpoints
    from lm.train import build_trainer

    assert not build_trainer(cfg, StepCheckpoints(Path("unused"), 10, 10), "auto")._accelerator_connector.use_distributed_sampler
    from lm.data import enough_for_every_rank

    with pytest.raises(DataError, match="gives 3 validation windows for 4 ranks: every rank needs one"):
        enough_for_every_rank(3, "validation windows", 4)  # a rank without windows would stop Lightning
    enough_for_every_rank(4, "validation windows", 4)


def test_a_split_of_many_shards_keeps_few_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full C4 is thousands of shards, past a process's usual 1024 file descriptors: a TokenStream holds at most
    MAX_OPEN_SHARDS memmaps (each an open descriptor), least recently read closed first, and reads stay exact, also
    across shards of no tokens (a foreign index may list one: a read crossing it tried to memmap an empty file)."""
    import os
    import pickle

    import lm.data
    from lm.data import TokenStream

    monkeypatch.setattr(lm.data, "MAX_OPEN_SHARDS", 4)
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 500, size=int(n), dtype=np.uint16) for n in rng.integers(5, 40, size=60)]
    parts[3] = parts[10] = parts[11] = np.zeros(0, dtype=np.uint16)
    for i, part in enumerate(parts):
        part.tofile(tmp_path / f"train_{i:05d}.bin")
    stream = TokenStream(tmp_path, "train", [{"file": f"train_{i:05d}.bin", "tokens": len(p)} for i, p in
                                             enumerate(parts)], vocab_size=500)
    flat = np.concatenate(parts)
    descriptors = len(os.listdir("/proc/self/fd"))
    for start in rng.integers(0, len(flat) - 50, size=300):
        assert np.array_equal(stream.read(int(start), 50), flat[start : start + 50])
        assert len(stream._maps) <= 4
    assert len(os.listdir("/proc/self/fd")) <= descriptors + 4
    copy = pickle.loads(pickle.dumps(stream))  # what a DataLoader worker gets: no open shards, the same reads
    assert copy._maps == {} and np.array_equal(copy.read(7, 100), flat[7:107])


def data_error(path: Path, **model: object) -> str:
    overrides = run_overrides(path, Path("unused")) + [f"model.{k}={v}" for k, v in model.items()]
    cfg = load_config(None, *overrides)
    with pytest.raises(DataError) as info:
        LMDataModule(cfg.data, cfg.model, 0).check()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_data_errors(tmp_path: Path, data: Path) -> None:
    assert "does not exist" in data_error(tmp_path / "missing")
    (tmp_path / "notes.md").write_text("not data")
    message = data_error(tmp_path / "notes.md")
    assert "notes.md is not a directory" in message and "--source gutenberg|c4|text" in message
    (tmp_path / "empty_dir").mkdir()
    assert "no index.json" in data_error(tmp_path / "empty_dir")
    assert "vocab_size 64 > model.vocab_size 50" in data_error(data, vocab_size=50)
    assert "model.seq_len=4000" in data_error(data, seq_len=4000)  # val has 4000 tokens: needs 4001
    empty = write_prepared(tmp_path / "no_val", val_tokens=0)
    assert "'val'" in data_error(empty) and "empty" in data_error(empty)
    broken = write_prepared(tmp_path / "truncated")
    (broken / "train_00001.bin").write_bytes(b"\0" * 10)
    assert "train_00001.bin" in data_error(broken)
    # an index entry without its file, or with a token count that is no number
    for name, damage in (("no_file", lambda e: e.pop("file")), ("bad_tokens", lambda e: e.update(tokens="lots"))):
        edited = write_prepared(tmp_path / name)
        index = json.loads((edited / "index.json").read_text())
        damage(index["splits"]["train"]["shards"][0])
        (edited / "index.json").write_text(json.dumps(index))
        assert "index.json has a damaged train shard entry" in data_error(edited)
    # an index.json that is no JSON, or no object, or has no vocab_size
    for name, text in (("cut", '{"vocab_size": 6'), ("list", "[]"), ("no_vocab", '{"splits": {}}')):
        edited = write_prepared(tmp_path / name)
        (edited / "index.json").write_text(text)
        assert data_error(edited).startswith(f"data.path: {edited / 'index.json'} is not a valid index (")
    # shards of another layout, or from a newer data_prep, are not read as uint16 tokens of this one
    for name, change in (("newer", {"format": "data_prep/99"}), ("foreign", {"format": "other/1"}),
                         ("wide", {"dtype": "uint32"})):
        edited = write_prepared(tmp_path / name)
        index = json.loads((edited / "index.json").read_text())
        (edited / "index.json").write_text(json.dumps({**index, **change}))
        assert data_error(edited).startswith(f"data.path: {edited / 'index.json'} is format "), name
        assert "this version reads data_prep/1 to data_prep/2 with uint16 tokens" in data_error(edited)


def test_token_ids_must_be_below_the_vocabulary_size(tmp_path: Path) -> None:
    """Ids 0 .. vocab_size - 1 are embeddings; vocab_size itself is one past the table."""
    from lm.data import check_token_range

    shard = tmp_path / "train_00000.bin"
    np.array([3, 63, 0], dtype="<u2").tofile(shard)
    check_token_range(shard, 64)
    with pytest.raises(DataError, match="holds token id 63 >= model.vocab_size 63 \\(first at token 1\\)"):
        check_token_range(shard, 63)


# ---- entry point ---------------------------------------------------------------------------------
def test_cli_errors_are_one_line_with_status_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import train_lm

    quickstart = str(ROOT / "configs" / "quickstart.yaml")
    for args, field in (([quickstart, "model.n_layer=3"], "model.n_layer"),
                        ([quickstart, f"data.path={tmp_path / 'none'}"], "data.path"),
                        ([str(tmp_path / "none.yaml")], "not found")):
        assert train_lm.main(["--config", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.strip().count("\n") == 0 and field in err, err


def test_resume_checks(trained: tuple[Path, dict], data: Path, tmp_path: Path) -> None:
    from lm.train import resume_path

    out = trained[0]
    same = load_config(None, *run_overrides(data, out))
    assert resume_path(same, "last") == (str(out / "checkpoints" / "step0000030.ckpt"), 30)  # the newest step file
    assert resume_path(load_config(None, *run_overrides(data, tmp_path)), "last") is None  # nothing yet: fresh
    with pytest.raises(ConfigError, match="model.n_layers"):
        resume_path(load_config(None, *run_overrides(data, out), "model.n_layers=3"), "last")
    with pytest.raises(ConfigError, match="not found"):
        resume_path(same, str(tmp_path / "nope.ckpt"))
    # was an IsADirectoryError
    with pytest.raises(ConfigError, match=r"is a directory, not a \.ckpt file \(only DeepSpeed writes .*give a \.ckpt file"):
        resume_path(same, str(out / "checkpoints"))
    deepspeed = load_config(None, *run_overrides(data, out), "trainer.strategy=deepspeed_stage_2")
    with pytest.raises(ConfigError, match=r"^--resume: \S+checkpoints holds checkpoint files \(step0000030\.ckpt, "
                                          r"\.\.\.\) of another strategy, and DeepSpeed loads only its own checkpoint "
                                          r"directories: resume with the strategy that wrote them$"):
        resume_path(deepspeed, "last")  # was a fresh start
    with pytest.raises(ConfigError, match=r"^--resume-from: \S+step0000010\.ckpt is a checkpoint file, and DeepSpeed"):
        resume_path(deepspeed, str(out / "checkpoints" / "step0000010.ckpt"))  # was Lightning's traceback
    step10 = str(out / "checkpoints" / "step0000010.ckpt")
    other = tmp_path / "retokenized"  # the same shards under another tokenizer: ids that mean other text
    shutil.copytree(data, other)
    index = json.loads((other / "index.json").read_text())
    (other / "index.json").write_text(json.dumps({**index, "tokenizer_sha256": "another"}))
    elsewhere = load_config(None, *run_overrides(other, tmp_path / "b"))
    with pytest.raises(ConfigError, match=r"^--resume-from: \S+step0000010\.ckpt was trained with another tokenizer "
                                          r"\(sha256 synthetic; data\.path \S+ has another\): its token ids mean other text$"):
        resume_path(elsewhere, step10)
    (other / "index.json").write_text(json.dumps(index))  # other data, the same tokenizer: continued pretraining
    assert resume_path(elsewhere, step10) == (step10, 10)
    compressed = load_config(None, *run_overrides(data, tmp_path / "c"), "compression.prefix_len=8", "compression.layer=1")
    with pytest.raises(ConfigError, match=r"is a plain model's checkpoint and this run trains a compressed one"):
        resume_path(compressed, step10)  # was a state_dict traceback


def test_deepspeed_resume_takes_the_newest_complete_checkpoint_directory(tmp_path: Path, capsys) -> None:
    """Under DeepSpeed, step<N>.ckpt and last.ckpt are directories (sharded states in checkpoint/, DeepSpeed's
    `latest`, then our `complete` once every rank's shards are): --resume takes the newest one holding `complete`
    (`latest` alone: killed while another rank still wrote its shard), names any incomplete one it passes over, and
    with none starts from scratch (it used to skip directories and always start afresh). Its entries (the rank-0
    model-states file's client state) pass the checks a file does: another model is one line (was DeepSpeed's
    strict-load traceback), and the step comes from it (last.ckpt's was unknown)."""
    from omegaconf import OmegaConf

    from lm.train import resume_path

    cfg = load_config(None, f"trainer.out_dir={tmp_path / 'run'}", "trainer.strategy=deepspeed_stage_2")
    ckpts = tmp_path / "run" / "checkpoints"

    def deepspeed_dir(name: str, complete: bool, step: int, **model: object) -> Path:
        (ckpts / name / "checkpoint").mkdir(parents=True)
        config = OmegaConf.to_container(OmegaConf.structured(cfg))
        config["model"].update(model)
        torch.save({"module": {}, "config": config, "global_step": step},
                   ckpts / name / "checkpoint" / "mp_rank_00_model_states.pt")
        (ckpts / name / "latest").write_text("checkpoint")
        if complete:
            (ckpts / name / "complete").write_text("step 1, 2 rank(s)\n")
        return ckpts / name

    ckpts.mkdir(parents=True)
    assert resume_path(cfg, "last") is None
    assert "--resume: no complete DeepSpeed checkpoint in" in capsys.readouterr().err
    deepspeed_dir("last.ckpt", complete=True, step=25)
    assert resume_path(cfg, "last") == (str(ckpts / "last.ckpt"), 25)
    deepspeed_dir("step0000010.ckpt", complete=True, step=10)
    deepspeed_dir("step0000025.ckpt", complete=True, step=25)
    deepspeed_dir("step0000030.ckpt", complete=False, step=30)  # killed while saving
    capsys.readouterr()
    assert resume_path(cfg, "last") == (str(ckpts / "step0000025.ckpt"), 25)
    err = capsys.readouterr().err
    assert (f"warning: --resume: skipping step0000030.ckpt: {ckpts / 'step0000030.ckpt'} is an incomplete DeepSpeed "
            "checkpoint (no 'complete' file") in err
    assert f"--resume: continuing from {ckpts / 'step0000025.ckpt'}" in err
    assert resume_path(cfg, str(ckpts / "step0000010.ckpt")) == (str(ckpts / "step0000010.ckpt"), 10)
    with pytest.raises(ConfigError, match=r"^--resume-from: \S+step0000030\.ckpt is an incomplete DeepSpeed checkpoint"):
        resume_path(cfg, str(ckpts / "step0000030.ckpt"))
    (deepspeed_dir("step0000035.ckpt", complete=True, step=35) / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert resume_path(cfg, "last") == (str(ckpts / "step0000025.ckpt"), 25)  # an unreadable one is passed over too
    assert f"skipping step0000035.ckpt: DeepSpeed checkpoint {ckpts / 'step0000035.ckpt'}" in capsys.readouterr().err
    other = deepspeed_dir("step0000040.ckpt", complete=True, step=40, n_layers=3)
    with pytest.raises(ConfigError, match=r"^--resume: \S+step0000040\.ckpt was trained with different model\.n_layers$"):
        resume_path(cfg, "last")
    with pytest.raises(ConfigError, match=r"^--resume-from: \S+checkpoints is not a DeepSpeed checkpoint directory"):
        resume_path(cfg, str(other.parent))
    # the same run resumed under another strategy: it used to start from scratch, then fail writing step0000010.ckpt
    plain = load_config(None, f"trainer.out_dir={tmp_path / 'run'}", "trainer.strategy=ddp")
    with pytest.raises(ConfigError, match=r"^--resume: \S+checkpoints holds DeepSpeed checkpoint directories "
                                          r"\(step0000040\.ckpt, \.\.\.\), which trainer\.strategy=ddp cannot load: "
                                          r"resume with trainer\.strategy=deepspeed_stage_2$"):
        resume_path(plain, "last")


def test_deepspeed_directory_is_marked_complete_after_every_ranks_save(tmp_path: Path) -> None:
    """mark_complete: rank 0 writes `complete` into a checkpoint directory only after the barrier every rank
    reaches once its shards are saved; other ranks and single-file checkpoints get no mark."""
    from types import SimpleNamespace

    from lm.checkpoint import mark_complete

    events: list[str] = []
    directory = tmp_path / "step0000004.ckpt"
    directory.mkdir()
    (tmp_path / "single.ckpt").write_bytes(b"x")

    def trainer(rank: int) -> SimpleNamespace:
        barrier = lambda: events.append(f"barrier {rank}, marked: {(directory / 'complete').exists()}")  # noqa: E731
        return SimpleNamespace(strategy=SimpleNamespace(barrier=barrier), is_global_zero=rank == 0, global_step=4,
                               world_size=2)

    mark_complete(trainer(1), directory)
    assert not (directory / "complete").exists()
    mark_complete(trainer(0), directory)
    mark_complete(trainer(0), tmp_path / "single.ckpt")
    assert events == ["barrier 1, marked: False", "barrier 0, marked: False", "barrier 0, marked: True"]
    assert (directory / "complete").read_text() == "step 4, 2 rank(s)\n"


def test_the_last_step_validated_inside_fit_as_deepspeed_runs_do(data: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DeepSpeed the last step (max_steps not a multiple of val_every) is validated inside fit
    (FinalStepValidates), never by a trainer.validate after it, which there builds an inference engine whose save
    fails. On CPU, with the same switch: no trainer.validate call, validations at steps 4 and 6, and step 6, a
    checkpoint step, is saved once, after its validation (a kill during that validation must not leave a checkpoint
    of the last step without it: its resume would validate after fit)."""
    import lightning as L

    import lm.train
    from lm.checkpoint import StepCheckpoints, read_checkpoint

    assert lm.train.validates_in_fit(load_config(None, "trainer.strategy=deepspeed_stage_2"))
    assert not lm.train.validates_in_fit(load_config(None, "trainer.strategy=ddp"))
    monkeypatch.setattr(lm.train, "validates_in_fit", lambda cfg: True)
    calls, saves = [], []
    monkeypatch.setattr(L.Trainer, "validate", lambda *a, **k: calls.append(1))
    save = StepCheckpoints.save

    def spy(self, trainer) -> None:  # which step, and the step of the newest validation it carries
        history = trainer.lightning_module.val_history
        saves.append((trainer.global_step, history[-1]["step"] if history else None))
        save(self, trainer)

    monkeypatch.setattr(StepCheckpoints, "save", spy)
    metrics = lm.train.train(load_config(None, *run_overrides(data, tmp_path / "run", max_steps=6, val_every=4,
                                                              ckpt_every=3)))
    assert calls == [] and [h["step"] for h in metrics["history"]] == [4, 6]
    assert saves == [(3, None), (6, 6)]  # step 6 (a checkpoint step) only after its validation (was: before it too)
    saved = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == 6 and saved["val_history"][-1]["step"] == 6


def test_a_deepspeed_directory_saved_again_loses_its_mark_until_the_new_save_completes(tmp_path: Path) -> None:
    """DeepSpeed rewrites last.ckpt at every save (and a resumed run may save a step directory again): a kill
    while the new shards are written must not leave the old `complete` mark beside them (--resume would take the
    half-written directory); it takes the previous complete one instead. The mark goes before any rank writes."""
    from types import SimpleNamespace

    from lm.checkpoint import StepCheckpoints, newest_deepspeed

    saves = []

    def save_checkpoint(path: Path, weights_only: bool = False) -> None:  # DeepSpeed: shards, then `latest`
        saves.append((path.name, (path / "complete").exists()))
        shard = path / "checkpoint" / "mp_rank_00_model_states.pt"
        shard.parent.mkdir(parents=True, exist_ok=True)
        if len(saves) == 3:  # the step's second save: killed while its shard is written
            shard.write_bytes(b"PK\x03\x04 truncated")
            raise KeyboardInterrupt
        torch.save({"config": {}, "global_step": 10}, shard)  # Lightning's entries beside the weights, in short
        (path / "latest").write_text("checkpoint")

    trainer = SimpleNamespace(lightning_module=torch.nn.Linear(2, 2), global_step=10, is_global_zero=True,
                              world_size=1, strategy=SimpleNamespace(barrier=lambda: None),
                              save_checkpoint=save_checkpoint)
    callback = StepCheckpoints(tmp_path, every=10, val_every=15, link_last=False)
    callback.save(trainer)  # step 10 and last.ckpt, both marked complete
    with pytest.raises(KeyboardInterrupt):
        callback.save(trainer)  # step 10 again, killed mid-shard
    assert saves == [("step0000010.ckpt", False), ("last.ckpt", False), ("step0000010.ckpt", False)]
    skipped = []
    chosen, entries = newest_deepspeed(tmp_path, lambda path, why: skipped.append(path.name))
    assert skipped == ["step0000010.ckpt"] and chosen == tmp_path / "last.ckpt" and entries["global_step"] == 10


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused kernels' deterministic mode needs a GPU; no GPU here")])])
def test_deterministic_runs_in_torch_deterministic_mode_and_repeat_exactly(data: Path, tmp_path: Path,
                                                                         accelerator: str) -> None:
    """trainer.deterministic=true trains a MoSA hybrid under torch.use_deterministic_algorithms (which the fused
    kernels follow, heads/gathered_triton.py); two runs end with bitwise-equal weights. On CPU that only checks the
    flag (CPU runs repeat anyway); on a GPU (bf16, the fused kernels, whose default grid adds with atomics in any
    order) it checks the repetition."""
    from lm.train import train

    seen: list[bool] = []
    original = LMModule.training_step

    def spy(self, *args, **kwargs):  # noqa: ANN001, ANN202
        seen.append(torch.are_deterministic_algorithms_enabled())
        return original(self, *args, **kwargs)

    heads = "model.heads=[{type: dense, count: 2}, {type: mosa, count: 3, options: {sparsity: 4}}]"
    weights = []
    try:
        LMModule.training_step = spy  # type: ignore[method-assign]
        for name in ("a", "b"):
            overrides = [*run_overrides(data, tmp_path / name, max_steps=4, deterministic="true",
                                        accelerator=accelerator), heads]
            train(load_config(None, *overrides))
            weights.append(load_model(tmp_path / name / "checkpoints" / "last.ckpt")[0].state_dict())
    finally:
        LMModule.training_step = original  # type: ignore[method-assign]
        torch.use_deterministic_algorithms(False)  # Lightning leaves the process-wide mode on
    assert seen == [True] * 8
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize("profiler", ["simple", "pytorch"])
def test_profiler_reports(data: Path, tmp_path: Path, profiler: str) -> None:
    """trainer.profiler writes Lightning's report to <out_dir>/profile: `simple` times every training hook over the
    run; `pytorch` records 3 steps after 2 (its default schedule) as an operator table and a Chrome trace."""
    from lm.train import train

    train(load_config(None, *run_overrides(data, tmp_path, max_steps=8, profiler=profiler)))
    report = (tmp_path / "profile" / f"fit-{profiler}.txt").read_text()
    if profiler == "simple":
        row = next(line for line in report.splitlines() if "run_training_batch" in line)
        assert [cell.strip() for cell in row.split("|")][3] == "8", row  # calls: one per step
        return
    steps = next(line for line in report.splitlines() if line.strip().startswith("ProfilerStep*"))
    assert steps.split()[-1] == "3", steps  # recorded steps
    # the table holds the top 20 rows by CPU time, which on a loaded machine may not include one given operator
    assert "aten::" in report and "[pl][module]" in report  # operators and module names
    (trace,) = (tmp_path / "profile").glob("fit-pytorch-*training_step*.pt.trace.json")
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}  # the trace holds every event
    assert "aten::mm" in names and any(n.startswith("[pl][module]heads.dense.DenseHeads: model.blocks.1") for n in names)


def test_pytorch_profiler_survives_a_validation_it_records_nothing_of(data: Path, tmp_path: Path) -> None:
    """The final validation of a run whose last step is no validation step, after a first validation
    (validate_first, as configs/quickstart.yaml sets), stopped the run with torch's AssertionError "Profiler must be
    initialized before accessing events": the profiler never started in it. Now the run ends normally. It follows
    another profiled run in the same process, whose profiler (started again by its last checkpoint's hooks, never
    closed) was closed by garbage collection in the middle of this run: a segfault."""
    from lm.train import train

    train(load_config(None, *run_overrides(data, tmp_path / "first", max_steps=6, profiler="pytorch")))
    overrides = run_overrides(data, tmp_path, max_steps=12, val_every=5, validate_first=True, profiler="pytorch")
    train(load_config(None, *overrides))
    assert json.loads((tmp_path / "metrics.json").read_text())["step"] == 12
    assert "ProfilerStep*" in (tmp_path / "profile" / "fit-pytorch.txt").read_text()


def test_pytorch_profiler_records_cuda_only_for_a_cuda_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """On a machine with a GPU, a CPU run's operator table is sorted by CPU time and no CUDA activity is recorded
    (Lightning's default sorted it by CUDA time, all zeros: the H200 run's table held no aten:: row); a CUDA run
    records both and sorts by CUDA time."""
    import lightning.pytorch.profilers.pytorch as lightning_profiler
    from torch.profiler import ProfilerActivity

    from lm.config import TrainerConfig
    from lm.train import build_profiler

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(lightning_profiler, "is_cuda_available", lambda: True)
    for accelerator, key, cuda in (("cpu", "cpu_time_total", False), ("auto", "cuda_time_total", True)):
        profiler = build_profiler(TrainerConfig(accelerator=accelerator, profiler="pytorch", out_dir=str(tmp_path)))
        assert profiler._sort_by_key == key
        assert (ProfilerActivity.CUDA in profiler._profiler_kwargs["activities"]) == cuda


def test_resume_from_an_earlier_step_sets_the_abandoned_checkpoints_aside(trained: tuple[Path, dict], data: Path,
                                                                          tmp_path: Path, capsys) -> None:
    """--resume-from step 10 of a run that went on to 30 starts another timeline: the old step 20/30 files and
    last.ckpt (a link to step 30) move to checkpoints/abandoned-after-step0000010/, so that a --resume of the new
    timeline (e.g. after a kill before its first checkpoint) never continues from the discarded steps."""
    import shutil

    from lm.checkpoint import newest_loadable, read_checkpoint
    from lm.train import train

    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    ckpts = out / "checkpoints"
    old30 = read_checkpoint(ckpts / "step0000030.ckpt")["state_dict"]
    cfg = load_config(None, *run_overrides(data, out, max_steps=10), "optim.lr=1e-3")  # stops at once: step 10
    train(cfg, resume=str(ckpts / "step0000010.ckpt"))
    aside = ckpts / "abandoned-after-step0000010"
    assert sorted(p.name for p in aside.iterdir()) == ["last.ckpt", "step0000020.ckpt", "step0000030.ckpt"]
    assert "moved the checkpoints of steps after 10" in capsys.readouterr().err
    assert all(torch.equal(v, read_checkpoint(aside / "step0000030.ckpt")["state_dict"][k]) for k, v in old30.items())
    path, ckpt = newest_loadable(ckpts, lambda p, why: None)
    assert path.name == "step0000010.ckpt" and ckpt["global_step"] == 10


def test_a_run_without_a_progress_bar_prints_a_progress_line_every_log_every_steps(data: Path, tmp_path: Path,
                                                                                    capsys, monkeypatch) -> None:
    """stderr is not a terminal here (pytest captures it), so no bar: at every trainer.log_every step (the time floor
    set to 0 s) one line with the step of max_steps, the step's training loss, tokens/s and the training time left;
    the loss is the one metrics.json reports for the last step."""
    import re

    import lm.module
    from lm.train import train

    monkeypatch.setattr(lm.module, "PROGRESS_LINE_SECONDS", 0.0)
    metrics = train(load_config(None, *run_overrides(data, tmp_path / "run", max_steps=12, log_every=4,
                                                     val_every=12, ckpt_every=12)))
    pattern = r"step +(\d+)/12 \| train loss (\d+\.\d{4}) \| +\d+ tokens/s \| training left (\d+:\d\d:\d\d)"
    lines = [m.groups() for line in capsys.readouterr().out.splitlines() if (m := re.fullmatch(pattern, line))]
    assert [int(step) for step, _, _ in lines] == [4, 8, 12]
    assert float(lines[-1][1]) == pytest.approx(metrics["train_loss"], abs=1e-4) and lines[-1][2] == "0:00:00"


@pytest.mark.parametrize("why", ["missing", "another model"])
def test_a_refused_resume_from_leaves_the_run_record_as_it_was(trained: tuple[Path, dict], data: Path,
                                                               tmp_path: Path, why: str) -> None:
    """--resume-from a checkpoint that does not exist, or of another model, is refused in one line before the run
    directory is claimed: its config.yaml and run.json keep the settings it was trained with (they were rewritten
    with the refused command's, e.g. its max_steps and learning rate, and a `resumed` time)."""
    import shutil

    from heads import ConfigError
    from lm.train import train

    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    before = {name: (out / name).read_bytes() for name in ("config.yaml", "run.json")}
    ckpt = out / "checkpoints" / ("none.ckpt" if why == "missing" else "step0000020.ckpt")
    layers = [] if why == "missing" else ["model.n_layers=3"]
    cfg = load_config(None, *run_overrides(data, out, max_steps=99), "optim.lr=1e-3", *layers)
    with pytest.raises(ConfigError, match="^--resume-from: "):
        train(cfg, resume=str(ckpt))
    assert {name: (out / name).read_bytes() for name in before} == before


def test_resume_from_a_last_ckpt_older_than_the_newest_step_keeps_it(trained: tuple[Path, dict], data: Path,
                                                                       tmp_path: Path) -> None:
    """A kill between writing step 30 and linking last.ckpt leaves last.ckpt at step 20. --resume-from last.ckpt
    rewinds to 20: step 30 is set aside, but last.ckpt, the checkpoint it resumes from, stays (it was moved away
    and the run crashed: checkpoint file not found)."""
    import os
    import shutil

    from lm.train import train

    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    ckpts = out / "checkpoints"
    (ckpts / "last.ckpt").unlink()
    os.link(ckpts / "step0000020.ckpt", ckpts / "last.ckpt")
    metrics = train(load_config(None, *run_overrides(data, out, max_steps=22)), resume=str(ckpts / "last.ckpt"))
    assert metrics["step"] == 22
    aside = ckpts / "abandoned-after-step0000020"
    assert sorted(p.name for p in aside.iterdir()) == ["step0000030.ckpt"]


def test_resume_without_a_checkpoint_starts_again_and_logs_each_step_once(data: Path, tmp_path: Path, capsys) -> None:
    """A run killed before its first checkpoint, then --resume: it starts from scratch, and TensorBoard drops what
    the killed run logged (every step showed twice)."""
    import shutil

    from lm.train import train
    from tests.test_resume import logged_steps

    out = tmp_path / "run"
    train(load_config(None, *run_overrides(data, out, max_steps=4, log_every=1, ckpt_every=100, val_every=100)))
    shutil.rmtree(out / "checkpoints")  # as if killed before its first checkpoint
    capsys.readouterr()
    train(load_config(None, *run_overrides(data, out, max_steps=6, log_every=1, ckpt_every=100, val_every=100)),
          resume="last")
    assert "no loadable checkpoint" in capsys.readouterr().err
    assert logged_steps(out) == list(range(1, 7))


def test_out_dir_below_a_file_and_empty_rope_buffers(data: Path, tmp_path: Path) -> None:
    """trainer.out_dir that is (or lies below) a file: one ConfigError line, not FileExistsError; a model with
    model.rope_fraction=0 (an empty RoPE frequency buffer) trains (the non-finite check used to crash on it)."""
    from lm.train import train

    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file", tmp_path / "file" / "run"):
        with pytest.raises(ConfigError, match=f"trainer.out_dir {out}: {tmp_path / 'file'} is a file, not a directory"):
            train(load_config(None, *run_overrides(data, out)))
    metrics = train(load_config(None, *run_overrides(data, tmp_path / "norope", max_steps=3), "model.rope_fraction=0"))
    assert metrics["step"] == 3 and math.isfinite(metrics["val_loss"])


def test_auto_and_gpu_accelerators_are_cuda_or_cpu_never_mps(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the Trainer gets: Lightning's own "auto" and "gpu" pick Apple's MPS before CUDA, where validation's float64
    sums fail; the run's precision and checks take the same answer."""
    from lm.config import TrainerConfig
    from lm.devices import lightning_accelerator, resolve_precision

    for cuda, want in ((False, "cpu"), (True, "cuda")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        for accelerator in ("auto", "gpu", "cuda"):
            t = TrainerConfig(accelerator=accelerator)
            assert lightning_accelerator(t) == want
            assert resolve_precision(t) == {"cpu": "32-true", "cuda": "bf16-mixed"}[want]
        assert lightning_accelerator(TrainerConfig(accelerator="cpu")) == "cpu"


def test_more_cpu_processes_than_cores_warn(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.devices on CPU starts that many DDP processes: more than the cores is slower, said once at the start."""
    import os

    from lm.config import TrainerConfig
    from lm.devices import check_devices

    cores = len(os.sched_getaffinity(0))  # Linux (this test's machines): the affinity mask
    check_devices(TrainerConfig(accelerator="cpu", devices=cores))
    assert capsys.readouterr().err == ""
    check_devices(TrainerConfig(accelerator="cpu", devices=cores + 2))
    assert capsys.readouterr().err == (f"warning: trainer.devices={cores + 2} on CPU starts {cores + 2} training "
                                       f"processes on {cores} core(s): each gets less than a core, and the run is "
                                       f"slower than with trainer.devices={cores}\n")
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS, Windows: the machine's cores (an AttributeError before)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    check_devices(TrainerConfig(accelerator="cpu", devices=2))
    assert "training processes on 1 core(s)" in capsys.readouterr().err


def test_more_nodes_without_a_cluster_launch_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.num_nodes > 1 in a process no cluster launched would wait for the other nodes forever (a fuzzing audit
    found the run hanging after claiming its directory): a one-line ConfigError; a manual launch's variables, or
    torchrun's, let it through."""
    from lm.config import TrainerConfig
    from lm.devices import check_devices

    for name in ("MASTER_ADDR", "NODE_RANK", "RANK", "SLURM_NTASKS", "SLURM_JOB_NAME", "TORCHELASTIC_RUN_ID",
                 "LSB_JOBID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    t = TrainerConfig(accelerator="cpu", devices=1, num_nodes=2)
    with pytest.raises(ConfigError, match=r"^trainer.num_nodes=2, but this process was not launched on a cluster: "):
        check_devices(t)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("NODE_RANK", "1")
    check_devices(t)
    monkeypatch.delenv("NODE_RANK")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")  # torchrun also sets RANK, LOCAL_RANK, GROUP_RANK, ...
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("GROUP_RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    check_devices(t)
    check_devices(TrainerConfig(accelerator="cpu", devices=1, num_nodes=1))


def test_fp16_mixed_precision_on_cpu_is_refused() -> None:
    """Lightning runs 16-mixed as bf16-mixed on CPU, with only its own warning: the run's config.yaml said 16-mixed and
    its metrics.json bf16-mixed (a fuzzing audit). Refused in one line; bf16-mixed and 32-true pass."""
    from lm.config import TrainerConfig
    from lm.devices import check_devices

    with pytest.raises(ConfigError, match=r"^trainer.precision=16-mixed needs a GPU \(Lightning runs bf16-mixed on CPU"):
        check_devices(TrainerConfig(accelerator="cpu", precision="16-mixed"))
    for precision in ("bf16-mixed", "32-true", "auto"):
        check_devices(TrainerConfig(accelerator="cpu", precision=precision))


def test_progress_bar_counts_the_whole_run() -> None:
    """The Rich bar (when stderr is a terminal) counts the run's micro-batches out of max_steps x accumulation,
    also on a resume (Lightning's total is the loader's remaining length: "40/9"), labelled "train" (Lightning's label
    reads "Epoch 0/-2" with max_epochs unset); without a terminal there is no bar."""
    import lightning as L

    from lm.progress_bar import StepProgressBar, progress_bars

    pytest.importorskip("rich", reason="the Rich bar needs the rich package")
    (bar,) = progress_bars(True)
    trainer = L.Trainer(max_steps=7, accumulate_grad_batches=3, callbacks=[bar], logger=False,
                        enable_checkpointing=False, accelerator="cpu")
    bar.setup(trainer, LMModule(load_config(None)), "fit")  # what Trainer.fit does first
    assert isinstance(bar, StepProgressBar) and trainer.progress_bar_callback is bar
    assert bar.total_train_batches == 21
    assert bar._get_train_description(trainer.current_epoch) == "train".ljust(len(bar.validation_description))
    assert progress_bars(False) == []
