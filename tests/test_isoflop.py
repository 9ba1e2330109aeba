"""IsoFLOP solver and CLI against MoSA Tables 4 and 5 (the paper's numbers are the data below)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from flops.formulas import group_cost
from flops.isoflop import main as isoflop_main
from flops.isoflop import solve
from flops.model import model_cost
from flops.presets import baseline
from heads.base import ConfigError
from lm.config import HeadGroupConfig
from lm.config_io import load_config

SPARSITIES = [1, 2, 4, 8, 16, 32, 64, 128, 256]

# Table 4: FLOPs per pass (G), as printed. Medium is printed 430.70G, but App. C's formula with
# Table 4's own hyperparameters gives 439.70G (18 * 24.43G); we report 439.70G (see README_flops).
TABLE4_PRINTED = {"tiny": 54.76, "small": 219.85, "medium": 430.70, "large": 1130.65}
TABLE4_APP_C = {**TABLE4_PRINTED, "medium": 439.70}

# Table 5: number of MoSA heads per sparsity (None = '-', not trained), hybrid (4 dense) and pure.
TABLE5_HEADS = {
    ("tiny", 4): [0, 13, 31, 69, 142, 276, 505, 848, 1277],
    ("tiny", 0): [0, 23, 56, 124, 255, None, None, None, None],
    ("small", 4): [0, 11, 26, 54, 109, 210, 381, None, None],
    ("small", 0): [0, 21, 47, 98, 197, None, None, None, None],
    ("medium", 4): [0, 11, 26, 54, 109, 210, None, None, None],
    ("medium", 0): [0, 21, 47, 98, 197, None, None, None, None],
    ("large", 4): [0, 27, 60, None, None, None, None, None, None],
    ("large", 0): [0, 37, 80, None, None, None, None, None, None],
}
# Table 5: number of parameters, as printed.
TABLE5_PARAMS = {
    ("tiny", 4): ["28M", "34M", "48M", "78M", "136M", "242M", "423M", "693M", "1B"],
    ("tiny", 0): ["28M", "39M", "65M", "119M", "222M"],
    ("small", 4): ["113M", "127M", "163M", "229M", "360M", "599M", "1B"],
    ("small", 0): ["113M", "142M", "203M", "324M", "559M"],
    ("medium", 4): ["210M", "239M", "310M", "442M", "703M", "1.2B"],
    ("medium", 0): ["210M", "267M", "390M", "632M", "1.1B"],
    ("large", 4): ["516M", "650M", "943M"],
    ("large", 0): ["516M", "703M", "1B"],
}


@pytest.mark.parametrize("size", list(TABLE4_PRINTED))
def test_table4_flops_per_pass(size: str) -> None:
    flops = model_cost(baseline(size)).flops_per_pass
    assert round(flops / 1e9, 2) == TABLE4_APP_C[size]
    if size == "medium":  # the printed figure is 9 GFLOPs lower than App. C's formula gives
        assert round(flops / 1e9, 2) - TABLE4_PRINTED[size] == pytest.approx(9.0)


def test_table4_excludes_vocab_projection() -> None:
    cost = model_cost(baseline("tiny"))
    assert cost.flops_per_pass == cost.attention_flops + cost.ffn_flops
    assert round((cost.flops_per_pass + cost.lm_head_flops) / 1e9, 2) != TABLE4_PRINTED["tiny"]


@pytest.mark.parametrize("size,dense", list(TABLE5_HEADS))
def test_table5_head_counts(size: str, dense: int) -> None:
    base = baseline(size)
    for rho, expected in zip(SPARSITIES, TABLE5_HEADS[size, dense]):
        if expected is None:
            continue
        r = solve(base, "mosa", rho, dense)
        assert r.sparse_heads == expected, (size, dense, rho)
        assert r.dense_heads == (base.heads[0].count if rho == 1 else dense)


def _printed(text: str) -> tuple[float, float]:
    """'239M' -> (239e6, 1e6); '1.2B' -> (1.2e9, 0.1e9); '1B' -> (1e9, 0.1e9): value and one printed unit."""
    scale = 1e6 if text.endswith("M") else 1e9
    return float(text[:-1]) * scale, (1e6 if scale == 1e6 else 0.1e9)


@pytest.mark.parametrize("size,dense", list(TABLE5_PARAMS))
def test_table5_params_within_printed_precision(size: str, dense: int) -> None:
    """Analytic parameters (4hh' per head + h per MoSA router, FFN, norms, embedding, untied vocab
    projection) agree with Table 5 to within one printed unit (all but Medium rho=2/4 round exactly)."""
    base = baseline(size)
    for rho, text in zip(SPARSITIES, TABLE5_PARAMS[size, dense]):
        value, unit = _printed(text)
        assert abs(solve(base, "mosa", rho, dense).params - value) <= unit, (size, dense, rho, text)


@pytest.mark.parametrize("head", ["mosa", "fixed", "routing"])
@pytest.mark.parametrize("dense", [0, 4])
def test_never_above_budget_and_one_more_head_exceeds(head: str, dense: int) -> None:
    for size in ["micro", "tiny", "large"]:
        base = baseline(size)
        for rho in [2, 4, 16, 64]:
            if base.seq_len // rho < 2:
                continue
            r = solve(base, head, rho, dense)
            assert r.flops_per_pass <= r.baseline_flops_per_pass
            mix = [dataclasses.replace(base.heads[0], count=r.dense_heads)] if r.dense_heads else []
            sparse = HeadGroupConfig(head, r.sparse_heads + 1, {"sparsity": rho})
            more = dataclasses.replace(base, heads=mix + [sparse])
            assert model_cost(more).flops_per_pass > r.baseline_flops_per_pass, (size, head, rho, dense)


def test_head_mix_is_a_valid_model_config() -> None:
    r = solve(baseline("tiny"), "mosa", 8, 4)
    assert r.heads == [
        {"type": "dense", "count": 4, "options": {}},
        {"type": "mosa", "count": 69, "options": {"sparsity": 8}},
    ]
    assert r.kv_per_layer == 4 * 1024 + 69 * 128 and r.kv_total == 6 * r.kv_per_layer


def test_table2_kv_of_the_perplexity_matched_pair() -> None:
    """Table 2, Tiny: 9 dense heads -> 9.2K; 4 dense + 17 MoSA (rho = 32) -> 4,640 per layer."""
    base = baseline("tiny")
    pair = dataclasses.replace(base, heads=[HeadGroupConfig("dense", 4), HeadGroupConfig("mosa", 17, {"sparsity": 32})])
    assert model_cost(base).kv_per_layer[0] == 9216
    assert model_cost(pair).kv_per_layer[0] == 4 * 1024 + 17 * 32


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flops.isoflop", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_cli_json() -> None:
    out = _cli("--size", "tiny", "--head", "mosa", "--sparsity", "8", "--dense-heads", "4", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert (r["sparse_heads"], r["dense_heads"], r["baseline_flops_per_pass"]) == (69, 4, 54760833024)
    assert r["flops_per_pass"] <= r["baseline_flops_per_pass"] and r["kv_total"] == 6 * (4096 + 69 * 128)
    over = _cli("--size", "tiny", "--head", "mosa", "--sparsity", "8", "--seq-len", "2048", "--layers", "2", "--json")
    assert json.loads(over.stdout)["baseline_flops_per_pass"] == model_cost(baseline("tiny", seq_len=2048, n_layers=2)).flops_per_pass


@pytest.mark.parametrize(
    "args,message",
    [
        (["--size", "tiny", "--head", "mosa", "--sparsity", "3"], "sparsity 3 does not divide seq_len 1024"),
        (["--size", "tiny", "--head", "mosa", "--sparsity", "1024"], "k = 1 < 2"),
        (["--size", "tiny", "--head", "nope", "--sparsity", "8"], "unknown head type 'nope'"),
        (["--size", "tiny", "--head", "compression", "--option", "t=4"], "unknown head type 'compression'"),
        (["--size", "huge", "--head", "mosa", "--sparsity", "8"], "unknown size 'huge'"),
        (["--size", "tiny", "--head", "mosa", "--sparsity", "8", "--dense-heads", "10"], "dense_heads must be in [0, 9]"),
        (["--size", "tiny", "--head", "mosa", "--sparsity", "8", "--layers", "0"], "n_layers must be >= 1"),
        (["--size", "micro", "--head", "mosa", "--sparsity", "8", "--vocab-size", "100000"],
         "model.vocab_size must be <= 65536"),
        (["--size", "tiny", "--head", "local", "--option", "window=64", "--sparsity", "8"],
         "--sparsity does not apply to local heads (their options: impl, window)"),
        # sizes past the training length, refused as training refuses them (the mix printed was never trainable)
        (["--size", "tiny", "--head", "topk", "--option", "k=5000"], "topk: options.k = 5000 > model.seq_len 1024"),
        (["--size", "tiny", "--head", "local", "--option", "window=5000"], "local: options.window = 5000 > model.seq_len"),
        # options that need the head count the solver finds: training's check, on that count
        (["--size", "tiny", "--head", "mosaic", "--sparsity", "8", "--option", "top_s=100"],
         "mosaic: top_s (100) must be <= the group's head count (69): 69 mosaic heads fit the FLOP budget"),
        # MoSAIC's sparsity is a float option: an IsoFLOP point still needs k = T / rho tokens, rho an integer
        (["--size", "tiny", "--head", "mosaic", "--option", "sparsity=2.5"],
         "sparsity must be a positive integer, got 2.5"),
        (["--size", "tiny", "--head", "local", "--option", "window"], "--option expects key=value, got 'window'"),
        # kept groups and budgets
        (["--size", "tiny", "--head", "mosa", "--with", "local:x"],
         "--with expects TYPE:COUNT[:KEY=VALUE,...] with a count >= 1, got 'local:x'"),
        (["--size", "tiny", "--head", "mosa", "--with", "local:0"], "with a count >= 1, got 'local:0'"),
        (["--size", "tiny", "--head", "mosa", "--with", "lokal:2"], "unknown head type 'lokal'"),
        (["--size", "tiny", "--head", "mosa", "--with", "local:2:windw=5"],
         "kept heads: head type 'local': unknown option(s) windw"),
        (["--size", "tiny", "--head", "mosa", "--budget", "lots"], "--budget expects a finite number of FLOPs per pass >= 1"),
        (["--size", "tiny", "--head", "mosa", "--budget", "0.5"], "--budget expects a finite number of FLOPs per pass >= 1"),
        (["--size", "tiny", "--head", "mosa", "--budget", "nan%"], "--budget expects a finite number of FLOPs per pass >= 1"),
        (["--size", "tiny", "--head", "mosa", "--budget", "1e308G"], "--budget expects a finite number of FLOPs per pass >= 1"),  # inf
        (["--size", "tiny", "--head", "mosa", "--budget", "1e30"], "--budget 1e30 is 1.826e+19x the baseline's 54.76G "
         "per pass (at most 100x)"),  # solved, it printed 4 dense + 4294923386813032243424 mosa heads
        (["--size", "tiny", "--head", "mosa", "--with", "local:²"], "--with expects TYPE:COUNT"),  # isdigit, not int
        (["--size", "tiny", "--head", "mosa", "--with", "local:2:foo"], "--with local:2: expects key=value, got 'foo'"),
        (["--size", "tiny", "--head", "mosa", "--budget", "50%"], "error: the model without mosa heads (4 dense heads "
         "and the FFNs) costs 38.65G per pass, over the FLOP budget of 27.38G"),
        (["--size", "tiny", "--head", "mosa", "--budget", "38.7G"],  # 4 dense: 38.65G; a MoSA head 0.23G
         "not even one mosa head fits in the FLOP budget (38.70G per pass) next to 4 dense heads"),
        (["--size", "tiny", "--head", "local", "--option", "=64"], "--option expects key=value, got '=64'"),
    ],
)
def test_cli_errors_are_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert isoflop_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_cli_error_exit_status_in_a_subprocess() -> None:
    out = _cli("--size", "tiny", "--head", "mosa", "--sparsity", "3")
    assert out.returncode == 2 and out.stderr.strip() == "error: sparsity 3 does not divide seq_len 1024"


@pytest.mark.parametrize("head", ["mosa", "fixed", "mosaic", "local", "topk"])
@pytest.mark.parametrize("sparsity", [float("nan"), float("inf"), 0, -8])
def test_solve_rejects_a_sparsity_that_is_no_positive_integer(head: str, sparsity: float) -> None:
    """From Python too (the CLI's argparse type never lets these through): a ConfigError naming the sparsity,
    not a KeyError (nan != nan) or an OverflowError (int(inf)); local and top-k heads have no sparsity at all."""
    with pytest.raises(ConfigError, match="sparsity does not apply" if head in ("local", "topk") else "sparsity must be"):
        solve(baseline("micro"), head, sparsity, 2)


def test_long_sequence_mosa_vs_routing_ratio() -> None:
    """Sec. 3 (long sequences): at T = 8192, k = 64 (rho = 128), h = 1024, 60 MoSA heads cost 22.99% of
    4 Routing heads as printed; App. C's formulas give 22.96% (same to 0.1 percentage point)."""
    mosa = group_cost("mosa", 1024, 64, 8192, 60, {"sparsity": 128}).flops
    routing = group_cost("routing", 1024, 64, 8192, 4, {"sparsity": 128}).flops
    assert round(100 * mosa / routing, 2) == 22.96 and round(100 * mosa / routing, 1) == round(22.99, 1)


@pytest.mark.parametrize(
    "args,shape",
    [
        (["--head", "mosa", "--sparsity", "8"], "69 mosa heads (rho=8, k=128)"),
        (["--head", "local", "--option", "window=128"], "8 local heads (window=128)"),
        (["--head", "agent"], "9 agent heads (default options)"),
    ],
)
def test_cli_text_names_the_sparse_group(args: list[str], shape: str, capsys: pytest.CaptureFixture) -> None:
    """The one-line summary shows rho and k for types with a sparsity, else the options given."""
    assert isoflop_main(["--size", "tiny", *args]) == 0
    assert f"tiny: 4 dense + {shape}; FLOPs/pass" in capsys.readouterr().out


def test_cli_text_reads_at_every_size(capsys: pytest.CaptureFixture) -> None:
    """FLOPs in G with 2 decimals (Table 4's), in M below 1G (micro's read "0.04G of 0.04G" before), parameters in M
    with 2 decimals; --vocab-size sets the vocabulary the parameters count (a sweep's model.vocab_size)."""
    assert isoflop_main(["--size", "tiny", "--head", "mosa", "--sparsity", "32"]) == 0
    assert ("FLOPs/pass 54.72G of 54.76G (99.93%); KV/layer 12928 (dense 9216); params 241.84M (dense 27.87M)"
            in capsys.readouterr().out)
    args = ["--size", "micro", "--head", "mosa", "--sparsity", "8", "--dense-heads", "2"]
    assert isoflop_main(args) == 0
    default = capsys.readouterr().out
    assert "FLOPs/pass 41.90M of 41.94M (99.91%)" in default and "params 1.53M (dense 1.14M)" in default
    assert isoflop_main([*args, "--vocab-size", "2048"]) == 0
    assert "FLOPs/pass 41.90M of 41.94M (99.91%); KV/layer 1072 (dense 768); params 0.77M (dense 0.38M)" in \
        capsys.readouterr().out


def test_cli_config_is_the_baseline(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """--config takes the baseline from a YAML's model: configs/tiny.yaml is the Tiny preset, so both give the same
    point; its shape overrides apply; a config with sparse heads, a missing file, or --config with --size: one line."""
    monkeypatch.chdir(ROOT)
    args = ["--head", "mosa", "--sparsity", "8", "--json"]
    assert isoflop_main(["--size", "tiny", *args]) == 0
    preset = json.loads(capsys.readouterr().out)
    assert isoflop_main(["--config", "configs/tiny.yaml", *args]) == 0
    assert json.loads(capsys.readouterr().out) == preset and preset["sparse_heads"] == 69
    assert isoflop_main(["--config", "configs/quickstart.yaml", "--head", "mosa", "--sparsity", "8", "--dense-heads",
                         "1", "--seq-len", "128"]) == 0
    quick = load_config("configs/quickstart.yaml", warnings=False).model
    want = solve(baseline(None, quick, seq_len=128), "mosa", 8, 1)
    assert capsys.readouterr().out.startswith(f"configs/quickstart.yaml: 1 dense + {want.sparse_heads} mosa heads")
    for bad, message in [(["--config", "configs/experiments/mosa_layer_override.yaml"], "error: the baseline must have "
                          "one head mix in every layer (no model.layer_heads); this one has dense, mosa heads and "
                          "layer_heads"),
                         (["--config", "nothere.yaml"], "error: config file not found: nothere.yaml"),
                         (["--config", "configs/experiments/compression.yaml"], "error: configs/experiments/"
                          "compression.yaml has a compression section: its FLOPs depend on the layout "
                          "(flops.model.compressed_flops); give a config without one")]:
        assert isoflop_main([*bad, "--head", "mosa"]) == 2
        assert capsys.readouterr().err.strip() == message
    with pytest.raises(SystemExit):
        isoflop_main(["--config", "configs/tiny.yaml", "--size", "tiny", "--head", "mosa"])
    assert "not allowed with argument --config" in capsys.readouterr().err


def test_solve_refuses_a_baseline_with_per_layer_heads() -> None:
    """The budget is one layer mix times n_layers: a baseline with model.layer_heads is refused with one line; the
    dense heads kept cannot outnumber the baseline's (named when the baseline has other heads too)."""
    base = baseline("micro")
    dense = base.heads[0]
    per_layer = dataclasses.replace(base, layer_heads={1: [dataclasses.replace(dense, count=3)]})
    with pytest.raises(ConfigError, match=r"^the baseline must have one head mix in every layer \(no model.layer_heads\)$"):
        solve(per_layer, "mosa", 4, 2)
    mixed = dataclasses.replace(base, heads=[dataclasses.replace(dense, count=2), HeadGroupConfig("mosa", 4, {"sparsity": 4})])
    with pytest.raises(ConfigError, match=r"^dense_heads must be in \[0, 2\], got 3 \(the baseline is 2 dense \+ 4 mosa; "
                                          r"other kept heads: --with\)$"):
        solve(mixed, "mosa", 4, 3)
    with pytest.raises(ConfigError, match="the baseline must be a dense config"):  # the sweep's baseline stays dense
        baseline(None, mixed)
    assert solve(base, "mosa", 4, 2).sparse_heads > 0  # the preset itself is one


def _most_that_fit(base, r, budget: int) -> None:
    """r is within `budget` and one more head of its sparse group is not."""
    assert r.flops_per_pass <= budget == r.budget_flops_per_pass and r.budget_used == r.flops_per_pass / budget
    groups = [HeadGroupConfig(**g) for g in r.heads]
    more = dataclasses.replace(groups[-1], count=groups[-1].count + 1)
    assert model_cost(dataclasses.replace(base, heads=[*groups[:-1], more])).flops_per_pass > budget
    assert model_cost(dataclasses.replace(base, heads=groups)).flops_per_pass == r.flops_per_pass


def test_kept_groups_stay_next_to_the_dense_heads() -> None:
    """--with: 2 dense + 2 local (window 128) + n MoSA in every layer, n the most that fit the dense budget; KV and
    parameters of the three-way mix from the same formulas (local: min(w, T) per head)."""
    base = baseline("tiny")
    local = HeadGroupConfig("local", 2, {"window": 128})
    r = solve(base, "mosa", 8, 2, keep=[local])
    assert [(g["type"], g["count"]) for g in r.heads] == [("dense", 2), ("local", 2), ("mosa", r.sparse_heads)]
    assert r.heads[1]["options"] == {"window": 128} and r.dense_heads == 2
    _most_that_fit(base, r, model_cost(base).flops_per_pass)
    assert r.kv_per_layer == 2 * 1024 + 2 * 128 + r.sparse_heads * 128
    # 2 local heads cost less than 2 more dense heads and more than none
    assert solve(base, "mosa", 8, 4).sparse_heads == 69 < r.sparse_heads == 81 < solve(base, "mosa", 8, 2).sparse_heads
    with pytest.raises(ConfigError, match="^kept heads: local: options.window = 5000 > model.seq_len 1024"):
        solve(base, "mosa", 8, 2, keep=[HeadGroupConfig("local", 2, {"window": 5000})])
    with pytest.raises(ConfigError, match="^a kept group of dense heads: give their count as dense_heads"):
        solve(base, "mosa", 8, 2, keep=[HeadGroupConfig("dense", 2)])
    with pytest.raises(ConfigError, match="^sparsity 1 is the baseline itself"):
        solve(base, "mosa", 1, 2, keep=[local])


def test_long_sequence_baseline_of_local_and_routing_heads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """MoSA Sec. 3, long sequences: 6 layers, h = 1024, every layer 4 local heads + 4 Routing heads (k = 64) is the
    baseline, and MoSA (or fixed) heads next to the same 4 local heads are matched to it at T = 1024. App. C's formulas
    give 45 MoSA (48 fixed) heads; the paper chose 60 "to roughly FLOP match", which is 131% of the 4 Routing heads.
    From a YAML config (any one mix in every layer may be the baseline), with --dense-heads 0 and --with."""
    config = tmp_path / "long_routing.yaml"
    config.write_text("model:\n  n_layers: 6\n  d_model: 1024\n  head_dim: 64\n  seq_len: 1024\n  heads:\n"
                      "    - {type: local, count: 4, options: {window: 256}}\n"
                      "    - {type: routing, count: 4, options: {sparsity: 16}}\n")
    args = ["--config", str(config), "--dense-heads", "0", "--with", "local:4:window=256", "--sparsity", "16"]
    assert isoflop_main([*args, "--head", "mosa", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["heads"] == [{"type": "local", "count": 4, "options": {"window": 256}},
                          {"type": "mosa", "count": 45, "options": {"sparsity": 16}}]
    assert r["flops_per_pass"] <= r["baseline_flops_per_pass"] == r["budget_flops_per_pass"]
    mosa = group_cost("mosa", 1024, 64, 1024, 60, {"sparsity": 16}).flops
    routing = group_cost("routing", 1024, 64, 1024, 4, {"sparsity": 16}).flops
    assert round(100 * mosa / routing) == 131
    assert isoflop_main([*args, "--head", "fixed"]) == 0
    assert capsys.readouterr().out.startswith(f"{config} (4 local + 4 routing): 4 local + 48 fixed heads (rho=16, k=64); "
                                              "FLOPs/pass")
    assert isoflop_main([*args, "--head", "mosa", "--dense-heads", "4"]) == 2  # the default 4 is not in this baseline
    assert capsys.readouterr().err.strip() == ("error: dense_heads must be in [0, 0], got 4 (the baseline is 4 local + "
                                               "4 routing; other kept heads: --with)")
    shipped = ["--config", "configs/experiments/routing_local_long.yaml", "--dense-heads", "0", "--with",
               "local:4:window=256", "--sparsity", "128", "--head", "mosa", "--json"]  # the same setting at T = 8192
    assert isoflop_main([str(ROOT / a) if a.startswith("configs/") else a for a in shipped]) == 0
    long = json.loads(capsys.readouterr().out)
    assert long["sparse_heads"] == 261 and long["k"] == 64 and long["flops_per_pass"] <= long["baseline_flops_per_pass"]
    assert isoflop_main([*args, "--head", "mosa", "--heads", "8"]) == 2
    assert "the head count override sets a dense baseline's heads; this baseline is 4 local + 4 routing" in \
        capsys.readouterr().err


@pytest.mark.parametrize("text,flops", [("50%", 20_971_520), ("200%", 83_886_080), ("30M", 30_000_000),
                                        ("3e7", 30_000_000), ("0.05G", 50_000_000), ("41943040", 41_943_040)])
def test_budget_replaces_the_baselines_flops(text: str, flops: int, capsys: pytest.CaptureFixture) -> None:
    """--budget: FLOPs per pass (plain, or with k/M/G/T/P) or a percentage of the baseline's (micro: 41,943,040);
    the sparse heads fill it, never more, and one more would not fit; the text names the budget and the baseline."""
    base = baseline("micro")
    assert model_cost(base).flops_per_pass == 41_943_040
    assert isoflop_main(["--size", "micro", "--head", "mosa", "--sparsity", "8", "--dense-heads", "0",
                         "--budget", text, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["budget_flops_per_pass"] == flops and r["baseline_flops_per_pass"] == 41_943_040
    _most_that_fit(base, solve(base, "mosa", 8, 0, budget=flops), flops)
    if text == "50%":
        assert isoflop_main(["--size", "micro", "--head", "mosa", "--sparsity", "8", "--dense-heads", "0", "--budget",
                             text]) == 0
        assert f"of 20.97M ({100 * r['budget_used']:.2f}%; the budget is 50.00% of the baseline's 41.94M)" in \
            capsys.readouterr().out
