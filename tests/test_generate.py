"""Incremental decoding with the KV cache (lm/generate.py) against full forward passes.

For every causal head type: prefill a prompt, then decode token by token; the logits of every step
must equal the full forward pass over the same tokens: max-abs <= 1e-4 relative to the logits' max
magnitude (fp32; measured ~1e-7). The cache holds only what the head type keeps, checked against the
analytic KV count (MoSA Table 2). Compiled decoding (decode_step) captures one graph that serves every
step, for every head type, and gives the eager steps' logits.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import spy_on_compile, tiny_config
from heads import commit_states
from lm.generate import (cache_nbytes, cached_logits, decode_step, generate, kv_bytes_analytic,
                         new_cache, sample)
from lm.model import build_model
from tests.head_checks import decodable_types, tiny_options

T = 45  # = seq_len, so MoSAIC's padded tail and capacities are reached inside the sequence
DECODED = {  # hand-picked decoding cases: options and head counts chosen for T = 45
    "dense": [{"type": "dense", "count": 2}],
    "local": [{"type": "local", "count": 2, "options": {"window": 6}}],
    "fixed": [{"type": "dense", "count": 1}, {"type": "fixed", "count": 2, "options": {"sparsity": 4}}],
    "mosa": [{"type": "dense", "count": 1}, {"type": "mosa", "count": 3, "options": {"sparsity": 4}}],
    "mosa_keep_first": [{"type": "dense", "count": 1},
                        {"type": "mosa", "count": 3, "options": {"sparsity": 4, "keep_first": True}}],
    **{f"mosa_{s}": [{"type": "dense", "count": 1}, {"type": "mosa", "count": 3, "options": {"sparsity": 4, "selection": s}}]
       for s in ("quota", "predictor")},
    **{f"mosaic_{p}_rho{r}": [{"type": "dense", "count": 1},
                              {"type": "mosaic", "count": 4, "options": {"sparsity": r, "padded": p}}]
       for p in ("include", "identity", "ignore") for r in (2, 8)},
    **{f"mosaic_gate_{g}": [{"type": "dense", "count": 1},
                            {"type": "mosaic", "count": 4, "options": {"sparsity": 2, "top_s": 2, "gate": g}}]
       for g in ("renorm", "sigmoid")},
    # block landmarks: blocks of 4-5 rows, so decoding crosses several block ends; k > b for young experts
    "agent": [{"type": "dense", "count": 1},
              {"type": "agent", "count": 2, "options": {"block": 5, "window": 3, "dwc": 4, "bias": 3}}],
    "mita": [{"type": "dense", "count": 1}, {"type": "mita", "count": 3, "options": {"block": 4, "k": 6, "s": 2}}],
    "mita_2blocks": [{"type": "dense", "count": 1},
                     {"type": "mita", "count": 2, "options": {"block": 4, "k": 5, "s": 2, "local_blocks": 2}}],
    "mita_route_only": [{"type": "dense", "count": 1},
                        {"type": "mita", "count": 2, "options": {"block": 5, "k": 3, "s": 1, "shared": False}}],
    "topk": [{"type": "dense", "count": 1}, {"type": "topk", "count": 2, "options": {"k": 6, "chunk": 8}}],
    # capacity 6 of 45 tokens in 4 clusters: full clusters turn tokens away inside the sequence
    "routing": [{"type": "dense", "count": 1},
                {"type": "routing", "count": 2, "options": {"sparsity": 4, "capacity_factor": 0.5}}],
    "routing_raw": [{"type": "dense", "count": 1},
                    {"type": "routing", "count": 2, "options": {"sparsity": 3, "layer_norm": False}}],
}


# the types whose cache keeps the tokens their selection admits (at most kv_per_head); every other type's holds exactly
# kv_per_head entries after T tokens
SELECTIVE = ("mosa", "mosaic", "routing")


def types_in(*mixes: list[dict]) -> set[str]:
    """The head types of some head mixes."""
    return {g["type"] for heads in mixes for g in heads}


# every decodable type is decoded: in its hand-picked cases, or else beside a dense head with its example options
CAUSAL_TYPES = {**DECODED, **{t: [{"type": "dense", "count": 1}, {"type": t, "count": 3, "options": tiny_options(t)}]
                              for t in sorted(decodable_types() - types_in(*DECODED.values()))}}
# agent at 1: its first decoding steps read the depthwise convolution's zero padding (fewer than dwc - 1 tokens)
PREFILLS = {"dense": (1, 17), "mosaic_include_rho2": (1, 17), "routing": (1, 17),  # default (17,); 3 = shorter than a block
            "mosa": (1, 17), "agent": (1, 3, 17), "mita": (3, 17), "mita_2blocks": (3, 9, 17), "mita_route_only": (3, 17)}


def model_for(heads: list[dict], seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    model = build_model(tiny_config(heads, seq_len=T, init_std=0.3, n_layers=layers).model)
    for name, p in model.named_parameters():
        if name.endswith("agent_bias"):  # the agent biases start at 0; decode with non-zero ones
            torch.nn.init.normal_(p, std=1.0)
    model.train()(torch.randint(0, 97, (4, T)))
    commit_states(model)  # sets MoSA's running thresholds from data
    return model.eval()


def assert_decoding_matches(model, tokens: torch.Tensor, prefill: int):
    """cached_logits(model, tokens, prefill) equals the full forward pass (the module doc's tolerance); the cache."""
    with torch.no_grad():
        full = model(tokens)
    inc, cache = cached_logits(model, tokens, prefill)
    assert (inc - full).abs().max().item() <= 1e-4 * full.abs().max().item(), f"prefill {prefill}"
    return cache


@pytest.mark.parametrize("name", sorted(CAUSAL_TYPES))
def test_incremental_decoding_matches_full_forward(name: str) -> None:
    """Three token draws: a selection decided by a threshold must not hinge on one draw (MoSA's tau once equalled
    a staged logit exactly, and a one-float-step difference between the passes flipped a token in most draws)."""
    model = model_for(CAUSAL_TYPES[name])
    for draw in range(3):
        tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(draw))
        for prefill in PREFILLS.get(name, (17,)):
            cache = assert_decoding_matches(model, tokens, prefill)
    for block, caches in zip(model.blocks, cache):
        for g, c in zip(block.attn.groups, caches):
            if g.type_name in SELECTIVE:  # a sparse cache: some tokens kept, never all of them
                fill = getattr(c, "kv", c).fill
                assert 0 < int(fill.sum()) and int(fill.max()) < T


