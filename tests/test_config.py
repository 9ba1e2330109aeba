"""Config loading (lm/config_io.py, lm/config.py) and the presets in configs/: every error is one line naming the field."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lm
from heads import ConfigError
from lm.config_io import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def error_of(*args: object, **kw: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kw)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message and message, f"not one line: {message!r}"
    return message


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_unknown_key(tmp_path: Path) -> None:
    assert "model.n_layer" in error_of(write(tmp_path, "model: {n_layer: 4}\n"))
    assert "trainer.max_step" in error_of(None, "trainer.max_step=5")
    # a misspelt key of a head group in a YAML list: OmegaConf knows no path for it, the message says where to look
    assert error_of(write(tmp_path, "model: {heads: [{type: dense, count: 4, option: {}}]}\n")).startswith(
        "model.heads / model.layer_heads: a head group's option: Key 'option' not in 'HeadGroupConfig'")
    # a type's option written beside type and count: the message says where options go
    assert error_of(None, "model.heads=[{type: mosa, count: 2, sparsity: 4}]") == (
        "model.heads / model.layer_heads: a head group's sparsity: Key 'sparsity' not in 'HeadGroupConfig' (a head "
        "group has type, count and options; its type's options go under options, e.g. "
        "{type: mosa, count: 8, options: {sparsity: ...}})")


def test_wrong_type(tmp_path: Path) -> None:
    assert "model.d_model" in error_of(write(tmp_path, "model: {d_model: wide}\n"))
    assert "optim.lr" in error_of(None, "optim.lr=fast")


def test_a_section_or_list_of_the_wrong_shape_is_named(tmp_path: Path) -> None:
    """A mapping where the schema has a list or a value, or the reverse, names the key and the file (OmegaConf's
    merge raised a TypeError, or named neither); a list for a tuple field stays valid."""
    cases = {"model:\n  heads: {type: dense, count: 2}\n": "model.heads must be a list, got a mapping",
             "model:\n  layer_heads: [1]\n": "model.layer_heads must be a mapping, got a list",
             "optim:\n  betas: {a: 1}\n": "optim.betas must not be a mapping",
             "model: 3\n": "model must be a mapping, got a value (3)",
             # inside head groups and layer mixes, and in the optional compression section (were TypeError
             # tracebacks, or OmegaConf's messages naming neither the key nor the file)
             "model:\n  heads: [{type: dense, count: 3, options: [1]}]\n": "model.heads[0].options must be a mapping, got a list",
             "model:\n  heads: [{type: dense, count: 3, options: null}]\n": "model.heads[0].options must be a mapping, got null",
             "model:\n  heads: [3]\n": "model.heads[0] must be a mapping, got a value (3)",
             "model:\n  layer_heads: {1: [{type: dense, count: 3, options: [1]}]}\n":
                 "model.layer_heads.1[0].options must be a mapping, got a list",
             "model:\n  layer_heads: {1: {type: dense, count: 3}}\n": "model.layer_heads.1 must be a list, got a mapping",
             "compression: 3\n": "compression must be a mapping, got a value (3)",
             # a tuple field's items (a nested list passed the merge and failed in validate with a TypeError)
             "optim:\n  betas: [[1], 2]\n": "optim.betas must be a list of 2 numbers, got [[1], 2]",
             "optim:\n  betas: [abc, 0.5]\n": "optim.betas must be a list of 2 numbers, got ['abc', 0.5]",
             "optim:\n  betas: [0.9]\n": "optim.betas must be a list of 2 numbers, got [0.9]",
             # ??? in a file kept the default silently
             "data:\n  path: ???\n": "data.path is ??? (missing): give it a value, or leave it out for the default"}
    for text, message in cases.items():
        path = write(tmp_path, text)
        assert error_of(path) == f"{path}: {message}"
    assert load_config(write(tmp_path, "optim:\n  betas: [0.9, 0.95]\n")).optim.betas == (0.9, 0.95)
    assert error_of(None, "optim.betas=[abc,0.5]") == "optim.betas must be a list of 2 numbers, got ['abc', 0.5]"
    assert error_of(None, "optim.betas.0=0.95") == "optim.betas.0: set the whole list, optim.betas=[...] with 2 numbers"


def test_bad_value() -> None:
    assert "n_layers" in error_of(None, "model.n_layers=0")
    assert "rope_fraction" in error_of(None, "model.rope_fraction=1.5")
    for base in ("0", "-10000", "1", ".inf"):  # zero / negative: infinite or NaN frequencies; 1: all frequencies 1;
        assert "rope_base" in error_of(None, f"model.rope_base={base}")  # inf: all 0 but the first (no positions)
    assert "trainer.strategy" in error_of(None, "trainer.strategy=fsdp")
    assert "trainer.precision" in error_of(None, "trainer.precision=fp8")
    assert "max_minutes" in error_of(None, "trainer.max_minutes=0")
    assert "trainer.profiler" in error_of(None, "trainer.profiler=advanced")
    # ids 0..65535 fit the uint16 shards, as data_prep's --vocab-size 65536 allows
    assert load_config(None, "model.vocab_size=65536").model.vocab_size == 65536
    assert error_of(None, "model.vocab_size=65537") == \
        "model.vocab_size must be <= 65536 (ids in uint16 token shards), got 65537"


@pytest.mark.parametrize("override,field", [
    ("trainer.seed=-1", "trainer.seed must be in [0, 2**32)"), ("trainer.seed=4294967296", "trainer.seed"),
    ("optim.betas=[1.5,0.999]", "optim.betas must both be in [0, 1)"), ("optim.betas=[0.9,1.0]", "optim.betas"),
    ("optim.lr=nan", "optim.lr must be a finite number > 0, got nan"), ("optim.grad_clip=inf", "optim.grad_clip"),
    ("optim.lr=1e300", "optim.lr / (1 - optim.betas[0]) must fit in float32 (<= 3.403e+38; AdamW's first step "
                       "size), got lr 1e+300, betas[0] 0.9"),
    ("optim.lr=1e38", "got lr 1e+38, betas[0] 0.9"),  # fits float32, but AdamW's first step is lr / 0.1
    ("model.init_std=-1", "model.init_std"), ("model.init_std=nan", "model.init_std"),
    ("trainer.max_minutes=nan", "trainer.max_minutes must be a finite"), ("trainer.max_minutes=1e30", "trainer.max_minutes must be <="),
    ("optim.weight_decay=-5", "optim.weight_decay must be a finite number >= 0"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio must be in [0, 1], got 2"),
    ("optim.warmup_steps=-1", "optim.warmup_steps must be >= 0, got -1"),
    ("data.val_batches=0", "data.val_batches must be a finite number > 0, got 0"),
    ("trainer.keep_last_k=-1", "trainer.keep_last_k must be >= 0 (0 = keep every checkpoint), got -1"),
])
def test_values_the_trainer_or_torch_would_reject_later_are_refused_at_load(override: str, field: str) -> None:
    """Each of these passed the type check and failed deep in training (seed_everything, AdamW, timedelta,
    the weight init) with a traceback, or, for a negative weight decay, trained silently (torch checks only
    the constructor default, not the per-group value)."""
    assert field in error_of(None, override)


@pytest.mark.parametrize("values,message", [
    ({"model": {"d_model": "abc"}}, "model.d_model: Value 'abc' of type 'str' could not be converted to Integer"),
    ({"model": {"foo": 1}}, "model.foo: Key 'foo' not in 'ModelConfig'"),
])
def test_a_bad_dict_is_one_config_error_naming_the_key(values: dict, message: str) -> None:
    """from_dict (a checkpoint's or a JSON spec's config): OmegaConf's multi-line merge error becomes one line."""
    from lm.config_io import from_dict

    with pytest.raises(ConfigError) as info:
        from_dict(values)
    assert str(info.value) == message


