"""Causal MiTA (heads/mita.py, routing/landmarks.py): fast vs reference (s = 1 and s > 1 with
overlapping experts, odd lengths, no complete landmark), reduction to dense causal attention,
causality in a hybrid mix, config errors, the routed experts' grouped layout under unbalanced routing; the published
(non-causal) variant: fast vs reference, Algorithm 1 written query by query (option errors: tests/test_config.py;
its leak and refused decoding: tests/test_head_contract_random.py)."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from tests.head_checks import assert_match, fast_vs_reference, make_group

import lm
from heads import ConfigError
from lm.causality import future_leak
from routing.landmarks import block_pool, earlier_blocks, prefix_mask

TOL = 1e-12  # float64: relative RMS error and max-abs error (relative to the reference max), outputs and all gradients


@pytest.mark.parametrize(
    "T,options",
    [
        (100, {"block": 8, "k": 6, "s": 1}),
        (257, {"block": 16, "k": 12, "s": 2}),
        (257, {"block": 32, "k": 257, "s": 3}),  # experts overlap heavily: union must drop repeats
        (100, {"block": 8, "k": 5, "s": 2, "shared": False}),
        (20, {"block": 32, "k": 4}),  # no completed block: own block only
        (100, {"block": 8, "k": 6, "s": 1, "local_blocks": 2}),
        (257, {"block": 16, "k": 12, "s": 2, "local_blocks": 3}),
        (40, {"block": 16, "k": 8, "local_blocks": 4}),  # local blocks reach past row 0: local only
    ],
)
def test_fast_matches_reference(T: int, options: dict) -> None:
    errors = fast_vs_reference(make_group("mita", options, T, std=None, dtype=torch.float64), T)
    assert_match(errors, TOL, TOL)


def test_landmarks_are_causal_block_means() -> None:
    x = torch.randn(1, 1, 11, 4)
    assert torch.allclose(block_pool(x, 4)[0, 0], torch.stack([x[0, 0, :4].mean(0), x[0, 0, 4:8].mean(0)]))
    assert prefix_mask(2, 11, 4, x.device).sum(-1).tolist() == [4, 8]  # keys <= e_j = 3, 7
    assert earlier_blocks(11, 2, 4, x.device).sum(-1).tolist() == [0] * 4 + [1] * 4 + [2] * 3


def per_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int, top: int, s: int, shared: bool,
              L: int) -> torch.Tensor:
    """One head's output [T, h'] written query by query from eqs. 5-12 and the causal rules of heads/mita.py:
    landmark j (block j ended at e_j) holds the top-k keys of rows <= e_j and the landmark value over them;
    a query at row t sees the shared entries of the blocks before its own, routes among the landmarks of the
    blocks before its L local blocks, and attends to the union of its experts' keys and its local keys <= t."""
    T, d = q.shape
    scale, n = d**-0.5, T // b
    landmarks = [q[j * b : (j + 1) * b].mean(0) for j in range(n)]
    experts, values = [], []
    for j, lq in enumerate(landmarks):
        scores = k[: (j + 1) * b] @ lq * scale  # keys at rows <= e_j
        experts.append(set(scores.topk(min(top, len(scores))).indices.tolist()))
        values.append(scores.softmax(0) @ v[: (j + 1) * b])
    out = []
    for t in range(T):
        routable = [j for j in range(n) if j < t // b - (L - 1)]
        logits = {j: q[t] @ landmarks[j] * scale for j in range(n)}
        best = sorted(routable, key=lambda j: -logits[j])[:s]
        keys = set().union(*(experts[j] for j in best)) | set(range(max(0, (t // b - L + 1) * b), t + 1))
        entries = [(logits[j], values[j]) for j in range(t // b) if shared] + [(q[t] @ k[p] * scale, v[p]) for p in keys]
        weights = torch.stack([e[0] for e in entries]).softmax(0)
        out.append(weights @ torch.stack([e[1] for e in entries]))
    return torch.stack(out)


@pytest.mark.parametrize("T,options", [(37, {"block": 4, "k": 5, "s": 1}),
                                       (37, {"block": 4, "k": 5, "s": 2, "local_blocks": 2}),
                                       (30, {"block": 3, "k": 4, "s": 3, "shared": False}),
                                       (41, {"block": 4, "k": 6, "s": 1, "local_blocks": 3})])
@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_matches_a_per_query_reading_of_the_paper(T: int, options: dict, impl: str) -> None:
    """Both paths against `per_query`: with local_blocks L >= 2 the shared entries of the L - 1 blocks before the
    query's own still count (eq. 11 puts every completed landmark into K~; only routing skips them)."""
    group = make_group("mita", {**options, "impl": impl}, T, count=2, std=None, dtype=torch.float64)
    x, positions = torch.randn(1, T, group.ctx.d_model, dtype=torch.float64), torch.arange(T)[None]
    q, k, v = group._qkv(x, positions)
    full = {"shared": True, "local_blocks": 1, **options}
    heads = [per_query(q[0, i], k[0, i], v[0, i], full["block"], full["k"], full["s"], full["shared"],
                       full["local_blocks"]) for i in range(group.count)]
    want = group.out(torch.cat(heads, -1))[None]
    assert (group(x, positions) - want).abs().max().item() <= TOL * want.abs().max().item()


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_full_experts_all_routed_no_shared_is_dense(impl: str) -> None:
    """k >= T (each expert holds its landmark's whole prefix), s >= T // b (every eligible landmark
    routed, so the union reaches the row before the own block) and no shared expert (whose landmark
    entries dense attention does not have): MiTA is exactly dense causal attention."""
    T, b = 45, 8
    dense = lm.build_model(tiny_config(heads=[{"type": "dense", "count": 2}], seq_len=T).model).double()
    options = {"block": b, "k": T, "s": T // b, "shared": False, "impl": impl}
    mita = lm.build_model(tiny_config(heads=[{"type": "mita", "count": 2, "options": options}], seq_len=T).model).double()
    mita.load_state_dict(dense.state_dict())  # same qkv / out layout as dense
    tokens = torch.randint(0, 97, (2, T))
    assert (mita(tokens) - dense(tokens)).abs().max().item() < TOL
    options["s"] = 1  # one routed expert only: no longer dense
    mita1 = lm.build_model(tiny_config(heads=[{"type": "mita", "count": 2, "options": options}], seq_len=T).model).double()
    mita1.load_state_dict(dense.state_dict())
    assert (mita1(tokens) - dense(tokens)).abs().max().item() > 1e-6


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_local_blocks_reaching_row_0_are_dense(impl: str) -> None:
    """local_blocks = L: a query sees its own block and the L - 1 before it. When they reach row 0 for every
    query (L b >= T + b - 1) no landmark is eligible and, without the shared expert, MiTA is dense causal
    attention; with one block fewer the last block's queries reach rows 0..b-1 only through a routed expert of
    k = 4 keys, and it is not."""
    T, b = 45, 8
    dense = lm.build_model(tiny_config(heads=[{"type": "dense", "count": 2}], seq_len=T).model).double()
    tokens = torch.randint(0, 97, (2, T))
    for L, equal in ((6, True), (5, False)):
        options = {"block": b, "k": 4, "s": 1, "shared": False, "local_blocks": L, "impl": impl}
        mita = lm.build_model(tiny_config(heads=[{"type": "mita", "count": 2, "options": options}], seq_len=T).model).double()
        mita.load_state_dict(dense.state_dict())
        assert ((mita(tokens) - dense(tokens)).abs().max().item() < TOL) == equal, L


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_causal_in_hybrid_mix_and_trains(impl: str) -> None:
    options = {"block": 8, "k": 6, "s": 2, "impl": impl}
    cfg = tiny_config(heads=[{"type": "dense", "count": 1}, {"type": "mita", "count": 2, "options": options}])
    model = lm.build_model(cfg.model)
    tokens = torch.randint(0, 97, (2, 64))
    assert model.causal
    for t in (0, 7, 8, 15, 16, 40):  # around block ends
        assert future_leak(model, tokens, t, 97) < 1e-5
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    group = model.blocks[0].attn.groups[1]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in group.parameters())


@pytest.mark.parametrize("field", ["block", "k", "s"])
def test_bad_options_name_the_field(field: str) -> None:
    with pytest.raises(ConfigError, match=f"options.{field}"):
        tiny_config(heads=[{"type": "mita", "count": 2, "options": {field: 0}}])


def test_flop_formula_lets_isoflop_match_it_to_dense() -> None:
    from flops.isoflop import solve
    from flops.presets import baseline

    result = solve(baseline("tiny"), "mita", dense_heads=4, options={"block": 64, "k": 64, "s": 1})
    assert result.budget_used <= 1 and result.sparse_heads > 5  # cheaper per head than the 5 dense heads replaced


@pytest.mark.parametrize("exact_groups", [False, True])
@pytest.mark.parametrize("routing", ["one_expert", "random"])
def test_routed_groups_hold_any_routing(routing: str, exact_groups: bool) -> None:
    """MiTAHeads._routed (s = 1) lays each expert's queries out in groups of b rows, as many groups as any
    routing could need (CUDA, torch.compile) or as this one needs (CPU). With every query routed to one expert
    (the most unbalanced case, several groups for one expert) or at random (some experts empty), every query's
    output and log-sum-exp equal its softmax over its expert's valid keys; unrouted queries get lse -inf."""
    torch.manual_seed(0)
    B, H, T, d, n, kk, b = 2, 3, 29, 4, 5, 7, 4
    group = make_group("mita", {"block": b, "k": kk}, T, count=H, d_model=16, head_dim=d, dtype=torch.float64)
    q, k, v = (torch.randn(B, H, T, d, dtype=torch.float64) for _ in range(3))
    idx_ok = torch.rand(B, H, n, kk) < 0.7
    idx_ok[..., 0] = True
    sel = torch.zeros(B, H, T, 1, dtype=torch.long) if routing == "one_expert" else torch.randint(0, n, (B, H, T, 1))
    sel_ok = torch.rand(B, H, T, 1) < 0.8
    idx = torch.randint(0, T, (B, H, n, kk))  # each expert's key rows
    out, lse = group._routed(q, k, v, idx, idx_ok, sel, sel_ok, d**-0.5, exact_groups=exact_groups)
    assert torch.isneginf(lse[~sel_ok]).all()
    for bi in range(B):
        for h in range(H):
            for t in range(T):
                if not sel_ok[bi, h, t, 0]:
                    continue
                j = sel[bi, h, t, 0]
                rows = idx[bi, h, j][idx_ok[bi, h, j]]
                keys, values = k[bi, h, rows], v[bi, h, rows]
                scores = keys @ q[bi, h, t] * d**-0.5
                torch.testing.assert_close(out[bi, h, t, 0], scores.softmax(-1) @ values, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(lse[bi, h, t, 0], scores.logsumexp(-1), rtol=1e-12, atol=1e-12)


def test_tied_routing_logits_go_to_the_earliest_landmark() -> None:
    """route() breaks equal logits by landmark index, for a logits row of any shape (the decoding step's [1, n_max]
    row and the full pass's [T, n] rows choose alike; topk's choice among ties depended on the shape)."""
    from routing.landmarks import route

    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0, 2.0]]).expand(1, 1, 3, 6)  # [B, H, T, n]
    eligible = torch.tensor([[True] * 6, [True] * 6, [False, False, True, True, True, True]])
    sel, valid = route(logits, eligible, 2)
    assert sel[0, 0].tolist() == [[1, 2], [1, 2], [2, 4]] and valid.all()
    wide = torch.cat([logits[:, :, :1], torch.full((1, 1, 1, 3), float("-inf"))], -1)  # n_max slots, 3 empty
    assert route(wide, torch.ones(1, 9, dtype=torch.bool), 3)[0][0, 0, 0].tolist() == [1, 2, 4]


def test_tied_expert_scores_go_to_the_earliest_key() -> None:
    """landmark_topk (eq. 7) breaks equal scores by key index whatever the row's width: the prefill's T_prompt
    columns, the full pass's T and the decoding cache's max_len (padded with -inf) choose the same keys (topk's
    choice among ties depended on the width)."""
    from routing.landmarks import landmark_topk

    scores = torch.zeros(1, 1, 1, 200)
    scores[..., [23, 45, 59, 69, 89, 122, 134, 150]] = torch.tensor([5.0, 7.0, 7.0, 6.0, 6.0, 3.0, 8.0, 3.0])
    wide = torch.cat([scores, torch.full((1, 1, 1, 300), float("-inf"))], -1)
    for k, chosen in [(6, [134, 45, 59, 69, 89, 23]), (7, [134, 45, 59, 69, 89, 23, 122])]:  # k = 7: 122 ties 150
        assert landmark_topk(scores, k)[0][0, 0, 0].tolist() == landmark_topk(wide, k)[0][0, 0, 0].tolist() == chosen


# variant published (Algorithm 1 over the whole sequence, NOT causal): the training length, shorter and longer inputs
# (m = seq_len // b landmarks pooling windows of other sizes), s > 1 with overlapping experts, route-only, one landmark
@pytest.mark.parametrize("seq_len,T,options", [
    (64, 64, {"block": 8, "k": 6, "s": 1}),
    (64, 45, {"block": 8, "k": 12, "s": 2}),
    (32, 70, {"block": 5, "k": 70, "s": 3}),
    (64, 33, {"block": 8, "k": 5, "s": 2, "shared": False}),
    (16, 9, {"block": 16, "k": 4}),
])
def test_published_fast_matches_reference(seq_len: int, T: int, options: dict) -> None:
    group = make_group("mita", {**options, "variant": "published"}, seq_len, std=None, dtype=torch.float64)
    assert_match(fast_vs_reference(group, T), TOL, TOL)


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_published_is_algorithm_1(impl: str) -> None:
    """Algorithm 1 (s = 1) written query by query with torch's operators: Q~ = AdaptiveAvgPool1d(m)(Q), m =
    seq_len // b; S = K Q~^T / sqrt(h') over all T keys; expert j = the top-k keys of S[:, j];
    v~_j = softmax(S[:, j]) V; query t goes to e(t) = argmax_j q_t . q~_j and attends, in one softmax, to
    [q~_1..q~_m | K[I_e(t)]] with values [v~_1..v~_m | V[I_e(t)]] (eqs. 10-12); the heads through W^O."""
    seq_len, T, b, kk, H, d = 32, 27, 6, 5, 2, 8
    group = make_group("mita", {"block": b, "k": kk, "variant": "published", "impl": impl}, seq_len, count=H,
                       head_dim=d, dtype=torch.float64)
    x, positions = torch.randn(2, T, 32, dtype=torch.float64), torch.arange(T).expand(2, T)
    q, k, v = group._qkv(x, positions)  # [B, H, T, h']
    m, scale = seq_len // b, d**-0.5
    heads = []
    for i in range(H):
        rows = []
        for bi in range(2):
            lq = torch.nn.AdaptiveAvgPool1d(m)(q[bi, i].T).T  # [m, h']
            S = k[bi, i] @ lq.T * scale  # [T, m]
            experts = S.topk(kk, dim=0).indices.T  # [m, k]
            lv = S.softmax(0).T @ v[bi, i]  # [m, h']
            out = []
            for t in range(T):
                e = int((lq @ q[bi, i, t]).argmax())
                keys, values = torch.cat((lq, k[bi, i, experts[e]])), torch.cat((lv, v[bi, i, experts[e]]))
                out.append((keys @ q[bi, i, t] * scale).softmax(0) @ values)
            rows.append(torch.stack(out))
        heads.append(torch.stack(rows))
    want = group.out(torch.cat(heads, -1))
    with torch.no_grad():
        got = group(x, positions)
    assert (got - want).abs().max().item() <= TOL * want.abs().max().item()


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_published_full_experts_without_shared_are_bidirectional_attention(impl: str) -> None:
    """Published, k >= T and no shared expert: every expert holds every key, so each query attends to all T keys,
    past and future: non-causal dense attention with the group's own projections."""
    T = 40
    group = make_group("mita", {"block": 8, "k": T, "shared": False, "variant": "published", "impl": impl}, T,
                       dtype=torch.float64)
    x, positions = torch.randn(2, T, 32, dtype=torch.float64), torch.arange(T).expand(2, T)
    with torch.no_grad():
        q, k, v = group._qkv(x, positions)
        want = group._merge(((q @ k.transpose(-1, -2)) * group.ctx.head_dim**-0.5).softmax(-1) @ v)
        assert (group(x, positions) - want).abs().max().item() <= TOL * want.abs().max().item()