@pytest.mark.parametrize("name", sorted(CAUSAL_TYPES))
def test_decoding_under_bf16_autocast_matches_its_full_forward(name: str) -> None:
    """Under bf16 autocast (GPU training's precision) keys, values and queries arrive in bf16 at caches allocated in the
    parameters' fp32: every write casts (in-place index writes do not, and raised a dtype error at the first token).
    Decoding then differs from the bf16 full pass by rounding and the odd flipped selection: at most twice what bf16
    changes in the full pass itself (relative RMS against fp32; measured: 0 to 1.1x)."""
    model = model_for(CAUSAL_TYPES[name])
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            full = model(tokens).float()
            inc = cached_logits(model, tokens, 17)[0].float()

    def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()

    assert rel_rms(inc, full) <= 2 * rel_rms(full, exact)


@pytest.mark.parametrize("name", sorted(CAUSAL_TYPES))
def test_decoding_past_the_training_length_matches_full_forward(name: str) -> None:
    """2T + 7 tokens, prefills inside and past the training length: whatever a head type does there
    (BEYOND_TRAINING), its decoding does what its full pass does."""
    model = model_for(CAUSAL_TYPES[name])
    tokens = torch.randint(0, 97, (2, 2 * T + 7), generator=torch.Generator().manual_seed(5))
    for prefill in (17, T + 15):
        assert_decoding_matches(model, tokens, prefill)


@pytest.mark.parametrize("name", sorted(CAUSAL_TYPES))
def test_compiled_decoding_is_one_graph_for_every_step(name: str) -> None:
    """fullgraph=True and static shapes: one capture serves all 28 steps (a graph break raises, a recompile
    counts a second frame); the captured graph, run eagerly, gives the eager steps' logits."""
    from torch._dynamo.testing import CompileCounter

    model = model_for(CAUSAL_TYPES[name])
    tokens = torch.randint(0, 97, (2, T))
    eager, _ = cached_logits(model, tokens, 17)
    torch.compiler.reset()
    counter = CompileCounter()
    compiled, cache = cached_logits(model, tokens, 17, step=decode_step(model, backend=counter))
    assert counter.frame_count == 1
    assert (compiled - eager).abs().max().item() <= 1e-5 * eager.abs().max().item()


def test_inductor_decoding_of_every_head_type_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """One model holding every decodable head type (with hand-picked options, or else its example options),
    compiled by inductor (generated code, torch.cond for the block landmarks), float64 so that no selection flips
    on rounding: the same logits as eager decoding (on torch < 2.13 without kernel fusion, INDUCTOR_OPTIONS: with
    fusion, 2.11 is off by 0.1-0.6 relative on such models)."""
    heads = [{"type": "dense", "count": 1}, {"type": "local", "count": 1, "options": {"window": 6}},
             {"type": "fixed", "count": 1, "options": {"sparsity": 4}}, {"type": "mosa", "count": 2, "options": {"sparsity": 4}},
             {"type": "mosaic", "count": 2, "options": {"sparsity": 2}},
             {"type": "agent", "count": 1, "options": {"block": 5, "window": 3, "bias": 3}},
             {"type": "mita", "count": 2, "options": {"block": 4, "k": 6, "s": 2}}, DECODED["topk"][1]]
    heads += [{"type": t, "count": 1, "options": tiny_options(t)} for t in sorted(decodable_types() - types_in(heads))]
    model = model_for(heads, layers=1).double()  # one layer: inductor's compile time grows with the graph
    tokens = torch.randint(0, 97, (2, T))
    eager, _ = cached_logits(model, tokens, 17)
    torch.compiler.reset()
    from torch._dynamo.utils import counters

    backends = spy_on_compile(monkeypatch)
    counters.clear()
    compiled, _ = cached_logits(model, tokens, 17, step=decode_step(model))
    assert backends == ["inductor"] and counters["stats"]["unique_graphs"] >= 1  # inductor compiled the steps
    assert (compiled - eager).abs().max().item() <= 1e-9 * eager.abs().max().item()


