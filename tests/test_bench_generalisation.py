"""bench/generalisation.py end to end at toy size: a dense checkpoint evaluated with its heads swapped."""
from __future__ import annotations

import pytest

from bench.generalisation import _parse, main
from heads import ConfigError
from lm.config_io import load_config
from lm.train import train
from tests.synthetic import run_overrides, write_prepared


def test_specs() -> None:
    mita = ("block", "k", "s"), ("local_blocks",)
    assert _parse("32:64:1", *mita) == {"block": 32, "k": 64, "s": 1}
    assert _parse("32:64:1:2", *mita) == {"block": 32, "k": 64, "s": 1, "local_blocks": 2}
    for bad in ("32:64", "32:64:1:2:3", "32:x:1"):
        with pytest.raises(ConfigError, match=r"block:k:s\[:local_blocks\]"):
            _parse(bad, *mita)


def test_swapped_heads_table(tmp_path) -> None:
    """Dense reproduces its own loss (training's last validation, on the same 16 windows); MiTA whose local blocks
    cover the whole window (4 blocks of 8 = 32 rows) with no shared expert is exactly dense again; a narrow window is not."""
    data = write_prepared(tmp_path / "data")
    metrics = train(load_config(None, *run_overrides(data, tmp_path / "run", max_steps=10)))  # validates at step 10
    out = tmp_path / "g.md"
    assert main(["--ckpt", str(tmp_path / "run" / "checkpoints" / "last.ckpt"), "--mita-no-shared", "8:4:1:4",
                 "--local", "2", "--val-windows", "16", "--out", str(out)]) == 0
    rows = [r.split(" | ") for r in out.read_text().splitlines() if r.startswith("| dense") or r.startswith("| mita")
            or r.startswith("| local")]
    loss = {r[0].strip("| "): float(r[2]) for r in rows}
    assert "4 local blocks, no shared expert" in out.read_text()
    assert loss["mita"] == pytest.approx(loss["dense"], abs=1e-5) and abs(loss["local"] - loss["dense"]) > 1e-3
    assert metrics["step"] == 10 and loss["dense"] == pytest.approx(metrics["val_loss"], abs=1e-4)  # printed to 4 places


@pytest.mark.parametrize("head_type,options,why", [
    ("topk", {"k": 100000}, "topk: options.k = 100000 > model.seq_len 64"),
    ("agent", {"block": 1000, "window": 1000}, "agent: options.block = 1000 > model.seq_len 64"),
    ("mita", {"block": 8, "k": 4, "local_blocks": 9}, "mita: options.local_blocks = 9 > the 8 block"),
])
def test_swapped_heads_beyond_the_sequence_are_refused(head_type: str, options: dict, why: str) -> None:
    """Options the config loader refuses at this length are refused for swapped heads too (they were accepted and
    reported as sparse rows that were dense attention, or had no agents, again)."""
    from bench.generalisation import swap_heads
    from lm import build_model
    from tests.conftest import tiny_config

    model = build_model(tiny_config([{"type": "dense", "count": 2}]).model)
    with pytest.raises(ConfigError, match=f"^model.heads: {why}"):
        swap_heads(model, head_type, options)
