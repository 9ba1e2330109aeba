"""DeepSpeed ZeRO-2 (trainer.strategy=deepspeed_stage_2) on CPU: Lightning's DeepSpeedStrategy refuses
CPU, so two gloo ranks run raw `deepspeed.initialize` with the same config, optimizer and loss
(tests/zero2_worker.py), and must equal one plain process accumulating the ranks' micro-batches: AdamW,
global-norm clipping at optim.grad_clip (the gradient norms are compared too: each rank accumulates two micro-batches,
and DeepSpeed must not divide Lightning's already divided loss again), warmup + cosine; the model has MoSA and
Routing heads, whose running
threshold and k-means centroids (buffers, compared too, and checked to have moved) must be updated from both
ranks' statistics once per step (routing/distributed.py).
Tolerance: relative RMS 1e-5 per tensor after 5 steps (float summation order of the reduce-scatter).
The same ranks' checkpoint, saved as Lightning's DeepSpeedStrategy saves it, resumes and consolidates (lm.consolidate);
Lightning's DeepSpeedStrategy itself trains train_lm.py on 1 and 2 CPU ranks (tests/deepspeed_on_cpu.py); the
engine's gradient norm is logged; a step the engine skips (NaN gradient or loss) counts against trainer.max_bad_steps
or stops the run (lm/nonfinite.py)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from heads import commit_states
from lm.config import ConfigError
from tests import zero2_worker as worker
from tests.conftest import child_env
from tests.synthetic import run_overrides, write_prepared

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zero2_two_cpu_ranks_match_one_process(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    out = tmp_path / "zero2.pt"
    # DeepSpeed's CPU accelerator even where a GPU is visible (with CUDA it would set rank 1 on device 1)
    env = child_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                    DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    ranks = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "zero2_worker.py"), str(out)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()  # no-op for a finished rank; never leave one waiting for its peer
    assert all(p.returncode == 0 for p in ranks), logs[0][-3000:] + logs[1][-3000:]

    from lm.module import LMModule

    cfg = worker.config()
    torch.manual_seed(0)
    module = LMModule(cfg)
    opt = module.configure_optimizers()
    optimizer, schedule = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
    start = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    parts, norms = 2 * worker.MICRO, []
    for step in range(worker.STEPS):
        for tokens in worker.global_batch(step, cfg).chunk(parts):  # the ranks' micro-batches, one after the other
            loss, _, _ = module.losses(tokens[:, :-1], tokens[:, 1:])
            (loss / parts).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(module.model.parameters(), cfg.optim.grad_clip)))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        commit_states(module.model)
    saved = torch.load(out, weights_only=True)
    zero2 = saved["state"]
    assert saved["grad_norms"] == pytest.approx(norms, rel=1e-5)
    for name, w in module.model.named_parameters():
        assert not torch.equal(w, start[name]), f"{name} did not train"
        rel = ((zero2[name] - w).norm() / w.norm()).item()
        assert rel <= 1e-5, f"{name}: relative RMS difference {rel:.1e}"
    consolidated_matches(tmp_path, zero2, cfg)
    buffers = {k: v for k, v in module.model.named_buffers() if k in zero2 and v.is_floating_point()}
    assert any(k.endswith("threshold.tau") for k in buffers) and any(k.endswith("kmeans.means") for k in buffers)
    for name, b in buffers.items():
        assert not torch.equal(b, start[name]), f"{name} did not move"
        rel = ((zero2[name] - b).norm() / b.norm()).item()
        assert rel <= 1e-5, f"{name}: relative RMS difference {rel:.1e}"


def consolidated_matches(tmp_path: Path, trained: dict[str, torch.Tensor], cfg) -> None:
    """A resume from the ranks' DeepSpeed checkpoint directory reads its entries (weights_only) for its checks;
    lm.consolidate makes one file of it that load_model and lm.generate take: the trained weights and buffers
    exactly (fp32: the master weights are the weights), the config; a resume from it is refused in one line (no
    optimizer state), and so is the directory where a file is read."""
    from lm.checkpoint import CheckpointError, load_model, read_checkpoint
    from lm.consolidate import consolidate, main
    from lm.train import resume_path

    directory, out = worker.checkpoint_dir(tmp_path / "zero2.pt"), tmp_path / "consolidated.ckpt"
    cfg.trainer.strategy = "deepspeed_stage_2"  # --resume-from the directory reads DeepSpeed's real rank-0 file
    assert resume_path(cfg, str(directory)) == (str(directory), worker.STEPS)
    with pytest.raises(CheckpointError, match=f"is a DeepSpeed checkpoint directory: make one file of it first, "
                                              f"python -m lm.consolidate {directory} OUT.ckpt"):
        read_checkpoint(directory)
    assert main([str(directory), str(out)]) == 0
    model, saved_cfg = load_model(out)
    assert saved_cfg.model == cfg.model and read_checkpoint(out)["global_step"] == worker.STEPS
    state = model.state_dict()
    assert state.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    with pytest.raises(ConfigError, match=f"holds weights only .*{directory.name}.*resume from that directory"):
        resume_path(saved_cfg, str(out))
    (directory / "complete").unlink()  # as a kill during the save leaves it
    with pytest.raises(CheckpointError, match="incomplete DeepSpeed checkpoint"):
        consolidate(directory, tmp_path / "again.ckpt")


def test_deepspeed_on_cpu_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's DeepSpeedStrategy needs CUDA; on CPU the config says so in one line, before DeepSpeed is imported
    (its import logs accelerator warnings above the error); on a GPU without DeepSpeed installed, how to install it."""
    import torch

    from lm.devices import build_strategy
    from tests.conftest import tiny_config

    cfg = tiny_config()
    cfg.trainer.strategy = "deepspeed_stage_2"
    cfg.trainer.accelerator = "cpu"
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError: not reached on CPU
    with pytest.raises(ConfigError, match="needs CUDA GPUs.*strategy=ddp"):
        build_strategy(cfg)
    cfg.trainer.accelerator = "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[deepspeed\]'"):
        build_strategy(cfg)


