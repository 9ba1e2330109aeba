"""heads/layer_norm.py: F.layer_norm without scale or bias, whose backward keeps the output instead of the input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heads.layer_norm import layer_norm


@pytest.mark.parametrize("shape", [(2, 3, 17, 8), (5, 1), (4, 64)])
def test_value_and_gradient_are_torchs(shape: tuple[int, ...]) -> None:
    """Output and input gradient equal F.layer_norm's (float64, 1e-12), for a random upstream gradient; a constant
    row (variance 0) too."""
    torch.manual_seed(0)
    x = (torch.randn(shape, dtype=torch.float64) * 3 + 1).requires_grad_()
    with torch.no_grad():
        x[..., 0, :] = 2.0 if len(shape) > 2 else x[..., 0, :]
    g = torch.randn(shape, dtype=torch.float64)
    ours, theirs = layer_norm(x), F.layer_norm(x, shape[-1:])
    (dx,), (expected,) = torch.autograd.grad(ours, x, g), torch.autograd.grad(theirs, x, g)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    torch.testing.assert_close(dx, expected, rtol=0, atol=1e-12)


def test_backward_keeps_the_output_not_the_input() -> None:
    """What autograd keeps is the output (and the [..., 1] reciprocal deviations), so normalize(layer_norm(x))
    keeps one [..., d] tensor where F.layer_norm's version keeps two."""
    x = torch.randn(2, 3, 50, 16, requires_grad=True)

    def kept(norm) -> list[torch.Tensor]:  # noqa: ANN001
        found: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: found.append(t) or t, lambda t: t):
            F.normalize(norm(x * 1.0), dim=-1)
        return list({t.untyped_storage().data_ptr(): t for t in found
                     if t.untyped_storage().nbytes() >= x.numel() * 4}.values())  # [..., d] storages

    assert len(kept(layer_norm)) == 1 and len(kept(lambda t: F.layer_norm(t, (16,)))) == 2


def test_bf16_input_gets_fp32_statistics_and_bf16_output() -> None:
    """A bf16 input: statistics in fp32, output and gradient in bf16, within bf16 rounding of the fp32 result."""
    torch.manual_seed(0)
    x = (torch.randn(4, 64) * 5 + 100).bfloat16().requires_grad_()
    g = torch.randn(4, 64).bfloat16()  # a random cotangent (y.sum()'s gradient is 0 in exact arithmetic)
    y = layer_norm(x)
    (dx,) = torch.autograd.grad(y, x, g)
    assert y.dtype == dx.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.layer_norm(x.float(), (64,)), rtol=0, atol=2e-2)
    xf = x.detach().float().requires_grad_()
    (want,) = torch.autograd.grad(F.layer_norm(xf, (64,)), xf, g.float())
    assert ((dx.float() - want).norm() / want.norm()).item() < 1e-2  # relative RMS error


def test_compiled_gradient_is_eagers() -> None:
    """normalize(layer_norm(x)) compiled (aot_eager, fullgraph), as the Routing heads use it: the same gradient as
    eager. torch 2.11's dynamo (the GPU image's) traced the custom Function there into a zero gradient, so compiled
    code takes F.layer_norm."""
    torch.manual_seed(0)
    x, g = torch.randn(2, 3, 5, 8, requires_grad=True), torch.randn(2, 3, 5, 8)

    def f(t: torch.Tensor) -> torch.Tensor:
        return F.normalize(layer_norm(t * 1.5), dim=-1)

    torch._dynamo.reset()
    (eager,), (compiled,) = (torch.autograd.grad(fn(x), x, g)
                             for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)))
    torch._dynamo.reset()
    assert eager.abs().sum() > 0
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
