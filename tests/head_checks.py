"""Shared head-test helpers: build a head group, compare its fast path against its reference.

fp32 for most heads; float64 where a selection (top-k, landmarks) could flip on rounding noise."""
from __future__ import annotations

from typing import Callable

import torch

from heads import GroupContext, HeadGroup, head_class, make_options


def tiny_options(head_type: str) -> dict:
    """Options that fit `head_type` into the tests' tiny models (seq_len >= 32): its Options.example(), a new dict."""
    return head_class(head_type).Options.example()


# The methods that are not causal as published, each behind its option: MoSA's expert choice, agent attention and
# MiTA over the whole sequence (the published agent variant has no local window: `window` back to its default).
AS_PUBLISHED = {"mosa": {"selection": "expert_choice"}, "agent": {"variant": "published", "window": 64},
                "mita": {"variant": "published"}}


def published_options(head_type: str) -> dict:
    """tiny_options(head_type) switched to the type's published, non-causal method (AS_PUBLISHED)."""
    return {**tiny_options(head_type), **AS_PUBLISHED[head_type]}


def decodable_types() -> set[str]:
    """The registered head types with a KV cache (new_cache does not raise NotImplementedError)."""
    from heads import REGISTRY

    out = set()
    for name in REGISTRY:
        try:
            make_group(name, tiny_options(name), 64).new_cache(1, 8)
        except NotImplementedError:
            continue
        out.add(name)
    return out


# fp32 tolerances for fast vs reference: relative RMS error and max-abs error relative to the
# reference's max-abs (the two paths sum in different orders, so they agree to float rounding).
REL_RMS_TOL = 1e-5
REL_MAX_TOL = 1e-4


def make_group(head_type: str, options: dict, T: int, count: int = 3, d_model: int = 32, head_dim: int = 8,
               std: float | None = 0.3, seed: int = 0, dtype: torch.dtype = torch.float32,
               rope_fraction: float = GroupContext.rope_fraction) -> HeadGroup:
    """A head group with weights ~ N(0, std^2) (large enough that attention is far from uniform);
    std=None keeps the layers' default initialisation."""
    torch.manual_seed(seed)
    ctx = GroupContext(d_model=d_model, head_dim=head_dim, seq_len=T, rope_fraction=rope_fraction)
    group = head_class(head_type)(ctx, count, make_options(head_type, dict(options), ctx)).to(dtype)
    if std is not None:
        for p in group.parameters():
            torch.nn.init.normal_(p, std=std)
    return group.eval()


def fast_and_reference(group: HeadGroup, T: int, batch: int = 2, before: Callable[[HeadGroup], None] | None = None
                       ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Run `group` with impl=reference and impl=fast on the same input (in the group's dtype, on its device); return
    (name, reference, fast) for the output, d/dx and every parameter gradient (a random cotangent; the loss
    includes the group's auxiliary losses). `before(group)` runs before each pass (e.g. to reset state)."""
    gen = torch.Generator().manual_seed(1)
    dtype, device = next(group.parameters()).dtype, next(group.parameters()).device  # the same draws on any device
    x = torch.randn(batch, T, group.ctx.d_model, generator=gen, dtype=dtype).to(device).requires_grad_()
    positions = torch.arange(T, device=device).expand(batch, T)
    cot = torch.randn(batch, T, group.ctx.d_model, generator=gen, dtype=dtype).to(device)
    params = [p for p in group.parameters()]
    results = []
    for impl in ("reference", "fast"):
        if before is not None:
            before(group)
        group.options.impl = impl
        y = group(x, positions)
        loss = (y * cot).sum() + sum((v for v in group.aux_losses.values()), torch.zeros((), dtype=dtype))
        results.append([y, *torch.autograd.grad(loss, [x, *params])])
    names = ["output", "grad_x"] + [f"grad_{n}" for n, _ in group.named_parameters()]
    return list(zip(names, *results))


def fast_vs_reference(group: HeadGroup, T: int, batch: int = 2,
                      before: Callable[[HeadGroup], None] | None = None) -> dict[str, tuple[float, float]]:
    """{name: (relative RMS error, max-abs error / max-abs of reference)} of fast_and_reference's pairs."""
    errors = {}
    for name, ref, fast in fast_and_reference(group, T, batch, before):
        diff = fast - ref
        scale = ref.abs().max().clamp_min(1e-30)
        errors[name] = ((diff.pow(2).mean() / ref.pow(2).mean().clamp_min(1e-30)).sqrt().item(),
                        (diff.abs().max() / scale).item())
    return errors


def assert_match(errors: dict[str, tuple[float, float]], rel_rms_tol: float = REL_RMS_TOL,
                 rel_max_tol: float = REL_MAX_TOL) -> None:
    """Every entry of fast_vs_reference within the tolerances (default: the fp32 ones above)."""
    for name, (rel_rms, rel_max) in errors.items():
        assert rel_rms < rel_rms_tol and rel_max < rel_max_tol, f"{name}: rel RMS {rel_rms:.2e}, rel max {rel_max:.2e}"


def saved_for_backward(group: HeadGroup, T: int, batch: int = 1) -> list[int]:
    """Sizes in bytes of the distinct storages autograd keeps for backward after one forward pass of
    `group` (the implementation's activation memory, parameters included; bench.heads.saved_storages)."""
    from bench.heads import saved_storages

    x = torch.randn(batch, T, group.ctx.d_model, requires_grad=True)
    return saved_storages(group, x, torch.arange(T).expand(batch, T))
