"""Causal MoSA selections (heads/mosa.py "quota", "predictor"): the prefix quota rule, coverage by
position against the earliest-first threshold variant, the membership predictor, FLOP/KV accounting."""
from __future__ import annotations

import math

import pytest
import torch

from flops.formulas import group_cost
from heads import commit_states
from routing.coverage import coverage_by_position, members
from routing.expert_choice import expert_choice
from routing.predictor import topk_targets
from routing.selection import earliest_topk, prefix_quota
from tests.head_checks import make_group


def quota_loop(mask: torch.Tensor, quota: list[int]) -> list[int]:
    """The rule as stated: token t joins while the head holds fewer than quota[t] tokens."""
    kept: list[int] = []
    for t, m in enumerate(mask.tolist()):
        if m and len(kept) < quota[t]:
            kept.append(t)
    return kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_earliest_topk_is_a_stable_sort_cut_to_k(dtype: torch.dtype) -> None:
    """earliest_topk equals the first k of a stable descending sort (the definition: largest first, equal scores in
    position order), values and indices, on rows full of ties and -inf, for every k from 1 to n."""
    g = torch.Generator().manual_seed(0)
    for shape in ((3, 7), (2, 5, 33), (4, 100)):
        for trial in range(4):
            s = torch.randint(-3, 3, shape, generator=g).to(dtype) if trial < 3 else torch.randn(shape, generator=g).to(dtype)
            s[s == -3] = float("-inf")
            ranked = s.sort(dim=-1, descending=True, stable=True)
            for k in range(1, shape[-1] + 2):  # k > n: all n
                values, indices = earliest_topk(s, k)
                assert torch.equal(values, ranked.values[..., :k]) and torch.equal(indices, ranked.indices[..., :k])


def test_prefix_quota_closed_form_equals_the_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        T = int(torch.randint(1, 80, (), generator=gen))
        mask = torch.rand(4, T, generator=gen) < torch.rand((), generator=gen)
        rate = 1.5 * float(torch.rand((), generator=gen))
        quota = torch.ceil(torch.arange(1, T + 1) * rate).long().clamp(min=1)
        sel = prefix_quota(mask, quota, int(quota[-1]))
        assert sel.idx.shape[-1] == int(quota[-1])
        for r in range(4):
            assert sel.idx[r][sel.valid[r]].tolist() == quota_loop(mask[r], quota.tolist())


def calibrated(selection: str, T: int = 256, rho: int = 8, batch: int = 64):
    """A group whose threshold is the exact (1 - 1/ρ)-quantile of i.i.d. router logits (a perfectly
    calibrated threshold), the logits, and the selection."""
    group = make_group("mosa", dict(sparsity=rho, selection=selection), T)
    logits = torch.randn(batch, 3, T, generator=torch.Generator().manual_seed(2))
    group.threshold.tau.copy_(logits.transpose(0, 1).reshape(3, -1).quantile(1 - 1 / rho, dim=1))
    return group, logits, group.select(logits)


def test_quota_respects_the_quota_at_every_prefix() -> None:
    group, logits, sel = calibrated("quota")
    T = logits.shape[-1]
    count = members(sel, T).long().cumsum(-1)  # kept so far, per row
    assert (count <= group.quota(torch.arange(T))).all()
    assert int(group.quota(torch.tensor(T - 1))) == group.capacity == 32
    assert torch.equal(members(sel, T), members(sel, T) & group.candidates(logits))
    for t in (0, 50, 200):  # a prefix selects exactly what the full sequence selects for it
        part = members(group.select(logits[..., : t + 1]), t + 1)
        assert torch.equal(part, members(sel, T)[..., : t + 1])


def test_earliest_first_starves_late_tokens_and_the_quota_does_not() -> None:
    """With a calibrated threshold (46% of rows overflow), earliest-first keeps all of the first quarter's
    candidates and ~76% of the last's; the prefix quota keeps ~93% of the last quarter's and loses
    more early (~81% of the first: a burst of early candidates meets a small quota), 89% overall."""
    cover = {}
    for selection in ("threshold", "quota"):
        group, logits, sel = calibrated(selection)
        cover[selection] = coverage_by_position(members(sel, logits.shape[-1]), group.candidates(logits))
    print("coverage of candidates by quarter:", cover)
    first, last = cover["threshold"][0], cover["threshold"][-1]
    assert first > 0.99 and last < 0.85  # measured 1.00 and ~0.75
    assert cover["quota"] == sorted(cover["quota"]) and cover["quota"][-1] > last + 0.1