def test_a_config_read_again_without_warnings_prints_nothing(capsys) -> None:
    """load_config prints a suspect setting's warning; with warnings=False (a sweep runner checking a point's
    max_steps, before training prints them) the same config loads silently and equal."""
    suspect = ("trainer.max_steps=10", "optim.warmup_steps=50")
    loud = load_config(None, *suspect)
    assert "warning: optim.warmup_steps=50 >= trainer.max_steps=10" in capsys.readouterr().err
    assert load_config(None, *suspect, warnings=False) == loud and capsys.readouterr().err == ""


@pytest.mark.parametrize("options,message", [
    ("{block: 16, k: 8, local_blocks: 5}", "mita: options.local_blocks = 5 > the 4 block(s) of model.seq_len 64: "
                                           "more local blocks than the sequence has"),
    ("{block: 16, k: 8, s: 5}", "mita: options.s = 5 > the 4 landmark(s) of model.seq_len 64: a query cannot route to "
                                "more experts than there are")])
def test_mita_local_blocks_and_routes_beyond_the_sequence(options: str, message: str) -> None:
    """MiTA's local blocks past the sequence's blocks, or more routes than landmarks: refused (a fuzzing audit found
    local_blocks 100 and s 100 accepted at T = 64); as many as there are is allowed."""
    heads = f"model.heads=[{{type: mita, count: 2, options: {options}}}]"
    assert message in error_of(None, "model.seq_len=64", heads)
    load_config(None, "model.seq_len=64", heads.replace(": 5}", ": 4}"))


