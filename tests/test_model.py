"""The dense decoder LM (lm/model.py): shapes, fast vs reference, causality, aux losses, KV count, overfitting."""
from __future__ import annotations

import pytest
import torch

import lm
from heads.attention import attend
from heads.dense import DenseHeads
from lm.causality import future_leak
from tests.conftest import tiny_config


def build(impl: str = "fast", **model) -> lm.DecoderLM:
    cfg = tiny_config(heads=[{"type": "dense", "count": 4, "options": {"impl": impl}}], **model)
    torch.manual_seed(0)
    return lm.build_model(cfg.model)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||_2 / ||b||_2."""
    return ((a - b).norm() / b.norm()).item()


def test_shapes_and_explicit_positions() -> None:
    model = build()
    tokens = torch.randint(0, 97, (3, 50))
    logits = model(tokens)
    assert logits.shape == (3, 50, 97) and logits.dtype == torch.float32
    # default positions are 0..T-1; passing them explicitly changes nothing, shifting them does
    positions = torch.arange(50).expand(3, -1)
    assert torch.equal(model(tokens, positions), logits)
    assert not torch.allclose(model(tokens, positions + 7), logits)


@pytest.mark.parametrize("T", [100, 257])
def test_dense_fast_matches_reference_outputs_and_all_gradients(T: int) -> None:
    """Fast (SDPA) vs reference (explicit masked softmax per head), float32, same weights.
    Tolerances: relative RMS error <= 1e-5 and max-abs <= 1e-4 for logits and for every parameter's
    gradient (float32 accumulation-order differences are ~1e-6 relative)."""
    fast, ref = build("fast", seq_len=T), build("reference", seq_len=T)
    ref.load_state_dict(fast.state_dict())
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(T))
    targets = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(T + 1))
    outs = []
    for model in (fast, ref):
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        outs.append(logits)
    assert rel_rms(outs[0], outs[1]) <= 1e-5 and (outs[0] - outs[1]).abs().max() <= 1e-4
    grads_ref = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        g, g_ref = p.grad, grads_ref[name].grad
        assert g is not None and g_ref is not None, name
        assert rel_rms(g, g_ref) <= 1e-5 and (g - g_ref).abs().max() <= 1e-4, f"{name}: rel {rel_rms(g, g_ref):.1e}"


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_dense_model_is_causal(impl: str) -> None:
    model = build(impl)
    assert model.causal
    tokens = torch.randint(0, 97, (2, 64))
    for t in (0, 31, 62):
        leak = future_leak(model, tokens, t, 97)
        assert leak < 1e-5, f"t={t}: logits at <= t moved by {leak:.2e} when later tokens changed"


class BidirectionalHeads(DenseHeads):
    """A deliberately non-causal toy: dense heads without the causal mask."""

    @property
    def causal(self) -> bool:
        return False

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self._qkv(x, positions)
        return self.out(attend(q, k, v, causal=False).transpose(1, 2).reshape(B, T, -1))


def test_causality_check_detects_a_leak() -> None:
    """The shared check must be able to fail: swap one layer's group for the bidirectional toy."""
    model = build()
    block = model.blocks[1]
    toy = BidirectionalHeads(block.attn.groups[0].ctx, 4, block.attn.groups[0].options)
    toy.load_state_dict(block.attn.groups[0].state_dict())
    block.attn.groups[0] = toy
    assert not model.causal
    leak = future_leak(model, torch.randint(0, 97, (2, 64)), 31, 97)
    print(f"bidirectional toy: future_leak = {leak:.3e}")
    assert leak > 1e-3


def test_causality_check_leaves_the_models_mode_and_the_callers_rng_as_they_were() -> None:
    """The check reseeds torch only inside a forked stream, and restores the model's mode even when the model
    raises (it used to stay in the mode the check had set)."""
    model = build().eval()
    tokens = torch.randint(0, 97, (1, 16))
    torch.manual_seed(5)
    assert future_leak(model, tokens, 7, 97, training=True) == 0.0
    after_check = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_check, torch.rand(3)) and not model.training
    model.blocks[0].attn.groups[0].forward_fast = lambda x, positions: 1 / 0
    with pytest.raises(ZeroDivisionError):
        future_leak(model, tokens, 7, 97, training=True)
    assert not model.training