def test_members_and_coverage_on_a_known_case() -> None:
    sel = expert_choice(torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0, 2.0, 0.5, 6.0]]), 3)  # picks 1, 3, 7
    m = members(sel, 8)
    assert m.tolist() == [[False, True, False, True, False, False, False, True]]
    deserved = torch.tensor([[True, True, False, False, False, False, True, True]])
    quarters = coverage_by_position(m, deserved)  # deserved {0, 1} | {} | {} | {6, 7}; kept 1 and 7
    assert quarters[0] == 0.5 and math.isnan(quarters[1]) and math.isnan(quarters[2]) and quarters[3] == 0.5
    assert coverage_by_position(m, ~deserved, parts=2) == [0.5, 0.0]  # {2, 3} | {4, 5}


def test_predictor_learns_topk_membership_without_touching_the_model() -> None:
    """The predictor's BCE loss trains only the predictor (stop-gradient on x and the router);
    trained on its own, it recovers most of the expert-choice top-k (chance: recall ≈ 1/ρ)."""
    T, rho = 64, 8
    group = make_group("mosa", dict(sparsity=rho, selection="predictor", threshold_momentum=0.3), T, std=None).train()
    x = torch.randn(8, T, 32, requires_grad=True)
    group(x, torch.arange(T).expand(8, T))
    loss = group.aux_losses["mosa_predictor"]
    grads = torch.autograd.grad(loss, [x, group.router.weight, group.predictor.proj.weight], allow_unused=True)
    assert grads[0] is None and grads[1] is None and grads[2].abs().sum() > 0
    opt = torch.optim.Adam(group.predictor.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    recall = []
    for _ in range(40):
        group(torch.randn(4, T, 32, generator=gen), torch.arange(T).expand(4, T))
        opt.zero_grad()
        group.aux_losses["mosa_predictor"].backward()
        opt.step()
        commit_states(group)  # the running threshold on the predictor's logits
        recall.append(group.stats["predictor_recall"])
    print(f"predictor recall: first {recall[0]:.2f}, last {recall[-1]:.2f}; acc {group.stats['predictor_acc']:.3f}")
    assert recall[-1] > 0.7 and group.stats["predictor_acc"] > 0.9
    with torch.no_grad():  # on fresh tokens, against the router's own top-k, written out here
        x = torch.randn(4, T, 32, generator=gen)
        truth = torch.zeros(4, 3, T, dtype=torch.bool).scatter(-1, group.router_logits(x).topk(T // rho, -1).indices, True)
        guess = group.threshold.above(group.predictor(x))
    assert (guess & truth).sum() / truth.sum() > 0.7 and (guess == truth).float().mean() > 0.9


def test_topk_targets_mark_each_rows_k_largest_logits() -> None:
    logits = torch.randn(2, 3, 50)
    target = topk_targets(logits, 6)
    assert torch.equal(target, torch.zeros(2, 3, 50).scatter(-1, logits.topk(6, -1).indices, 1.0))


@pytest.mark.parametrize("selection", ["threshold", "quota", "predictor"])
def test_flops_count_the_capacity_and_the_predictor(selection: str) -> None:
    """flops/ counts every causal selection at its capacity ceil(cf*k) (the slots the fast path
    computes on), not k, and the predictor's extra 2hT per head; KV is the capacity too."""
    h, hd, T, n, rho = 128, 32, 256, 5, 8
    k = T // rho
    base = group_cost("mosa", h, hd, T, n, {"sparsity": rho, "selection": selection})
    wide = group_cost("mosa", h, hd, T, n, {"sparsity": rho, "selection": selection, "capacity_factor": 1.5})
    c = 48
    extra = 2 * h * T if selection == "predictor" else 0  # z = x W^p + b on every token
    assert base.flops == n * (8 * h * hd * k + 4 * hd * k * k + 2 * h * T + hd * k + extra) and base.kv == n * k
    assert wide.flops == n * (8 * h * hd * c + 4 * hd * c * c + 2 * h * T + hd * c + extra) and wide.kv == n * c
    group = make_group("mosa", dict(sparsity=rho, selection=selection, capacity_factor=1.5), T, count=n, d_model=h, head_dim=hd)
    assert group.kv_entries(T) == wide.kv
    assert wide.params == sum(p.numel() for p in group.parameters())


def test_causal_routing_variants_are_flop_matched_and_probed() -> None:
    """bench/causal_routing.py: every variant is a valid config within 5% below the dense baseline's FLOPs,
    causal except faithful MoSA, and the coverage probe reports four quarters for the causal MoSA models: exactly
    what a threshold that passes no token, or every token, implies."""
    from omegaconf import OmegaConf

    import lm
    from bench.causal_routing import ROOT, selection_coverage
    from heads.mosa import MoSAHeads
    from bench.gutenberg_compare import base_config, run_config
    from flops.model import model_cost

    settings = OmegaConf.load(ROOT / "configs" / "experiments" / "causal_routing.yaml")
    budget = model_cost(base_config(settings, []).model).flops_per_pass
    for name in settings.variants:
        cfg = run_config(settings, name, [])
        assert 0.95 <= model_cost(cfg.model).flops_per_pass / budget <= 1.0, name
        assert lm.build_model(cfg.model).causal == (name != "mosa_faithful"), name
    cfg = run_config(settings, "mosa_predictor", ["model.d_model=32", "model.head_dim=8", "model.vocab_size=97"])
    model = lm.build_model(cfg.model)
    windows = torch.randint(0, 97, (3, cfg.model.seq_len + 1))
    probe = selection_coverage(model, windows)
    assert len(probe["cover_cand"]) == len(probe["cover_topk"]) == 4 and 0 <= probe["predictor_acc"] <= 1
    assert all(0 <= v <= 1 for v in probe["cover_cand"] + probe["cover_topk"])
    groups = [g for g in model.modules() if isinstance(g, MoSAHeads) and g.causal]
    assert groups and all(g.capacity == groups[0].capacity and not g.options.keep_first for g in groups)
    share = groups[0].capacity / cfg.model.seq_len  # k = capacity = T/ρ of T tokens
    for tau in (math.inf, -math.inf):  # no token passes: none selected; every token passes: the quota's T/ρ
        for g in groups:
            g.threshold.tau.fill_(tau)
            g.threshold.initialized.fill_(True)
        probe = selection_coverage(model, windows)
        assert probe["predictor_acc"] == pytest.approx(1 - share if tau > 0 else share)  # the top-k: 1/ρ
        if tau > 0:
            assert all(math.isnan(v) for v in probe["cover_cand"]) and probe["cover_topk"] == [0.0] * 4
        else:
            assert probe["cover_cand"] == pytest.approx([share] * 4) and all(v > 0 for v in probe["cover_topk"])


@pytest.mark.parametrize("selection", ["quota", "predictor"])
def test_decoding_equals_full_forward_where_the_quota_binds(selection: str) -> None:
    """Group-level: prefill 10 tokens then decode one at a time with tau = 0 (about half the tokens are
    candidates, far above the quota): every step equals the full forward pass."""
    T = 45
    group = make_group("mosa", dict(sparsity=4, selection=selection), T)
    group.threshold.tau.zero_()
    x, pos = torch.randn(2, T, 32), torch.arange(T).expand(2, T)
    with torch.no_grad():
        full = group(x, pos)
        scores = group.selection_scores(x, group.router_logits(x))
        assert (group.candidates(scores).sum(-1) > members(group.select(scores), T).sum(-1)).all()  # drops
        cache = group.new_cache(2, T)
        steps = [group(x[:, :10], pos[:, :10], cache)] + [group(x[:, t : t + 1], pos[:, t : t + 1], cache)
                                                         for t in range(10, T)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.fill, members(group.select(scores), T).sum(-1))
