"""heads/kv_cache.SlotKV: a decoding step's single-token write (no index lists, no host sync) stores exactly
what the general write stores, for append-only and ring caches; a full cache refuses the entry."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from heads.base import HeadGroup
from heads import gathered_lean
from heads.kv_cache import SlotKV, gathered_prefill
from heads.rope import RotaryEmbedding
from tests.head_checks import make_group

B, H, T, D = 2, 3, 23, 4


def entries(seed: int) -> tuple[torch.Tensor, ...]:
    """keep[B, H, T] (about half kept), k, v [B, H, T, D], pos [B, H, T]."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, H, T, generator=g) < 0.5
    k, v = torch.randn(2, B, H, T, D, generator=g)
    return keep, k, v, torch.arange(T).expand(B, H, T) + 5


@pytest.mark.parametrize("ring, slots", [(False, T), (False, 14), (True, 5)])  # 14: fits ~half kept
def test_one_token_writes_equal_one_prefill_write(ring: bool, slots: int) -> None:
    keep, k, v, pos = entries(0)
    if not ring:
        keep &= keep.cumsum(-1) <= slots  # an append-only cache must not overflow
    whole, steps = (SlotKV.empty(B, H, slots, D, ring=ring) for _ in range(2))
    whole.write(keep, k, v, pos)
    for t in range(T):
        steps.write(keep[..., t : t + 1], k[..., t : t + 1, :], v[..., t : t + 1, :], pos[..., t : t + 1])
        assert steps.rows >= int(steps.fill.max().clamp(max=slots))  # the host bound attend slices by
    assert torch.equal(whole.fill, steps.fill) and torch.equal(whole.pos, steps.pos)
    assert torch.equal(whole.k, steps.k) and torch.equal(whole.v, steps.v)
    assert int((steps.pos >= 0).sum()) == steps.entries() > 0