def test_bounds_that_mean_something_are_allowed() -> None:
    """min_lr_ratio 1 (a constant rate after warm-up) and keep_last_k 0 (keep every checkpoint), as documented."""
    cfg = load_config(None, "optim.min_lr_ratio=1.0", "trainer.keep_last_k=0")
    assert cfg.optim.min_lr_ratio == 1.0 and cfg.trainer.keep_last_k == 0


@pytest.mark.parametrize("head,option,value", [("topk", "k", 65), ("local", "window", 65), ("agent", "block", 65),
                                               ("agent", "dwc", 65), ("agent", "bias", 1000),
                                               ("mita", "block", 65), ("mita", "k", 100)])
def test_head_option_beyond_the_sequence_length(head: str, option: str, value: int) -> None:
    """k > T and its kind (a window, block or expert size over model.seq_len) would degenerate the head: refused."""
    heads = f"model.heads=[{{type: {head}, count: 2, options: {{{option}: {value}}}}}]"
    msg = error_of(None, "model.seq_len=64", heads)
    assert f"{head}: options.{option} = {value} > model.seq_len 64" in msg
    load_config(None, "model.seq_len=64", heads.replace(str(value), "64"))  # equal to T is allowed


@pytest.mark.parametrize("head,options,message", [
    ("agent", "{variant: bidirectional}", "agent: options.variant must be one of causal, published, got 'bidirectional'"),
    ("agent", "{variant: published, window: 8}", "agent: options.window is the causal variant's local window; variant "
                                                 "'published' (eq. 6) has none: leave window out"),
    ("mita", "{variant: global}", "mita: options.variant must be one of causal, published, got 'global'"),
    ("mita", "{variant: published, local_blocks: 2}", "mita: options.local_blocks is the causal variant's local term; "
                                                      "variant 'published' (Algorithm 1) has none: leave local_blocks out")])
def test_a_published_variant_s_options_name_what_is_wrong(head: str, options: str, message: str) -> None:
    """agent attention's and MiTA's variant option, and the causal variant's options the published one refuses."""
    assert message in error_of(None, f"model.heads=[{{type: {head}, count: 2, options: {options}}}]")


