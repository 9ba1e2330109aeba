"""Leak-free evaluation (lm/leakfree.py): each prediction from its own prefix only."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import lm
from heads import commit_states
from lm.leakfree import evaluate, leak_free_logits
from tests.conftest import tiny_config

CAUSAL = [{"type": "dense", "count": 1}, {"type": "mosa", "count": 3, "options": {"sparsity": 4, "keep_first": True}},
          {"type": "fixed", "count": 1, "options": {"sparsity": 4}}, {"type": "local", "count": 1, "options": {"window": 8}},
          {"type": "routing", "count": 1, "options": {"sparsity": 4}}]
FAITHFUL = [{"type": "dense", "count": 1}, {"type": "mosa", "count": 3, "options": {"sparsity": 4, "selection": "expert_choice"}}]


def _model(heads: list[dict]) -> lm.DecoderLM:
    torch.manual_seed(0)
    model = lm.build_model(tiny_config(heads, init_std=0.3, seq_len=24).model)
    model.train()(torch.randint(0, 97, (2, 24)))
    commit_states(model)  # initialise running thresholds, move centroids
    return model


def test_equals_ordinary_evaluation_for_causal_model() -> None:
    model = _model(CAUSAL)
    assert model.causal
    windows = [torch.randint(0, 97, (2, 25)), torch.randint(0, 97, (3, 25))]
    out = evaluate(model, windows)
    with torch.no_grad():  # the mean next-token cross-entropy over every target of every window
        nll = torch.cat([F.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten(), reduction="none")
                         for w in windows])
    assert len(nll) == 5 * 24 and math.isclose(out["loss"], nll.mean().item(), rel_tol=1e-6)
    assert math.isclose(out["ppl"], math.exp(out["loss"]), rel_tol=1e-9)
    assert math.isclose(out["leakfree_loss"], out["loss"], rel_tol=1e-5)
    tokens = windows[0][:, :-1]
    torch.testing.assert_close(leak_free_logits(model, tokens), model(tokens), rtol=1e-4, atol=1e-5)


def test_differs_for_faithful_mosa() -> None:
    model = _model(FAITHFUL)
    assert not model.causal
    out = evaluate(model, [torch.randint(0, 97, (2, 25))])
    gap = abs(out["leakfree_loss"] - out["loss"])
    print(f"faithful MoSA: teacher-forced loss {out['loss']:.4f}, leak-free {out['leakfree_loss']:.4f}")
    assert gap > 1e-3


def test_prefix_logits_and_positions() -> None:
    model = _model(FAITHFUL)
    tokens = torch.randint(0, 97, (2, 24))
    lf = leak_free_logits(model, tokens, positions=[0, 7, 23])
    torch.testing.assert_close(lf[:, 1], model.eval()(tokens[:, :8])[:, -1])
    assert lf.shape == (2, 3, 97) and model.training is False
    with pytest.raises(ValueError, match="positions"):
        leak_free_logits(model, tokens, positions=[24])


def test_no_windows_is_an_error_not_a_division_by_zero() -> None:
    model = lm.build_model(tiny_config([{"type": "dense", "count": 2}]).model).train()
    with pytest.raises(ValueError, match=r"^evaluate: no windows given$"):
        evaluate(model, iter([]))
    assert model.training  # left as it was
