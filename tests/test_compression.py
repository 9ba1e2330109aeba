"""Compression layer (lm/compression.py), its training regimes and online cache compression."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_config
from flops import mfu
from heads import ConfigError
from heads.base import HeadGroup, HeadOptions
from lm.causality import future_leak
from lm.compressed_generate import CompressedGenerator
from lm.compressed_training import (
    CompressedModule, DocumentWindows, LayoutSampler, decode, document_windows, encode, evaluate, fixed_windows, load_compressed,
    train_compressed,
)
from lm.compression import CompressedLM, Layout, tokens_for
from lm.config import CompressionConfig, validate
from lm.ratio_predictor import AdaptiveRatio, RatioPredictor

V = 61
ROOT = Path(__file__).resolve().parents[1]


def make(mode: str = "compress", detach: bool = True, seed: int = 0, heads: list[dict] | None = None, **comp) -> CompressedLM:
    cfg = tiny_config(heads or [{"type": "dense", "count": 4}], n_layers=4, d_model=32, head_dim=8, seq_len=16, vocab_size=V)
    values = dict(layer=2, n_heads=2, prefix_len=12, ratio=0.25, mode=mode, detach_prefix=detach)
    cfg.compression = CompressionConfig(**{**values, **comp})
    validate(cfg)
    torch.manual_seed(seed)
    return CompressedLM(cfg.model, cfg.compression).eval()


def tokens(n: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("spans", [(12,), (12, 12, 12), (13, 7)])
def test_suffix_never_sees_raw_prefix_below_L(spans):
    """Resampling every prefix token leaves the suffix's states in blocks [0, L) bit-identical,
    and changes them from block L on (where the memory is visible)."""
    model, layout = make(), Layout(spans, 3, 10)
    x = tokens(layout.window)
    y = x.clone()
    y[:, : layout.prefix] = tokens(layout.prefix, seed=7)
    ha, hb = [], []
    with torch.no_grad():
        model(x, layout, ha), model(y, layout, hb)
    assert len(ha) == 4
    for a, b in zip(ha[: model.layer], hb[: model.layer]):
        assert torch.equal(a, b)
    for a, b in zip(ha[model.layer :], hb[model.layer :]):
        assert (a - b).abs().max() > 1e-3


class _OnSuffix(nn.Module):
    """The model as a function of its suffix tokens, with the prefix held fixed (for future_leak)."""

    def __init__(self, model: CompressedLM, prefix: torch.Tensor, layout: Layout) -> None:
        super().__init__()
        self.model, self.prefix, self.layout = model, prefix, layout

    def forward(self, suffix: torch.Tensor) -> torch.Tensor:
        return self.model(torch.cat([self.prefix, suffix], dim=1), self.layout)


@pytest.mark.parametrize("mode", ["compress", "recent"])
@pytest.mark.parametrize("spans", [(12,), (12, 12)])
def test_suffix_is_causal(mode, spans):
    model, layout = make(mode), Layout(spans, 3, 15)
    x = tokens(layout.prefix + layout.suffix)
    wrapped = _OnSuffix(model, x[:, : layout.prefix], layout)
    for t in (0, 6, 13):
        assert future_leak(wrapped, x[:, layout.prefix :], t, V) < 1e-5


@pytest.mark.parametrize("ratio", [1 / 12, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("span", [12, 37])
def test_shapes_across_ratios(ratio, span):
    model = make()
    t = tokens_for(ratio, span)
    layout = Layout((span,), t, 9)
    h = model.lower(tokens(span))
    assert model.compress(h, t).shape == (2, t, 32)
    assert model(tokens(layout.window), layout).shape == (2, 9, V)
    loss = model.train().suffix_loss(tokens(layout.window), layout)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.compressor.parameters())


@pytest.mark.parametrize("detach", [True, False])
def test_prefix_frozen_during_compression_attention(detach):
    """With detach_prefix, the compressed states get no gradient from the span's states except
    through their own (suffix-initialised) rows: span rows [0, N-t) receive exactly zero."""
    model = make(detach=detach)
    span = torch.randn(2, 12, 32, requires_grad=True)
    model.compress(span, 3).sum().backward()
    head = span.grad[:, :9].abs().max().item()
    assert (head == 0.0) if detach else (head > 1e-4)
    assert span.grad[:, 9:].abs().max() > 1e-4


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("mode", ["compress", "recent"])
def test_recursion_depth(depth, mode):
    """Depth-k memory = C([C([C(c1) | c2]) | c3]); the first chunk still reaches the suffix
    through k compressions, while the `recent` baseline only ever sees the last chunk's tail."""
    model, layout = make(mode), Layout((12,) * depth, 3, 10)
    x = tokens(layout.window)
    chunks = [model.lower(c) for c in x[:, : layout.prefix].split(12, dim=1)]
    mem = model.compress(chunks[0], 3)
    for h in chunks[1:]:
        mem = model.compress(torch.cat([mem, h], dim=1), 3)
    assert torch.allclose(model.memory(chunks, 3), mem)
    y = x.clone()
    y[:, :12] = tokens(12, seed=9)  # the first chunk only
    with torch.no_grad():
        moved = (model(x, layout) - model(y, layout)).abs().max().item()
    reaches = mode == "compress" or depth == 1
    assert (moved > 1e-4) if reaches else (moved == 0.0)


def test_the_recent_baseline_runs_the_lower_blocks_on_the_fewest_last_chunks_holding_its_t_states():
    """`recent` keeps the last t raw states at depth L: it needs the lower blocks on the last chunks until they hold
    t states, and on no chunk more (an extra one changes no output, but costs and is counted by
    flops.model.compressed_flops, so the FLOP-matched baseline's FLOPs would be overstated), also when t fills the
    chunks exactly."""
    from flops.model import compressed_flops

    assert Layout((12, 12, 12), 12, 10).chunks_used(compress=False) == (12,)
    assert Layout((12, 9), 9, 10).chunks_used(compress=False) == (9,)
    assert Layout((12, 9), 10, 10).chunks_used(compress=False) == (12, 9)
    assert Layout((12, 4, 4), 8, 10).chunks_used(compress=False) == (4, 4)
    assert Layout((12, 12), 3, 10).chunks_used(compress=True) == (12, 12)
    model = make("recent")
    assert compressed_flops(model.cfg, model.comp, Layout((12, 12, 12), 12, 10)) == \
        compressed_flops(model.cfg, model.comp, Layout((12,), 12, 10))


