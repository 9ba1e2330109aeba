"""Gradient accumulation (trainer.accumulate_grad_batches, lm/accumulation.py): A micro-batches of B train
like one batch of A*B (same windows, same weights up to float summation order); checkpoints, validation and
the time limit act at step boundaries only, so a resumed run equals an uninterrupted one bit for bit."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from heads import ConfigError
from lm.compressed_training import LayoutBatches, LayoutSampler, document_windows
from lm.config_io import load_config
from lm.data import TrainBatches, open_split
from lm.run_logs import tb_scalars
from lm.train import train
from tests.synthetic import run_overrides, write_prepared

WEIGHT_RTOL = 1e-5  # max |w_A - w_1| / max |w_1| per tensor after 6 AdamW steps: fp32 summation order only


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_prepared(tmp_path_factory.mktemp("prepared"), train_tokens=4000, val_tokens=1000)


def run(data: Path, out: Path, batch: int, accumulate: int, steps: int, resume: str | None = None, **trainer: object) -> dict:
    if resume is None:
        shutil.rmtree(out, ignore_errors=True)
    overrides = run_overrides(data, out, max_steps=steps, ckpt_every=2, val_every=3, accumulate_grad_batches=accumulate,
                              **trainer)
    train(load_config(None, *overrides, f"data.batch_size={batch}"), resume=resume)
    return torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def batches_done(ckpt: dict) -> int:
    """Training batches Lightning's loop has fetched (the count a resumed loop continues from)."""
    return ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"]


def test_micro_batches_and_ranks_split_the_step_batch(data: Path) -> None:
    """Micro-batch i on rank r of step s = slice i * world + r of step s's global batch, in order."""
    stream = open_split(data, "train", load_config(None, *run_overrides(data, Path("unused"))).model)
    whole = TrainBatches(stream, 32, 12, seed=7).batch(5)[0]
    parts = [TrainBatches(stream, 32, 2, seed=7, rank=r, world_size=2, accumulate=3).batch(5, i)[0]
             for i in range(3) for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)
    resumed = iter(TrainBatches(stream, 32, 4, seed=7, start_step=5, accumulate=3))
    one = TrainBatches(stream, 32, 4, seed=7, accumulate=3)
    assert all(torch.equal(next(resumed)[0], one.batch(s, i)[0]) for s, i in ((5, 0), (5, 1), (5, 2), (6, 0)))
    loader = torch.utils.data.DataLoader(TrainBatches(stream, 32, 4, seed=7, start_step=5, accumulate=3),
                                         batch_size=None, num_workers=2)
    got = [x for _, (x, _) in zip(range(4), loader)]  # workers read round-robin: the same order
    assert all(torch.equal(g, one.batch(s, i)[0]) for g, (s, i) in zip(got, ((5, 0), (5, 1), (5, 2), (6, 0))))


def test_compression_micro_batches_share_the_step_layout(data: Path) -> None:
    cfg = load_config(None, *run_overrides(data, Path("unused")), "compression.layer=1", "compression.prefix_len=64",
                      "compression.regime=random", "compression.max_depth=2")
    windows, sampler = document_windows(data, "train", cfg), LayoutSampler(cfg.compression, cfg.model.seq_len)
    whole_tokens, whole_layout = LayoutBatches(windows, sampler, 6, seed=3).batch(4)
    micro = [LayoutBatches(windows, sampler, 2, seed=3, accumulate=3).batch(4, i) for i in range(3)]
    assert torch.equal(torch.cat([t for t, _ in micro]), whole_tokens)
    assert all(torch.equal(layout, whole_layout) for _, layout in micro)
    loader = torch.utils.data.DataLoader(LayoutBatches(windows, sampler, 2, seed=3, accumulate=3), batch_size=None,
                                         num_workers=2)
    got = [t for _, (t, _) in zip(range(4), loader)]  # two workers, no batch repeated
    one = LayoutBatches(windows, sampler, 2, seed=3, accumulate=3)
    assert all(torch.equal(g, one.batch(s, i)[0]) for g, (s, i) in zip(got, ((0, 0), (0, 1), (0, 2), (1, 0))))
    # two ranks: micro-batch i of rank r is slice 2i + r of the step's global batch, all with the step's layout
    ranks = [[LayoutBatches(windows, sampler, 2, seed=3, accumulate=3, rank=r, world_size=2).batch(4, i) for i in range(3)]
             for r in (0, 1)]
    doubled, layout = LayoutBatches(windows, sampler, 12, seed=3).batch(4)
    assert torch.equal(torch.cat([ranks[r][i][0] for i in range(3) for r in (0, 1)]), doubled)
    assert all(torch.equal(m[1], layout) for rank in ranks for m in rank)


