"""Causal agent attention (heads/agent.py): fast vs reference, reduction to dense when no agent is
complete and the window covers everything, agents are really used, causality in a hybrid mix."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from tests.head_checks import assert_match, fast_vs_reference, make_group, saved_for_backward

import lm
from heads import ConfigError
from lm.causality import future_leak

TOL = 1e-12  # float64: relative RMS error and max-abs error (relative to the reference max), outputs and all gradients


@pytest.mark.parametrize("T,block,window,dwc", [(100, 8, 5, 0), (257, 16, 16, 0), (20, 32, 7, 0), (100, 8, 5, 3),
                                                (37, 4, 2, 1), (20, 32, 7, 5), (4, 4, 2, 9)])  # K > T
def test_fast_matches_reference(T: int, block: int, window: int, dwc: int) -> None:
    group = make_group("agent", {"block": block, "window": window, "dwc": dwc}, T, std=None, dtype=torch.float64)
    assert_match(fast_vs_reference(group, T), TOL, TOL)


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_dwc_adds_a_causal_depthwise_convolution_of_v(impl: str) -> None:
    """Option dwc = K (eq. 6's DWC(V), made causal): the output gains W^O applied to, per head and channel,
    bias + sum_j w_j v[t - K + 1 + j] over rows >= 0; written here token by token."""
    T, K, H, d = 19, 3, 2, 8
    group = make_group("agent", {"block": 4, "window": 2, "dwc": K, "impl": impl}, T, count=H, head_dim=d,
                       dtype=torch.float64)
    x, positions = torch.randn(2, T, 32, dtype=torch.float64), torch.arange(T).expand(2, T)
    v = group._qkv(x, positions)[2]  # [B, H, T, h']
    w, bias = group.dwc.weight[:, 0].view(H, d, K), group.dwc.bias.view(H, d)
    conv = torch.stack([bias + sum(w[..., j] * v[:, :, t - K + 1 + j] for j in range(K) if t - K + 1 + j >= 0)
                        for t in range(T)], 2)  # [B, H, T, h']
    with_dwc = group(x, positions)
    with torch.no_grad():
        group.dwc.weight.zero_()
        group.dwc.bias.zero_()
    want = group(x, positions) + conv.transpose(1, 2).reshape(2, T, H * d) @ group.out.weight.T
    assert (with_dwc - want).abs().max().item() <= TOL * want.abs().max().item()


def test_fast_path_keeps_no_score_tensor() -> None:
    """SDPA's fused kernel runs (4-D blocks, a mask with no batch/head dimension), so nothing kept for
    backward is as large as the [H, T, n + 2b] probabilities the math kernel keeps (the old 5-D
    layout ran it); the largest saved tensors are the per-block agent keys, h'/b of that."""
    T, b, w, H = 256, 32, 16, 4
    group = make_group("agent", {"block": b, "window": w}, T, count=H, head_dim=8)
    assert max(saved_for_backward(group, T)) < H * T * (T // b + 2 * b) * 4


def _models(T: int, **options) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Dense and agent models (same weights) for sequences of up to T tokens; a block over T is allowed by
    building them for length `block` (config load refuses block > model.seq_len) and running them on T."""
    T = max(T, options.get("block", 0), options.get("window", 0))
    dense = lm.build_model(tiny_config(heads=[{"type": "dense", "count": 2}], seq_len=T).model).double()
    agent = lm.build_model(tiny_config(heads=[{"type": "agent", "count": 2, "options": options}], seq_len=T).model).double()
    agent.load_state_dict(dense.state_dict())  # same qkv / out layout as dense
    return dense, agent


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_no_complete_agent_and_full_window_is_dense(impl: str) -> None:
    T = 30
    dense, agent = _models(T, block=T + 1, window=T + 1, impl=impl)
    tokens = torch.randint(0, 97, (2, T))
    assert (agent(tokens) - dense(tokens)).abs().max().item() < TOL


def test_agents_change_rows_after_the_first_block() -> None:
    """With window 1, rows before the first completed block see only themselves; from row b-1 on
    the agents contribute, so the output differs from the window-only (no agent) model there."""
    T, b = 24, 6
    _, with_agents = _models(T, block=b, window=1)
    _, no_agents = _models(T, block=T + 1, window=1)
    no_agents.load_state_dict(with_agents.state_dict())
    tokens = torch.randint(0, 97, (1, T))
    diff = (with_agents(tokens) - no_agents(tokens)).abs().amax(-1)[0]  # [T]
    assert diff[: b - 1].max().item() < TOL
    assert diff[b - 1 :].min().item() > 1e-6


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_causal_in_hybrid_mix_and_trains(impl: str) -> None:
    cfg = tiny_config(heads=[{"type": "dense", "count": 1},
                             {"type": "agent", "count": 2, "options": {"block": 8, "window": 4, "dwc": 3, "impl": impl}}])
    model = lm.build_model(cfg.model)
    tokens = torch.randint(0, 97, (2, 64))
    assert model.causal
    for t in (0, 6, 7, 8, 40):  # around the first block end (row 7)
        assert future_leak(model, tokens, t, 97) < 1e-5
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    group = model.blocks[0].attn.groups[1]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in group.parameters())


@pytest.mark.parametrize("options,field", [({"block": 0}, "options.block"), ({"block": 8, "window": 9}, "options.window"),
                                           ({"dwc": -1}, "options.dwc")])
def test_bad_options_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        tiny_config(heads=[{"type": "agent", "count": 2, "options": options}])


def test_flop_formula_lets_isoflop_match_it_to_dense() -> None:
    from flops.isoflop import solve
    from flops.presets import baseline

    result = solve(baseline("tiny"), "agent", dense_heads=4, options={"block": 64, "window": 64})
    assert result.budget_used <= 1 and result.sparse_heads > 5  # cheaper per head than the 5 dense heads replaced