def test_a_cpu_causality_check_leaves_cuda_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with a GPU, checking a CPU model neither starts CUDA (forking every device's generator did) nor
    queues a reseed of its generators for when it starts (torch.manual_seed does); the check is as before."""
    model = build().eval()
    tokens = torch.randint(0, 97, (1, 16))
    leak = future_leak(model, tokens, 7, 97, training=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("get_rng_state", "set_rng_state", "manual_seed_all", "manual_seed"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name, **k: pytest.fail(f"torch.cuda.{name}"))
    assert future_leak(model, tokens, 7, 97, training=True) == leak == 0.0


class OneLeakHeads(DenseHeads):
    """Causal dense heads, except that row `dst` also receives the input of the later row `src`."""

    def __init__(self, *args, dst: int, src: int) -> None:
        super().__init__(*args)
        self.dst, self.src = dst, src

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        y = super().forward_fast(x, positions)
        return y.index_add(1, torch.tensor([self.dst]), x[:, self.src : self.src + 1])


@pytest.mark.parametrize("dst,src,t", [(20, 22, 20), (62, 63, None)])
def test_causality_check_finds_a_leak_between_two_rows(dst: int, src: int, t: int | None) -> None:
    """A leak from one later row only: row 22 into row 20 shows at t = 20 only if every token after t is resampled
    (not just t + 1); the last row into row 62 shows only at t = 62, which t = None must reach."""
    model = build()
    group = model.blocks[0].attn.groups[0]
    model.blocks[0].attn.groups[0] = OneLeakHeads(group.ctx, group.count, group.options, dst=dst, src=src)
    tokens = torch.randint(0, 97, (2, 64))
    assert future_leak(model, tokens, t, 97) > 1e-3
    assert future_leak(model, tokens, dst - 1, 97) == 0.0  # rows before dst see no later token


def test_causality_check_changes_every_later_token() -> None:
    """Every token after t is replaced by another one: in a two-token vocabulary a leak from the last row alone shows
    for every seed (a fresh draw kept the last token, and hid the leak, for half of them)."""
    model = build()
    group = model.blocks[0].attn.groups[0]
    model.blocks[0].attn.groups[0] = OneLeakHeads(group.ctx, group.count, group.options, dst=62, src=63)
    tokens = torch.randint(0, 2, (1, 64))
    assert all(future_leak(model, tokens, 62, 2, seed=seed) > 1e-3 for seed in range(8))
    with pytest.raises(ValueError, match=r"^vocab_size must be >= 2 to change a token, got 1$"):
        future_leak(model, tokens, 62, 1)


@pytest.mark.parametrize("t", [-1, 63])
def test_causality_check_needs_a_position_with_a_future(t: int) -> None:
    """t = T - 1 has no later token to resample (a leak of 0 that proves nothing); t < 0 no logits to compare."""
    with pytest.raises(ValueError, match=rf"^t must be in \[0, 63\), got {t}$"):
        future_leak(build(), torch.randint(0, 97, (2, 64)), t, 97)


@pytest.mark.timeout(10)  # without the check, stride 0 loops forever, appending windows
@pytest.mark.parametrize("first,stride,message", [
    (1, 0, r"^stride must be in 1\.\.context \(8\), got 0$"),
    (1, 9, r"^stride must be in 1\.\.context \(8\), got 9$"),
    (0, 4, r"^the first scored token needs at least one token before it \(first >= 1\)$"),
])
def test_scoring_windows_check_their_arguments(first: int, stride: int, message: str) -> None:
    """lm/scoring.py's sliding windows (lm.evaluate's); a stride past the context would skip targets."""
    from lm.scoring import windows

    with pytest.raises(ValueError, match=message):
        windows(20, first, 8, stride)


class ToyAuxHeads(DenseHeads):
    """Dense heads that report a fixed auxiliary loss, to check how the model aggregates them."""

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.aux_losses = {"toy": x.new_tensor(0.25), f"layer{self.ctx.layer}": x.new_tensor(1.0)}
        return super().forward_fast(x, positions)


def test_aux_losses_available_after_forward() -> None:
    model = build()
    model(torch.randint(0, 97, (1, 20)))
    assert model.aux_losses == {} and model.aux_loss == 0.0  # dense heads have none
    for block in model.blocks:
        g = block.attn.groups[0]
        block.attn.groups[0] = ToyAuxHeads(g.ctx, g.count, g.options)
    model(torch.randint(0, 97, (1, 20)))
    aux = model.aux_losses
    assert set(aux) == {"toy", "layer0", "layer1"}
    assert aux["toy"].item() == 0.5  # summed over the 2 layers per name
    assert float(model.aux_loss) == 2.5


@pytest.mark.parametrize("layers, heads, T", [(2, 4, 64), (3, 5, 128)])
def test_kv_total_is_layers_times_heads_times_T(layers: int, heads: int, T: int) -> None:
    cfg = tiny_config(heads=[{"type": "dense", "count": heads}], n_layers=layers, seq_len=T)
    model = lm.build_model(cfg.model)
    assert model.kv_total() == layers * heads * T
    assert model.kv_total(100) == layers * heads * 100


def test_overfits_one_batch() -> None:
    """Memorising one batch of random tokens: from ln(97) = 4.57 nats to < 0.05 in 150 Adam steps."""
    model = build()
    tokens = torch.randint(0, 97, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 4.0 and losses[-1] < 0.05, f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_forward_equals_the_architecture_written_out() -> None:
    """The whole LM in float64 against MoSA App. H's pre-LN decoder written out by hand (no RoPE here, which
    tests/test_rope.py covers): h_0 = E[x]; per layer u = h + sum_i softmax(q_i k_i^T / sqrt(h') + M) v_i W^O_i on
    LN(h), h' = u + W_down GELU(W_up LN(u)); logits = LN(h_L) W_vocab^T. Norm gains and biases are random."""
    import math

    cfg = tiny_config([{"type": "dense", "count": 2}, {"type": "dense", "count": 1}], rope_fraction=0.0, n_layers=2)
    torch.manual_seed(0)
    model = lm.build_model(cfg.model).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_()
    x = torch.randint(0, 97, (2, 13))
    d, hd = cfg.model.d_model, cfg.model.head_dim

    def ln(t: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
        mu, var = t.mean(-1, keepdim=True), t.var(-1, unbiased=False, keepdim=True)
        return (t - mu) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias

    T = x.shape[1]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    hidden = model.embed.weight[x]
    for block in model.blocks:
        a = ln(hidden, block.norm_attn)
        attn = torch.zeros_like(hidden)
        for group in block.attn.groups:
            w = group.qkv.weight.view(3, group.count, hd, d)
            wo = group.out.weight.view(d, group.count, hd)
            for i in range(group.count):
                q, k, v = a @ w[0, i].T, a @ w[1, i].T, a @ w[2, i].T
                s = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~causal, float("-inf"))
                attn = attn + s.softmax(-1) @ v @ wo[:, i].T
        hidden = hidden + attn
        f = ln(hidden, block.norm_ffn) @ block.ffn.up.weight.T
        hidden = hidden + 0.5 * f * (1 + torch.erf(f / math.sqrt(2))) @ block.ffn.down.weight.T
    want = ln(hidden, model.norm) @ model.lm_head.weight.T
    with torch.no_grad():
        got = model(x)
    assert (got - want).abs().max().item() <= 1e-10 * want.abs().max().item()


def test_every_weight_starts_at_init_std_and_every_bias_at_zero() -> None:
    """model.init_std applies to every weight of every head type, the agent heads' depthwise convolution too (its
    PyTorch default init was ~15x larger); LayerNorm keeps 1 and 0, the agent-bias tables and the MoSA predictor's
    bias their own zeros."""
    from heads import REGISTRY
    from tests.head_checks import tiny_options

    mix = [{"type": "dense", "count": 1}, *({"type": t, "count": 2, "options": tiny_options(t)}
                                           for t in REGISTRY if t != "dense")]
    torch.manual_seed(0)
    model = lm.build_model(tiny_config(mix, init_std=0.05, seq_len=32).model)
    for name, p in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, torch.nn.LayerNorm):
            continue
        if name.endswith("bias"):
            assert not p.any(), name
        elif p.numel() >= 48:  # enough draws for the spread
            assert 0.03 < p.std().item() < 0.07, (name, p.std().item())