def test_accumulated_micro_batches_train_like_the_whole_batch(data: Path, tmp_path: Path) -> None:
    whole = run(data, tmp_path / "b8", batch=8, accumulate=1, steps=6)
    micro = run(data, tmp_path / "b2x4", batch=2, accumulate=4, steps=6)
    other = run(data, tmp_path / "b2x4_seed", batch=2, accumulate=4, steps=6, seed=99)
    assert micro["global_step"] == whole["global_step"] == 6 and batches_done(micro) == 4 * batches_done(whole) == 24
    assert micro["tokens_seen"] == whole["tokens_seen"] == 6 * 8 * 32
    assert [h["step"] for h in micro["val_history"]] == [h["step"] for h in whole["val_history"]] == [3, 6]
    assert sorted(p.name for p in (tmp_path / "b2x4" / "checkpoints").iterdir()) == \
        ["last.ckpt", "step0000002.ckpt", "step0000004.ckpt", "step0000006.ckpt"]

    def distance(a: dict, b: dict) -> float:
        return max(((a["state_dict"][k] - v).abs().max() / v.abs().max()).item() for k, v in b["state_dict"].items())

    assert distance(micro, whole) < WEIGHT_RTOL
    assert distance(other, whole) > 100 * WEIGHT_RTOL  # other windows: the check above can fail


def test_routing_centroids_move_once_per_step_as_with_the_whole_batch(data: Path, tmp_path: Path) -> None:
    """Routing's k-means (decay 0.5, so the centroids move fast): 4 micro-batches of 2 end where one batch of 8 ends,
    centroids included; they move once per optimizer step, from all its micro-batches (routing/kmeans.py).
    Moved by every micro-batch, as before, the centroids (and so the weights) differ by far more."""
    heads = "model.heads=[{type: dense, count: 1}, {type: routing, count: 2, options: {sparsity: 4, decay: 0.5}}]"
    ends, halfway = [], []
    for batch, accumulate in ((8, 1), (2, 4)):
        out = tmp_path / f"b{batch}x{accumulate}"
        train(load_config(None, *run_overrides(data, out, max_steps=4, ckpt_every=2, val_every=4,
                                               accumulate_grad_batches=accumulate), f"data.batch_size={batch}", heads))
        read = lambda name: torch.load(out / "checkpoints" / name, map_location="cpu", weights_only=False)  # noqa: E731
        ends.append(read("last.ckpt")["state_dict"])
        halfway.append(read("step0000002.ckpt")["state_dict"])
    means = [k for k in ends[0] if k.endswith("kmeans.means")]
    for end, mid in zip(ends, halfway):  # the centroids moved in steps 3-4, in both runs
        assert means and all((end[k] - mid[k]).abs().max() > 1e-3 for k in means)
    for name, whole in ends[0].items():
        assert ((ends[1][name] - whole).abs().max() / whole.abs().max()).item() < WEIGHT_RTOL, name


def test_accumulated_run_resumes_bit_for_bit_and_stops_on_time_at_a_step_boundary(data: Path, tmp_path: Path) -> None:
    full = run(data, tmp_path / "full", batch=2, accumulate=3, steps=8)
    part = run(data, tmp_path / "part", batch=2, accumulate=3, steps=4)
    for step in (2, 4):  # each written once, after its step's last micro-batch (not again in the next step)
        ckpt = torch.load(tmp_path / "part" / "checkpoints" / f"step{step:07d}.ckpt", weights_only=False)
        assert ckpt["global_step"] == step and batches_done(ckpt) == 3 * step
    resumed = run(data, tmp_path / "part", batch=2, accumulate=3, steps=8, resume="last")
    assert all(torch.equal(v, resumed["state_dict"][k]) for k, v in full["state_dict"].items())
    # the same validations, plus the one that ended the 4-step run (kept in its last checkpoint)
    assert [h for h in resumed["val_history"] if h["step"] != 4] == full["val_history"]
    assert [h for h in resumed["val_history"] if h["step"] == 4] == part["val_history"][-1:]
    assert resumed["tokens_seen"] == full["tokens_seen"]

    timed = run(data, tmp_path / "timed", batch=2, accumulate=3, steps=10_000, max_minutes=1e-5)  # stops at once
    assert 1 <= timed["global_step"] < 10_000 and batches_done(timed) == 3 * timed["global_step"]

    with pytest.raises(ConfigError, match=r"trainer.accumulate_grad_batches: 3 -> 2"):
        run(data, tmp_path / "part", batch=2, accumulate=2, steps=10, resume="last")
    step4 = tmp_path / "part" / "checkpoints" / "step0000004.ckpt"  # into a new run directory: the checkpoint's check
    with pytest.raises(ConfigError, match=rf"^--resume-from: {step4} was trained with trainer\.accumulate_grad_batches=3, "
                                          r"which cannot change on resume$"):
        run(data, tmp_path / "other", batch=2, accumulate=2, steps=10, resume=str(step4))