def test_deepspeed_strategy_takes_the_loss_as_lightning_divides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """build_strategy's DeepSpeedStrategy carries lm.devices.LossDividedOnce (checked by the ZeRO-2 test above) and
    the Trainer keeps it, with the run's precision: Lightning's default plugin divides by the accumulation twice."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    import lightning as L

    from lm.devices import LossDividedOnce, build_strategy
    from tests.conftest import tiny_config

    cfg = tiny_config()
    cfg.trainer.strategy, cfg.trainer.precision = "deepspeed_stage_2", "bf16-mixed"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    strategy = build_strategy(cfg)
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    assert type(trainer.strategy.precision_plugin) is LossDividedOnce and trainer.precision == "bf16-mixed"


def test_the_engines_gradient_norm_is_logged_after_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DeepSpeed the gradients live in the engine's partitions, so configure_gradient_clipping finds none and
    never logged train/grad_norm: the module logs the engine's global norm (the one it clipped by) after the micro-batch
    that ends a step, not after the others."""
    from types import SimpleNamespace

    import lightning as L

    from lm.module import LMModule

    cfg = worker.config()
    cfg.trainer.strategy = "deepspeed_stage_2"
    module = LMModule(cfg)
    engine = SimpleNamespace(get_global_grad_norm=lambda: 0.75, was_step_applied=lambda: True)
    module.trainer = SimpleNamespace(model=engine, accumulate_grad_batches=2, precision_plugin=SimpleNamespace())
    monkeypatch.setattr(L.LightningModule, "optimizer_step", lambda *a, **k: None)  # the engine's step, not run here
    logged = []
    monkeypatch.setattr(module, "log", lambda name, value, **k: logged.append((name, value)))
    module.optimizer_step(0, 0, None)  # the step's first micro-batch
    assert logged == []
    module.optimizer_step(0, 1, None)
    assert logged == [("train/grad_norm", 0.75)]


