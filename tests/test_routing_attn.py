"""Routing Transformer attention (heads/routing_attn.py, MoSA App. A baseline)."""
from __future__ import annotations

import pytest
import torch

import lm
from heads import ConfigError, commit_states
from heads.routing_attn import RoutingHeads
from lm.causality import future_leak
from tests.conftest import tiny_config
from tests.head_checks import assert_match, fast_vs_reference, make_group


@pytest.mark.parametrize("T", [100, 257])
@pytest.mark.parametrize("sparsity", [2, 8])
@pytest.mark.parametrize("assignment", ["nearest", "topk"])
def test_fast_matches_reference(T: int, sparsity: int, assignment: str) -> None:
    group = make_group("routing", dict(sparsity=sparsity, assignment=assignment, commitment=0.1), T)
    errors = fast_vs_reference(group, T)
    assert set(errors) == {"output", "grad_x", "grad_qv.weight", "grad_out.weight"}
    assert_match(errors)


def centroid_distances(group: RoutingHeads, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RT's routing written out from the weights: u = normalize(LayerNorm(x W^Q)) [B, H, T, d] and the squared
    distances ||u - mu_c||^2 [B, H, C, T] (nearest centroid = smallest distance; the head uses dot products)."""
    B, T, _ = x.shape
    q = group.qv(x).view(B, T, 2, group.count, -1)[:, :, 0].transpose(1, 2)
    if group.options.layer_norm:
        q = (q - q.mean(-1, keepdim=True)) / (q.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    u = q / q.norm(dim=-1, keepdim=True)
    return u, (u[:, :, None] - group.kmeans.means[None, :, :, None]).pow(2).sum(-1)


def test_balanced_topk_clusters_hold_their_k_nearest_tokens() -> None:
    """assignment topk (RT's balanced variant): cluster c holds the k = T/ρ tokens closest to its centroid, in
    ascending order."""
    T, rho = 96, 4
    group: RoutingHeads = make_group("routing", dict(sparsity=rho, assignment="topk"), T)
    x = torch.randn(2, T, 32)
    _, _, _, _, sel = group._route(x)
    _, dist = centroid_distances(group, x)
    assert sel.valid.all()
    assert torch.equal(sel.idx, dist.topk(T // rho, -1, largest=False).indices.sort(-1).values)


@pytest.mark.parametrize("capacity_factor", [100.0, 0.5])
def test_nearest_clusters_partition_up_to_capacity(capacity_factor: float) -> None:
    """Each cluster holds the earliest `capacity` tokens whose nearest centroid it is (all of them when nothing
    overflows), in ascending order: the clusters are disjoint, and a token past its cluster's capacity is in none."""
    T, rho = 96, 4
    group: RoutingHeads = make_group("routing", dict(sparsity=rho, capacity_factor=capacity_factor), T)
    x = torch.randn(2, T, 32)
    _, _, _, routed_to, sel = group._route(x)
    nearest = centroid_distances(group, x)[1].argmin(2)  # [B, H, T]
    assert torch.equal(routed_to, nearest)
    overflowed = 0
    for b in range(2):
        for i in range(3):
            for c in range(rho):
                routed = (nearest[b, i] == c).nonzero().flatten()
                assert torch.equal(sel.idx[b, i, c][sel.valid[b, i, c]], routed[: group.capacity])
                overflowed += max(0, len(routed) - group.capacity)
    assert (overflowed > 0) == (capacity_factor < 1)  # 0.5: the overflow case is exercised
    group(x, torch.arange(T).expand(2, T))  # the logged routed fraction: tokens in a cluster, of all (b, head, t)
    assert group.stats["routed_frac"].item() == pytest.approx(sel.valid.sum().item() / (2 * 3 * T))
    assert (group.stats["routed_frac"].item() < 1) == (capacity_factor < 1)


@pytest.mark.parametrize("impl", ["reference", "fast"])
@pytest.mark.parametrize("layer_norm", [True, False])
def test_one_cluster_is_causal_shared_qk_attention(impl: str, layer_norm: bool) -> None:
    """ρ = 1 with room for every token: one cluster holding the whole sequence. RT's attention is then causal
    softmax attention of LayerNorm(x W^Q) (RoPE) with itself as keys and unscaled logits, as RT's released code
    computes it (raw x W^Q and logits / sqrt(h') with layer_norm=False), written out here directly."""
    T, d = 40, 8
    group: RoutingHeads = make_group("routing", dict(sparsity=1, impl=impl, layer_norm=layer_norm), T)
    x, positions = torch.randn(2, T, 32), torch.arange(T).expand(2, T)
    q, v = group.qv(x).view(2, T, 2, 3, d).permute(2, 0, 3, 1, 4)  # [B, H, T, d]
    if layer_norm:
        q = (q - q.mean(-1, keepdim=True)) / (q.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    q = group.rope(q, positions[:, None])
    logits = q @ q.transpose(-1, -2) * (1.0 if layer_norm else d**-0.5)
    p = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    expected = group.out((p @ v).transpose(1, 2).reshape(2, T, 3 * d))
    assert torch.allclose(group(x, positions), expected, atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_a_token_in_several_balanced_clusters_gets_the_mean_of_their_outputs(impl: str) -> None:
    """assignment topk: the clusters overlap (each holds its k = T/ρ nearest tokens); a token's head output is the
    mean over the clusters holding it of each cluster's causal shared-QK attention (RT Alg. 1 per cluster), and 0
    for a token in none. Membership from the centroid distances, attention written out per cluster."""
    T, rho, d = 48, 4, 8
    group: RoutingHeads = make_group("routing", dict(sparsity=rho, assignment="topk", impl=impl), T)
    x, positions = torch.randn(1, T, 32), torch.arange(T).expand(1, T)
    _, dist = centroid_distances(group, x)
    q, v = group.qv(x).view(1, T, 2, 3, d).permute(2, 0, 3, 1, 4)  # [1, H, T, d]
    q = (q - q.mean(-1, keepdim=True)) / (q.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()  # layer_norm
    a = torch.zeros(3, T, d)
    memberships = torch.zeros(3, T)
    for i in range(3):
        for c in range(rho):
            I = dist[0, i, c].topk(T // rho, largest=False).indices.sort().values  # the cluster, ascending
            qc = group.rope(q[0, i, I], positions[0, I])
            p = (qc @ qc.T).masked_fill(~torch.ones(len(I), len(I), dtype=torch.bool).tril(), float("-inf")).softmax(-1)
            a[i, I] += p @ v[0, i, I]
            memberships[i, I] += 1
    assert (memberships > 1).any() and (memberships == 0).any()  # overlapping clusters, and tokens left out
    expected = group.out((a / memberships.clamp(min=1)[..., None]).transpose(0, 1).reshape(1, T, 3 * d))
    assert torch.allclose(group(x, positions), expected, atol=1e-5)


def test_commitment_loss_and_centroid_updates() -> None:
    T = 64
    group: RoutingHeads = make_group("routing", dict(sparsity=4), T).train()
    before = group.kmeans.means.clone()
    x = torch.randn(2, T, 32)
    y = group(x, torch.arange(T).expand(2, T))
    loss = group.aux_losses["routing_commitment"]
    u, dist = centroid_distances(group, x)  # the commitment loss is `commitment` x mean ||u - mu_nearest||^2
    torch.testing.assert_close(loss, group.options.commitment * dist.amin(2).mean(), rtol=1e-5, atol=0)
    (loss_grad,) = torch.autograd.grad(loss, group.qv.weight, retain_graph=True)
    assert loss_grad[: 3 * 8].abs().sum() > 0 and not loss_grad[3 * 8 :].any()  # it trains W^Q only, not W^V
    (y.sum() + loss).backward()
    assert torch.equal(before, group.kmeans.means)  # staged in the forward pass, not applied
    assert group.kmeans.pending[..., -1].sum() == 2 * T * 3  # every token of every head counted once
    commit_states(group)  # after the optimizer step
    assert not group.kmeans.pending.any()
    decay, nearest, expected = group.kmeans.decay, dist.argmin(2), before.clone()
    for h in range(3):  # "unit_mean": mu <- normalize(decay mu + (1 - decay) mean of its members); none: stays
        for c in range(4):
            members = u.detach()[:, h][nearest[:, h] == c]  # [n, d]
            if len(members):
                moved = decay * before[h, c] + (1 - decay) * members.mean(0)
                expected[h, c] = moved / moved.norm()
    assert not torch.equal(before, expected)
    torch.testing.assert_close(group.kmeans.means, expected, rtol=1e-5, atol=1e-6)
    group.eval()(x, torch.arange(T).expand(2, T))
    commit_states(group)
    assert not group.kmeans.pending.any()  # nothing staged in eval mode


@pytest.mark.parametrize("update", ["unit_mean", "ema_counts"])
def test_commitment_is_the_squared_distance_and_keeps_no_per_token_vectors(update: str) -> None:
    """kmeans.commitment = mean ||u - mu_nearest||^2 with the gradient in q (through u = normalize(q)) of that
    formula (float64, 1e-12), also for centroids that are no unit vectors ("ema_counts" after a step), while what
    backward keeps holds no [B, H, T, d] tensor, only indices and per-cluster sums (the direct formula keeps u - mu:
    1 MiB a head at T = 4096, h' = 64)."""
    import torch.nn.functional as F

    from routing.kmeans import OnlineKMeans

    torch.manual_seed(0)
    B, H, T, C, d = 2, 3, 50, 4, 8
    kmeans = OnlineKMeans(H, C, d, 0.99, update).double()
    if update == "ema_counts":  # one step: centroids of norm far from 1
        w = F.normalize(torch.randn(B, H, T, d, dtype=torch.float64), dim=-1)
        near = kmeans.similarity(w).argmax(2)
        kmeans.stage(kmeans.cluster_sums(w, near), kmeans.cluster_counts(near))
        kmeans.commit()
        assert (kmeans.means.norm(dim=-1) - 1).abs().max() > 0.5
    q = torch.randn(B, H, T, d, dtype=torch.float64, requires_grad=True)
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        u = F.normalize(q, dim=-1)
        nearest = kmeans.similarity(u.detach()).argmax(2)
        kept.clear()  # what the commitment adds
        loss = kmeans.commitment(kmeans.cluster_sums(u, nearest), kmeans.cluster_counts(nearest), B * T * H)
    assert not [t for t in kept if t.is_floating_point() and t.numel() >= B * H * T * d], [t.shape for t in kept]
    mu = kmeans.means[torch.arange(H)[None, :, None], nearest]
    direct = (F.normalize(q, dim=-1) - mu).pow(2).sum(-1).mean()
    (grad,), (expected,) = torch.autograd.grad(loss, q), torch.autograd.grad(direct, q)
    assert torch.allclose(loss, direct, atol=1e-12) and torch.allclose(grad, expected, atol=1e-12)


def test_centroid_update_is_the_ema_of_each_clusters_mean() -> None:
    """mu <- normalize(decay * mu + (1 - decay) * mean of the vectors nearest to mu) for every cluster with members
    (the default "unit_mean" rule, routing/kmeans.py), per head and over everything staged since the last commit (here two forward passes of one sequence
    each: one step of a batch of 2); a cluster nothing joined keeps its centroid (float64, 1e-12)."""
    import torch.nn.functional as F

    from routing.kmeans import OnlineKMeans

    torch.manual_seed(0)
    B, H, T, C, d = 2, 3, 20, 5, 8
    kmeans = OnlineKMeans(H, C, d, 0.9).double()
    u = F.normalize(torch.randn(B, H, T, d, dtype=torch.float64), dim=-1)
    nearest = torch.randint(0, C - 1, (B, H, T))  # cluster C - 1 stays empty
    before = kmeans.means.clone()
    for b in range(B):  # two forward passes, one step
        kmeans.stage(kmeans.cluster_sums(u[b : b + 1], nearest[b : b + 1]), kmeans.cluster_counts(nearest[b : b + 1]))
    kmeans.commit()
    for h in range(H):
        for c in range(C):
            members = u[:, h][nearest[:, h] == c]  # [n, d] over both batch rows
            expected = F.normalize(0.9 * before[h, c] + 0.1 * members.mean(0), dim=0) if len(members) else before[h, c]
            assert torch.allclose(kmeans.means[h, c], expected, atol=1e-12), (h, c)


def test_ema_counts_update_is_rt_released_codes() -> None:
    """centroids="ema_counts" follows RT's online_kmeans over three steps: N <- decay N + (1 - decay) n,
    S <- decay S + (1 - decay) sum (N from 0, S from the initial centroids), mu = S / N~ with
    N~ = (N + 1e-5) / (sum N + C 1e-5) * sum N, unnormalised; counts and sums over everything staged in the step
    (two forward passes here); an empty cluster's centroid grows as S / N~ (float64, 1e-12)."""
    import torch.nn.functional as F

    from routing.kmeans import OnlineKMeans

    torch.manual_seed(0)
    B, H, T, C, d, decay = 2, 3, 20, 5, 8, 0.9
    kmeans = OnlineKMeans(H, C, d, decay, "ema_counts").double()
    N, S = torch.zeros(H, C, dtype=torch.float64), kmeans.means.clone()
    for step in range(3):
        u = F.normalize(torch.randn(B, H, T, d, dtype=torch.float64), dim=-1)
        nearest = torch.randint(0, C - 1, (B, H, T))  # cluster C - 1 stays empty
        for b in range(B):
            kmeans.stage(kmeans.cluster_sums(u[b : b + 1], nearest[b : b + 1]), kmeans.cluster_counts(nearest[b : b + 1]))
        kmeans.commit()
        hot = F.one_hot(nearest, C).double()  # [B, H, T, C]
        N = decay * N + (1 - decay) * hot.sum((0, 2))
        S = decay * S + (1 - decay) * torch.einsum("bhtc,bhtd->hcd", hot, u)
        n = N.sum(-1, keepdim=True)
        expected = S / ((N + 1e-5) / (n + C * 1e-5) * n)[..., None]
        torch.testing.assert_close(kmeans.means, expected, rtol=0, atol=1e-12)
    assert kmeans.means[:, C - 1].norm(dim=-1).min() > 1e3  # RT's code: an empty cluster's S / N~ is huge


@pytest.mark.parametrize("update", ["unit_mean", "ema_counts"])
@pytest.mark.parametrize("steps_before", [0, 2])
def test_a_commit_with_nothing_staged_moves_nothing(update: str, steps_before: int) -> None:
    """A skipped step (lm/nonfinite.py drops what it staged, then the optimizer step commits nothing) leaves the
    centroids and RT's EMA counts and sums as they were, before any step too (ema_counts decayed them, and at N = 0
    divided by zero)."""
    import torch.nn.functional as F

    from routing.kmeans import OnlineKMeans

    kmeans = OnlineKMeans(2, 3, 4, 0.9, update).double()
    for _ in range(steps_before):
        u = F.normalize(torch.randn(1, 2, 10, 4, dtype=torch.float64), dim=-1)
        nearest = torch.randint(0, 3, (1, 2, 10))
        kmeans.stage(kmeans.cluster_sums(u, nearest), kmeans.cluster_counts(nearest))
        kmeans.commit()
    before = {name: buf.clone() for name, buf in kmeans.named_buffers()}
    kmeans.commit()
    for name, buf in kmeans.named_buffers():
        assert torch.equal(buf, before[name]), name


def test_ema_count_centroids_of_an_empty_cluster_do_not_overflow_fp16_similarities() -> None:
    """An empty cluster's "ema_counts" centroid grows to ~1e5, past fp16's 65504: its similarities are computed in
    fp32, under autocast too (unit-mean ones stay in the vectors' dtype); an unknown rule is refused when the module is built."""
    import torch.nn.functional as F

    from routing.kmeans import OnlineKMeans

    torch.manual_seed(0)
    kmeans = OnlineKMeans(1, 4, 16, 0.999, "ema_counts")
    u = F.normalize(torch.randn(1, 1, 256, 16), dim=-1)
    nearest = torch.randint(0, 3, (1, 1, 256))  # cluster 3 stays empty
    kmeans.stage(kmeans.cluster_sums(u, nearest), kmeans.cluster_counts(nearest))
    kmeans.commit()
    assert kmeans.means[0, 3].norm() > 6e4
    sim = kmeans.similarity(u.half())
    assert sim.dtype == torch.float32 and sim.isfinite().all()
    exact = torch.einsum("bhtd,hcd->bhct", u.double(), kmeans.means.double())
    for low in (torch.float16, torch.bfloat16):  # autocast (training's 16-mixed / bf16-mixed) would run it in `low`
        with torch.autocast("cpu", dtype=low):
            sim = kmeans.similarity(u)
        assert sim.dtype == torch.float32 and torch.allclose(sim.double(), exact, rtol=1e-5, atol=1e-3), low
    assert OnlineKMeans(1, 4, 16, 0.999).similarity(u.half()).dtype == torch.float16
    with pytest.raises(ValueError, match="update must be one of unit_mean, ema_counts, got 'rt'"):
        OnlineKMeans(1, 4, 16, 0.999, "rt")


def test_centroid_rule_is_an_option_and_its_state_is_saved() -> None:
    """routing.centroids picks the rule; "ema_counts" keeps its EMA counts and sums in the state dict (a resumed
    run continues them); an unknown rule is one line."""
    group = make_group("routing", dict(sparsity=4, centroids="ema_counts"), 32)
    assert {"kmeans.ema_count", "kmeans.ema_sum"} <= set(group.state_dict())
    assert "kmeans.ema_count" not in make_group("routing", dict(sparsity=4), 32).state_dict()
    with pytest.raises(ConfigError, match="routing: centroids must be one of unit_mean, ema_counts, got 'rt'"):
        make_group("routing", dict(sparsity=4, centroids="rt"), 32)


BOUNDS = r"^routing: need capacity_factor > 0, decay in \[0, 1\), commitment >= 0$"


@pytest.mark.parametrize("options,message", [
    ({"sparsity": 0}, "^routing: sparsity must be an integer >= 1, got 0$"),
    ({"assignment": "balanced"}, "^routing: assignment must be one of nearest, topk, got 'balanced'$"),
    ({"capacity_factor": 0.0}, BOUNDS), ({"decay": 1.0}, BOUNDS), ({"decay": -0.1}, BOUNDS),
    ({"commitment": -1e-4}, BOUNDS),
])
def test_options_out_of_range_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_group("routing", {"sparsity": 4, **options}, 32)


def _leak(assignment: str) -> float:
    cfg = tiny_config([{"type": "dense", "count": 1}, {"type": "routing", "count": 2,
                        "options": {"sparsity": 4, "assignment": assignment}}], init_std=0.3)
    torch.manual_seed(0)
    model = lm.build_model(cfg.model)
    return future_leak(model, torch.randint(0, 97, (2, 64)), t=30, vocab_size=97)


def test_nearest_assignment_is_causal() -> None:
    assert lm.build_model(tiny_config([{"type": "routing", "count": 2}]).model).causal
    assert _leak("nearest") <= 1e-5


def test_balanced_topk_assignment_is_flagged() -> None:
    leak = _leak("topk")
    print(f"Routing attention, balanced top-k clusters: future leak = {leak:.3e}")
    assert leak > 1e-2
    assert not lm.build_model(tiny_config([{"type": "routing", "count": 2, "options": {"assignment": "topk"}}]).model).causal


def test_prefill_routes_and_projects_once() -> None:
    """Prefill stores the clusters' members from the same routing pass it attends with (one projection, one
    k-means assignment), and its output is the full pass's."""
    T = 37
    group: RoutingHeads = make_group("routing", dict(sparsity=4), T)
    x, positions = torch.randn(2, T, 32), torch.arange(T).expand(2, T)
    calls = []
    group.qv.register_forward_hook(lambda *_: calls.append(1))
    cache = group.new_cache(2, T + 3)
    y = group(x, positions, cache)
    assert len(calls) == 1
    torch.testing.assert_close(y, group.forward_fast(x, positions), rtol=0, atol=0)
    assert cache.entries() == int(group._route(x)[4].valid.sum())  # every admitted member of both sequences
