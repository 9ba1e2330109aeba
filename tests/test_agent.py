"""Causal agent attention (heads/agent.py): fast vs reference, reduction to dense when no agent is
complete and the window covers everything, agents are really used, causality in a hybrid mix; the published
(non-causal) variant: fast vs reference, eq. 6 written with torch's operators (option errors: tests/test_config.py;
its leak and refused decoding: tests/test_head_contract_random.py)."""
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


def _per_query(group, x: torch.Tensor) -> torch.Tensor:
    """Eq. 5 made causal, one query at a time, from the group's own projections and bias tables: agent j
    (complete at e_j) = mean of block j's rotated queries, V_A_j = softmax(A_j K_{<=e_j}^T / sqrt(h') + B1(e_j - p)) V;
    query t: softmax over [q_t A_j^T / sqrt(h') + B2(t - e_j) for e_j <= t | q_t k_p^T / sqrt(h') for t-w < p <= t]
    of [V_A_j | v_p]; the heads' outputs through W^O (no dwc)."""
    from routing.landmarks import distance_buckets

    B, T, _ = x.shape
    q, k, v = group._qkv(x, torch.arange(T).expand(B, T))  # [B, H, T, h']
    b, w, n, scale = group.options.block, group.options.window, T // group.options.block, group.ctx.head_dim ** -0.5

    def bias(which: int, i: int, d: int) -> torch.Tensor:
        return group.agent_bias[which, i, distance_buckets(torch.tensor(d), group.options.bias, group.ctx.seq_len)]

    heads = []
    for i in range(group.count):
        rows = []
        for t in range(T):
            scores, values = [], []
            for j in range(n):
                e = (j + 1) * b - 1
                if e > t:
                    continue
                a = q[:, i, j * b : e + 1].mean(1)  # [B, h']
                s = torch.stack([(a * k[:, i, p]).sum(-1) * scale + bias(0, i, e - p) for p in range(e + 1)], -1)
                values.append(torch.einsum("bp,bpd->bd", s.softmax(-1), v[:, i, : e + 1]))
                scores.append((q[:, i, t] * a).sum(-1) * scale + bias(1, i, t - e))
            for p in range(max(0, t - w + 1), t + 1):
                values.append(v[:, i, p])
                scores.append((q[:, i, t] * k[:, i, p]).sum(-1) * scale)
            prob = torch.stack(scores, -1).softmax(-1)  # [B, keys]
            rows.append(torch.einsum("bk,bkd->bd", prob, torch.stack(values, 1)))
        heads.append(torch.stack(rows, 1))
    return group.out(torch.cat(heads, -1))


def test_distance_buckets_are_t5_buckets() -> None:
    """routing.landmarks.distance_buckets against T5's relative-position buckets worked by hand (8 buckets, max
    distance 64): exact below 8 // 2 = 4, then 4 + floor(log(d / 4) / log(64 / 4) * 4), the last bucket beyond;
    distances away from bucket edges, so no rounding decides them."""
    from routing.landmarks import distance_buckets

    want = {-3: 0, 0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 7: 4, 9: 5, 15: 5, 17: 6, 31: 6, 33: 7, 63: 7, 64: 7, 1000: 7}
    d = torch.tensor(list(want))
    assert distance_buckets(d, 8, 64).tolist() == list(want.values())
    assert distance_buckets(d, 1, 64).tolist() == [0] * len(want)  # one bucket: every distance shares one bias
    assert distance_buckets(torch.arange(6), 3, 64).tolist() == [0, 1, 1, 1, 1, 1]  # 3 // 2 = 1 exact, then log


@pytest.mark.parametrize("buckets", [1, 3, 6])
@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_agent_biases_enter_both_softmaxes(impl: str, buckets: int) -> None:
    """Option bias (eq. 5's B1, B2 as learned per-head biases of the token distances e_j - p and t - e_j): both
    paths equal a per-query implementation; the biases change the output (they start at 0: plain agent
    attention); cached decoding equals the full forward."""
    T, b = 23, 4
    group = make_group("agent", {"block": b, "window": 3, "bias": buckets, "impl": impl}, T, dtype=torch.float64)
    x = torch.randn(2, T, group.ctx.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(T).expand(2, T)
    with torch.no_grad():
        group.agent_bias.zero_()
        plain = group(x, pos)
        group.agent_bias.normal_(std=2.0, generator=torch.Generator().manual_seed(4))
        out = group(x, pos)
        want = _per_query(group, x)
        assert (out - want).abs().max().item() <= TOL * want.abs().max().item()
        assert (out - plain).abs().max().item() > 1e-3
        cache = group.new_cache(2, T, "cpu", torch.float64)
        steps = [group(x[:, :6], pos[:, :6], cache)] + [group(x[:, t : t + 1], pos[:, t : t + 1], cache) for t in range(6, T)]
    assert (torch.cat(steps, 1) - out).abs().max().item() <= 1e-10 * out.abs().max().item()


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
                             {"type": "agent", "count": 2, "options": {"block": 8, "window": 4, "dwc": 3, "bias": 4,
                                                                        "impl": impl}}])
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
                                           ({"dwc": -1}, "options.dwc"), ({"bias": -2}, "options.bias")])