def test_attend_sees_only_written_slots() -> None:
    """A cache whose host bound exceeds its fill (a sparse head) attends like one sliced to the fill."""
    keep, k, v, pos = entries(1)
    cache = SlotKV.empty(B, H, T, D)
    for t in range(T):
        cache.write(keep[..., t : t + 1], k[..., t : t + 1, :], v[..., t : t + 1, :], pos[..., t : t + 1])
    q, qpos = torch.randn(B, H, 1, D), torch.full((B, 1), T + 5)
    out = cache.attend(q, qpos)
    for b in range(B):
        for h in range(H):
            kk, vv = k[b, h][keep[b, h]], v[b, h][keep[b, h]]
            ref = ((q[b, h] @ kk.T) * D**-0.5).softmax(-1) @ vv if len(kk) else torch.zeros(1, D)
            torch.testing.assert_close(out[b, h], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("step", [1, 3])
def test_a_full_cache_refuses_the_entry(step: int) -> None:
    cache = SlotKV.empty(1, 2, 4, D)
    keep = torch.tensor([[True], [False]]).expand(2, step)[None]  # head 0 keeps every token, head 1 none
    kv = torch.randn(1, 2, step, D)
    written = 0
    with pytest.raises(RuntimeError, match="KV cache full: 4 slots per head"):
        for _ in range(5):
            cache.write(keep, kv, kv, torch.zeros(1, 2, step, dtype=torch.long))
            written += step
    assert written == 4 // step * step and int(cache.fill[0, 0]) == written  # the failed write stored nothing


STEPWISE = {"local": {"window": 4}, "fixed": {"sparsity": 2}, "mosa": {"sparsity": 2, "selection": "quota"},
            "mosaic": {"sparsity": 2}, "agent": {"block": 4, "window": 3}, "mita": {"block": 4, "k": 4},
            "routing": {"sparsity": 2}}


@pytest.mark.parametrize("head", sorted(STEPWISE))
def test_stepwise_heads_refuse_a_multi_token_step(head: str) -> None:
    """Heads whose cached state advances token by token (a local head's ring buffer would overwrite keys the chunk's
    earlier queries need; MoSA's and fixed heads' single-slot writes would fold the tokens into the features)
    refuse a chunk after the prefill with one line; single steps go on."""
    group = make_group(head, STEPWISE[head], 16, count=2)
    cache = group.new_cache(2, 16)
    x, positions = torch.randn(2, 9, 32), torch.arange(9).expand(2, 9)
    group(x[:, :6], positions[:, :6], cache=cache)
    with pytest.raises(ValueError, match=f"^{head}: decoding takes one token per call after the prefill, got 2$"):
        group(x[:, 6:8], positions[:, 6:8], cache=cache)
    assert group(x[:, 6:7], positions[:, 6:7], cache=cache).shape == (2, 1, 32)


def _decodable() -> list[str]:
    from heads import REGISTRY

    return sorted(name for name, cls in REGISTRY.items() if cls.forward_cached is not HeadGroup.forward_cached)


@pytest.mark.parametrize("head", _decodable())
def test_a_cache_sized_for_fewer_tokens_refuses_or_stays_exact(head: str) -> None:
    """A cache built for 6 tokens and fed 20 (a prefill of 2, then one at a time) either goes on exactly as the full
    pass (a ring as long as the window) or stops with 'KV cache full'; every output before that is the full pass's.
    (A local head's ring shorter than its window overwrote keys inside the window, a Routing cluster shorter than its
    capacity turned members away, both without a word.)"""
    from heads import REGISTRY

    options = {**REGISTRY[head].Options.example(), **{"local": {"window": 8}, "routing": {"capacity_factor": 2.0}}.get(head, {})}
    group = make_group(head, options, 20, dtype=torch.float64)
    assert group.causal  # every decodable type's example options are causal ones
    x, positions = torch.randn(1, 20, 32, dtype=torch.float64), torch.arange(20)[None]
    full = group(x, positions)
    cache = group.new_cache(1, 6, dtype=torch.float64)
    outputs, t = [group(x[:, :2], positions[:, :2], cache)], 2
    try:
        for t in range(2, 20):
            outputs.append(group(x[:, t : t + 1], positions[:, t : t + 1], cache))
        t = 20
    except RuntimeError as err:
        assert str(err).startswith("KV cache full"), err
    torch.testing.assert_close(torch.cat(outputs, 1), full[:, :t], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("head", _decodable())
def test_a_chunk_after_the_prefill_is_refused_or_exact(head: str) -> None:
    """Every decodable type, given two tokens at once after its prefill, either refuses in one line (the STEPWISE
    types above) or returns the full pass's outputs for them; one token at a time then goes on exactly."""
    from heads import REGISTRY

    group = make_group(head, REGISTRY[head].Options.example(), 32, count=2, dtype=torch.float64)
    x, positions = torch.randn(2, 32, 32, dtype=torch.float64), torch.arange(32).expand(2, 32)
    full = group(x, positions)
    cache = group.new_cache(2, 32, dtype=torch.float64)
    outputs = [group(x[:, :20], positions[:, :20], cache=cache)]
    try:
        outputs.append(group(x[:, 20:22], positions[:, 20:22], cache=cache))
        fed = 22
    except ValueError as err:
        assert head in STEPWISE, f"{head} refuses a chunk after the prefill ({err}): add it to STEPWISE if it must"
        assert str(err) == f"{head}: decoding takes one token per call after the prefill, got 2"
        fed = 20
    assert head not in STEPWISE or fed == 20, f"{head} took a chunk, though listed as refusing one"
    outputs += [group(x[:, t : t + 1], positions[:, t : t + 1], cache=cache) for t in range(fed, 32)]
    torch.testing.assert_close(torch.cat(outputs, 1), full, rtol=1e-9, atol=1e-9)


class _LargestOutput(TorchDispatchMode):
    """The most elements any operator returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("floor, step", [(1, 1), (3 * 2 * 12 * 16, 3), (2**19, 7)])  # chunks of 1; 3, 3, 1; all 7
def test_gathered_prefill_caches_the_projection_in_chunks_of_heads(monkeypatch: pytest.MonkeyPatch, floor: int,
                                                                   step: int) -> None:
    """gathered_prefill caches R(pos) X[I] W^K_i and X[I] W^V_i of every head, and never holds the gathered X^s of
    all heads at once ([B, H, c, h], H c / T times X) when the chunk rule splits them."""
    monkeypatch.setattr(gathered_lean, "MIN_CHUNK_ELEMENTS", floor)
    Bx, Tx, h, Hx, c, d = 2, 40, 16, 7, 12, 4
    g = torch.Generator().manual_seed(3)
    x = torch.randn(Bx, Tx, h, generator=g)
    idx = torch.rand(Bx, Hx, Tx, generator=g).argsort(-1)[..., :c].sort(-1).values  # ascending token indices
    keep = torch.rand(Bx, Hx, c, generator=g) < 0.8
    w = torch.randn(3 * Hx * d, h, generator=g)
    positions = torch.arange(Tx).expand(Bx, Tx) + 9
    rope = RotaryEmbedding(d)
    cache = SlotKV.empty(Bx, Hx, c, d)
    with _LargestOutput() as seen:
        gathered_prefill(cache, x, positions, idx, keep, w, rope)
    assert gathered_lean.heads_per_chunk(Hx, c, Tx, Bx * c * h) == step
    assert seen.largest <= max(x.numel(), w.numel(), Bx * step * c * h)  # the inputs (and views of them), a chunk
    assert (seen.largest < Bx * Hx * c * h) == (step < Hx)  # the whole gather is bigger than all of them
    wk, wv = w.view(3, Hx, d, h)[1:]  # the reference: the old whole-gather projection
    ref = SlotKV.empty(Bx, Hx, c, d)
    xs = torch.stack([x[b, idx[b]] for b in range(Bx)])  # [B, H, c, h]
    pos = torch.stack([positions[b, idx[b]] for b in range(Bx)])
    ref.write(keep, rope(torch.einsum("bnch,ndh->bncd", xs, wk), pos), torch.einsum("bnch,ndh->bncd", xs, wv), pos)
    for name in ("k", "v", "pos", "fill"):
        torch.testing.assert_close(getattr(cache, name), getattr(ref, name), rtol=1e-5, atol=1e-5, msg=name)