def _caches(cache):
    for layer in cache:
        for c in layer:
            yield getattr(c, "kv", c)


@pytest.mark.parametrize("name", ["dense", "local", "fixed", "mosa", "mosa_quota", "mosaic_include_rho8", "routing",
                                  "routing_raw"])
def test_cache_bytes_match_the_analytic_kv_count(name: str) -> None:
    """K and V slots allocated = kv_total(T) x 2 x head_dim x 4 bytes per sequence; on top, exactly an int32
    position per slot and an int64 fill counter per cache row (a head; a Routing head's ρ clusters), and MoSAIC's
    int64 slot counter per head, counted here from the config."""
    model = model_for(CAUSAL_TYPES[name])
    cache = new_cache(model, batch=3, max_len=T)
    kv_only = sum(c.k.nbytes + c.v.nbytes for c in _caches(cache))
    assert kv_only == 3 * kv_bytes_analytic(model, T)
    groups = [g for layer in range(model.cfg.n_layers) for g in model.cfg.mix(layer)]
    rows = sum(g.count * (g.options.get("sparsity", 1) if g.type == "routing" else 1) for g in groups)
    counters = sum(g.count for g in groups if g.type == "mosaic")
    slots = kv_only // (2 * model.cfg.head_dim * 4)  # over sequences, heads and layers
    assert cache_nbytes(cache) == kv_only + 4 * slots + 8 * 3 * rows + 8 * 3 * counters


