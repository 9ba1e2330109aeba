"""Activation checkpointing (lm/checkpointing.py): every head type, in a training-mode hybrid model, gives the
same loss, gradients and head state with checkpointed blocks as without (float64, two steps, so the second
runs on state the first step's commit moved), while autograd keeps only the blocks' inputs."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

import lm
from heads import REGISTRY, ConfigError, commit_states
from lm.config_io import load_config
from lm.model import checkpoint_blocks
from routing.kmeans import OnlineKMeans
from routing.threshold import RunningQuantileThreshold
from tests.head_checks import tiny_options
from tests.synthetic import run_overrides, write_prepared

TOL = 1e-12  # float64: relative max-abs error of the loss and of every gradient
# fast-moving state for the stateful heads, on top of their tiny-model options
FAST_STATE = {"mosa": {"threshold_momentum": 0.5}, "routing": {"decay": 0.5}}
OPTIONS = {k: {**tiny_options(k), **FAST_STATE.get(k, {})} for k in sorted(REGISTRY)}


def pair(kind: str, options: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    heads = [{"type": "dense", "count": 1}, {"type": kind, "count": 2, "options": options}]
    plain = lm.build_model(tiny_config(heads=heads, seq_len=32).model).double().train()
    twin = copy.deepcopy(plain)
    checkpoint_blocks(twin)
    return plain, twin


def step(model: torch.nn.Module, tokens: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)  # MoSAIC's training priorities: the same draw in both models
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss
    loss.backward()
    commit_states(model)  # after the optimizer step, as lm/module.py does
    return loss.detach()


CASES = [*OPTIONS.items(), ("mosa", {"sparsity": 4, "selection": "expert_choice"}),
         ("mosa", {"sparsity": 4, "selection": "predictor"})]


@pytest.mark.parametrize("kind,options", CASES, ids=[f"{k}-{o.get('selection', '')}".rstrip("-") for k, o in CASES])
def test_checkpointed_blocks_match_plain_blocks(kind: str, options: dict) -> None:
    plain, twin = pair(kind, options)
    tokens = torch.randint(0, 97, (2, 32))
    for seed in (0, 1):
        a, b = step(plain, tokens, seed), step(twin, tokens, seed)
        assert (a - b).abs().item() <= TOL * a.abs().item()
        for (name, p), q in zip(plain.named_parameters(), twin.parameters()):
            assert p.grad is not None and q.grad is not None, name
            assert (p.grad - q.grad).abs().max().item() <= TOL * p.grad.abs().max().item() + 1e-300, name
            p.grad = q.grad = None
        for (name, x), y in zip(plain.named_buffers(), twin.buffers()):  # moved once per step, identically
            assert torch.equal(x, y), name


@pytest.mark.parametrize("kind,state", [("mosa", RunningQuantileThreshold), ("routing", OnlineKMeans)])
def test_a_replay_stages_nothing(kind: str, state: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block's statistics are staged once per forward pass: the replay in backward does not stage them again
    (which would count the micro-batch twice in the step's update)."""
    calls = []
    original = state.stage
    monkeypatch.setattr(state, "stage", lambda self, *args: calls.append(1) or original(self, *args))
    _, twin = pair(kind, OPTIONS[kind])
    step(twin, torch.randint(0, 97, (2, 32)), seed=0)
    assert len(calls) == 2  # 2 blocks, one forward pass each


def test_only_block_inputs_are_kept() -> None:
    """With 4 blocks, what autograd keeps outside the checkpointed blocks (their inputs, the embedding and the
    head) is under a third of what the plain model keeps."""
    heads = [{"type": "dense", "count": 2}, {"type": "mosa", "count": 4, "options": {"sparsity": 4}}]
    model = lm.build_model(tiny_config(heads=heads, seq_len=64, n_layers=4, d_model=64).model).train()
    tokens = torch.randint(0, 97, (4, 64))
    plain = activation_bytes(model, tokens)
    checkpoint_blocks(model)
    kept = activation_bytes(model, tokens)
    assert kept < plain / 3, (kept, plain)


def activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward after one forward pass, parameters excluded
    (saved_tensors_hooks: a checkpointed block's own hooks take its tensors, which are not kept)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(storages.values())


def test_training_with_activation_checkpointing_ends_where_plain_training_does(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.activation_checkpointing through lm.train (LMModule.setup): a MoSA hybrid's 4 AdamW steps end with
    the plain run's weights and thresholds (fp32: the replayed forward computes the same values)."""
    import lm.model
    from lm.train import train

    calls = []
    original = lm.model.checkpointed
    monkeypatch.setattr(lm.model, "checkpointed", lambda *args: calls.append(1) or original(*args))
    data = write_prepared(tmp_path / "data", train_tokens=4000, val_tokens=1000)
    heads = "model.heads=[{type: dense, count: 2}, {type: mosa, count: 3, options: {sparsity: 4}}]"
    states = []
    for name, flag in (("plain", "false"), ("checkpointed", "true")):
        overrides = run_overrides(data, tmp_path / name, max_steps=4, activation_checkpointing=flag)
        train(load_config(None, *overrides, heads))
        states.append(torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"])
    assert len(calls) == 4 * 2  # 4 steps x 2 blocks, in the second run only (not in validation)
    for name, value in states[0].items():
        assert torch.allclose(states[1][name], value, rtol=1e-6, atol=1e-7), name


def test_activation_checkpointing_with_compile_is_one_line() -> None:
    with pytest.raises(ConfigError, match="activation_checkpointing and trainer.compile cannot be combined"):
        load_config(None, "trainer.activation_checkpointing=true", "trainer.compile=true")