@pytest.mark.parametrize("ranks", [1, 2])
def test_lightnings_deepspeed_strategy_trains_validates_resumes_and_consolidates_on_cpu(tmp_path: Path,
                                                                                       ranks: int) -> None:
    """train_lm.py through Lightning's own DeepSpeedStrategy (ZeRO-2, bf16-mixed) on one or two CPU ranks, its CUDA
    refusals patched (tests/deepspeed_on_cpu.py): 6 steps validating at 4 and at the last step inside fit (a
    trainer.validate after fit crashed the save after it), a complete checkpoint directory, --resume to step 8 from
    step 6's, and lm.consolidate of the final one, which load_model reads."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    from lm.checkpoint import CONSOLIDATED, load_model, read_checkpoint, read_deepspeed
    from lm.consolidate import main as consolidate

    data, run = write_prepared(tmp_path / "data"), tmp_path / "run"
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")

    def train(steps: int, *flags: str) -> str:
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "deepspeed_on_cpu.py"), "train_lm.py", "--config",
                               "configs/tiny.yaml", *run_overrides(data, run, max_steps=steps, val_every=4, ckpt_every=3),
                               "trainer.strategy=deepspeed_stage_2", "trainer.precision=bf16-mixed",
                               f"trainer.devices={ranks}", *flags],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stderr

    assert "will not actually clip" not in train(6)  # Lightning's warning: the engine clips at optim.grad_clip
    ckpts = run / "checkpoints"
    assert [h["step"] for h in json.loads((run / "metrics.json").read_text())["history"]] == [4, 6]
    for name in ("step0000006.ckpt", "last.ckpt"):
        assert (ckpts / name / "complete").read_text() == f"step 6, {ranks} rank(s)\n"
    assert f"--resume: continuing from {ckpts / 'step0000006.ckpt'}" in train(8, "--resume")
    assert [h["step"] for h in json.loads((run / "metrics.json").read_text())["history"]] == [4, 6, 8]
    assert consolidate([str(ckpts / "last.ckpt"), str(tmp_path / "final.ckpt")]) == 0
    model, cfg = load_model(tmp_path / "final.ckpt")
    final = read_checkpoint(tmp_path / "final.ckpt")
    assert final["global_step"] == 8 and cfg.trainer.strategy == "deepspeed_stage_2"
    assert set(final) == {"state_dict", "config", "run", "global_step", "epoch", "tokens_seen", "val_history",
                          "pytorch-lightning_version", CONSOLIDATED}  # every entry a reader uses; none of DeepSpeed's
    assert final["tokens_seen"] == read_deepspeed(ckpts / "last.ckpt")["tokens_seen"] > 0  # not re-derived
    assert [h["step"] for h in final["val_history"]] == [4, 6, 8]
    assert all(p.dtype == torch.float32 and p.isfinite().all() for p in model.parameters())


def train_poisoned(data: Path, run: Path, steps: int, *flags: str, **poison: str) -> subprocess.CompletedProcess:
    """train_lm.py on configs/tiny.yaml through Lightning's DeepSpeedStrategy (ZeRO-2) on one CPU rank, checkpointing
    every step (all kept), with NaN gradients or losses at the trainer.global_step values `poison` names
    (NAN_GRADIENT_AT_STEP / NAN_LOSS_AT_STEP, tests/deepspeed_on_cpu.py)."""
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="",
                    **poison)
    return subprocess.run([sys.executable, str(ROOT / "tests" / "deepspeed_on_cpu.py"), "train_lm.py", "--config",
                           "configs/tiny.yaml", *run_overrides(data, run, max_steps=steps, val_every=6, ckpt_every=1),
                           "trainer.keep_last_k=0", "trainer.strategy=deepspeed_stage_2", *flags],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def step_dirs(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step"))


@pytest.mark.parametrize("precision,accumulate", [("bf16-mixed", 1), ("32-true", 1), ("bf16-mixed", 2)])
def test_a_step_deepspeed_skipped_for_a_nonfinite_gradient_stops_the_run(tmp_path: Path, precision: str,
                                                                         accumulate: int) -> None:
    """The engine holds the gradients (the guard sees only the loss) and skips a step whose gradient norm is not finite:
    in bf16 and fp32 that is a bad step, which stops the run (exit 3, the step and the last checkpoint named), as
    trainer.max_bad_steps = 0 says; the run went on silently, every such step skipped. One NaN gradient at step 4
    (a tensor hook, tests/deepspeed_on_cpu.py), the loss finite; the checkpoint of step 3 stays the newest. With two
    micro-batches per step the engine reports "not applied" after the first of each (it steps only at the boundary):
    read there, the guard would stop at step 1."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    data, run = write_prepared(tmp_path / "data"), tmp_path / "run"
    done = train_poisoned(data, run, 6, f"trainer.precision={precision}",
                          f"trainer.accumulate_grad_batches={accumulate}",
                          NAN_GRADIENT_AT_STEP="3")  # trainer.global_step 3: the fourth step
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-3000:]
    assert last == ("error: non-finite training at step 4: DeepSpeed's engine found the global gradient norm non-finite "
                    f"and skipped the update; stopped; last finite checkpoint: {run / 'checkpoints' / 'step0000003.ckpt'}"
                    " (lower optim.lr, or set trainer.max_bad_steps to skip a few bad steps)")
    assert step_dirs(run) == ["step0000001.ckpt", "step0000002.ckpt", "step0000003.ckpt"]


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DeepSpeed checkpoint directory (module, fp32 master partitions, AdamW moments), by path."""
    tag = (checkpoint / "latest").read_text().strip()
    found: dict[str, torch.Tensor] = {}

    def walk(value: object, path: str) -> None:
        if isinstance(value, torch.Tensor):
            found[path] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]")

    for file in sorted((checkpoint / tag).glob("*.pt")):
        walk(torch.load(file, map_location="cpu", weights_only=False), file.name)
    return found


def test_a_step_deepspeed_skipped_within_max_bad_steps_changes_nothing_and_the_run_goes_on(tmp_path: Path) -> None:
    """trainer.max_bad_steps = 1 under DeepSpeed (fp32): the engine's skip of step 4 (one NaN gradient) is the skip, one
    warning line counts it, and the run ends normally. Every tensor of the checkpoint of step 4 (weights, fp32 master
    partitions, AdamW moments) equals step 3's, and step 5 moves them again."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    data, run = write_prepared(tmp_path / "data"), tmp_path / "run"
    done = train_poisoned(data, run, 6, "trainer.precision=32-true", "trainer.max_bad_steps=1", NAN_GRADIENT_AT_STEP="3")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert ("warning: skipped step 4 (DeepSpeed's engine found the global gradient norm non-finite and skipped the "
            "update); 1 of trainer.max_bad_steps=1 used") in done.stdout.splitlines()
    assert step_dirs(run) == [f"step{n:07d}.ckpt" for n in range(1, 7)]
    step3, step4, step5 = (tensors(run / "checkpoints" / f"step{n:07d}.ckpt") for n in (3, 4, 5))
    assert step4.keys() == step3.keys() and len(step3) > 20
    assert all(torch.equal(step4[key], step3[key]) for key in step3)
    moved = [key for key in step3 if not torch.equal(step5[key], step4[key])]
    assert any("optim_states" in key for key in moved) and any("model_states" in key for key in moved)


