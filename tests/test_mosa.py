"""MoSA heads (heads/mosa.py): fast path vs reference, paper properties, causality, hybrids, KV totals."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import lm
from heads import ConfigError, GroupContext, commit_states, make_options
from heads.dense import DenseHeads
from heads.mosa import MoSAHeads
from lm.causality import future_leak
from routing.expert_choice import tokens_per_head
from tests.conftest import tiny_config
from tests.head_checks import assert_match, fast_vs_reference, make_group

ROOT = Path(__file__).resolve().parents[1]


def set_thresholds(group: MoSAHeads) -> None:
    """Per-head thresholds giving overflow (head 0), about k candidates (head 1) and underflow (head 2)."""
    group.threshold.tau.copy_(torch.tensor([0.0, 1.5, 3.5]))


@pytest.mark.parametrize("T", [100, 257])
@pytest.mark.parametrize("sparsity", [2, 8, 32])
@pytest.mark.parametrize("selection,keep_first", [("expert_choice", False), ("expert_choice", True),
                                                  ("threshold", False), ("threshold", True),
                                                  ("quota", False), ("quota", True), ("predictor", False),
                                                  ("predictor", True)])
def test_fast_matches_reference(T: int, sparsity: int, selection: str, keep_first: bool) -> None:
    group = make_group("mosa", dict(sparsity=sparsity, selection=selection, keep_first=keep_first), T)
    before = None if selection == "expert_choice" else set_thresholds
    errors = fast_vs_reference(group, T, before=before)
    names = {"output", "grad_x", "grad_router.weight", "grad_qkv.weight", "grad_out.weight"}
    if selection == "predictor":
        names |= {"grad_predictor.proj.weight", "grad_predictor.proj.bias"}
    assert set(errors) == names
    assert_match(errors)


def test_threshold_fixture_covers_overflow_and_underflow() -> None:
    group = make_group("mosa", dict(sparsity=8), 257)
    set_thresholds(group)
    logits = group.router_logits(torch.randn(2, 257, 32))
    above = group.candidates(logits).sum(-1)  # [B, H]
    assert (above[:, 0] > group.capacity).all() and (above[:, 2] < group.capacity).all()


def test_k_equals_T_with_router_one_is_dense() -> None:
    """ρ = 1 (k = T) and r forced to 1: MoSA is the dense head with the same weights."""
    T = 37
    ctx = GroupContext(32, 8, T)
    dense = DenseHeads(ctx, 3, make_options("dense", {}, ctx))
    for selection in ("expert_choice", "threshold"):
        mosa = MoSAHeads(ctx, 3, make_options("mosa", dict(sparsity=1, selection=selection), ctx)).eval()
        mosa.qkv.weight.data.copy_(dense.qkv.weight)
        mosa.out.weight.data.copy_(dense.out.weight)
        mosa.router.register_forward_hook(lambda m, i, o: torch.full_like(o, 40.0))  # σ(40) == 1 in fp32
        x, pos = torch.randn(2, T, 32), torch.arange(T).expand(2, T)
        for impl in ("reference", "fast"):
            mosa.options.impl = dense.options.impl = impl
            torch.testing.assert_close(mosa(x, pos), dense(x, pos), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("selection", ["expert_choice", "threshold"])
def test_gathered_tokens_rotated_by_original_positions(selection: str) -> None:
    """RoPE receives the selected tokens' original positions (offset positions included), not 0..k-1."""
    T = 64
    group = make_group("mosa", dict(sparsity=4, selection=selection), T)
    seen = []
    cos_sin = group.rope.cos_sin
    group.rope.cos_sin = lambda p, dtype: seen.append(p.clone()) or cos_sin(p, dtype)  # once per chunk, for q and k
    x = torch.randn(2, T, 32)
    positions = torch.arange(T).expand(2, T) + 1000
    group(x, positions)
    sel = group.select(group.router_logits(x))
    expected = (sel.idx + 1000).flatten().sort().values  # every slot's original position (layout-free)
    assert len(seen) >= 1 and torch.equal(torch.cat([p.flatten() for p in seen]).sort().values, expected)
    assert sel.valid.sum() > 0 and not torch.equal(sel.idx[sel.valid], torch.arange(sel.idx.shape[-1]).expand_as(sel.idx)[sel.valid])


