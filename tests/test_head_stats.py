"""Head statistics in training (lm/module.py): MoSA threshold / fill / overflow and MoSAIC load per head,
dropped fraction and router entropy reach TensorBoard exactly every `trainer.log_every` steps (once per step
under gradient accumulation)."""
from __future__ import annotations

from pathlib import Path

import pytest

from lm.config_io import load_config
from tests.synthetic import run_overrides, write_prepared

HEADS = ("[{type: dense, count: 2}, {type: mosa, count: 3, options: {sparsity: 4}},"
         " {type: mosaic, count: 3, options: {sparsity: 4}}]")


@pytest.mark.parametrize("accumulate", [1, 2])
def test_head_stats_logged_every_log_every_steps(tmp_path: Path, accumulate: int) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lm.train import train

    data = write_prepared(tmp_path / "prepared")
    overrides = run_overrides(data, tmp_path / "run", max_steps=7, log_every=3, val_every=100, ckpt_every=100,
                              accumulate_grad_batches=accumulate)
    train(load_config(None, *overrides, f"model.heads={HEADS}"))
    scalars: dict[str, list] = {}
    histograms: dict[str, list] = {}
    for events in (tmp_path / "run" / "tb").glob("events.out.tfevents.*"):  # train and validation writers
        acc = EventAccumulator(str(events), size_guidance={"histograms": 0})
        acc.Reload()
        scalars |= {t: acc.Scalars(t) for t in acc.Tags()["scalars"] if t.startswith("heads/")}
        histograms |= {t: acc.Histograms(t) for t in acc.Tags()["histograms"]}
    for layer in (0, 1):
        mosa, mosaic = f"heads/blocks.{layer}.attn.groups.1.mosa", f"heads/blocks.{layer}.attn.groups.2.mosaic"
        expected = {f"{mosa}/{s}" for s in ("tau_mean", "fill", "overflow", "selected_frac")}
        expected |= {f"{mosaic}/{s}" for s in ("mosaic_router_entropy", "mosaic_dropped", "mosaic_padded")}
        assert expected <= set(scalars), expected - set(scalars)
        assert f"{mosaic}/mosaic_load" in histograms
    for tag, events in scalars.items():
        assert [e.step for e in events] == [1, 4, 7], tag  # the forward passes of steps 1, 4 and 7
        assert all(0.0 <= e.value <= 1.0 for e in events) or tag.endswith(("tau_mean", "router_entropy")), tag
    fill = [e.value for e in scalars["heads/blocks.0.attn.groups.1.mosa/fill"]]
    overflow = [e.value for e in scalars["heads/blocks.0.attn.groups.1.mosa/overflow"]]
    # the first step uses tau = 0: about half of the 32 tokens pass, capacity is 8, so heads fill and overflow
    assert fill[0] > 0.9 and overflow[0] > 0.2 and 0 < fill[-1] <= 1
    load = histograms["heads/blocks.0.attn.groups.2.mosaic/mosaic_load"]
    assert [h.step for h in load] == [1, 4, 7] and load[0].histogram_value.num == 3  # one value per head