def test_unknown_head_type_and_option(tmp_path: Path) -> None:
    msg = error_of(write(tmp_path, "model: {heads: [{type: dense_ish, count: 4}]}\n"))
    assert "dense_ish" in msg and "dense" in msg.replace("dense_ish", "")  # names the known types
    msg = error_of(write(tmp_path, "model: {heads: [{type: dense, count: 4, options: {window: 8}}]}\n"))
    assert "window" in msg and "impl" in msg  # names the allowed options
    assert "heads" in error_of(None, "model.heads.0.kount=4")


def test_head_impl_is_fast_or_reference() -> None:
    assert error_of(None, "model.heads=[{type: dense, count: 2, options: {impl: slow}}]") == \
        "model.heads: dense: impl must be 'fast' or 'reference', got 'slow'"


def test_an_integral_float_is_a_valid_int_option() -> None:
    """4.0 (JSON / YAML) for an int option becomes the int 4, not a ConfigError and not a float size."""
    from heads.base import GroupContext, make_options

    sparsity = make_options("mosa", {"sparsity": 4.0}, GroupContext(d_model=32, head_dim=8, seq_len=32)).sparsity
    assert sparsity == 4 and type(sparsity) is int


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    assert "not found" in error_of(tmp_path / "nope.yaml")
    msg = error_of(write(tmp_path, "model: {n_layers: [4\n"))
    assert "YAML" in msg and "c.yaml" in msg
    assert error_of(write(tmp_path, "model:\n  n_layers: 2\nmodel:\n  n_layers: 3\n")).endswith(
        "c.yaml: not valid YAML: found duplicate key model (line 3)")  # the problem and where, not the error's type
    for nothing in ("", "# model: {n_layers: 2}\n"):  # would have trained the default model unasked
        assert error_of(write(tmp_path, nothing)).endswith(
            "c.yaml: the file sets nothing (empty, or only comments; {} to mean the defaults)")
    assert load_config(write(tmp_path, "{}\n")) == load_config()  # the defaults, asked for
    top = "c.yaml: the top level must be a mapping with sections model, data, optim, trainer"
    for text, holds in (("just a string\n", "one value"), ("42\n", "one value"), ("- model\n", "a list")):
        assert error_of(write(tmp_path, text)).endswith(f"{top} (this file holds {holds})")  # an AttributeError before
    assert "model.heads" in error_of(None, "model.heads=[{type: dense")  # a bad YAML value on the command line
    assert error_of(None, "model.n_layers") == "override 'model.n_layers' is not key=value (e.g. model.n_layers=4)"


def test_overrides_reach_list_items_and_keywords() -> None:
    cfg = load_config(CONFIGS / "tiny.yaml", "model.heads.0.count=4", "trainer.max_steps=7", optim__lr=1e-3)
    assert cfg.model.heads[0].count == 4 and cfg.trainer.max_steps == 7 and cfg.optim.lr == 1e-3


def test_keyword_overrides_are_python_values() -> None:
    """Keyword values are set as they are, not printed and re-read as YAML (None was the string 'None', a tuple
    a string, a path with ': ' a mapping)."""
    cfg = load_config(CONFIGS / "tiny.yaml", trainer__max_minutes=None, trainer__profiler=None, optim__betas=(0.8, 0.9),
                      data__path=Path("data/x: y"))
    assert cfg.trainer.max_minutes is None and cfg.trainer.profiler is None
    assert tuple(cfg.optim.betas) == (0.8, 0.9) and cfg.data.path == "data/x: y"


def test_head_groups_name_their_type_and_count() -> None:
    for group, missing in (("{type: mosa, options: {sparsity: 8}}", "count"), ("{count: 3}", "type")):
        assert error_of(None, f"model.heads=[{group}]") == f"model.heads[0].{missing}: Structured config of type " \
            f"`HeadGroupConfig` has missing mandatory value: {missing}"