@pytest.mark.parametrize("selection", ["expert_choice", "threshold"])
def test_router_gets_gradients(selection: str) -> None:
    group = make_group("mosa", dict(sparsity=4, selection=selection), 50).train()
    group(torch.randn(2, 50, 32), torch.arange(50).expand(2, 50)).pow(2).sum().backward()
    assert group.router.weight.grad is not None and group.router.weight.grad.abs().min() > 0


@pytest.mark.parametrize("T,sparsity", [(100, 4), (257, 8), (64, 32), (1000, 64)])
def test_expert_choice_selects_exactly_k(T: int, sparsity: int) -> None:
    group = make_group("mosa", dict(sparsity=sparsity, selection="expert_choice"), T)
    sel = group.select(group.router_logits(torch.randn(2, T, 32)))
    k = max(T // sparsity, 2)
    assert sel.idx.shape == (2, 3, k) and sel.valid.all()
    assert (sel.idx.diff(dim=-1) > 0).all()  # sorted and distinct
    assert group.kv_entries(T) == 3 * k


def test_threshold_selection_respects_capacity_and_order() -> None:
    T = 257
    group = make_group("mosa", dict(sparsity=8), T)
    set_thresholds(group)
    logits = group.router_logits(torch.randn(2, T, 32))
    sel, above = group.select(logits), group.candidates(logits)
    count = sel.valid.sum(-1)
    assert torch.equal(count, above.sum(-1).clamp(max=group.capacity))
    for b in range(2):
        for i in range(3):
            expected = above[b, i].nonzero()[:, 0][: group.capacity]  # earliest candidates
            assert torch.equal(sel.idx[b, i][sel.valid[b, i]], expected)


def test_threshold_selection_is_decodable_token_by_token() -> None:
    """The selection of a prefix is the full sequence's selection restricted to that prefix, so
    autoregressive decoding (one token, the thresholds and a counter) makes the same decisions."""
    T = 120
    group = make_group("mosa", dict(sparsity=8, keep_first=True), T)
    set_thresholds(group)
    logits = group.router_logits(torch.randn(2, T, 32))
    full = group.select(logits)
    for t in (0, 1, 17, 60, 119):
        part = group.select(logits[..., : t + 1])
        for b in range(2):
            for i in range(3):
                want = full.idx[b, i][full.valid[b, i] & (full.idx[b, i] <= t)]
                assert torch.equal(part.idx[b, i][part.valid[b, i]], want)


def test_running_threshold_selects_about_one_in_rho() -> None:
    """Training steps move tau to the (1 - 1/ρ) quantile: about T/ρ candidates per head."""
    T, rho = 256, 8
    group = make_group("mosa", dict(sparsity=rho, threshold_momentum=0.2), T).train()
    gen = torch.Generator().manual_seed(3)
    for _ in range(30):
        group(torch.randn(4, T, 32, generator=gen), torch.arange(T).expand(4, T))
        commit_states(group)  # after the optimizer step, as lm/module.py does
    frac = group.candidates(group.router_logits(torch.randn(8, T, 32, generator=gen))).float().mean().item()
    assert abs(frac - 1 / rho) < 0.02, frac
    assert bool(group.threshold.initialized)


def test_threshold_moves_once_per_step_toward_the_mean_micro_batch_quantile() -> None:
    """Micro-batches of one step all select with the same tau; the commit after the optimizer step moves it one EMA
    step toward the mean of their (1 - 1/ρ)-quantiles (routing/threshold.py); evaluation stages nothing, and a
    commit with nothing staged leaves tau where it is. Momentum 0.3, not 0.5, at which an EMA whose old and new
    values were swapped would read the same."""
    T, rho, momentum = 64, 8, 0.3
    group = make_group("mosa", dict(sparsity=rho, threshold_momentum=momentum), T).train()
    set_thresholds(group)
    group.threshold.initialized.fill_(True)
    start = group.threshold.tau.clone()
    positions = torch.arange(T).expand(2, T)
    micro = [torch.randn(2, T, 32) for _ in range(3)]
    quantiles = []
    for x in micro:
        group(x, positions)
        assert torch.equal(group.threshold.tau, start)  # not moved between micro-batches
        per_head = group.router_logits(x).detach().transpose(0, 1).reshape(3, -1).sort(dim=1).values
        rank = math.ceil((1 - 1 / rho) * 2 * T)  # distinct random logits: the midpoint of two neighbours
        quantiles.append((per_head[:, rank - 1] + per_head[:, rank]) / 2)
    group.eval()(micro[0], positions)  # stages nothing
    commit_states(group)
    torch.testing.assert_close(group.threshold.tau, start.lerp(torch.stack(quantiles).mean(0), momentum))
    moved = group.threshold.tau.clone()
    commit_states(group)
    assert torch.equal(group.threshold.tau, moved)


def test_the_first_commit_sets_tau_to_the_staged_quantile_whatever_the_momentum() -> None:
    """A fresh threshold starts at the first step's quantile, not an EMA step away from 0: at momentum 0.02 that
    would leave tau near 0 for many steps, and most tokens (83% at ρ = 8 here) passing instead of 1/ρ."""
    from routing.threshold import RunningQuantileThreshold

    threshold = RunningQuantileThreshold(2, 8, 0.02)
    logits = 2.0 + torch.randn(4, 2, 256, generator=torch.Generator().manual_seed(0))
    threshold.stage(logits)
    staged = threshold.pending[:-1].clone()
    threshold.commit()
    assert bool(threshold.initialized)
    torch.testing.assert_close(threshold.tau, staged)
    assert abs(threshold.above(logits).float().mean().item() - 1 / 8) < 0.01


def test_tied_top_logits_pass_the_threshold() -> None:
    """When the quantile's logit is also the largest (5% of the logits tied at the top, rho = 32: a frequent token
    type in the first layer), tau is cut below the tie, so the tied tokens pass (capacity caps them; tau at the
    tied value passed none, and the router of a head with no tokens gets no gradient); all logits equal: all pass."""
    from routing.threshold import RunningQuantileThreshold

    threshold = RunningQuantileThreshold(2, 32, 1.0)
    logits = torch.randn(2, 2, 2048, generator=torch.Generator().manual_seed(0))
    logits[:, 0, ::20] = 10.0  # head 0: 5% tied at the top
    logits[:, 1] = 3.0  # head 1: all equal
    threshold.stage(logits)
    threshold.commit()
    passed = threshold.above(logits).float().mean(-1).mean(0)
    assert passed[0] == (logits[:, 0] == 10.0).float().mean() and passed[1] == 1.0  # 103 of 2048 tied
    assert 3.0 < threshold.tau[0] < 10.0 and threshold.tau[1] == 2.0


def test_staged_cut_is_the_midpoint_around_the_quantile_by_sorting() -> None:
    """stage's cut against its definition computed by sorting each head's logits: the statistic s = the
    ceil((1 - 1/ρ) n)-th smallest, cut = midpoint of s and the next larger logit, else of s and the next smaller one,
    else s - 1; on 400 random cases with and without ties (stage takes s with topk, not kthvalue: half the time)."""
    import math
    from fractions import Fraction

    from routing.threshold import RunningQuantileThreshold

    g = torch.Generator().manual_seed(0)
    for case in range(400):
        B, H, T = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g)), \
            int(torch.randint(1, 60, (1,), generator=g))
        rho = (1, 2, 2.5, 3, 8, 32)[case % 6]
        logits = torch.randn(B, H, T, generator=g) if case % 2 else torch.randint(0, 3, (B, H, T), generator=g).float()
        threshold = RunningQuantileThreshold(H, rho, 1.0)
        threshold.stage(logits)
        for head in range(H):
            values = logits[:, head].flatten().sort().values.tolist()
            n = len(values)
            rank = min(max(math.ceil((1 - 1 / Fraction(rho)) * n), 1), n)
            s = values[rank - 1]
            larger, smaller = [v for v in values if v > s], [v for v in values if v < s]
            cut = (s + (larger[0] - s) / 2 if larger else smaller[-1] + (s - smaller[-1]) / 2 if smaller else s - 1)
            assert threshold.pending[head].item() == pytest.approx(cut, rel=1e-6, abs=1e-6), (case, head)