def test_accumulate_grad_batches_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"accumulate_grad_batches must be a finite number > 0, got 0"):
        load_config(None, "trainer.accumulate_grad_batches=0")


def test_logged_training_loss_is_the_step_mean(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train/loss at each step = the mean cross-entropy of that step's micro-batches (what was optimised)."""
    from lm.module import LMModule

    seen: list[float] = []
    original = LMModule.losses

    def spy(self, x, y):  # noqa: ANN001, ANN202
        out = original(self, x, y)
        seen.append(out[1].item())
        return out

    monkeypatch.setattr(LMModule, "losses", spy)
    run(data, tmp_path / "run", batch=2, accumulate=3, steps=4, log_every=1)
    logged = tb_scalars(tmp_path / "run", "train/loss")
    assert sorted(logged) == [1, 2, 3, 4]  # once per optimizer step, at its count (lm/step_logger.py)
    for step, value in logged.items():
        assert value == pytest.approx(sum(seen[3 * step - 3 : 3 * step]) / 3, rel=1e-6)


def test_head_state_commits_once_per_step_when_the_optimizer_is_stepped_per_micro_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DeepSpeed (which accumulates gradients itself) Lightning calls LMModule.optimizer_step after every
    micro-batch; the staged head state must still move once, after the step's last micro-batch."""
    from types import SimpleNamespace

    import lightning as L

    from lm.module import LMModule
    from tests.conftest import tiny_config

    module = LMModule(tiny_config([{"type": "mosa", "count": 2, "options": {"sparsity": 4}}], seq_len=16)).train()
    module._trainer = SimpleNamespace(accumulate_grad_batches=4, precision_plugin=SimpleNamespace())
    monkeypatch.setattr(L.LightningModule, "optimizer_step", lambda *args, **kwargs: None)  # the engine's step
    tau = module.model.blocks[0].attn.groups[0].threshold.tau
    for batch_idx in range(4):
        module.model(torch.randint(0, 97, (2, 16)))  # a micro-batch's forward stages its statistics
        module.optimizer_step(0, batch_idx, None)
        assert torch.equal(tau, torch.zeros_like(tau)) == (batch_idx < 3), batch_idx


@pytest.mark.parametrize("applied", [True, False])
def test_a_step_deepspeed_skipped_leaves_the_head_state(applied: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DeepSpeed the engine says whether its step was applied (not on an overflow: a non-finite gradient norm);
    a skipped step drops what it staged, as the weights stay."""
    from types import SimpleNamespace

    import lightning as L

    from lm.module import LMModule
    from tests.conftest import tiny_config

    cfg = tiny_config([{"type": "mosa", "count": 2, "options": {"sparsity": 4}}], seq_len=16)
    cfg.trainer.strategy = "deepspeed_stage_2"
    module = LMModule(cfg).train()
    engine = SimpleNamespace(was_step_applied=lambda: applied, get_global_grad_norm=lambda: None)
    module._trainer = SimpleNamespace(accumulate_grad_batches=1, precision_plugin=SimpleNamespace(), model=engine)
    monkeypatch.setattr(L.LightningModule, "optimizer_step", lambda *args, **kwargs: None)  # the engine's step
    tau = module.model.blocks[0].attn.groups[0].threshold.tau
    module.model(torch.randint(0, 97, (2, 16)))
    module.optimizer_step(0, 0, None)
    assert torch.equal(tau, torch.zeros_like(tau)) != applied


def test_throughput_counts_the_tokens_of_the_timed_micro_batches() -> None:
    """tokens_per_s (logged, and MFU's input) = timed micro-batches x their tokens (batch x seq_len x devices) /
    seconds, whatever the accumulation (each timed micro-batch adds tokens_per_batch); tokens_per_step is the
    step's A micro-batches."""
    from types import SimpleNamespace

    from lm.module import LMModule
    from tests.conftest import tiny_config

    cfg = tiny_config([{"type": "dense", "count": 2}], seq_len=16)
    cfg.data.batch_size = 4
    module = LMModule(cfg)
    module._trainer = SimpleNamespace(accumulate_grad_batches=3, world_size=2)
    assert module.tokens_per_batch == 4 * 16 * 2 and module.tokens_per_step == 3 * 4 * 16 * 2
    module._timed = [6 * module.tokens_per_batch, 2.0]  # 6 micro-batches (2 steps) in 2 s
    assert module.tokens_per_s() == 6 * 4 * 16 * 2 / 2.0