def test_a_whole_layer_heads_value_replaces_the_files() -> None:
    """`model.layer_heads={}` clears the YAML's per-layer mixes (a merge kept them, so a 2-layer smoke run of a
    6-layer config with a mix at layer 5 could not be configured), on the command line and as a keyword."""
    override = CONFIGS / "experiments" / "mosa_layer_override.yaml"  # mixes at layers 0 and 5
    assert load_config(override, "model.n_layers=2", "model.layer_heads={}").model.layer_heads == {}
    assert load_config(override, **{"model.layer_heads": {}}).model.layer_heads == {}
    mix = [{"type": "dense", "count": 3}]  # as keywords: one layer merges, a whole map replaces
    assert {k: [g.count for g in v] for k, v in load_config(override, **{"model.layer_heads.1": mix})
            .model.layer_heads.items()} == {0: [9], 5: [9], 1: [3]}
    assert {k: [g.count for g in v] for k, v in load_config(override, **{"model.layer_heads": {2: mix}})
            .model.layer_heads.items()} == {2: [3]}
    cfg = load_config(override, "model.layer_heads={2: [{type: dense, count: 2}]}")
    assert {k: [(g.type, g.count) for g in v] for k, v in cfg.model.layer_heads.items()} == {2: [("dense", 2)]}


def test_a_layer_mix_is_set_by_its_index() -> None:
    """model.layer_heads has int keys, which OmegaConf's dotted path alone cannot add (it gave an unfilled
    `Key $KEY ($KEY_TYPE)` template); the other layers' mixes stay."""
    override = CONFIGS / "experiments" / "mosa_layer_override.yaml"  # layers 0 and 5 have mixes of their own
    cfg = load_config(override, "model.layer_heads.1=[{type: dense, count: 2}]", "model.layer_heads.0.0.count=3")
    assert {k: [(g.type, g.count) for g in v] for k, v in cfg.model.layer_heads.items()} == {
        0: [("dense", 3)], 1: [("dense", 2)], 5: [("dense", 9)]}
    assert [g.count for g in load_config(CONFIGS / "tiny.yaml", "model.layer_heads.2=[{type: dense, count: 4}]")
            .model.mix(2)] == [4]
    assert error_of(None, "model.layer_heads.9=[{type: dense, count: 2}]") == \
        "model.layer_heads: layer 9 outside [0, 6)"
    hint = "model.layer_heads keys are layer indices, each set to a whole head mix: model.layer_heads.1=["
    for bad, key in (("model.layer_heads.x=[{type: dense, count: 2}]", "model.layer_heads.x"),
                     ("model.layer_heads.1.0.count=2", "model.layer_heads.1")):  # layer 1 has no mix of its own
        assert error_of(None, bad).startswith(f"{key}: {hint}")


def test_an_item_past_the_end_of_a_list_is_named() -> None:
    """Items of lists can be changed, not added, by a dotted override: past the end it names the list and its length
    (it said 'Invalid type assigned: dict is not a subclass of HeadGroupConfig')."""
    mix = "model.layer_heads={1: [{type: dense, count: 2}]}"
    assert error_of(CONFIGS / "tiny.yaml", "model.heads.5.count=3") == \
        "model.heads.5.count: model.heads has 1 item(s), no item 5; to add one, set the whole list (model.heads=[...])"
    assert error_of(CONFIGS / "tiny.yaml", mix, "model.layer_heads.1.1.options.window=8").startswith(
        "model.layer_heads.1.1.options.window: model.layer_heads.1 has 1 item(s), no item 1;")
    assert load_config(CONFIGS / "tiny.yaml", mix, "model.layer_heads.1.0.count=5").model.layer_heads[1][0].count == 5
    assert error_of(CONFIGS / "tiny.yaml", **{"model.heads.5.count": 3}).startswith(  # keyword overrides too
        "model.heads.5.count: model.heads has 1 item(s), no item 5;")