@pytest.mark.parametrize("rho,n", [(3, 9), (3, 15), (7, 14), (19, 38), (8, 64), (2.5, 10)])
def test_threshold_passes_exactly_one_in_rho(rho: float, n: int) -> None:
    """n distinct logits, n divisible by ρ: the first committed tau passes exactly n/ρ of them (the quantile's rank
    is counted exactly; (1 - 1/3) * 9 in floats is 6.000000000000001, whose ceiling passed 2 of 9)."""
    from routing.threshold import RunningQuantileThreshold

    threshold = RunningQuantileThreshold(1, rho, 1.0)
    logits = torch.randperm(n, generator=torch.Generator().manual_seed(0)).float().view(1, 1, n)
    threshold.stage(logits)
    threshold.commit()
    assert int(threshold.above(logits).sum()) == round(n / rho)


@pytest.mark.parametrize("T", [1, 2, 3, 5, 15])
@pytest.mark.parametrize("selection", ["expert_choice", "threshold", "quota", "predictor"])
def test_short_sequences(T: int, selection: str) -> None:
    """T < 2ρ: k = max(floor(T/ρ), 2) capped at T (App. F); both paths agree and stay finite."""
    group = make_group("mosa", dict(sparsity=8, selection=selection, keep_first=True), 64)
    errors = fast_vs_reference(group, T)
    assert_match(errors)
    if selection == "expert_choice":
        assert group.select(group.router_logits(torch.randn(1, T, 32))).idx.shape[-1] == min(T, 2)


