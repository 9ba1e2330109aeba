"""MoSAIC tied to demand: top_s defaults to round(N/rho), load/capacity advice (config load, IsoFLOP
solver, sweep), and the gate options (softmax over N, renormalised over the chosen s, sigmoid)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flops.isoflop import main as isoflop_main
from flops.sweep import main as sweep_main
from heads.base import GroupContext
from heads.mosaic import MosaicHeads, MosaicOptions
from lm.config_io import load_config
from routing.token_choice import choose, gate_weights, load_mismatch, resolve_top_s
from tests.head_checks import assert_match, fast_vs_reference, make_group


@pytest.mark.parametrize("count,sparsity,top_s", [(26, 8, 3), (276, 32, 9), (17, 32, 1), (4, 8, 1), (40, 2, 20)])
def test_default_top_s_is_heads_over_rho(count: int, sparsity: int, top_s: int) -> None:
    g = MosaicHeads(GroupContext(32, 8, 64), count, MosaicOptions(sparsity=sparsity))
    assert g.top_s == top_s and resolve_top_s(count, 5, sparsity) == min(5, count)


def test_default_keeps_load_within_2x_of_capacity() -> None:
    """load / capacity = s*rho/N: with s = max(1, round(N/rho)) it stays in [0.5, 2] whenever N >= rho/2."""
    for rho in (2, 8, 32, 64):
        for n in range(max(1, rho // 2), 400):
            assert 0.5 <= resolve_top_s(n, 0, rho) * rho / n <= 2.0, (n, rho)
            assert load_mismatch(n, 0, rho) is None


def test_issue_examples_are_flagged() -> None:
    pad = load_mismatch(276, 1, 32)  # the solver's tiny point at rho 32 with top-1
    assert pad is not None and "0.12" in pad and "88% of slots padding" in pad and "\n" not in pad
    drop = load_mismatch(17, 1, 64)
    assert drop is not None and "73% of routing choices dropped" in drop
    assert load_mismatch(17, 1, 32) is None  # 1.88x: inside the 2x tolerance (47% dropped; see docs/mosaic.md)
    assert load_mismatch(17, 1, 17) is None  # configs/experiments/mosaic_hybrid.yaml: capacity = load
    assert load_mismatch(8, 1, 4) is None and load_mismatch(2, 1, 4) is None  # exactly 0.5x and 2x: within
    assert load_mismatch(9, 1, 4) is not None and load_mismatch(2, 1, 4, capacity_factor=0.99) is not None  # beyond


def test_config_load_warns_once_in_one_line(capsys: pytest.CaptureFixture) -> None:
    """Printed like the other config sanity warnings (lm/sanity.py): once, not once per layer."""
    load_config(None, "model.heads=[{type: mosaic, count: 4, options: {sparsity: 32, top_s: 1}}]", "model.n_layers=3",
                "model.d_model=32", "model.head_dim=8", "model.seq_len=64")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: model.heads: mosaic") and "load / capacity" in err[0]


def test_solver_and_sweep_print_the_warning(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert isoflop_main(["--size", "tiny", "--head", "mosaic", "--sparsity", "32", "--option", "top_s=1"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: mosaic: 276 heads") and "88%" in err[0]
    assert isoflop_main(["--size", "tiny", "--head", "mosaic", "--sparsity", "32", "--json"]) == 0  # default top_s 9
    out = capsys.readouterr()
    assert out.err == "" and json.loads(out.out)["warning"] is None
    assert sweep_main(["--size", "tiny", "--heads", "mosaic", "--sparsity", "32", "--out", str(tmp_path),
                       "--option", "mosaic.top_s=1", "trainer.max_steps=3"]) == 0
    assert "warning: mosaic_s32: mosaic: 276 heads" in capsys.readouterr().err
    assert json.loads((tmp_path / "sweep.json").read_text())["points"][0]["warning"].startswith("mosaic: 276")


def test_gate_options() -> None:
    logits = torch.randn(2, 7, 6)
    probs, chosen = choose(logits, 2)
    renorm = gate_weights(logits, probs, chosen, "renorm")
    torch.testing.assert_close((renorm * chosen).sum(-1), torch.ones(2, 7))
    kept = logits.softmax(-1) * chosen  # p_ti over the token's chosen heads, renormalised
    torch.testing.assert_close(renorm * chosen, kept / kept.sum(-1, keepdim=True))
    torch.testing.assert_close(gate_weights(logits, probs, chosen, "sigmoid"), torch.sigmoid(logits))
    assert gate_weights(logits, probs, chosen, "softmax") is probs


@pytest.mark.parametrize("gate", ["renorm", "sigmoid"])
@pytest.mark.parametrize("T", [37, 100])
def test_gates_fast_matches_reference(gate: str, T: int) -> None:
    group = make_group("mosaic", dict(sparsity=3.0, top_s=2, gate=gate), T, count=4)
    errors = fast_vs_reference(group, T)
    assert {"output", "grad_router.weight"} <= set(errors)
    assert_match(errors)