@pytest.mark.parametrize("mode", ["compress", "recent"])
def test_full_layout_keeps_every_raw_prefix_state(mode):
    """Layout(full=True), Delta's reference: blocks above L see [lower(chunk_1) | ... | lower(chunk_k) | suffix];
    nothing is compressed, so the compression layer gets no gradient; ratio_data's Loss(full) is this layout."""
    from lm.ratio_data import measure

    model, layout = make(mode), Layout((12, 7), 0, 10, full=True)
    x = tokens(layout.window)
    assert layout.memory == 19 and layout.chunks_used(compress=False) == (12, 7)
    with torch.no_grad():
        chunks = torch.cat([model.lower(x[:, :12]), model.lower(x[:, 12:19])], dim=1)
        ref = model.lm.lm_head(model.upper(model.lower(x[:, 19:29]), chunks))
    assert torch.allclose(model(x, layout), ref, atol=1e-6)
    model.suffix_loss(x, layout).backward()
    assert mode == "recent" or all(p.grad is None for p in model.compressor.parameters())
    single = Layout((12,), 0, 10, full=True)
    y = x[:, : single.window]
    full_nll = model.suffix_loss(y, single, reduce=False)
    assert torch.allclose(measure(model, y, 12, [0.25], 0.25)["full"], full_nll, atol=1e-6)
    with pytest.raises(ValueError, match="full layout keeps its prefix uncompressed, t must be 0"):
        Layout((12,), 3, 10, full=True)