# MoSA App. H Table 4 (layers, h, heads of h'=64) and Table 5 parameter counts (vocab 8000).
# Ours: untied input embedding and output projection (8000 x h each), no biases, 2 LayerNorms per
# block + a final one. Tiny: 6 * (4 * 512 * 576 + 2 * 512 * 2048 + 4 * 512) + 2 * 8000 * 512 + 1024
# = 27.87M vs the paper's "28M" (rounded); all four agree within 1%, so the paper's counts include
# both embedding matrices (with tied embeddings Tiny would be 23.8M, 15% off).
PRESETS = {"tiny": (6, 512, 9, 28e6), "small": (9, 1024, 9, 113e6), "medium": (18, 1024, 9, 210e6),
           "large": (27, 1280, 16, 516e6)}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_match_mosa_table_4_and_5(name: str) -> None:
    layers, width, heads, params = PRESETS[name]
    cfg = load_config(CONFIGS / f"{name}.yaml")
    m = cfg.model
    assert (m.n_layers, m.d_model, m.head_dim, m.ffn_mult * m.d_model) == (layers, width, 64, 4 * width)
    assert [(g.type, g.count) for g in m.heads] == [("dense", heads)]
    assert (m.seq_len, m.vocab_size, cfg.data.batch_size, cfg.optim.lr, cfg.optim.grad_clip,
            cfg.optim.warmup_steps) == (1024, 8000, 64, 2.5e-4, 0.25, 4000)
    with torch.device("meta"):  # count parameters without allocating them
        model = lm.build_model(m)
    assert abs(model.num_params() / params - 1) < 0.01, f"{name}: {model.num_params() / 1e6:.1f}M"
    assert model.kv_total() == layers * heads * 1024


def test_quickstart_preset_is_small() -> None:
    cfg = load_config(CONFIGS / "quickstart.yaml")
    with torch.device("meta"):
        n = lm.build_model(cfg.model).num_params()
    assert 2e6 <= n <= 3e6, f"{n / 1e6:.2f}M params"
    assert cfg.trainer.max_minutes is not None


def test_compression_override_switches_the_optional_section_on() -> None:
    assert load_config(CONFIGS / "tiny.yaml").compression is None
    cfg = load_config(CONFIGS / "tiny.yaml", "compression.ratio=0.25", "compression.layer=3")
    assert (cfg.compression.ratio, cfg.compression.layer) == (0.25, 3)


ROOT = Path(__file__).resolve().parents[1]
BENCH_SETTINGS = {"gutenberg_compare.yaml", "causal_routing.yaml"}  # bench settings, not training configs (own tests)
TRAINING_CONFIGS = sorted(p for p in [*ROOT.glob("configs/*.yaml"), *ROOT.glob("configs/experiments/*.yaml")]
                          if p.name not in BENCH_SETTINGS)


@pytest.mark.parametrize("path", TRAINING_CONFIGS, ids=[p.name for p in TRAINING_CONFIGS])
def test_every_training_config_loads_and_runs(path: Path) -> None:
    """Every shipped config validates and its head mix runs, shrunk to toy width (its layers, head types,
    counts and options kept; T = 256 >= every config's sparsity, block and window)."""
    T = 256
    cfg = load_config(path, "model.d_model=32", "model.head_dim=8", f"model.seq_len={T}", "model.vocab_size=97")
    model = lm.build_model(cfg.model)
    with torch.no_grad():
        logits = model(torch.randint(0, 97, (1, T)))
    assert logits.shape == (1, T, 97) and torch.isfinite(logits).all()
    assert model.kv_total() > 0


def test_no_two_training_configs_share_a_run_directory() -> None:
    """Each config trains into a trainer.out_dir of its own (runs/default, the fallback, would collide)."""
    out_dirs = {path.name: load_config(path).trainer.out_dir for path in TRAINING_CONFIGS}
    shared = {d for d in out_dirs.values() if list(out_dirs.values()).count(d) > 1}
    assert not shared, {name: d for name, d in out_dirs.items() if d in shared}


TINY_SHAPED = [p for p, c in ((p, load_config(p)) for p in TRAINING_CONFIGS if "experiments" in p.parts)
               if c.compression is None and (c.model.d_model, c.model.seq_len) == (512, 1024)]


