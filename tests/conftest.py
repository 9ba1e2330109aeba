"""Shared test helpers: small models of any head mix, built through the public API."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED_DATA = Path(os.environ.get("SHARED_DATA", ROOT.parent / "shared" / "data"))

torch.set_num_threads(min(2, torch.get_num_threads()))


def tiny_config(heads: list[dict] | None = None, **model):
    """A small validated Config; `heads` is a list of {type, count, options} dicts."""
    import lm

    values = dict(vocab_size=97, n_layers=2, d_model=32, head_dim=8, seq_len=64)
    values.update(model)
    cfg = lm.load_config(None, **{f"model.{k}": v for k, v in values.items()})
    if heads is not None:
        from lm.config import HeadGroupConfig

        cfg.model.heads = [HeadGroupConfig(h["type"], h["count"], dict(h.get("options", {}))) for h in heads]
        from lm.config import validate

        validate(cfg)
    return cfg


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


def fast_vs_reference(head_type: str, options: dict, T: int, count: int = 3, batch: int = 2, seed: int = 0) -> dict:
    """Run one float64 head group of `head_type` with impl=reference and impl=fast on the same random
    input; return {name: (relative RMS error, max-abs error)} for the output, d/dx and every parameter
    gradient. float64 so that top-k selections cannot flip on rounding noise."""
    from heads import GroupContext, head_class, make_options

    torch.manual_seed(seed)
    ctx = GroupContext(d_model=32, head_dim=8, seq_len=T)
    group = head_class(head_type)(ctx, count, make_options(head_type, dict(options), ctx)).double()
    x = torch.randn(batch, T, 32, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(T).expand(batch, T)
    results = []
    for impl in ("reference", "fast"):
        group.options.impl = impl
        y = group(x, positions)
        grads = torch.autograd.grad(y, [x, *group.parameters()], torch.ones_like(y).normal_(generator=torch.Generator().manual_seed(1)))
        results.append([y, *grads])
    names = ["output", "grad_x"] + [f"grad_{n}" for n, _ in group.named_parameters()]
    errors = {}
    for name, ref, fast in zip(names, *results):
        diff = fast - ref
        errors[name] = ((diff.pow(2).mean() / ref.pow(2).mean().clamp_min(1e-300)).sqrt().item(), diff.abs().max().item())
    return errors