def test_deepspeeds_bad_step_budget_counts_nonfinite_losses_and_survives_a_resume(tmp_path: Path) -> None:
    """bf16, two micro-batches per step: a NaN loss at step 2 uses the one bad step allowed (the engine skips the
    update, its gradient being NaN too); the budget is saved in the checkpoint, so after --resume a NaN gradient at
    step 5 stops the run, naming step 4's checkpoint."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    data, run = write_prepared(tmp_path / "data"), tmp_path / "run"
    flags = ("trainer.precision=bf16-mixed", "trainer.accumulate_grad_batches=2", "trainer.max_bad_steps=1")
    done = train_poisoned(data, run, 4, *flags, NAN_LOSS_AT_STEP="1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert ("warning: skipped step 2 (loss nan; DeepSpeed's engine skipped the update); 1 of trainer.max_bad_steps=1 "
            "used") in done.stdout.splitlines()
    done = train_poisoned(data, run, 6, *flags, "--resume", NAN_GRADIENT_AT_STEP="4")
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: non-finite training at step 5: DeepSpeed's engine found the global gradient norm non-finite and skipped "
        f"the update; stopped after skipping 1 bad steps; last finite checkpoint: {run / 'checkpoints' / 'step0000004.ckpt'}"
        " (lower optim.lr, or set trainer.max_bad_steps to skip a few bad steps)")


def test_consolidate_replaces_its_file_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that fails half-way (a full disk) leaves the previous consolidated file as it was and no partial file
    or temporary directory beside it (the DeepSpeed conversion itself stubbed: a few bytes of state)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    import lightning.pytorch.utilities.deepspeed as lightning_deepspeed

    import lm.consolidate as consolidate

    monkeypatch.setattr(consolidate, "read_deepspeed", lambda directory: None)
    monkeypatch.setattr(lightning_deepspeed, "convert_zero_checkpoint_to_fp32_state_dict",
                        lambda directory, path: {"state_dict": {}, "config": {}})

    def full_disk(obj: object, f) -> None:
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(consolidate.torch, "save", full_disk)
    out = tmp_path / "consolidated.ckpt"
    out.write_bytes(b"the previous consolidation")
    with pytest.raises(OSError, match="No space left"):
        consolidate.consolidate(tmp_path / "checkpoint_dir", out)
    assert out.read_bytes() == b"the previous consolidation"
    assert [p.name for p in tmp_path.iterdir()] == ["consolidated.ckpt"]