@pytest.mark.parametrize("spans,t,suffix,message", [
    ((12,), 3, 0, r"^Layout: spans and suffix must be >= 1, got \(12,\), 0$"),
    ((12, 0), 3, 10, r"^Layout: spans and suffix must be >= 1, got \(12, 0\), 10$"),
    ((12,), 0, 10, r"^Layout: t must be in \[1, 12\] \(first span\), got 0$"),
    ((12, 20), 13, 10, r"^Layout: t must be in \[1, 12\] \(first span\), got 13$"),
])
def test_a_layout_needs_tokens_in_every_part(spans: tuple[int, ...], t: int, suffix: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Layout(spans, t, suffix)


def test_compression_and_the_model_check_their_inputs_lengths() -> None:
    """The compression layer keeps 1..N states of an N-token span; the model needs prefix + suffix tokens."""
    model = make()
    span = torch.zeros(2, 12, 32)
    for t in (0, 13):
        with pytest.raises(ValueError, match=rf"^CompressionLayer: t must be in \[1, 12\] \(span length\), got {t}$"):
            model.compressor(span, t)
    with pytest.raises(ValueError, match=r"^CompressedLM: need 22 tokens for Layout\(spans=\(12,\), t=3, suffix=10, "
                                         r"full=False\), got 21$"):
        model(tokens(21), Layout((12,), 3, 10))


LOCAL = [{"type": "dense", "count": 2}, {"type": "local", "count": 2, "options": {"window": 5}}]
BLOCKS = [{"type": "dense", "count": 2}, {"type": "agent", "count": 1, "options": {"block": 4, "window": 4}},
          {"type": "mosaic", "count": 2, "options": {"sparsity": 2}}]


@pytest.mark.parametrize("heads", [None, LOCAL, BLOCKS], ids=["dense", "dense+local", "dense+agent+mosaic"])
def test_generation_matches_training_forward_and_counts_entries(heads):
    """Online compression while decoding (the head groups' own decoding caches) gives the logits of
    the training-time forward pass with layout ((W,) * k, t, n) for the k full windows seen and the
    n tokens of the current window."""
    model = make(heads=heads)
    gen = CompressedGenerator(model)
    W, t = 12, 3
    x = tokens(3 * W + 7)
    cache = gen.new_cache(2)
    pieces = [gen.feed(cache, x[:, :5]), gen.feed(cache, x[:, 5:30])]
    pieces += [gen.feed(cache, x[:, i : i + 1]) for i in range(30, x.shape[1])]
    logits = torch.cat(pieces, dim=1)
    for k in range(4):
        layout = Layout((W,) * k, t, min(W, x.shape[1] - W * k))
        with torch.no_grad():
            ref = model(x[:, : W * k + layout.suffix], layout)
        assert (ref - logits[:, W * k : W * k + layout.suffix]).abs().max() < 1e-5
    # per layer 2 dense heads keep the window (below L: 7 tokens, above: t + 7); local heads <= 5
    dense = 4 if heads is None else 2
    if heads is BLOCKS:  # + the agent's tokens and one agent per block of 4; MoSAIC's members, read off their slots
        members = sum(int((c.kv.pos >= 0).sum()) for layer in cache.layers for c in layer[2:]) // 2
        other = 2 * (7 + 7 // 4) + 2 * (t + 7 + (t + 7) // 4) + members
    else:
        other = 0 if heads is None else 4 * 2 * 5
    assert cache.kv_entries() == 2 * dense * 7 + 2 * dense * (t + 7) + other
    assert cache.kv_uncompressed() == 4 * sum(g["count"] for g in heads or [{"count": 4}]) * x.shape[1]
    seq, cache = gen.generate(x[:, :5], 30)
    assert seq.shape == (2, 35) and torch.equal(seq[:, :5], x[:, :5])


class Scripted(AdaptiveRatio):
    """An AdaptiveRatio whose choices are given: t = script[i] at the i-th compression."""

    def __init__(self, script: list[int]) -> None:
        self.script = list(script)

    def tokens(self, model: CompressedLM, span: torch.Tensor) -> int:
        assert span.shape[1] == 12  # the window being compressed, W states
        return self.script.pop(0)


def test_adaptive_generation_keeps_the_chosen_t_per_window():
    """With an adaptive ratio each compression keeps its own t: the decoder's logits are those of the model with
    memories m_j = C([m_{j-1} | window_j], t_j) built from those t's, and the cache holds t_j + window above L."""
    model = make()
    W, script = 12, [2, 7, 1]
    gen = CompressedGenerator(model, adaptive=Scripted(script))
    x = tokens(3 * W + 5)
    cache = gen.new_cache(2)
    logits = torch.cat([gen.feed(cache, x[:, :W])] + [gen.feed(cache, x[:, i : i + 1]) for i in range(W, x.shape[1])], 1)
    assert cache.kept == script
    mem = None
    with torch.no_grad():
        for j in range(4):
            window = x[:, j * W : (j + 1) * W]
            ref = model.lm.lm_head(model.upper(model.lower(window), mem))
            assert (ref - logits[:, j * W : j * W + window.shape[1]]).abs().max() < 1e-5, j
            if j < 3:
                mem = model.memory([model.lower(window)], script[j], mem)
    assert cache.kv_entries() == 2 * 4 * 5 + 2 * 4 * (script[-1] + 5)  # 2 layers below L, 2 above, 4 heads


def test_kv_total_is_the_decoders_largest_cache():
    """kv_total() counts the cache CompressedGenerator reaches with its default window W = prefix_len (here 12, not
    seq_len 16): W entries per head below L and t + W above, as the W-th token of a window is fed after a memory of
    t states (the window is compressed right after)."""
    model = make()  # 4 dense heads, L = 2 of 4 blocks, P = 12, r = 0.25: t = 3
    gen = CompressedGenerator(model)
    cache = gen.new_cache(1)
    gen.feed(cache, tokens(12 + 11, batch=1))  # one window compressed, 11 tokens of the next
    assert cache.kv_entries() == model.kv_total(11) == 2 * 4 * 11 + 2 * 4 * (3 + 11)
    assert gen.window == 12 and model.kv_total() == model.kv_total(12) == 2 * 4 * 12 + 2 * 4 * (3 + 12)
    assert model.kv_total(11, 0) == 4 * 4 * 11  # no memory: every block keeps the window
    short = gen.new_cache(1)
    gen.feed(short, tokens(12 + 4, batch=1))  # a window of 4 after the memory of a full window: t stays 3
    assert short.kv_entries() == model.kv_total(4) == 2 * 4 * 4 + 2 * 4 * (3 + 4)


def test_suffix_loss_needs_the_last_target():
    model = make()
    layout = Layout((12,), 3, 16)
    assert model.suffix_loss(tokens(29), layout).isfinite()
    with pytest.raises(ValueError, match="suffix_loss: need 29 tokens .* \\(the last suffix position's target too\\), got 28"):
        model.suffix_loss(tokens(28), layout)


def test_adaptive_ratio_clamps_to_the_measured_ratios(tmp_path):
    """AdaptiveRatio.tokens: t = round(r* N), r* the predictor's choice for the span clamped to the ratios its
    data measured; loaded from a predictor file (probe ratio and ratios travel with it)."""
    model = make()
    predictor = RatioPredictor(32)
    path = tmp_path / "p.pt"
    span = model.lower(tokens(12))
    for bias, t in ((-5.0, 6), (5.0, 3)):  # log r = -softplus(bias): r ~ 0.99 -> clamped to 0.5; r ~ 0.007 -> 0.25
        with torch.no_grad():
            predictor.head[-1].weight.zero_()
            predictor.head[-1].bias.fill_(bias)
        predictor.save(path, probe_ratio=0.25, ratios=[0.25, 0.5])
        assert AdaptiveRatio.load(path, tolerance=0.1).tokens(model, span) == t
    for probe, ratios in (("x", [0.25]), (0.25, []), (0.25, [0.5, 2.0]), (0.25, "0.5")):  # a file no training wrote
        predictor.save(path, probe_ratio=probe, ratios=ratios)
        with pytest.raises(ValueError, match="the predictor's probe_ratio and ratios must be ratios in"):
            AdaptiveRatio.load(path, tolerance=0.1)
    for damaged in ("0.1", [0.2], [0.2, 0.1], [0.0, float("nan")]):
        predictor.save(path, probe_ratio=0.25, ratios=[0.25, 0.5], delta_range=damaged)
        with pytest.raises(ValueError, match="the predictor's delta_range must be \\[min, max\\] of finite Deltas"):
            AdaptiveRatio.load(path, tolerance=0.1)


def test_adaptive_ratio_gives_a_batch_its_largest_rows_t(monkeypatch):
    """Rows whose predictor ratios differ (0.25 and 0.5 here) share one t, the largest row's: every row keeps at least
    the states its tolerance asks for (row 0's would starve row 1)."""
    from lm import ratio_predictor

    model = make()
    adaptive = AdaptiveRatio(RatioPredictor(32), tolerance=0.1, probe_ratio=0.25, ratios=[0.25, 0.5])
    monkeypatch.setattr(ratio_predictor, "choose_ratio", lambda predictor, states, tolerance, ratios:
                        torch.tensor([0.25, 0.5])[: states.shape[0]])
    assert adaptive.tokens(model, model.lower(tokens(12, batch=2))) == tokens_for(0.5, 12) == 6


def test_a_predictor_of_another_span_length_is_refused(tmp_path):
    """The predictor's Deltas are of spans of its data's prefix_len tokens: a decoder compressing other windows
    refuses it in one line (the model here compresses windows of 12)."""
    model = make()
    path = tmp_path / "p.pt"
    RatioPredictor(32).save(path, probe_ratio=0.25, prefix_len=512, ratios=[0.25, 0.5])
    with pytest.raises(ValueError, match="^the ratio predictor was fit on spans of 512 tokens, this decoder compresses "
                                         "windows of 12: fit one on ratio data of this window$"):
        CompressedGenerator(model, adaptive=AdaptiveRatio.load(path, tolerance=0.1))
    RatioPredictor(32).save(path, probe_ratio=0.25, prefix_len=12, ratios=[0.25, 0.5])
    CompressedGenerator(model, adaptive=AdaptiveRatio.load(path, tolerance=0.1))


def test_generation_needs_cached_decoding():
    model = make()
    model.lm.blocks[0].attn.groups.append(HeadGroup(model.cfg.group_context(0), 1, HeadOptions()))
    with pytest.raises(ValueError, match="needs KV-cached decoding"):
        CompressedGenerator(model)


def test_generator_arguments_are_checked():
    """t = 0 is refused, not replaced by the default; an empty prompt, a negative max_new_tokens or temperature
    is one line; the model's training mode is restored."""
    model = make()
    with pytest.raises(ValueError, match="^need window >= 1 and t in \\[1, window\\], got window 12 and t 0$"):
        CompressedGenerator(model, t=0)
    gen = CompressedGenerator(model)
    for prompt, n, temperature, message in (
            (tokens(0), 3, 0.0, "generate: need a prompt of at least one token and max_new_tokens >= 0"),
            (tokens(4), -1, 0.0, "generate: need a prompt of at least one token and max_new_tokens >= 0"),
            (tokens(4), 3, -1.0, "temperature must be finite and >= 0"),
            (tokens(4) + model.cfg.vocab_size, 3, 0.0, "generate: prompt token id .* is outside the model's vocab")):
        with pytest.raises(ValueError, match=f"^{message}"):
            gen.generate(prompt, n, temperature)
    model.train()
    assert gen.generate(tokens(4), 3, temperature=1.0)[0].shape == (2, 7) and model.training


def test_layout_sampler_regimes():
    rng = np.random.default_rng(0)
    fixed = LayoutSampler(make(prefix_len=40, ratio=0.25).comp, suffix=16)
    assert {fixed.sample(s, rng) for s in range(20)} == {Layout((40,), 10, 16)}
    comp = make(regime="random", prefix_len=40, ratio=0.25, ramp_steps=100, max_depth=3).comp
    rand = LayoutSampler(comp, suffix=16)
    assert {len(rand.sample(0, rng).spans) for _ in range(60)} == {1, 2, 3}
    assert {(ly.spans[0], ly.t) for ly in (rand.sample(0, rng) for _ in range(30))} == {(40, 10)}
    early = [rand.sample(25, rng) for _ in range(400)]
    late = [rand.sample(1000, rng) for _ in range(400)]
    for ly in early + late:
        assert 20 <= ly.spans[0] <= 60 and 1 <= ly.t <= ly.spans[0]
        assert ly.spans[0] * 0.125 - 1 <= ly.t <= ly.spans[0] * 0.375 + 1
        assert decode(encode(ly)) == ly
    std = lambda ls, f: np.std([f(ly) for ly in ls])  # noqa: E731
    assert std(late, lambda ly: ly.spans[0]) > 2.5 * std(early, lambda ly: ly.spans[0])
    assert std(late, lambda ly: ly.t / ly.spans[0]) > 2.5 * std(early, lambda ly: ly.t / ly.spans[0])
    assert max(ly.window for ly in late) <= rand.longest()
    assert not any(ly.full for ly in early + late)
    mixed = LayoutSampler(make(regime="random", prefix_len=40, ratio=0.25, max_depth=3, full_prob=0.25).comp, suffix=16)
    drawn = [mixed.sample(s, rng) for s in range(800)]
    full = [ly for ly in drawn if ly.full]
    assert 0.2 < len(full) / len(drawn) < 0.3
    assert {len(ly.spans) for ly in full} == {1, 2, 3} and {ly.t for ly in full} == {0}
    assert all(decode(encode(ly)) == ly for ly in drawn)


def test_each_new_state_is_its_own_query_row_at_the_span_suffix_positions():
    """The t new states are the span's last t rows, rotated at their own positions N - t .. N - 1 (a query at 0 ..
    t - 1 would read the span from its start); each is one query row over all N keys, so compressing to fewer
    states gives the last rows of compressing to more."""
    model = make()
    for p in model.compressor.parameters():
        torch.nn.init.normal_(p, std=0.5)  # far from the initial near-identity, so positions show
    h = model.lower(tokens(12))
    with torch.no_grad():
        whole = model.compress(h, 12)
        for t in (1, 3, 7):
            torch.testing.assert_close(model.compress(h, t), whole[:, -t:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ratio, span, t", [(0.3, 12, 4), (0.2, 13, 3), (0.7, 10, 7), (0.01, 12, 1), (1.0, 37, 37)])
def test_tokens_for_rounds_to_the_nearest_count_and_keeps_at_least_one(ratio, span, t):
    assert tokens_for(ratio, span) == t  # 3.6 -> 4, 2.6 -> 3 (round, not floor)


def test_a_document_exactly_as_long_as_the_window_is_drawn_whole_and_every_start_is_drawn():
    """A document of n tokens holds one window of n; one of n + 5 holds six, starts 0 .. 5 all drawn."""
    eos, n = 0, 20
    exact = DocumentWindows([np.concatenate([np.arange(1, n + 1), [eos]]).astype(np.uint16)], eos_id=eos, seed=0)
    assert exact.sample(3, n).tolist() == [list(range(1, n + 1))] * 3
    longer = DocumentWindows([np.concatenate([np.arange(1, n + 6), [eos]]).astype(np.uint16)], eos_id=eos, seed=0)
    assert {int(row[0]) - 1 for row in longer.sample(300, n)} == set(range(6))


def test_document_windows_stay_inside_one_document():
    eos = 0
    docs = [np.arange(1, 1 + n) for n in (5, 40, 3, 25)]  # distinct ranges: a window's tokens name its doc
    flat = np.concatenate([np.concatenate([d + 100 * i, [eos]]) for i, d in enumerate(docs)]).astype(np.uint16)
    w = DocumentWindows([flat[:60], flat[60:]], eos_id=eos, seed=0)
    seen = set()
    for row in w.sample(200, 20):
        assert (row != eos).all() and len(set((row // 100).tolist())) == 1
        assert torch.equal(row[1:] - row[:-1], torch.ones(19, dtype=row.dtype))
        seen.add(int(row[0] // 100))
    assert seen == {1}  # doc 3 (25 tokens) is cut at the shard end into 9 + 16, both shorter than 20
    whole = DocumentWindows([flat], eos_id=eos, seed=0)  # without the cut, doc 3 holds windows of 20
    assert {int(row[0] // 100) for row in whole.sample(200, 20)} == {1, 3}
    with pytest.raises(ValueError, match="no document has 41 tokens"):
        w.sample(1, 41)


def _prepared(root, docs: list[np.ndarray], eos: int = 0) -> str:
    """A minimal data_prep-format directory: one train and one val shard of the given documents."""
    index = {"vocab_size": V, "eos_id": eos, "splits": {}}
    for split, part in (("train", docs[:-4]), ("val", docs[-4:])):
        flat = np.concatenate([np.concatenate([d, [eos]]) for d in part]).astype(np.uint16)
        flat.tofile(root / f"{split}_00000.bin")
        shard = {"file": f"{split}_00000.bin", "tokens": len(flat), "documents": len(part)}
        index["splits"][split] = {"tokens": len(flat), "documents": len(part), "shards": [shard]}
    (root / "index.json").write_text(json.dumps(index))
    return str(root)


@pytest.mark.parametrize("val_len, error", [(30, None), (19, "no val document has the 21 tokens")])
def test_validation_documents_need_the_validation_window_only(tmp_path, val_len: int, error: str | None):
    """Training may recurse over 2 prefixes (33 tokens), validation takes one prefix of 12 + suffix 8 + 1 = 21 tokens:
    validation documents of 30 tokens are enough."""
    from lm.compressed_training import CompressedDataModule

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, V, 60) for _ in range(6)] + [rng.integers(1, V, val_len) for _ in range(4)]
    cfg = tiny_config([{"type": "dense", "count": 2}], n_layers=3, d_model=32, head_dim=8, seq_len=8, vocab_size=V)
    cfg.compression = CompressionConfig(layer=1, n_heads=2, prefix_len=12, ratio=0.25, max_depth=2)
    cfg.data.path = _prepared(tmp_path, docs)
    validate(cfg)
    data = CompressedDataModule(cfg)
    assert data.sampler.longest() == 33 and data.val_layout().window == 21
    if error is None:
        data.check()
    else:
        with pytest.raises(ValueError, match=error):
            data.check()


def test_compressed_validation_overlap_warning_counts_its_own_windows(tmp_path, capsys):
    """Validation windows are prefix_len + seq_len + 1 = 21 tokens drawn inside documents, not the plain model's
    seq_len + 1 = 9: four validation documents of 30 tokens hold 4 disjoint ones (the plain count, 120 // 9 = 13
    windows, would not warn)."""
    from lm.compressed_training import CompressedDataModule

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, V, 60) for _ in range(6)] + [rng.integers(1, V, 30) for _ in range(4)]
    cfg = tiny_config([{"type": "dense", "count": 2}], n_layers=3, d_model=32, head_dim=8, seq_len=8, vocab_size=V)
    cfg.compression = CompressionConfig(layer=1, n_heads=2, prefix_len=12, ratio=0.25)
    cfg.data.path, cfg.data.batch_size = _prepared(tmp_path, docs), 2
    for val_batches, warns in ((2, False), (3, True)):
        cfg.data.val_batches = val_batches
        validate(cfg)
        CompressedDataModule(cfg).check()
        err = capsys.readouterr().err
        expected = ("warning: validation windows overlap: data.val_batches x data.batch_size = 6 windows of 21 tokens "
                    "(prefix_len + seq_len + 1) are drawn inside validation documents that hold 4 disjoint ones "
                    "(lower data.val_batches to 2)\n")
        assert err == (expected if warns else ""), err
    cfg.data.batch_size, cfg.data.val_batches = 8, 1  # not even one batch: no data.val_batches helps
    validate(cfg)
    CompressedDataModule(cfg).check()
    assert capsys.readouterr().err == ("warning: the validation documents hold 4 disjoint windows of 21 tokens "
                                       "(prefix_len + seq_len + 1), fewer than one batch (data.batch_size=8): every "
                                       "validation window overlaps others\n")


def test_training_regimes_lower_the_suffix_loss(tmp_path):
    """Random ratios with recursion train end to end through the Lightning stack on a task where
    the memory matters: each document repeats its own random 6-token pattern, so the suffix's first
    tokens follow from the (compressed) prefix. A quarter of the batches keep the prefix uncompressed
    (full_prob). On training windows the loss falls and is lower with the memory, compressed or full, than
    without it; the validation loss is logged (and drawn); the checkpoint reloads."""
    rng = np.random.default_rng(0)
    path = _prepared(tmp_path, [np.tile(rng.integers(1, V, 6), 40) for _ in range(54)])
    cfg = make(regime="random", ramp_steps=20, max_depth=2, full_prob=0.25).comp
    full = tiny_config([{"type": "dense", "count": 4}], n_layers=4, d_model=32, head_dim=8, seq_len=8, vocab_size=V)
    full.compression = cfg
    # on CPU: the equalities below are fp32 ones (on a GPU, auto would train in bf16-mixed)
    for key, value in dict(accelerator="cpu", max_steps=100, val_every=50, ckpt_every=100, log_every=50,
                           out_dir=str(tmp_path / "run")).items():
        setattr(full.trainer, key, value)
    full.data.path, full.data.batch_size, full.data.val_batches = path, 8, 2
    full.optim.lr, full.optim.warmup_steps, full.optim.grad_clip = 3e-3, 5, 1.0
    torch.manual_seed(0)
    before = CompressedLM(full.model, cfg)
    metrics = train_compressed(full)
    model, _ = load_compressed(tmp_path / "run" / "checkpoints" / "last.ckpt")
    val = fixed_windows(document_windows(path, "val", full), 2, 8, 12 + 8 + 1, seed=full.trainer.seed)
    with_memory, without = Layout((12,), 3, 8), Layout((), 0, 8)
    assert metrics["step"] == 100 and abs(metrics["val_loss"] - evaluate(model, val, with_memory)) < 1e-5
    evalset = fixed_windows(document_windows(path, "train", full), 4, 8, 12 + 8 + 1)
    after = evaluate(model, evalset, with_memory)
    assert after < evaluate(before, evalset, with_memory) - 0.8
    assert after < evaluate(model, evalset, without) - 0.04
    assert evaluate(model, evalset, Layout((12,), 0, 8, full=True)) < evaluate(model, evalset, without) - 0.04
    assert (tmp_path / "run" / "config.yaml").is_file()  # the run directory is claimed (lm/run_dir.py)
    assert (tmp_path / "run" / "val_curve.png").is_file()  # two validations: the curve, as train_lm.py draws it
    with pytest.raises(ConfigError, match="already holds a run"):
        train_compressed(full)


@pytest.mark.parametrize("mode", ["compress", "recent"])
def test_flops_mfu_counts_the_layouts_a_resumed_accumulating_run_trained_on(tmp_path, monkeypatch, mode):
    """flops.mfu replays a compression run's layouts from (seed, step): they are the layouts its micro-batches
    carried (2 per step, one layout per step), full-memory ones included, across a stop at step 6 and a resume
    to 12; its FLOPs per token are counted from those, the suffix tokens' vocabulary projection added."""
    from flops.model import compressed_flops, model_cost

    seen: list[tuple[int, Layout]] = []
    losses = CompressedModule.losses

    def spy(self, tokens, meta):
        layout = decode(meta)
        assert tokens.shape == (2, layout.window)
        seen.append((self.trainer.global_step, layout))
        return losses(self, tokens, meta)

    monkeypatch.setattr(CompressedModule, "losses", spy)
    rng = np.random.default_rng(0)
    path = _prepared(tmp_path, [np.tile(rng.integers(1, V, 6), 40) for _ in range(54)])
    cfg = tiny_config([{"type": "dense", "count": 4}], n_layers=4, d_model=32, head_dim=8, seq_len=8, vocab_size=V)
    cfg.compression = CompressionConfig(layer=2, n_heads=2, prefix_len=12, ratio=0.25, mode=mode, regime="random",
                                        ramp_steps=5, max_depth=3, full_prob=0.3)
    for key, value in dict(accelerator="cpu", max_steps=6, val_every=4, ckpt_every=3, out_dir=str(tmp_path / "run"),
                           accumulate_grad_batches=2, seed=5).items():
        setattr(cfg.trainer, key, value)
    cfg.data.path, cfg.data.batch_size, cfg.data.val_batches = path, 2, 1
    validate(cfg)
    train_compressed(cfg)
    cfg.trainer.max_steps = 12
    metrics = train_compressed(cfg, resume="last")
    assert metrics["step"] == 12 and [step for step, _ in seen] == [s for s in range(12) for _ in range(2)]
    trained = [layout for _, layout in seen[::2]]
    assert [layout for _, layout in seen[1::2]] == trained  # both micro-batches of a step
    assert any(layout.full for layout in trained) and len(set(trained)) > 3
    sampler = LayoutSampler(cfg.compression, cfg.model.seq_len)
    assert [sampler.at_step(5, step)[0] for step in range(12)] == trained
    forward = sum(compressed_flops(cfg.model, cfg.compression, layout) for layout in trained) / 12
    r = mfu.run_mfu(tmp_path / "run")
    assert r["tokens_per_s"] == metrics["tokens_per_s"]
    assert r["flops_per_token"] == 3 * (forward + model_cost(cfg.model).lm_head_flops) / 8


def test_compression_training_accumulates_and_checkpoints_like_plain_training(tmp_path):
    """train_compressed with 2 micro-batches of 4 per step ends where one batch of 8 does (the same windows and
    layout per step, lm/compressed_training.LayoutBatches), and so does a run with activation-checkpointed
    blocks (inside the CompressedLM)."""
    rng = np.random.default_rng(0)
    path = _prepared(tmp_path, [np.tile(rng.integers(1, V, 6), 40) for _ in range(54)])

    def run(name: str, batch: int, accumulate: int, checkpointing: bool) -> dict:
        full = tiny_config([{"type": "dense", "count": 4}], n_layers=4, d_model=32, head_dim=8, seq_len=8, vocab_size=V)
        full.compression = make(regime="random", ramp_steps=3, max_depth=2).comp
        for key, value in dict(accelerator="cpu", max_steps=6, val_every=100, ckpt_every=100,  # fp32 (bf16 on a GPU)
                               out_dir=str(tmp_path / name), accumulate_grad_batches=accumulate,
                               activation_checkpointing=checkpointing).items():
            setattr(full.trainer, key, value)
        full.data.path, full.data.batch_size, full.data.val_batches = path, batch, 1
        full.optim.lr, full.optim.warmup_steps = 3e-3, 2
        train_compressed(full)
        return torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]

    whole, micro, replayed = run("whole", 8, 1, False), run("micro", 4, 2, False), run("replayed", 8, 1, True)

    def steps(a: dict) -> float:  # the largest weight difference to the whole-batch run, in learning-rate steps
        return max((a[name] - w).abs().max().item() for name, w in whole.items()) / 3e-3

    # measured: 0.003 (fp32 summation order, amplified where AdamW divides by a tiny second moment) and 0;
    # micro-batches that repeated one slice of the step's windows instead: 7.7
    assert steps(micro) < 0.05 and steps(replayed) < 1e-3


def test_config_errors_name_the_field():
    for layer in (0, 4):  # the compressed span needs a layer below it, and one above (the tiny model has 4)
        with pytest.raises(ConfigError, match=rf"^compression.layer must be in \[1, 4\) \(model.n_layers\), got {layer}$"):
            make(layer=layer)
    with pytest.raises(ConfigError, match="compression.mode"):
        make(mode="zip")
    with pytest.raises(ConfigError, match=r"compression.ratio \* \(1 \+ ratio_spread\) must be <= 1"):
        make(ratio=0.9, ratio_spread=0.5, regime="random")
    assert make(ratio=1.0, ratio_spread=0.5).comp.ratio == 1.0  # the spread is the random regime's only
    with pytest.raises(ConfigError, match="compression.ratio must be <= 1, got 1.5"):
        make(ratio=1.5)
    with pytest.raises(ConfigError, match=r"compression.full_prob must be in \[0, 1\), got 1.0"):
        make(full_prob=1.0)
    with pytest.raises(ConfigError, match=r"^compression\.regime must be fixed or random, got 'mixed'$"):
        make(regime="mixed")
    for spread in ({"prefix_spread": 1.0}, {"prefix_spread": -0.1}, {"ratio_spread": 1.0}, {"ratio_spread": -0.1}):
        with pytest.raises(ConfigError, match=r"^compression\.prefix_spread and compression\.ratio_spread must be in "
                                              r"\[0, 1\)$"):
            make(**spread)
    with pytest.raises(ConfigError, match=r"^compression\.ramp_steps must be >= 0, got -1$"):
        make(ramp_steps=-1)
    # a non-causal head mix (a paper's faithful rule) would leak into the teacher-forced suffix loss unmeasured
    with pytest.raises(ConfigError, match=r"^compression needs causal head groups .*, but mosa \(model\.heads\) is "
                                          r"not causal as configured; choose causal options$"):
        make(heads=[{"type": "dense", "count": 2}, {"type": "mosa", "count": 2,
                                                     "options": {"sparsity": 2, "selection": "expert_choice"}}])
    make(heads=[{"type": "dense", "count": 2}, {"type": "mosa", "count": 2, "options": {"sparsity": 2}}])


def test_compile_is_refused_and_the_suffix_loss_is_fp32():
    """trainer.compile with a compression section is one line (each batch's layout shapes the graph); under bf16 the
    suffix cross-entropy is taken in fp32 (as the plain LM's), not rounded to bf16's 1/32 nat steps near 4."""
    from lm.compressed_training import train_compressed
    from lm.config_io import load_config

    cfg = load_config(ROOT / "configs" / "experiments" / "compression.yaml", "trainer.compile=true")  # loads (checkpoints)
    with pytest.raises(ConfigError, match="^trainer.compile is not supported with a compression section"):
        train_compressed(cfg)
    model = make().to(torch.bfloat16)
    x, layout = tokens(12 + 10 + 1), Layout((12,), 3, 10)
    loss = model.suffix_loss(x, layout, reduce=False)
    with torch.no_grad():
        logits = model(x, layout).float()
    want = F.cross_entropy(logits.flatten(0, 1), x[:, 13:23].flatten(), reduction="none").view(2, 10).mean(1)
    assert loss.dtype == torch.float32 and torch.allclose(loss, want, atol=1e-6)


def test_flop_formula_matches_counted_matmuls():
    """flops/formulas.py's "compression" = the matmuls torch's FlopCounterMode sees in the layer
    (projections and SwiGLU) + 4 h' t N per head for the scores and AV, which the counter does not
    see in CPU SDPA."""
    from torch.utils.flop_counter import FlopCounterMode

    from flops.formulas import group_cost

    model = make()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.compress(torch.randn(1, 37, 32), 5)
    cost = group_cost("compression", 32, 8, 37, 2, {"t": 5, "ffn_mult": 4})
    assert cost.flops == counter.get_total_flops() + 2 * 4 * 8 * 5 * 37
    assert cost.params == sum(p.numel() for n, p in model.compressor.named_parameters() if "norm" not in n)


def test_compression_training_final_checkpoint_carries_the_final_validation(tmp_path):
    """As lm.train.train (tests/test_resume.py): step 4's checkpoint (ckpt_every 2) is due before the end-of-run
    validation (val_every 3); it is written again after it, so that it carries that validation."""
    rng = np.random.default_rng(0)
    path = _prepared(tmp_path, [np.tile(rng.integers(1, V, 6), 40) for _ in range(54)])
    full = tiny_config([{"type": "dense", "count": 2}], n_layers=2, d_model=32, head_dim=8, seq_len=8, vocab_size=V)
    full.compression = make(regime="random", ramp_steps=2, max_depth=2).comp
    for key, value in dict(accelerator="cpu", max_steps=4, val_every=3, ckpt_every=2, out_dir=str(tmp_path / "run")).items():
        setattr(full.trainer, key, value)
    full.data.path, full.data.batch_size, full.data.val_batches = path, 4, 1
    metrics = train_compressed(full)
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert [h["step"] for h in saved["val_history"]] == [h["step"] for h in metrics["history"]] == [3, 4]
    assert saved["val_history"] == metrics["history"]


def test_compressed_module_builds_only_the_compressed_model():
    """CompressedModule's weights are those of a CompressedLM built from the same seed: no plain DecoderLM is
    built first and thrown away (which drew from the RNG and held a second copy of the weights meanwhile)."""
    cfg = tiny_config([{"type": "dense", "count": 4}], n_layers=4, d_model=32, head_dim=8, seq_len=16, vocab_size=V)
    cfg.compression = make().comp
    torch.manual_seed(3)
    module = CompressedModule(cfg)
    torch.manual_seed(3)
    alone = CompressedLM(cfg.model, cfg.compression)
    assert module.model.state_dict().keys() == alone.state_dict().keys()
    for name, w in alone.state_dict().items():
        assert torch.equal(module.model.state_dict()[name], w), name


def test_compressed_evaluate_scores_every_layout_on_the_same_suffixes(tmp_path, capsys):
    """python -m lm.compressed_evaluate: rows none / full / compress per depth and ratio, each the suffix loss
    lm.compressed_training.evaluate gives on the same windows (max depth's, cut to each depth's last tokens), delta
    = compressed - full at that depth; JSON with --out. Documents shorter than the window, bad --depths/--ratios, a
    plain model's checkpoint: one line, exit 2."""
    from omegaconf import OmegaConf

    from lm.compressed_evaluate import main as evaluate_main

    rng = np.random.default_rng(0)
    cfg = tiny_config([{"type": "dense", "count": 2}], n_layers=3, d_model=32, head_dim=8, seq_len=8, vocab_size=V)
    cfg.compression = CompressionConfig(layer=1, n_heads=2, prefix_len=12, ratio=0.25, max_depth=2)
    cfg.data.path = _prepared(tmp_path, [rng.integers(1, V, 60) for _ in range(10)])
    validate(cfg)
    torch.manual_seed(0)
    model = CompressedLM(cfg.model, cfg.compression).eval()
    ckpt = tmp_path / "c.ckpt"
    torch.save({"config": OmegaConf.to_container(OmegaConf.structured(cfg)),
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, ckpt)
    out = tmp_path / "eval.json"
    assert evaluate_main(["--ckpt", str(ckpt), "--ratios", "0.25,0.5", "--batches", "2", "--batch", "3",
                          "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "6 windows of 33 tokens" in printed  # 2 chunks of 12 + suffix 8 + 1
    rows = json.loads(out.read_text())["rows"]
    assert [(r["memory"], r["depth"], r["ratio"], r["t"]) for r in rows] == [
        ("none", 0, None, 0), ("full", 1, None, 12), ("compress", 1, 0.25, 3), ("compress", 1, 0.5, 6),
        ("full", 2, None, 24), ("compress", 2, 0.25, 3), ("compress", 2, 0.5, 6)]
    windows = fixed_windows(document_windows(cfg.data.path, "val", cfg), 2, 3, 33, seed=0)
    with torch.no_grad():  # every layout on the last 9 + 12 k tokens of each 33-token window: the same 8 suffix targets
        expected = [sum(model.suffix_loss(w[:, 33 - (12 * len(spans) + 9):], Layout(spans, t, 8, full)).item()
                        for w in windows) / 2
                    for spans, t, full in (((), 0, False), ((12,), 0, True), ((12,), 3, False), ((12,), 6, False),
                                           ((12, 12), 0, True), ((12, 12), 3, False), ((12, 12), 6, False))]
    assert [r["loss"] for r in rows] == pytest.approx(expected, rel=1e-6)
    assert rows[3]["delta"] == pytest.approx(expected[3] - expected[1]) and rows[6]["delta"] == pytest.approx(
        expected[6] - expected[4])
    assert all(r["ppl"] == pytest.approx(float(np.exp(r["loss"]))) for r in rows)
    assert f"| compress | 2 | 0.5 | 6 | {expected[6]:.4f} |" in printed
    for args, message in [(["--depths", "5"], "no document has 69 tokens (longest: 60): depth 5 needs windows of 69 "
                                              "tokens"),
                          (["--depths", "0"], "expected distinct comma-separated integers >= 1 for --depths, got '0'"),
                          (["--ratios", "0.25,0.25"], "expected distinct comma-separated ratios in (0, 1]"),
                          (["--ratios", "2"], "expected distinct comma-separated ratios in (0, 1]"),
                          (["--batch", "0"], "--batches and --batch must be >= 1")]:
        assert evaluate_main(["--ckpt", str(ckpt), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    index = json.loads((tmp_path / "index.json").read_text())
    (tmp_path / "index.json").write_text("[]")  # the data's own check first, not a traceback in the tokenizer check
    assert evaluate_main(["--ckpt", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "index.json" in err and len(err.splitlines()) == 1, err
    # data from another tokenizer than the training run's
    (tmp_path / "index.json").write_text(json.dumps({**index, "tokenizer_sha256": "cd" * 32}))
    recorded = tmp_path / "recorded.ckpt"
    torch.save({**torch.load(ckpt, weights_only=True), "run": {"tokenizer_sha256": "ab" * 32}}, recorded)
    assert evaluate_main(["--ckpt", str(recorded)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path} was tokenised with another tokenizer than the one {recorded} "
                                       f"trained with (SHA-256 cdcdcdcdcdcd, the checkpoint's abababababab)\n")
    (tmp_path / "index.json").write_text(json.dumps({**index, "tokenizer_sha256": "ab" * 32}))
    assert evaluate_main(["--ckpt", str(recorded), "--depths", "1", "--batches", "1"]) == 0
    capsys.readouterr()
    misfit = tmp_path / "misfit.ckpt"  # a compression section whose weights are another model's
    torch.save({"config": OmegaConf.to_container(OmegaConf.structured(cfg)),
                "state_dict": {f"model.{k}": v for k, v in list(model.state_dict().items())[1:]}}, misfit)
    assert evaluate_main(["--ckpt", str(misfit)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {misfit}: incompatible checkpoint: its weights do not fit its model config (Missing "
                          "key(s)") and len(err.splitlines()) == 1, err
    plain = tmp_path / "plain.ckpt"
    cfg.compression = None
    torch.save({"config": OmegaConf.to_container(OmegaConf.structured(cfg)), "state_dict": {}}, plain)
    assert evaluate_main(["--ckpt", str(plain)]) == 2
    assert "not a compressed-model checkpoint" in capsys.readouterr().err


def test_compressed_generate_command_samples_as_the_generator_does(tmp_path, capsys):
    """python -m lm.compressed_generate: the text CompressedGenerator samples for the prompt (same seed; only the
    tokenizer's pieces are drawn from a padded vocabulary), the tokenizer the checkpoint carries, and a line with the
    KV entries kept against an uncompressed cache and each compression's t; bad arguments: one line, exit 2."""
    from omegaconf import OmegaConf

    import sentencepiece as spm
    from eval_setup import prepared_corpus

    from lm.compressed_generate import main as generate_main
    from lm.run_dir import read_provenance

    data = prepared_corpus(tmp_path)
    capsys.readouterr()  # (data_prep's report)
    sp = spm.SentencePieceProcessor(model_file=str(data / "tokenizer.model"))
    cfg = tiny_config([{"type": "dense", "count": 2}], n_layers=3, d_model=32, head_dim=8, seq_len=8,
                      vocab_size=sp.get_piece_size() + 5, init_std=0.2)
    cfg.compression = CompressionConfig(layer=1, n_heads=2, prefix_len=12, ratio=0.25)
    cfg.data.path = str(tmp_path / "elsewhere")  # the tokenizer comes from the checkpoint's run record
    validate(cfg)
    torch.manual_seed(0)
    model = CompressedLM(cfg.model, cfg.compression).eval()
    ckpt = tmp_path / "c.ckpt"
    torch.save({"config": OmegaConf.to_container(OmegaConf.structured(cfg)), "run": read_provenance(data.resolve()),
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, ckpt)
    prompt = "the function returns"
    assert generate_main(["--ckpt", str(ckpt), "--prompt", prompt, "--max-new-tokens", "30", "--seed", "3"]) == 0
    out = capsys.readouterr()
    ids = sp.encode(prompt)
    tokens, cache = CompressedGenerator(model).generate(torch.tensor([ids]), 30, 1.0, seed=3, vocab=sp.get_piece_size())
    assert int(tokens.max()) < sp.get_piece_size()
    assert out.out == sp.decode(tokens[0].tolist()) + "\n"
    fed = len(ids) + 29
    assert cache.held_states() == fed % 12 + 3  # the window's states so far and the memory's t = 3 (d_model 32)
    assert out.err == (f"KV cache after {fed} tokens fed: {cache.kv_entries()} entries kept, {cache.kv_uncompressed()} in "
                       f"an uncompressed cache, plus {fed % 12 + 3} hidden states of width 32 (the window to compress "
                       f"and the memory); {len(cache.kept)} compression(s) of windows of 12 tokens, keeping t = "
                       f"{[3] * (fed // 12)}\n")
    other = tmp_path / "other.pt"  # a ratio predictor trained on another model's states (d_model 64, not 32)
    RatioPredictor(64).save(other, probe_ratio=0.25, ratios=[0.125, 0.25])
    ranged = tmp_path / "ranged.pt"  # fit on Deltas in [-0.01, 0.2]
    RatioPredictor(32).save(ranged, probe_ratio=0.25, ratios=[0.125, 0.25], delta_range=[-0.01, 0.2])
    diverged = tmp_path / "nan.ckpt"
    weights = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    next(v for k, v in weights.items() if k.endswith("weight")).fill_(float("nan"))
    torch.save({**torch.load(ckpt, weights_only=True), "state_dict": weights}, diverged)
    assert generate_main(["--ckpt", str(diverged), "--prompt", prompt]) == 2  # sampling raised on NaN probabilities
    assert "holds NaN/inf values (a diverged run's checkpoint)" in capsys.readouterr().err
    for args, message in [(["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
                          (["--tolerance", "0.1"], "--predictor and --tolerance go together"),
                          (["--predictor", str(other), "--tolerance", "0.1"], f"--predictor {other} reads states of "
                           f"d_model 64, {ckpt} has d_model 32"),
                          (["--temperature", "-1"], "--temperature must be finite and >= 0, got -1.0"),
                          (["--predictor", str(tmp_path / "none.pt"), "--tolerance", "0.1"], "predictor "),
                          (["--predictor", str(ranged), "--tolerance", "0.5"], "the tolerance Delta* = 0.5 is outside "
                           "the Deltas the predictor was fit on [-0.01, 0.2] nats/token"),
                          (["--prompt", ""], "--prompt encodes to no tokens")]:
        assert generate_main(["--ckpt", str(ckpt), "--prompt", prompt, *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