@pytest.mark.parametrize("path", TINY_SHAPED, ids=[p.name for p in TINY_SHAPED])
def test_tiny_shaped_experiments_train_with_the_dense_baselines_recipe(path: Path) -> None:
    """A sparse Tiny-shaped experiment (e.g. mosa_hybrid.yaml, MoSA Table 2's Tiny row) is compared with
    configs/tiny.yaml: same data, batch and optimizer (App. H), or the comparison is not at equal tokens."""
    cfg, tiny = load_config(path), load_config(CONFIGS / "tiny.yaml")
    assert (cfg.data, cfg.optim, cfg.trainer.max_steps) == (tiny.data, tiny.optim, tiny.trainer.max_steps)


@pytest.mark.parametrize("override,message", [
    ("model.heads=[]", "model.heads: layer 0 has an empty head mix"),
    ("model.layer_heads={1: []}", "model.layer_heads.1: layer 1 has an empty head mix"),
    ("model.heads.0.count=0", "model.heads: dense count must be >= 1, got 0"),
    ("model.layer_heads={1: [{type: dense, count: 0}]}", "model.layer_heads.1: dense count must be >= 1, got 0"),
    ("model.layer_heads={2: [{type: mosa, count: 2, options: {sparsity: 2048}}]}",
     "model.layer_heads.2: mosa: options.sparsity = 2048 > model.seq_len 1024"),
    ("model.layer_heads={1: [{type: dense, count: 2, options: {window: 5}}]}",
     "model.layer_heads.1: head type 'dense': unknown option(s) window; allowed: impl"),
])
def test_a_head_group_error_names_the_mix_it_is_in(override: str, message: str) -> None:
    """A per-layer override's group is named as model.layer_heads.<layer>, the shared mix's as model.heads."""
    assert error_of(None, override) == message


def test_a_config_read_back_from_json_keeps_its_per_layer_mixes() -> None:
    """JSON (a worker's spec, an HF export's config.json) turns layer_heads' int keys into strings: from_dict reads
    "1" as layer 1 again (it refused the key)."""
    import json

    from omegaconf import OmegaConf

    from lm.config_io import from_dict

    cfg = load_config(None, "model.n_layers=3", "model.layer_heads.1=[{type: dense, count: 2}]")
    back = from_dict(json.loads(json.dumps(OmegaConf.to_container(OmegaConf.structured(cfg)))))
    assert back == cfg and list(back.model.layer_heads) == [1]


def test_a_bool_field_takes_only_true_or_false(tmp_path: Path) -> None:
    """OmegaConf reads any integer as a bool (trainer.compile=2 trained compiled without a word): a bool field, in a
    YAML file, a dotted override or a keyword override, takes true/false (yes/no) only, as head options do."""
    from lm.config_io import BOOL_KEYS

    assert BOOL_KEYS == {"trainer.validate_first", "trainer.compile", "trainer.activation_checkpointing", "trainer.deterministic",
                         "compression.detach_prefix"}
    (tmp_path / "c.yaml").write_text("trainer:\n  compile: 2\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: trainer\.compile must be true or false, got 2$"):
        load_config(tmp_path / "c.yaml")
    for update in ("trainer.deterministic=1", "compression.detach_prefix=0"):
        with pytest.raises(ConfigError, match=f"^{update.split('=')[0]} must be true or false, got {update[-1]}$"):
            load_config(None, update)
    with pytest.raises(ConfigError, match=r"^trainer\.activation_checkpointing must be true or false, got 'sometimes'$"):
        load_config(None, trainer__activation_checkpointing="sometimes")
    (tmp_path / "ok.yaml").write_text("trainer:\n  compile: yes\n")
    assert load_config(tmp_path / "ok.yaml", "trainer.deterministic=true").trainer.deterministic
    assert load_config(tmp_path / "ok.yaml").trainer.compile and not load_config(None, "trainer.compile=false").trainer.compile