def test_bad_options_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        tiny_config(heads=[{"type": "agent", "count": 2, "options": options}])


def test_flop_formula_lets_isoflop_match_it_to_dense() -> None:
    from flops.isoflop import solve
    from flops.presets import baseline

    result = solve(baseline("tiny"), "agent", dense_heads=4, options={"block": 64, "window": 64})
    assert result.budget_used <= 1 and result.sparse_heads > 5  # cheaper per head than the 5 dense heads replaced


# variant published (eq. 6 over the whole sequence, NOT causal): training length, a shorter and a longer input (the
# n = seq_len // b agents then pool windows of other sizes, overlapping where n does not divide T), DWC of odd and
# even width, biases with an odd bucket count, one agent (block = seq_len; no bias: one agent makes both constant)
@pytest.mark.parametrize("seq_len,T,block,dwc,bias", [(32, 32, 8, 0, 0), (32, 20, 8, 3, 4), (32, 45, 5, 4, 5),
                                                      (16, 7, 16, 1, 0), (8, 3, 2, 0, 3)])
def test_published_fast_matches_reference(seq_len: int, T: int, block: int, dwc: int, bias: int) -> None:
    options = {"block": block, "dwc": dwc, "bias": bias, "variant": "published"}
    group = make_group("agent", options, seq_len, std=0.3, dtype=torch.float64)
    assert_match(fast_vs_reference(group, T), TOL, TOL)


def test_signed_distance_buckets_are_t5_bidirectional_buckets() -> None:
    """routing.landmarks.signed_distance_buckets, worked by hand: 8 buckets = 4 per sign (T5's bidirectional rule),
    each side distance_buckets(|d|, 4, 64): 2 exact (0, 1), then log-spaced 2 + floor(ln(|d|/2) / ln(32) * 2), the
    last bucket beyond; d < 0 adds 4."""
    from routing.landmarks import signed_distance_buckets

    d = torch.tensor([0, 1, -1, 2, -2, 7, 63, -63, 100, -100])
    assert signed_distance_buckets(d, 8, 64).tolist() == [0, 1, 5, 2, 6, 2, 3, 7, 3, 7]
    assert signed_distance_buckets(d, 1, 64).tolist() == [0] * len(d)  # one bucket: a constant bias
    assert signed_distance_buckets(d, 2, 64).tolist() == [0, 0, 1, 0, 1, 0, 0, 1, 0, 1]  # only the sign


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")  # the copy it warns of is wanted
@pytest.mark.parametrize("K", [3, 4])
@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_published_is_eq_6_over_the_whole_sequence(impl: str, K: int) -> None:
    """Eq. 6 written with torch's own operators, from the group's projections and tables: A = AdaptiveAvgPool1d(n)(Q)
    with n = seq_len // b, V_A = softmax(A K^T / sqrt(h') + B1) V, O = softmax(Q A^T / sqrt(h') + B2) V_A + DWC(V),
    DWC a depthwise conv1d with padding 'same' (centred; for even K one more tap ahead), B1 and B2 by the signed
    distances between agent j's last row ceil((j+1)T/n) - 1 and each key and query; the heads through W^O."""
    import torch.nn.functional as F

    from routing.landmarks import signed_distance_buckets

    seq_len, T, b, N, H, d = 24, 19, 5, 6, 2, 8
    group = make_group("agent", {"block": b, "dwc": K, "bias": N, "variant": "published", "impl": impl}, seq_len,
                       count=H, head_dim=d, dtype=torch.float64)
    x, positions = torch.randn(2, T, 32, dtype=torch.float64), torch.arange(T).expand(2, T)
    q, k, v = group._qkv(x, positions)  # [B, H, T, h']
    n, scale = seq_len // b, d**-0.5
    A = torch.nn.AdaptiveAvgPool1d(n)(q.flatten(0, 1).transpose(1, 2)).transpose(1, 2).view(2, H, n, d)
    ends = torch.tensor([-(-(j + 1) * T // n) - 1 for j in range(n)])
    rows = torch.arange(T)
    B1 = group.agent_bias[0][:, signed_distance_buckets(ends[:, None] - rows, N, seq_len)]  # [H, n, T]
    B2 = group.agent_bias[1][:, signed_distance_buckets(rows[:, None] - ends, N, seq_len)]  # [H, T, n]
    VA = (A @ k.transpose(-1, -2) * scale + B1).softmax(-1) @ v
    O = (q @ A.transpose(-1, -2) * scale + B2).softmax(-1) @ VA
    conv = F.conv1d(v.transpose(2, 3).reshape(2, H * d, T), group.dwc.weight, group.dwc.bias, padding="same",
                    groups=H * d).view(2, H, d, T).transpose(2, 3)
    want = group.out((O + conv).transpose(1, 2).reshape(2, T, H * d))
    with torch.no_grad():
        out = group(x, positions)
    assert (out - want).abs().max().item() <= TOL * want.abs().max().item()