@pytest.mark.parametrize("name", sorted(CAUSAL_TYPES))
def test_a_full_cache_holds_the_analytic_kv_count(name: str) -> None:
    """After T decoded tokens, the entries each head type's cache stores (keys/values, plus agent / landmark pairs)
    equal the analytic count flops/ and Table 2-style KV numbers use (kv_per_head): at most that for the SELECTIVE
    types (the tokens their selection admitted), exactly that for every other; and the cache allocates at least
    that many slots. Every decodable type, so that a new type's kv_per_head is checked against its cache."""
    from lm.generate import cache_fill

    model = model_for(CAUSAL_TYPES[name])
    _, cache = cached_logits(model, torch.randint(0, 97, (2, T)), 17)
    for type_name, (stored, slots) in cache_fill(model, cache).items():
        analytic = 2 * sum(g.kv_entries(T) for g in model.head_groups() if g.type_name == type_name)
        assert (stored <= analytic if type_name in SELECTIVE else stored == analytic) and analytic <= slots, type_name


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 2.0])
def test_routing_stores_at_most_its_analytic_kv_count(capacity_factor: float) -> None:
    """A Routing head stores each token in one cluster at most, and a cluster at most its capacity: min(T, ρ x
    capacity) entries (it counted T whatever the capacity); its clusters allocate ρ x capacity slots, more than it
    stores when capacity_factor > 1, and lm.generate's memory check counts those."""
    from lm.generate import cache_fill

    model = model_for([{"type": "routing", "count": 2, "options": {"sparsity": 3, "capacity_factor": capacity_factor}}])
    per_head = min(T, 3 * math.ceil(capacity_factor * (T // 3)))
    assert model.kv_total(T) == model.cfg.n_layers * 2 * per_head
    _, cache = cached_logits(model, torch.randint(0, 97, (2, T)), 17)
    (stored, slots), = cache_fill(model, cache).values()
    assert stored <= 2 * model.kv_total(T) and slots == 2 * model.cfg.n_layers * 2 * 3 * math.ceil(capacity_factor * 15)
    meta = new_cache(model, 1, T, device="meta")
    assert cache_nbytes(meta) == cache_nbytes(new_cache(model, 1, T))
    kv_slots = sum(c.k.nbytes + c.v.nbytes for c in _caches(meta))
    assert (kv_slots > kv_bytes_analytic(model, T)) == (capacity_factor > 1)


def test_non_causal_heads_refuse_to_decode() -> None:
    for heads in ([{"type": "mosaic", "count": 4, "options": {"priority": "random"}}],
                  [{"type": "mosa", "count": 4, "options": {"selection": "expert_choice"}}],
                  [{"type": "routing", "count": 2, "options": {"assignment": "topk"}}],
                  [{"type": "agent", "count": 2, "options": {"block": 8, "variant": "published"}}],
                  [{"type": "mita", "count": 2, "options": {"block": 8, "k": 8, "variant": "published"}}]):
        with pytest.raises(ValueError, match="not causal"):
            new_cache(model_for(heads), 1, T)


def test_sampling_controls() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, temperature=0).item() == 1
    assert sample(logits, temperature=0, top_k=2).item() == 1 and sample(logits, temperature=0, top_p=0.5).item() == 1
    assert all(sample(logits, top_k=1, generator=g).item() == 1 for _ in range(20))
    assert all(sample(logits, top_p=0.05, generator=g).item() == 1 for _ in range(20))
    drawn = {sample(logits, top_k=2, generator=g).item() for _ in range(200)}
    assert drawn == {1, 3}
    # p = .024, .479, .065, .433: the nucleus of 0.6 is {1, 3}, of 0.95 {1, 2, 3}
    assert {sample(logits, top_p=0.6, generator=g).item() for _ in range(200)} == {1, 3}
    assert {sample(logits, top_p=0.95, generator=g).item() for _ in range(400)} == {1, 2, 3}
    # the nucleus is taken of the tempered distribution: at temperature 3, p = .129, .351, .180, .340 and the
    # nucleus of 0.75 is {1, 3, 2}; untempered (.479 + .433 before token 2) it would be {1, 3}
    assert {sample(logits, top_p=0.75, generator=g).item() for _ in range(400)} == {1, 3}
    assert {sample(logits, temperature=3.0, top_p=0.75, generator=g).item() for _ in range(400)} == {1, 2, 3}


@pytest.mark.parametrize("temperature,probs", [(2.0, (0.1863, 0.3072, 0.5065)), (0.5, (0.0159, 0.1173, 0.8668)),
                                               (1.0, (0.0900, 0.2447, 0.6652))])
def test_sampling_draws_from_the_softmax_at_the_temperature(temperature: float, probs: tuple) -> None:
    """Logits (0, 1, 2) at temperature tau are drawn with probabilities e^(l/tau) / sum, written out here; 20000
    seeded draws land within 0.01 (3.5 standard deviations) of each."""
    drawn = sample(torch.tensor([[0.0, 1.0, 2.0]]).expand(20000, 3), temperature,
                   generator=torch.Generator().manual_seed(0))
    assert drawn.bincount(minlength=3).float().div(20000).tolist() == pytest.approx(probs, abs=0.01)


def test_greedy_generation_agrees_with_full_forward() -> None:
    model = model_for(CAUSAL_TYPES["mosaic_include_rho2"])
    prompt = torch.randint(0, 97, (2, 5))
    out = generate(model, prompt, max_new_tokens=20, temperature=0)
    assert out.shape == (2, 25) and torch.equal(out[:, :5], prompt)
    with torch.no_grad():
        greedy = model(out[:, :-1]).argmax(-1)[:, 4:]
    assert torch.equal(greedy, out[:, 5:])


def test_a_finished_sequence_pads_with_the_stop_id_and_the_mode_is_restored() -> None:
    """With stop_id, a sequence that produced it gets only stop_id after it (the others go on as without
    stop_id); generate leaves a training model in training mode; bad arguments are one line."""
    model = model_for(CAUSAL_TYPES["mosa"])
    prompt = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(0))
    free = generate(model, prompt, 12, generator=torch.Generator().manual_seed(1))
    stop = int(free[0, 7])  # row 0's third new token
    out = generate(model.train(), prompt, 12, generator=torch.Generator().manual_seed(1), stop_id=stop)
    assert model.training
    for row, ref in zip(out, free):
        ends = (ref[5:] == stop).nonzero()
        if len(ends):  # up to its stop the row is unchanged, then padding
            e = 5 + int(ends[0])
            assert torch.equal(row[: e + 1], ref[: e + 1]) and bool((row[e:] == stop).all())
        else:
            assert torch.equal(row, ref[: len(row)])
    assert not all((ref[5:] == stop).any() for ref in free)  # a row that never stops ...
    assert out.shape == free.shape  # ... so generation runs to max_new_tokens
    greedy = generate(model, prompt, 4, temperature=0)
    for dtype in (torch.uint16, torch.int16, torch.uint8, torch.int32):  # uint16: data_prep's token dtype
        assert torch.equal(generate(model, prompt.to(dtype), 4, temperature=0), greedy)
    for bad_prompt, n in ((prompt[:, :0], 3), (prompt, -1)):
        with pytest.raises(ValueError, match="^generate: need a prompt of at least one token and max_new_tokens >= 0"):
            generate(model, bad_prompt, n)
    for bad_prompt, message in ((prompt[0], r"the prompt must be a \[batch, tokens\] tensor of integer token ids, "
                                            r"got shape \[5\]"),
                                (prompt.float(), "the prompt must be .* got shape \\[3, 5\\] of torch.float32$"),
                                (prompt.masked_fill(prompt == prompt[1, 2], 97),
                                 r"prompt token id 97 is outside the model's vocabulary \[0, 97\)$"),
                                (prompt - 100, r"prompt token id -\d+ is outside")):
        with pytest.raises(ValueError, match=f"^generate: {message}"):
            generate(model, bad_prompt, 3)
    with pytest.raises(ValueError, match=r"^generate: the prompt holds no sequences \(batch size 0\)$"):
        generate(model, prompt[:0], 3)  # (its range check crashed on the empty tensor)
    for setting, message in (({"top_p": 0.0}, "top_p must be in"), ({"top_p": -1.0}, "top_p must be in"),
                             ({"temperature": -1.0}, "temperature must be finite"),
                             ({"temperature": float("nan")}, "temperature must be finite"),
                             ({"top_k": -3}, "top_k must be >= 0")):
        with pytest.raises(ValueError, match=f"^{message}"):
            generate(model, prompt, 3, **setting)


@pytest.mark.parametrize("name", ["dense", "topk", "mosa", "mita", "mosaic_include_rho2"])
def test_generate_takes_only_a_new_cache_for_its_batch(name: str) -> None:
    """A cache that already holds a generation would be read as the prompt's past (dense and top-k accept several
    tokens per call, so nothing else would notice); one for another batch size fails deep inside a head."""
    model = model_for(CAUSAL_TYPES[name])
    prompt = torch.randint(0, 97, (2, 5))
    cache = new_cache(model, 2, 20)
    generate(model, prompt, 3, cache=cache)
    for used in (cache, new_cache(model, 1, 20)):
        with pytest.raises(ValueError, match=r"^generate: `cache` must be new, for the prompt's 2 sequences"):
            generate(model, prompt, 3, cache=used)


@pytest.mark.parametrize("name", sorted(CAUSAL_TYPES))
def test_generate_refuses_a_cache_too_short_for_the_tokens_fed(name: str) -> None:
    """A short cache was taken: local heads' ring buffer overwrote keys inside the window, MoSA and Routing
    heads stopped admitting tokens, so the generation changed without a word. A longer cache is fine."""
    model = model_for(CAUSAL_TYPES[name])
    prompt = torch.randint(0, 97, (2, 4), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"^generate: `cache` must be new, .* and for 33 tokens"):
        generate(model, prompt, 30, temperature=0, cache=new_cache(model, 2, 5))
    assert torch.equal(generate(model, prompt, 30, temperature=0, cache=new_cache(model, 2, 40)),
                       generate(model, prompt, 30, temperature=0))


def test_cli_reports_a_full_dense_cache(tmp_path, capsys) -> None:
    """The cache holds the tokens fed, every token but the last sampled one: a dense head's slots are all used."""
    from lm.generate import main

    ckpt, cfg = _checkpoint(tmp_path)
    assert main(["--ckpt", str(ckpt), "--prompt", "the cat", "--max-new-tokens", "6", "--temperature", "0"]) == 0
    report = capsys.readouterr().err
    fed = int(report.split("after the ")[1].split()[0])
    dense = cfg.model.n_layers * fed  # one dense head per layer
    assert f"dense {dense}/{dense} (100%)" in report and f"kv_total({fed})" in report, report


def _checkpoint(tmp_path, vocab: int = 60, model_vocab: int | None = None, heads: list[dict] | None = None):
    """A train_lm.py-style checkpoint (config + 'model.'-prefixed state dict) and its tokenizer of `vocab`
    pieces; `model_vocab`: the model's vocabulary (default `vocab`)."""
    import sentencepiece as spm
    from omegaconf import OmegaConf

    data = tmp_path / "data"
    data.mkdir()
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "home", "tree", "big"]
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(words[i] for i in torch.randint(0, len(words), (12,), generator=g).tolist()) for _ in range(300)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(data / "tokenizer"),
                                   vocab_size=vocab, model_type="bpe", minloglevel=2)
    cfg = tiny_config(heads or [{"type": "dense", "count": 1}, {"type": "mosaic", "count": 4}], vocab_size=model_vocab or vocab)
    cfg.data.path = str(data)
    model = build_model(cfg.model)
    ckpt = tmp_path / "last.ckpt"
    torch.save({"config": OmegaConf.to_container(OmegaConf.structured(cfg)),
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, ckpt)
    return ckpt, cfg


def test_cli_sampling_flags_reach_the_sampler(tmp_path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """--temperature, --top-k, --top-p and --seed decode as `generate` does with them and a generator seeded so;
    another seed draws otherwise; --top-k 1 is greedy; --compile decodes through `decode_step`."""
    import lm.generate as gen
    from lm.generate import main
    from lm.loading import load_for_generation

    ckpt, _ = _checkpoint(tmp_path)
    model, sp, _ = load_for_generation(str(ckpt))
    prompt = torch.tensor([sp.encode("the cat")])

    def cli(*flags: str) -> str:
        assert main(["--ckpt", str(ckpt), "--prompt", "the cat", "--max-new-tokens", "12", *flags]) == 0
        return capsys.readouterr().out.rstrip("\n")

    def direct(*args: object) -> str:
        return sp.decode(generate(model, prompt, 12, *args, stop_id=sp.eos_id(), vocab=sp.get_piece_size())[0].tolist())

    flags = ["--temperature", "2", "--top-k", "20", "--top-p", "0.9"]
    assert cli(*flags, "--seed", "3") == direct(2.0, 20, 0.9, torch.Generator().manual_seed(3))
    assert cli(*flags, "--seed", "3") != cli(*flags, "--seed", "4")
    assert cli("--top-k", "1") == cli("--temperature", "0") == direct(0.0)
    compiled: list[str] = []
    monkeypatch.setattr(gen, "decode_step", lambda m, backend="inductor": compiled.append(backend) or m)
    assert cli("--temperature", "0", "--compile") == direct(0.0) and compiled == ["inductor"]


@pytest.mark.parametrize("heads", [None, [{"type": "dense", "count": 1}, {"type": "routing", "count": 2,
                                                                             "options": {"sparsity": 4}}]],
                         ids=["mosaic", "routing"])
def test_cli_samples_from_a_checkpoint(tmp_path, capsys, heads) -> None:
    from lm.generate import main

    ckpt, _ = _checkpoint(tmp_path, heads=heads)
    assert main(["--ckpt", str(ckpt), "--prompt", "the cat", "--max-new-tokens", "8", "--top-k", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("the cat") and (heads is None or "routing " in captured.err)


def test_cli_encodes_the_prompt_as_training_encoded_text(tmp_path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompt is fed as data_prep encoded the training text: lines joined by the newline token, a literal
    U+2581 as its UTF-8 bytes (plain SentencePiece read it as a space: "a\u2581b" came back as "a b")."""
    import lm.generate as gen
    from data_prep.tokenizer import META_BYTE_IDS, NEWLINE_ID, encode_documents
    from eval_setup import prepared_corpus, save_checkpoint

    corpus = prepared_corpus(tmp_path / "corpus")
    ckpt, _ = save_checkpoint(tmp_path, corpus, seq_len=32)
    fed: list[list[int]] = []
    real = gen.generate
    monkeypatch.setattr(gen, "generate", lambda model, prompt, *a, **k: fed.append(prompt[0].tolist()) or real(
        model, prompt, *a, **k))
    prompt = "the cat\u2581sat\nend"
    capsys.readouterr()  # data_prep's summary line
    assert gen.main(["--ckpt", str(ckpt), "--prompt", prompt, "--max-new-tokens", "1", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith(prompt)
    sp = gen.load_for_generation(str(ckpt))[1]
    assert fed == [encode_documents(sp, [prompt], threads=1)[0][:-1].tolist()]
    assert NEWLINE_ID in fed[0] and all(i in fed[0] for i in META_BYTE_IDS)


def test_cli_errors_are_one_line(tmp_path, capsys) -> None:
    from lm.generate import main

    ckpt, cfg = _checkpoint(tmp_path)
    bad = tmp_path / "bad.ckpt"
    state = torch.load(ckpt, weights_only=False)
    state["config"]["model"]["d_model"] = 64  # weights no longer fit the config
    torch.save(state, bad)
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    diverged = tmp_path / "nan.ckpt"  # loads, but its samples would be a traceback from torch.multinomial
    state = torch.load(ckpt, weights_only=False)
    name = next(k for k in state["state_dict"] if k.endswith("attn.groups.0.qkv.weight"))
    state["state_dict"][name][0, 0] = float("nan")
    torch.save(state, diverged)
    assert main(["--ckpt", str(diverged), "--prompt", "the"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {diverged}: {name.removeprefix('model.')} (dense heads) holds NaN/inf values")
    assert main(["--ckpt", str(ckpt), "--prompt", "the", "--seed", str(2**64)]) == 2
    assert capsys.readouterr().err == f"error: --seed must be in [-2**63, 2**64), got {2**64}\n"
    (tmp_path / "data" / "tokenizer.model").rename(tmp_path / "tok.model")
    cases = [(tmp_path / "missing.ckpt", "checkpoint not found"), (junk, "truncated or not a torch file"),
             (bad, "incompatible checkpoint"), (ckpt, "tokenizer not found")]
    for path, message in cases:
        assert main(["--ckpt", str(path), "--prompt", "the"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_a_padded_vocabulary_is_never_sampled() -> None:
    """Ids the tokenizer lacks (a model vocabulary padded beyond its pieces) are never drawn, whatever the
    sampling settings, and greedy decoding takes the best id the tokenizer has."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[:, 20:] += 100  # the padded ids would win every draw
    g = torch.Generator().manual_seed(1)
    for kw in ({"temperature": 0}, {}, {"top_k": 40}, {"top_p": 0.99}, {"temperature": 5.0}):
        assert all(bool((sample(logits, generator=g, vocab=20, **kw) < 20).all()) for _ in range(20)), kw
    assert torch.equal(sample(logits, temperature=0, vocab=20), logits[:, :20].argmax(-1))
    out = generate(model_for(CAUSAL_TYPES["dense"]), torch.randint(0, 10, (2, 4)), 30, generator=g, vocab=10)
    assert bool((out < 10).all())
    for bad in (0, -1):  # -1 sliced away the last id without a word; 0 failed deep in argmax / multinomial
        with pytest.raises(ValueError, match=f"^sample: vocab must be >= 1, got {bad}$"):
            sample(logits, vocab=bad)


def test_cli_decodes_a_model_with_a_padded_vocabulary(tmp_path, capsys) -> None:
    """model.vocab_size 200 over a 60-piece tokenizer, as training allows: loads, and every sampled id decodes."""
    from lm.generate import main

    ckpt, _ = _checkpoint(tmp_path, model_vocab=200)
    assert main(["--ckpt", str(ckpt), "--prompt", "the cat", "--max-new-tokens", "30", "--temperature", "2"]) == 0
    assert capsys.readouterr().out.startswith("the cat")


def test_tokenizer_must_be_the_checkpoints(tmp_path) -> None:
    """A tokenizer file other than the one the checkpoint records (SHA-256), a file that is no SentencePiece
    model, and a tokenizer larger than the model are one-line ValueErrors; a copy of the right one loads."""
    import hashlib
    import shutil

    from lm.loading import load_for_generation

    ckpt, _ = _checkpoint(tmp_path)
    proto = (tmp_path / "data" / "tokenizer.model").read_bytes()
    state = torch.load(ckpt, weights_only=False)
    carried, recorded = tmp_path / "carried.ckpt", tmp_path / "recorded.ckpt"
    torch.save({**state, "run": {"tokenizer_model": proto, "tokenizer_sha256": hashlib.sha256(proto).hexdigest()}},
               carried)
    torch.save({**state, "run": {"tokenizer_model": None, "tokenizer_sha256": hashlib.sha256(proto).hexdigest()}},
               recorded)
    other = tmp_path / "other"
    other.mkdir()
    small, _ = _checkpoint(other, vocab=50)  # another tokenizer (50 pieces)
    shutil.copy(tmp_path / "data" / "tokenizer.model", tmp_path / "copy.model")
    (tmp_path / "notes.md").write_text("# not a tokenizer\n")
    for path in (carried, recorded):
        assert load_for_generation(path, tmp_path / "copy.model")[1].serialized_model_proto() == proto
        with pytest.raises(ValueError, match=f"tokenizer {other}/data/tokenizer.model is not the one {path} was "
                                             r"trained with \(SHA-256 [0-9a-f]{12}, the checkpoint's [0-9a-f]{12}\)"):
            load_for_generation(path, other / "data" / "tokenizer.model")
        with pytest.raises(ValueError, match=f"^tokenizer {tmp_path}/notes.md is not a SentencePiece model$"):
            load_for_generation(path, tmp_path / "notes.md")
    (tmp_path / "data" / "tokenizer.model").write_bytes((other / "data" / "tokenizer.model").read_bytes())
    with pytest.raises(ValueError, match="is not the one"):  # the default <data.path>/tokenizer.model, replaced
        load_for_generation(recorded)
    with pytest.raises(ValueError, match=f"^tokenizer {tmp_path}/copy.model has 60 pieces, more than "
                                         "model.vocab_size 50$"):
        load_for_generation(small, tmp_path / "copy.model")


def test_cache_fill_counts_the_entries_stored() -> None:
    """Measured fill next to the slots: dense and agent/MiTA store every token (plus a landmark per
    block), local at most its window, MoSA only what its threshold selected (counted from the slots'
    positions, independently of the fill counters)."""
    from lm.generate import cache_fill

    for name, expect in (("dense", {"dense": (2 * 2 * 2 * T, 2 * 2 * 2 * T)}),
                         ("local", {"local": (2 * 2 * 2 * 6, 2 * 2 * 2 * 6)}),
                         ("mita", {"dense": (2 * 2 * 1 * T, 2 * 2 * 1 * T),
                                   "mita": (2 * 2 * 3 * (T + T // 4), 2 * 2 * 3 * (T + T // 4))})):
        _, cache = cached_logits(model_for(CAUSAL_TYPES[name]), torch.randint(0, 97, (2, T)), 17)
        assert cache_fill(model_for(CAUSAL_TYPES[name]), cache) == expect, name
    model = model_for(CAUSAL_TYPES["mosa"])
    _, cache = cached_logits(model, torch.randint(0, 97, (2, T)), 17)
    stored, slots = cache_fill(model, cache)["mosa"]
    assert stored == sum(int((layer[1].pos >= 0).sum()) for layer in cache)
    assert 0 < stored < slots == sum(layer[1].pos.numel() for layer in cache)


def test_generating_past_the_training_length_warns_once(capsys: pytest.CaptureFixture[str]) -> None:
    model = model_for(CAUSAL_TYPES["mosa"])
    generate(model, torch.randint(0, 97, (1, 5)), max_new_tokens=T - 4, temperature=0)
    assert capsys.readouterr().err == ""  # T + 1 tokens, T fed (the last is sampled, never fed): silent
    generate(model, torch.randint(0, 97, (1, 5)), max_new_tokens=T, temperature=0)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"warning: generating {T + 5} tokens, past the training length {T}: dense attends to every "
                     "token, at rotary positions never seen in training; mosa adds no token once its capacity "
                     "slots (sized for the training length) are full"]


def test_every_type_with_a_kv_cache_is_decoded_here_and_says_what_it_does_past_the_training_length() -> None:
    """Every decodable type is in CAUSAL_TYPES (decoding == forward, compiled decoding) and states its own
    beyond_training: a subclass inherits its parent's cache code, not its behaviour (top-k is not dense there)."""
    from heads import REGISTRY

    decodable = decodable_types()
    assert decodable <= types_in(*CAUSAL_TYPES.values())
    for name, cls in REGISTRY.items():
        if name in decodable:
            assert "beyond_training" in vars(cls) and cls.beyond_training, f"{name} does not state beyond_training"
        else:
            assert cls.beyond_training == "", name


def test_a_tiny_temperature_samples_the_argmax_instead_of_nan() -> None:
    """logits / 1e-30 overflows to inf (and softmax to nan) unless the logits are shifted first."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 0.01  # near-equal: only tau picks
    for temperature in (1e-30, 1e-45):
        assert torch.equal(sample(logits, temperature, generator=torch.Generator().manual_seed(1)), logits.argmax(-1))


def test_register_refuses_a_head_that_would_decode_with_its_parents_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DenseHeads subclass with attention of its own (here an unimplemented stand-in) that inherited dense decoding
    would generate with dense attention, unlike its forward: @register refuses it, and a class that decodes halfway
    (forward_cached refused, dense's new_cache kept). Refusing both registers."""
    import heads.base
    from heads import HeadGroup
    from heads.dense import DenseHeads

    monkeypatch.setattr(heads.base, "REGISTRY", {})  # the real registry stays as it is

    class Biased(DenseHeads):
        def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            raise NotImplementedError

    class HalfDecoding(Biased):
        forward_cached = HeadGroup.forward_cached

    class Refusing(HalfDecoding):
        new_cache = HeadGroup.new_cache

    with pytest.raises(RuntimeError, match=r"^head type 'biased': Biased defines forward_reference but would decode "
                                           r"with DenseHeads\.forward_cached; define forward_cached"):
        heads.base.register("biased")(Biased)
    with pytest.raises(RuntimeError, match=r"^head type 'half': HalfDecoding must both decode"):
        heads.base.register("half")(HalfDecoding)
    assert heads.base.register("refusing")(Refusing) is Refusing and list(heads.base.REGISTRY) == ["refusing"]


def test_generation_ends_once_every_sequence_has_stopped() -> None:
    """When every row has produced stop_id, generate returns at once, shorter than max_new_tokens: each row as without
    stop_id up to its stop, then padding."""
    model = model_for(CAUSAL_TYPES["dense"])
    prompt = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(3))
    free = generate(model, prompt, 12, temperature=0)
    stop = int(free[0, 7])  # row 0's third new token, which row 1 produces as its second (measured)
    ends = [5 + int((row[5:] == stop).nonzero()[0]) for row in free]
    assert ends == [7, 6]
    out = generate(model, prompt, 12, temperature=0, stop_id=stop)
    assert out.shape == (2, 8)
    for row, ref, end in zip(out, free, ends):
        assert torch.equal(row[: end + 1], ref[: end + 1]) and bool((row[end:] == stop).all())


def _tensors(obj: object) -> list[torch.Tensor]:
    """Every tensor a cache object holds, through its attributes, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return [t for value in getattr(obj, "__dict__", {}).values() for t in _tensors(value)]


@pytest.mark.parametrize("name", sorted(CAUSAL_TYPES))
def test_cache_nbytes_counts_every_tensor_the_cache_holds(name: str) -> None:
    """cache_nbytes (lm.generate's memory check, bench.decode's cache column) is the bytes of every distinct storage
    a fresh cache holds, and after decoding: nothing allocated is left out (MiTA's and agents' block state too), and
    nothing is counted twice."""
    model = model_for(CAUSAL_TYPES[name])
    for cache in (new_cache(model, 2, T), cached_logits(model, torch.randint(0, 97, (2, T)), 17)[1]):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(cache)}
        assert cache_nbytes(cache) == sum(storages.values()) > 0


def test_every_group_that_cannot_decode_is_named_at_once() -> None:
    """A model with several non-causal groups is refused in one line naming each (only the first was named: a
    walkthrough fixed them one refusal at a time); a decodable model passes."""
    from lm.generate import check_decodable

    heads = [{"type": "mosa", "count": 2, "options": {"sparsity": 4, "selection": "expert_choice"}},
             {"type": "routing", "count": 2, "options": {"sparsity": 4, "assignment": "topk"}},
             {"type": "dense", "count": 1}]
    with pytest.raises(ValueError) as refused:
        check_decodable(build_model(tiny_config(heads).model))
    assert str(refused.value) == ("mosa: selection 'expert_choice' is not causal and cannot be decoded incrementally; "
                                  "routing: assignment 'topk' is not causal and cannot be decoded incrementally; this "
                                  "checkpoint cannot be sampled with lm.generate")
    check_decodable(build_model(tiny_config([{"type": "dense", "count": 2}]).model))