def _leak(selection: str, **opts) -> float:
    cfg = tiny_config([{"type": "dense", "count": 1}, {"type": "mosa", "count": 3,
                        "options": dict(sparsity=8, selection=selection, **opts)}], init_std=0.3)
    torch.manual_seed(0)
    model = lm.build_model(cfg.model)
    tokens = torch.randint(0, 97, (2, 64))
    model.train()(tokens)
    commit_states(model)  # one training step initialises the running thresholds
    return future_leak(model, tokens, t=40, vocab_size=97)


@pytest.mark.parametrize("selection", ["threshold", "quota", "predictor"])
@pytest.mark.parametrize("keep_first", [False, True])
def test_causal_variant_passes_causality_check(selection: str, keep_first: bool) -> None:
    assert _leak(selection, keep_first=keep_first) <= 1e-5


def test_faithful_expert_choice_is_flagged() -> None:
    leak = _leak("expert_choice")
    print(f"faithful MoSA (expert choice) future leak: max |Δlogits| at t<=40 = {leak:.3e}")
    assert leak > 1e-2


def test_causal_property_and_default() -> None:
    cfg = tiny_config([{"type": "mosa", "count": 2}])
    model = lm.build_model(cfg.model)
    assert model.causal  # default selection is the causal one
    cfg = tiny_config([{"type": "mosa", "count": 2, "options": {"selection": "expert_choice"}}])
    assert not lm.build_model(cfg.model).causal


@pytest.mark.parametrize("options,field", [({"sparsity": 0}, "sparsity"), ({"selection": "topk"}, "selection"),
                                           ({"capacity_factor": 0}, "capacity_factor"),
                                           ({"threshold_momentum": 2}, "threshold_momentum"),
                                           ({"predictor_weight": 0}, "predictor_weight"),
                                           ({"predictor_weight": float("nan")}, "predictor_weight"),
                                           ({"capacity_factor": float("inf")}, "capacity_factor"),
                                           ({"rho": 4}, "rho")])
