"""heads/lse_attention.attention_lse against the plain autograd expression: outputs, log-sum-exp and every
gradient (through both outputs), with broadcast keys, a constant bias and rows that see no key; `merge` of parts
over disjoint keys against one softmax over all of them."""
from __future__ import annotations

import pytest
import torch

from heads.lse_attention import attention_lse, merge


def plain(q, k, v, allowed, scale, bias=None):
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~allowed, float("-inf"))
    return s.softmax(-1) @ v, s.logsumexp(-1)


def inputs(broadcast: bool, dtype: torch.dtype = torch.float64):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 5, 7, 4, dtype=dtype, requires_grad=True)  # [..., M = 7, d = 4]
    kv_shape = (2, 3, 1, 9, 4) if broadcast else (2, 3, 5, 9, 4)  # keys shared by the 5 query groups
    k = torch.randn(kv_shape, dtype=dtype, requires_grad=True)
    v = torch.randn(kv_shape, dtype=dtype, requires_grad=True)
    allowed = torch.rand(2, 3, 5, 1, 9) < 0.6  # per group of queries, broadcast over M
    allowed[..., 0] = True
    bias = -torch.rand(2, 3, 5, 7, 9, dtype=dtype) * 2
    return q, k, v, allowed, bias


@pytest.mark.parametrize("broadcast", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_outputs_and_gradients_match_autograd(broadcast: bool, with_bias: bool) -> None:
    """fp64, rtol 1e-10 / atol 1e-12: out, lse and dq, dk, dv under a cotangent on both outputs."""
    q, k, v, allowed, bias = inputs(broadcast)
    bias = bias if with_bias else None
    out, lse = attention_lse(q, k, v, allowed, 0.5, bias)
    ref_out, ref_lse = plain(q, k, v, allowed, 0.5, bias)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    d_out, d_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), (q, k, v))
    ref = torch.autograd.grad((ref_out * d_out).sum() + (ref_lse * d_lse).sum(), (q, k, v))
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("which", ["out", "lse"])
def test_one_output_alone(which: str) -> None:
    """A gradient that reaches only one of the two outputs (the other's cotangent is None)."""
    q, k, v, allowed, _ = inputs(False)
    got = attention_lse(q, k, v, allowed, 0.5)[which == "lse"].sum()
    want = plain(q, k, v, allowed, 0.5)[which == "lse"].sum()
    for a, b in zip(torch.autograd.grad(got, (q, k, v), allow_unused=True),
                    torch.autograd.grad(want, (q, k, v), allow_unused=True)):
        if b is None:  # lse does not depend on v
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck() -> None:
    q, k, v, allowed, bias = (t[:1, :1, :2] if t.dim() == 5 else t for t in inputs(True))
    torch.autograd.gradcheck(lambda q, k, v: attention_lse(q, k, v, allowed, 0.5, bias), (q, k, v))


def test_row_without_keys_gives_zero_and_neg_inf() -> None:
    """Where softmax would give NaN: out 0, lse -inf, finite zero gradients."""
    q, k, v, allowed, _ = inputs(False)
    allowed = allowed.expand(2, 3, 5, 7, 9).clone()
    allowed[0, 0, 0, 3] = False
    out, lse = attention_lse(q, k, v, allowed, 0.5)
    assert torch.isneginf(lse[0, 0, 0, 3]) and not out[0, 0, 0, 3].any()
    (out.sum() + lse.masked_fill(torch.isneginf(lse), 0).sum()).backward()
    assert torch.isfinite(q.grad).all() and not q.grad[0, 0, 0, 3].any()


def test_autocast_runs_in_the_autocast_dtype() -> None:
    """Under CPU bf16 autocast: bf16 out, fp32 lse, gradients in the inputs' fp32, close to fp32 maths."""
    q, k, v, allowed, _ = inputs(False, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = attention_lse(q, k, v, allowed, 0.5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32
    ref_out, _ = plain(q.detach(), k.detach(), v.detach(), allowed, 0.5)
    rel = (out.float() - ref_out).norm() / ref_out.norm()
    assert rel < 2e-2  # bf16 inputs and probabilities: ~3 significant digits


def test_rows_given_by_index_equal_the_gathered_tensors() -> None:
    """q_rows / kv_rows: attention over table rows (repeated rows too) = attention over the gathered copies,
    and the tables' gradients are the gathered gradients summed back (fp64, rtol 1e-10 / atol 1e-12)."""
    torch.manual_seed(1)
    q_table, k_table, v_table = (torch.randn(11, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    q_rows, kv_rows = torch.randint(0, 11, (3, 5, 6)), torch.randint(0, 11, (3, 1, 7))  # keys shared by 5 groups
    allowed = torch.rand(3, 5, 1, 7) < 0.7
    allowed[..., 0] = True
    out, lse = attention_lse(q_table, k_table, v_table, allowed, 0.5, q_rows=q_rows, kv_rows=kv_rows)
    ref_out, ref_lse = plain(q_table[q_rows], k_table[kv_rows], v_table[kv_rows], allowed, 0.5)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    d_out, d_lse = torch.randn_like(out), torch.randn_like(lse)
    tables = (q_table, k_table, v_table)
    grads = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), tables)
    ref = torch.autograd.grad((ref_out * d_out).sum() + (ref_lse * d_lse).sum(), tables)
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_merging_parts_over_disjoint_keys_is_one_softmax_over_all() -> None:
    """Keys split into three disjoint sets (one of them empty for some rows: lse -inf, output 0): merge gives the
    attention over the union and its log-sum-exp (fp64, rtol 1e-10), and gradients flow to every part."""
    q, k, v, allowed, bias = inputs(False)
    parts = [allowed & (torch.arange(9) % 3 == p) for p in range(3)]
    parts[2] = parts[2] & (torch.arange(5)[:, None, None] < 3)  # query groups 3, 4 see nothing of part 2
    outs, lses = zip(*(attention_lse(q, k, v, part, 0.5, bias) for part in parts))
    assert torch.isinf(lses[2]).any()
    out, lse = merge(outs, lses)
    ref_out, ref_lse = plain(q, k, v, parts[0] | parts[1] | parts[2], 0.5, bias)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad((out * d_out).sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad((ref_out * d_out).sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