def test_bad_options_are_one_line_errors(options: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        tiny_config([{"type": "mosa", "count": 2, "options": options}])
    assert field in str(err.value) and "\n" not in str(err.value)


def test_hybrid_kv_total() -> None:
    """KV total = sum over layers of T*H_dense + k*H_mosa (MoSA Table 2), with per-layer overrides."""
    T, rho = 64, 8
    cfg = tiny_config([{"type": "dense", "count": 4}, {"type": "mosa", "count": 17, "options": {"sparsity": rho}}],
                      n_layers=3, seq_len=T)
    from lm.config import HeadGroupConfig

    cfg.model.layer_heads = {2: [HeadGroupConfig("mosa", 5, {"sparsity": rho}), HeadGroupConfig("local", 2, {"window": 16})]}
    model = lm.build_model(cfg.model)
    k = T // rho
    assert model.kv_total(T) == 2 * (4 * T + 17 * k) + (5 * k + 2 * 16)
    # Shorter sequences: the causal selection keeps at most min(T, capacity) (capacity fixed by seq_len) ...
    assert model.kv_total(16) == 2 * (4 * 16 + 17 * min(16, k)) + (5 * min(16, k) + 2 * 16)
    # ... expert choice uses App. F's k = max(floor(T/ρ), 2).
    for groups in [cfg.model.heads, *cfg.model.layer_heads.values()]:
        for g in groups:
            g.options = {"sparsity": rho, "selection": "expert_choice"} if g.type == "mosa" else g.options
    model = lm.build_model(cfg.model)
    assert model.kv_total(T) == 2 * (4 * T + 17 * k) + (5 * k + 2 * 16)
    assert model.kv_total(16) == 2 * (4 * 16 + 17 * 2) + (5 * 2 + 2 * 16)


def test_rho_1_keeps_every_token() -> None:
    """At ρ = 1 (k = T) the running (1 - 1)-quantile would be the mean of batch minima, which drops the tokens below
    it: every token is a candidate instead, in training, eval and decoding."""
    T = 64
    group = make_group("mosa", dict(sparsity=1), T).train()
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        group(torch.randn(2, T, 32, generator=gen), torch.arange(T).expand(2, T))
        commit_states(group)
    group.eval()
    group(torch.randn(8, T, 32, generator=gen), torch.arange(T).expand(8, T))
    assert group.stats["selected_frac"].item() == 1.0
    errors = fast_vs_reference(group, T)
    assert_match(errors)


@pytest.mark.parametrize("cf, T, rho, capacity, quota_49", [(1.1, 800, 8, 110, 7), (1.0, 100, 7, 14, 7),
                                                            (0.3, 100, 10, 3, 2)])
def test_capacities_are_exact_decimals(cf: float, T: int, rho: int, capacity: int, quota_49: int) -> None:
    """ceil(1.1 * 100) = 110 and q_49 = ceil(50 * 14 / 100) = 7: the decimals as written, not their binary
    rounding (1.1 * 100 = 110.00000000000001, 50 * 0.14 = 7.000000000000001), in the heads and in flops/."""
    from flops.formulas import group_cost

    assert make_group("mosa", dict(sparsity=rho, capacity_factor=cf), T, count=1).capacity == capacity
    group = make_group("mosa", dict(sparsity=rho, capacity_factor=cf, selection="quota"), T, count=1)
    assert group.capacity == capacity
    assert int(group.quota(torch.tensor([49]))) == quota_49 and int(group.quota(torch.tensor([T - 1]))) == capacity
    routing = make_group("routing", dict(sparsity=rho, capacity_factor=cf), T, count=1)
    assert routing.capacity == capacity
    h, hd, k = 32, 16, capacity
    cost = group_cost("mosa", h, hd, T, 1, {"sparsity": rho, "capacity_factor": cf})
    assert (cost.flops, cost.kv) == (8 * h * hd * k + 4 * hd * k * k + 2 * h * T + hd * k, k)


@pytest.mark.parametrize("cf, T", [(0.3333333333333333, 8192), (1.2345678901234567, 1024)])
def test_quotas_of_long_decimals_do_not_overflow(cf: float, T: int) -> None:
    """A capacity factor with 16 digits is a fraction with a numerator near 1e16: q_t stays exact (int64 products
    of it wrapped to negative quotas), non-decreasing, and reaches the capacity at the training length."""
    from fractions import Fraction

    group = make_group("mosa", dict(sparsity=8, capacity_factor=cf, selection="quota"), T, count=1)
    q = group.quota(torch.arange(2 * T)).tolist()  # decoding past the training length keeps the capacity
    rate = Fraction(repr(cf)) * (T // 8) / T
    assert q[:T] == [min(group.capacity, math.ceil(rate * (t + 1))) for t in range(T)]
    assert q[T - 1] == group.capacity == math.ceil(Fraction(repr(cf)) * (T // 8)) and set(q[T:]) == {group.capacity}


def test_tokens_per_head_rule() -> None:
    assert [tokens_per_head(T, 32) for T in (1024, 100, 64, 63, 10, 1)] == [32, 3, 2, 2, 2, 1]


def test_gutenberg_compare_variants_are_flop_matched() -> None:
    """Every variant of the Gutenberg experiment is a valid config at or below the dense baseline's FLOPs with
    as many sparse heads as fit (one more would exceed them), except the reference `dense_kept`: the 4 dense
    heads the sparse variants keep, alone (below the budget)."""
    import dataclasses

    from omegaconf import OmegaConf

    from bench.gutenberg_compare import base_config, run_config
    from flops.model import model_cost

    settings = OmegaConf.load(ROOT / "configs" / "experiments" / "gutenberg_compare.yaml")
    budget = model_cost(base_config(settings, []).model).flops_per_pass
    causal = {}
    for name in settings.variants:
        cfg = run_config(settings, name, [])
        ratio = model_cost(cfg.model).flops_per_pass / budget
        if name == "dense_kept":
            assert [(g.type, g.count) for g in cfg.model.heads] == [("dense", 4)] and ratio < 0.95
        else:
            assert 0.9 <= ratio <= 1.0, name
            if "head" in settings.variants[name]:
                sparse = cfg.model.heads[-1]
                more = [*cfg.model.heads[:-1], dataclasses.replace(sparse, count=sparse.count + 1)]
                assert model_cost(dataclasses.replace(cfg.model, heads=more)).flops_per_pass > budget, name
        assert cfg.trainer.out_dir.endswith(name) and cfg.trainer.seed == settings.base.trainer.seed
        causal[name] = lm.build_model(cfg.model).causal
    mine = {"dense": True, "mosa_causal": True, "mosa_faithful": False, "fixed": True, "routing": True, "routing_balanced": False}
    assert {name: causal[name] for name in mine} == mine


def test_frozen_state_nests() -> None:
    """Inside an outer frozen_state the head state stays frozen after an inner block ends."""
    from heads.base import frozen_state

    group = make_group("mosa", dict(sparsity=4), 32).train()
    with frozen_state():
        with frozen_state():
            assert not group.updates_state
        assert not group.updates_state
    assert group.updates_state


def test_expert_choice_ties_go_to_the_earliest_tokens() -> None:
    """Equal scores (repeated tokens in the first layer) are taken earliest first, whatever else is in the batch;
    torch.topk took positions 5, 6, 7 of eight equal scores, and 21 ... 48 of every third position."""
    from routing.expert_choice import expert_choice

    scores = torch.tensor([[0.0, 1, 1, 1, 1, 1, 1, 1, 1, 0]])
    assert expert_choice(scores, 3).idx.tolist() == [[1, 2, 3]]
    assert expert_choice(scores.expand(4, 10), 3).idx.tolist() == [[1, 2, 3]] * 4
    every_third = torch.zeros(1, 64)
    every_third[0, ::3] = 1
    assert expert_choice(every_third, 5).idx.tolist() == [[0, 3, 6, 9, 12]]
