"""Analytic FLOPs (flops/formulas.py, flops/model.py) against App. C and against the real model's
matmul FLOPs measured by torch.utils.flop_counter.FlopCounterMode."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import lm
from conftest import tiny_config
from flops.formulas import FORMULAS, group_cost, sparse_k
from flops.model import compressed_flops, layer_flops, mfu, model_cost, peak_flops, training_flops
from heads import REGISTRY, ConfigError

h, hd, T = 512, 64, 1024


def test_app_c_per_head_formulas() -> None:
    k = T // 8
    assert group_cost("dense", h, hd, T, 1).flops == 8 * h * hd * T + 4 * hd * T**2
    mosa = 8 * h * hd * k + 4 * hd * k**2 + 2 * h * T + hd * k
    assert group_cost("mosa", h, hd, T, 3, {"sparsity": 8}).flops == 3 * mosa
    assert group_cost("fixed", h, hd, T, 1, {"sparsity": 8}).flops == 8 * h * hd * k + 4 * hd * k**2
    assert type(group_cost("fixed", h, hd, T, 1, {"sparsity": 8.0}).flops) is int  # rho as YAML's 8.0: still an int
    # App. C: rho (6hh'k + 4h'k^2) + 2h'T, i.e. one routing head ~ rho fixed heads
    assert group_cost("routing", h, hd, T, 1, {"sparsity": 8}).flops == 8 * (6 * h * hd * k + 4 * hd * k**2) + 2 * hd * T
    # rho = 200 does not divide T: heads/routing_attn.py still keeps 200 clusters (of k = 5), not T // k = 204
    assert group_cost("routing", h, hd, T, 1, {"sparsity": 200}).flops == 6 * h * hd * T + 200 * 4 * hd * 5**2 + 2 * hd * T
    assert group_cost("local", h, hd, T, 1, {"window": 128}).flops == 8 * h * hd * T + 4 * hd * T * 128
    # top-k scatters its k weights into a dense row and multiplies by all values (as Gupta et al.'s code)
    assert group_cost("topk", h, hd, T, 2, {"k": 64}).flops == group_cost("dense", h, hd, T, 2).flops


def test_agent_and_mita_formulas_in_numbers() -> None:
    """Every term of the agent and MiTA formulas, written out at h = 512, h' = 64, T = 1024 (projections
    8hh'T = 268,435,456)."""
    agent = group_cost("agent", h, hd, T, 1, {"block": 64, "window": 64, "dwc": 3, "bias": 4})
    # + aggregation and broadcast 8h'mT (m = 16 agents) 8,388,608 + window 4h'Tw 16,777,216 + DWC 2Kh'T 393,216
    assert (agent.flops, agent.params, agent.kv) == (293_994_496, 131_072 + 4 * 64 + 8, 1024 + 16)
    # two heads, m = 8, w = 32: 2 x (268,435,456 + 4,194,304 + 8,388,608); no DWC or bias parameters
    assert group_cost("agent", h, hd, T, 2, {"block": 128, "window": 32}).flops == 562_036_736
    mita = group_cost("mita", h, hd, T, 1, {"block": 64, "k": 64, "s": 2, "local_blocks": 2})
    # + landmark scores and routing logits 4h'mT 4,194,304 + shared expert 4h'mT 4,194,304
    # + s = 2 routed experts of k = 64 keys 33,554,432 + two local blocks 4h'T(2b) 33,554,432
    assert (mita.flops, mita.params) == (343_932_928, 131_072)
    # no shared expert, m = 8: + 2,097,152 + one expert of 32 keys 8,388,608 + own block of 128 33,554,432
    assert group_cost("mita", h, hd, T, 1, {"block": 128, "k": 32, "s": 1, "shared": False}).flops == 312_475_648
    # published (over the whole sequence): no window / local term; agent 8,388,608 + DWC 393,216
    assert group_cost("agent", h, hd, T, 1, {"block": 64, "dwc": 3, "variant": "published"}).flops == 277_217_280
    # MiTA: scores and routing 4,194,304 + shared 4,194,304 + s = 2 experts of 64 keys 33,554,432
    assert group_cost("mita", h, hd, T, 1, {"block": 64, "k": 64, "s": 2, "variant": "published"}).flops == 310_378_496


def test_kv_entries_and_short_sequences() -> None:
    assert group_cost("dense", h, hd, T, 9).kv == 9 * T
    assert group_cost("mosa", h, hd, T, 17, {"sparsity": 32}).kv == 17 * 32
    assert group_cost("routing", h, hd, T, 2, {"sparsity": 8}).kv == 2 * T
    # a Routing head keeps each token in one cluster at most, a cluster at most ceil(cf x k) tokens
    assert group_cost("routing", h, hd, T, 2, {"sparsity": 8, "capacity_factor": 0.5}).kv == 2 * 8 * 64
    assert group_cost("routing", h, hd, T, 2, {"sparsity": 8, "capacity_factor": 2.0}).kv == 2 * T
    assert group_cost("local", h, hd, 100, 1, {"window": 256}).kv == 100
    assert sparse_k(10, 64) == 2 and sparse_k(1000, 64) == 15  # App. F: max(floor(T / rho), 2)
    assert group_cost("mosa", h, hd, T, 1, {"sparsity": 8, "capacity_factor": 1.5}).kv == 192


def test_options_from_dataclass_dict_or_head_defaults() -> None:
    from heads import REGISTRY

    as_dataclass = REGISTRY["mosa"].Options(sparsity=16)
    assert group_cost("mosa", h, hd, T, 2, as_dataclass) == group_cost("mosa", h, hd, T, 2, {"sparsity": 16})
    default = REGISTRY["mosa"].Options().sparsity  # a dict without sparsity takes the head's default
    assert group_cost("mosa", h, hd, T, 1, {}) == group_cost("mosa", h, hd, T, 1, {"sparsity": default})


def test_unknown_head_type_is_one_line() -> None:
    with pytest.raises(ConfigError, match="no FLOP formula for head type 'nope'; known: .*dense"):
        group_cost("nope", h, hd, T, 1)


def test_training_flops_and_mfu() -> None:
    cost = model_cost(lm.ModelConfig())
    assert training_flops(cost, 64) == 3 * 64 * cost.flops_per_pass
    assert training_flops(cost, 1, include_lm_head=True) == 3 * (cost.flops_per_pass + 2 * 512 * 8000 * 1024)
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("NVIDIA H200 NVL") == 835e12
    # whole words: an L40 is not an L4, a workstation RTX A1000 not an A100, a GH200 is listed as itself
    assert peak_flops("NVIDIA L40") == 181e12 and peak_flops("NVIDIA L4") == 121e12
    assert peak_flops("NVIDIA GH200 480GB") == 989e12 and peak_flops("NVIDIA A10G") == 70e12
    assert peak_flops("NVIDIA H800 PCIe") == 756e12 and peak_flops("NVIDIA H800") == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16-true") == peak_flops("NVIDIA H100 80GB HBM3", "16-mixed")
    # fp32 runs (the stack never enables TF32) are measured against the CUDA cores' fp32 peak, not the tensor cores'
    assert peak_flops("NVIDIA H100 80GB HBM3", "32-true") == 67e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "32-true") == 19.5e12
    assert peak_flops("Tesla V100-PCIE-16GB", "32-true") == 14e12
    assert peak_flops("Tesla V100-SXM2-16GB", "32-true") == 15.7e12
    # Volta: fp16 tensor cores (PCIe 112, SXM2 125), no bf16
    assert peak_flops("Tesla V100-PCIE-16GB", "16-mixed") == 112e12
    assert peak_flops("Tesla V100-SXM2-16GB", "16-mixed") == 125e12
    with pytest.raises(ValueError, match="no bf16-mixed peak FLOP/s known for device 'Tesla V100-SXM2-16GB'"):
        peak_flops("Tesla V100-SXM2-16GB", "bf16-mixed")
    assert peak_flops("NVIDIA A10G", "32-true") == 35e12 and peak_flops("NVIDIA A10", "32-true") == 31.2e12
    assert mfu(156e12, 1.0, 312e12) == pytest.approx(0.5)
    assert mfu(156e12, 1.0, 312e12, n_devices=4) == pytest.approx(0.125)  # the step's FLOPs over 4 devices' peak
    for unknown in ("Some CPU", "NVIDIA RTX A1000", "NVIDIA A1000X"):
        with pytest.raises(ValueError, match="no bf16-mixed peak FLOP/s known"):
            peak_flops(unknown)
    with pytest.raises(ValueError, match="no 32-true peak FLOP/s known for device 'NVIDIA B200'"):
        peak_flops("NVIDIA B200", "32-true")
    for mig in ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "NVIDIA H100 80GB HBM3 MIG 3g.40gb"):  # a slice's peak is a fraction
        with pytest.raises(ValueError, match="is a MIG slice, .* give its peak with --peak-tflops$"):
            peak_flops(mig)
    with pytest.raises(ValueError, match="no peak FLOP/s table for precision '64-true'"):
        peak_flops("NVIDIA H100 80GB HBM3", "64-true")


def _counted(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    return _counted_with(model, tokens)


def _cpu_sdpa_flops(q: tuple, k: tuple, v: tuple, *args: object, out_shape: object = None, **kwargs: object) -> int:
    return sdpa_flop_count(q, k, v)  # CPU's fused SDPA kernel, which the counter does not know


def _counted_with(model: torch.nn.Module, *inputs: object) -> int:
    """Matmul FLOPs (linear, bmm, SDPA incl. its CPU kernel) of one forward pass."""
    cpu_sdpa = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=cpu_sdpa) as counter:
        model(*inputs)
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "heads,elementwise_per_head,tol",
    [
        ([{"type": "dense", "count": 4}], 0, 0),
        # MoSA's h'k (scaling the head output by the router scores) is element-wise: the flop counter
        # does not see it, so it is taken out of the analytic count explicitly.
        (
            [{"type": "dense", "count": 2}, {"type": "mosa", "count": 6, "options": {"sparsity": 4, "selection": "expert_choice"}}],
            8 * (64 // 4), 0,
        ),
        ([{"type": "fixed", "count": 6, "options": {"sparsity": 4}}], 0, 0),
        ([{"type": "fixed", "count": 6, "options": {"sparsity": 5}}], 0, 0),  # rho does not divide T: 13 tokens
        # Routing: the formula counts every cluster full (k slots) and the paper's 2h'T cluster selection; the
        # reference attends over each cluster's actual members (some clusters turn tokens away, some stay short)
        # and finds the nearest of rho centroids (2h'T*rho): data-dependent, -0.34% here
        ([{"type": "dense", "count": 2}, {"type": "routing", "count": 2, "options": {"sparsity": 4}}], 0, 0.01),
        # top-k multiplies its scattered weights by all values, as Gupta et al.'s code: a dense head's FLOPs
        ([{"type": "dense", "count": 2}, {"type": "topk", "count": 2, "options": {"k": 8}}], 0, 0),
        # MoSAIC: every expert computes on its k = T / rho slots, filled or not, with MoSA's element-wise h'k
        ([{"type": "dense", "count": 2}, {"type": "mosaic", "count": 6, "options": {"sparsity": 4}}], 8 * (64 // 4), 0),
    ],
    ids=["dense", "mosa", "fixed", "fixed-uneven", "routing", "topk", "mosaic"],
)
def test_analytic_matches_flop_counter(heads: list[dict], elementwise_per_head: int, tol: float) -> None:
    """Reference implementation, CPU: matmul FLOPs (linear, bmm, SDPA) of one forward pass equal the
    analytic count + the vocabulary projection 2hVT (not in Table 4's totals) - element-wise terms, exactly
    (to `tol` where the executed work depends on the routing). Gathers and scatters cost no FLOPs in either count."""
    torch.manual_seed(0)
    for g in heads:
        g.setdefault("options", {})["impl"] = "reference"
    cfg = tiny_config(heads, d_model=32, head_dim=8, seq_len=64).model
    model = lm.build_model(cfg)
    B = 2
    counted = _counted(model, torch.randint(0, cfg.vocab_size, (B, cfg.seq_len)))
    cost = model_cost(cfg)
    n_sparse = sum(g["count"] for g in heads if g["type"] != "dense") * cfg.n_layers
    expected = B * (cost.flops_per_pass + cost.lm_head_flops - n_sparse * elementwise_per_head)
    assert abs(counted - expected) <= tol * expected, (counted, expected)
    assert cost.params == model.num_params()
    assert cost.kv_total == model.kv_total()


def test_published_agent_fast_path_executes_its_count() -> None:
    """Agent attention as published (eq. 6, no window) on its fast path, CPU: the matmul and convolution FLOPs of a
    forward pass equal the analytic count + the vocabulary projection exactly: projections, A K^T and its V, Q A^T
    and its V_A (two SDPA calls), the DWC as a depthwise convolution (2Kh'T per head)."""
    torch.manual_seed(0)
    heads = [{"type": "dense", "count": 1}, {"type": "agent", "count": 3,
                                             "options": {"block": 8, "dwc": 3, "variant": "published"}}]
    cfg = tiny_config(heads, d_model=32, head_dim=8, seq_len=64).model
    B, cost = 2, model_cost(cfg)
    counted = _counted(lm.build_model(cfg), torch.randint(0, cfg.vocab_size, (B, cfg.seq_len)))
    assert counted == B * (cost.flops_per_pass + cost.lm_head_flops)


# Head types whose fast path executes other than their algorithmic count (flops/formulas.py says which and why):
# the bounds of executed / counted FLOPs for the head group alone at the tiny models' shapes. Every other type, a
# new one included, must execute its count to within 1% (MoSA's and MoSAIC's element-wise h'k, which the counter
# does not see), so a formula that states another head's work fails here.
EXECUTED_OVER_COUNTED = {
    "local": (1.0, 1.15),  # band_layout: blocks of w queries score 2w keys (1.11 at w = 8)
    "agent": (1.0, 1.15),  # the same band of 2b window keys, whatever w (1.09 at T = 64, 1.06 at 256)
    "mita": (1.0, 1.3),  # routed experts grouped in blocks of b queries, padded (1.11 at T = 64, 1.25 at 256)
    "routing": (0.97, 1.03),  # clusters hold their actual members, not k each: data-dependent (1.02, 1.01)
}


@pytest.mark.parametrize("seq_len", [64, 256])
@pytest.mark.parametrize("head_type", sorted(REGISTRY))
def test_every_head_type_executes_its_counted_flops(head_type: str, seq_len: int) -> None:
    """Every registered type's formula against torch's counter on the type's default (fast) path, CPU, with
    tiny_options: the matmul FLOPs of a model with 3 heads of the type minus those of one with 1 head (the head group
    alone: embeddings, FFNs and the vocabulary projection cancel) over the formula's difference."""
    from tests.head_checks import tiny_options

    def executed_and_counted(count: int) -> tuple[int, int]:
        heads = [{"type": head_type, "count": count, "options": tiny_options(head_type)}]
        cfg = tiny_config(heads, d_model=32, head_dim=8, seq_len=seq_len).model
        torch.manual_seed(0)
        model = lm.build_model(cfg).eval()
        cost = model_cost(cfg)
        return _counted(model, torch.randint(0, cfg.vocab_size, (2, seq_len))), 2 * cost.flops_per_pass

    (e3, c3), (e1, c1) = executed_and_counted(3), executed_and_counted(1)
    low, high = EXECUTED_OVER_COUNTED.get(head_type, (0.99, 1.0))
    assert low <= (e3 - e1) / (c3 - c1) <= high, f"{head_type}: executes {e3 - e1}, formula counts {c3 - c1}"


# The bounds over every value of an option the type's grid() draws (one option at a time, on example(), T = 256)
# where the option changes the executed layout; every other option keeps its type's EXECUTED_OVER_COUNTED bounds.
GRID_EXECUTED_OVER_COUNTED = {
    ("local", "window"): (1.0, 1.25),  # a window near T scores the masked causal square (1.21 at w = 200)
    ("agent", "block"): (1.0, 1.25),  # block 16: a band of 2b keys for an 8-key window (1.23)
    ("mita", "block"): (1.0, 1.5),  # blocks of 1-5 queries, routed groups padded to them (1.30-1.44)
    ("mita", "k"): (1.0, 1.4),  # k = 64 experts padded to blocks of 8 queries (1.35)
    ("routing", "sparsity"): (0.97, 1.05),  # data-dependent cluster sizes (1.04 at rho = 8)
    ("topk", "chunk"): (0.55, 1.0),  # a chunk < T skips the key chunks after each query chunk (0.60-0.61)
}


@pytest.mark.parametrize("head_type", sorted(REGISTRY))
def test_every_option_value_keeps_the_formulas_true(head_type: str) -> None:
    """For each option the type's grid() names and each of its values (set alone on example(), T = 256): the
    formula's parameters and KV entries are the built model's exactly, and its FLOPs within the type's bounds of what
    the fast path executes, so that a new option value whose formula forgets its work fails here. Values the tiny
    model refuses (a config check) are skipped, but every option must build with at least one of its values."""
    from tests.head_checks import tiny_options

    for key, values in REGISTRY[head_type].Options.grid().items():
        low, high = GRID_EXECUTED_OVER_COUNTED.get((head_type, key), EXECUTED_OVER_COUNTED.get(head_type, (0.99, 1.0)))
        built = 0
        for value in values:
            options, what = {**tiny_options(head_type), key: value}, f"{head_type} {key}={value!r}"

            def executed_and_counted(count: int) -> tuple[int, int]:
                cfg = tiny_config([{"type": head_type, "count": count, "options": options}], d_model=32, head_dim=8,
                                  seq_len=256).model
                torch.manual_seed(0)
                model = lm.build_model(cfg).eval()
                cost = model_cost(cfg)
                assert cost.params == model.num_params(), f"{what}: params {cost.params} != {model.num_params()}"
                assert cost.kv_total == model.kv_total(), f"{what}: KV {cost.kv_total} != {model.kv_total()}"
                return _counted(model, torch.randint(0, cfg.vocab_size, (2, 256))), 2 * cost.flops_per_pass

            try:
                (e5, c5), (e3, c3) = executed_and_counted(5), executed_and_counted(3)
            except ConfigError:
                continue
            built += 1
            assert low <= (e5 - e3) / (c5 - c3) <= high, f"{what}: executes {e5 - e3}, formula counts {c5 - c3}"
        assert built, f"{head_type}: no value of option {key} in grid() builds a model at T = 256"


@pytest.mark.parametrize("mode,spans,full", [("compress", (12,), False), ("compress", (12, 9, 12), False),
                                             ("recent", (12, 9), False), ("recent", (12, 9, 2), False),
                                             ("compress", (), False), ("compress", (12, 9), True), ("recent", (12, 9), True)])
def test_compressed_model_matches_flop_counter(mode: str, spans: tuple[int, ...], full: bool) -> None:
    """A CompressedLM forward (blocks below L on each chunk and the suffix, the compressions, blocks
    above L on t + S; the `recent` baseline only on the chunks holding its t states; a full layout on
    every chunk, no compression, blocks above L on prefix + S): counted matmul FLOPs = compressed_flops +
    the vocabulary projection on the suffix."""
    from lm.compression import CompressedLM, Layout
    from lm.config import CompressionConfig

    torch.manual_seed(0)
    cfg = tiny_config([{"type": "dense", "count": 3}], n_layers=4, d_model=32, head_dim=8, seq_len=16).model
    comp = CompressionConfig(layer=2, n_heads=2, prefix_len=12, ratio=0.25, mode=mode)
    layout, B = Layout(spans, 0 if full else 3, 10, full), 2
    counted = _counted_with(CompressedLM(cfg, comp).eval(), torch.randint(0, cfg.vocab_size, (B, layout.window)), layout)
    analytic = compressed_flops(cfg, comp, layout)
    expected = B * (analytic + 2 * cfg.d_model * cfg.vocab_size * layout.suffix)
    assert counted == expected


@pytest.mark.parametrize("options", [{"sparsity": 4, "selection": "threshold"}, {"sparsity": 4, "selection": "quota"}])
def test_compressed_flops_refuse_heads_whose_slots_the_training_length_sets(options: dict) -> None:
    """Below L the blocks run on chunks shorter than model.seq_len: a MoSA threshold head still computes on
    capacity(seq_len) slots there, which its formula at the chunk's length would undercount, so it is refused
    in one line; a quota head's slots follow the chunk and its count matches the counter."""
    from lm.compression import CompressedLM, Layout
    from lm.config import CompressionConfig

    torch.manual_seed(0)
    # the fast path computes on every slot of the layout (the reference only on the tokens actually selected)
    heads = [{"type": "dense", "count": 1}, {"type": "mosa", "count": 3, "options": options}]
    cfg = tiny_config(heads, n_layers=4, d_model=32, head_dim=8, seq_len=32).model
    comp, layout, B = CompressionConfig(layer=2, n_heads=2, prefix_len=16, ratio=0.25), Layout((16,), 4, 16), 2
    if options["selection"] == "threshold":
        with pytest.raises(ConfigError, match="no FLOP count of mosa heads .* on 16-token windows: their slots are set "
                                              "by model.seq_len=32"):
            compressed_flops(cfg, comp, layout)
        return
    counted = _counted_with(CompressedLM(cfg, comp).eval(), torch.randint(0, cfg.vocab_size, (B, layout.window)), layout)
    # MoSA's h'k output scaling (App. C), 3 heads of h' = 8: 2 blocks below L x 2 windows of 16 tokens (k = 4), and
    # 2 blocks above L on t + suffix = 20 tokens (k = 5)
    elementwise = 2 * 2 * 3 * 8 * (16 // 4) + 2 * 3 * 8 * (20 // 4)
    assert counted == B * (compressed_flops(cfg, comp, layout) + 2 * cfg.d_model * cfg.vocab_size * layout.suffix - elementwise)


@pytest.mark.parametrize("window", [16, 48])
@pytest.mark.parametrize("head", ["mosa", "mosaic"])
def test_layer_flops_refuse_fixed_slot_heads_on_any_other_window(window: int, head: str) -> None:
    """A MoSA threshold head keeps capacity(model.seq_len) slots on a window of any length (above a compression
    layer the blocks see t + S > seq_len positions), and so does a MoSAIC head (k(seq_len) per expert): their
    formula, which takes k from the window, is refused on a shorter and on a longer window alike, and counts the
    training window."""
    options = {"sparsity": 4, "selection": "threshold"} if head == "mosa" else {"sparsity": 4}
    cfg = tiny_config([{"type": head, "count": 3, "options": options}], n_layers=2, d_model=32, head_dim=8,
                      seq_len=32).model
    assert layer_flops(cfg, 0, 32) > 0
    with pytest.raises(ConfigError, match=f"no FLOP count of {head} heads .* on {window}-token windows"):
        layer_flops(cfg, 0, window)


@pytest.mark.parametrize("selection", ["quota", "predictor"])
def test_layer_flops_refuse_quota_heads_on_longer_windows(selection: str) -> None:
    """A quota (or predictor) head's slots follow a shorter window but stop at capacity(model.seq_len) on a longer one
    (above a compression layer with a suffix of seq_len): counted by its formula at the window's k, 48 tokens would
    read 12 slots where the head computes on 8."""
    heads = [{"type": "mosa", "count": 3, "options": {"sparsity": 4, "selection": selection}}]
    cfg = tiny_config(heads, n_layers=2, d_model=32, head_dim=8, seq_len=32).model
    assert layer_flops(cfg, 0, 16) > 0
    with pytest.raises(ConfigError, match="no FLOP count of mosa heads .* on 48-token windows"):
        layer_flops(cfg, 0, 48)


@pytest.mark.parametrize("window, slots", [(16, 4), (20, 5), (6, 2), (18, None), (4, None)])
def test_layer_flops_count_quota_heads_on_shorter_windows_only_where_the_formula_holds(window: int, slots: int | None) -> None:
    """On a window W < model.seq_len = 32 a quota head computes on its prefix quota, ceil(k(32) W / 32) slots (rho = 4):
    where that is the formula's k(W) = max(floor(W / 4), 2) it is counted exactly (less App. C's element-wise h'k):
    4 slots at W = 16, 5 at 20, 2 at 6; elsewhere it is refused: 5 slots at W = 18 (formula 4), 1 at 4 (formula 2)."""
    heads = [{"type": "mosa", "count": 3, "options": {"sparsity": 4, "selection": "quota"}}]
    cfg = tiny_config(heads, n_layers=1, d_model=32, head_dim=8, seq_len=32).model
    if slots is None:
        with pytest.raises(ConfigError, match=f"no FLOP count of mosa heads .* on {window}-token windows"):
            layer_flops(cfg, 0, window)
        return
    torch.manual_seed(0)
    counted = _counted(lm.build_model(cfg).eval(), torch.randint(0, cfg.vocab_size, (1, window)))
    lm_head, elementwise = 2 * cfg.d_model * cfg.vocab_size * window, 3 * cfg.head_dim * slots
    assert counted == layer_flops(cfg, 0, window) + lm_head - elementwise


def test_every_registered_formula_has_a_name_in_the_registry() -> None:
    # one formula per head type, none for a type that does not exist; plus the compression layer (lm/compression.py)
    missing = set(REGISTRY) - set(FORMULAS)
    assert not missing, f"head type(s) {sorted(missing)} have no @formula in flops/formulas.py (README, adding a head type)"
    assert set(FORMULAS) == set(REGISTRY) | {"compression"}
    cfg = dataclasses.replace(lm.ModelConfig(), heads=[lm.config.HeadGroupConfig("dense", 9)])
    assert model_cost(cfg).flops_per_pass == 54_760_833_024  # Table 4, Tiny


@pytest.mark.parametrize("head_type", sorted(REGISTRY))
def test_params_and_kv_formulas_match_the_built_model(head_type: str) -> None:
    """Every type's formula states the parameters of the module it describes, exactly, and group_cost reports the
    model's KV entries (FLOPs of masked or banded kernels are checked against the counter above where the executed
    work is the counted one)."""
    from tests.head_checks import tiny_options

    heads = [{"type": "dense", "count": 1}, {"type": head_type, "count": 3, "options": tiny_options(head_type)}]
    cfg = tiny_config(heads, d_model=32, head_dim=8, seq_len=64).model
    model = lm.build_model(cfg)
    cost = model_cost(cfg)
    assert cost.params == model.num_params()
    # wiring only: both sides read Options.kv_per_head (the built caches hold exactly that many entries:
    # tests/test_generate.py), except the selective types, whose model counts its slots itself
    assert cost.kv_total == model.kv_total()


def test_window_and_block_terms_at_lengths_they_do_not_divide() -> None:
    """The clamps and integer divisions of App. C-style counts, written out (h = 512, h' = 64): a local window
    longer than T scores T keys; agent attention has m = T // b = 15 agents at T = 1000, b = 64; MiTA's local
    blocks cover at most T tokens (2 x 64 > T = 100, and no landmark is left to route to), and a query routes to at
    most the (T - 1) // b - L + 1 = 15 landmarks before its local block (s = 16 asked, T = 1024, b = 64)."""
    h, hd = 512, 64
    dense = lambda T: 8 * h * hd * T  # noqa: E731  (Q, K, V, O on every token)
    assert group_cost("local", h, hd, 100, 1, {"window": 256}).flops == dense(100) + 4 * hd * 100 * 100
    assert group_cost("agent", h, hd, 1000, 1, {"block": 64, "window": 64}).flops == (
        dense(1000) + 8 * hd * 15 * 1000 + 4 * hd * 1000 * 64)
    landmarks_and_shared = lambda m, T: 4 * hd * m * T + 4 * hd * m * T  # noqa: E731  (scores, routing; shared expert)
    assert group_cost("mita", h, hd, 100, 1, {"block": 64, "k": 32, "s": 1, "local_blocks": 2}).flops == (
        dense(100) + landmarks_and_shared(1, 100) + 4 * hd * 100 * 100)
    assert group_cost("mita", h, hd, 1024, 1, {"block": 64, "k": 64, "s": 16}).flops == (
        dense(1024) + landmarks_and_shared(16, 1024) + 4 * hd * 1024 * 15 * 64 + 4 * hd * 1024 * 64)


def test_terms_clamped_to_a_window_shorter_than_their_option() -> None:
    """Each head's per-query term is clamped to the T tokens there are, as its docstring states and its fast path
    executes, also where an option exceeds T: on a compressed model's short chunks (flops.model.layer_flops on a
    window < model.seq_len) or a Routing cluster whose ceil(capacity_factor * k) slots exceed T (h = 512, h' = 64).
    Agent: the window term is 4h'T*min(w, T) (w = 64 > T = 40, no completed block); MiTA: a routed expert holds
    min(k, T) keys (k = 128 > T = 100: m = 6 landmarks, s = 1, own block of 16); Routing: rho = 2 clusters of
    min(T, ceil(3 x 32)) = T = 64 slots each."""
    h, hd = 512, 64
    dense = lambda T: 8 * h * hd * T  # noqa: E731  (Q, K, V, O on every token)
    assert group_cost("agent", h, hd, 40, 1, {"block": 64, "window": 64}).flops == dense(40) + 4 * hd * 40 * 40
    landmarks_and_shared = lambda m, T: 4 * hd * m * T + 4 * hd * m * T  # noqa: E731  (scores, routing; shared expert)
    assert group_cost("mita", h, hd, 100, 1, {"block": 16, "k": 128, "s": 1}).flops == (
        dense(100) + landmarks_and_shared(6, 100) + 4 * hd * 100 * 1 * 100 + 4 * hd * 100 * 16)
    assert group_cost("routing", h, hd, 64, 1, {"sparsity": 2, "capacity_factor": 3.0}).flops == (
        6 * h * hd * 64 + 2 * 4 * hd * 64 * 64 + 2 * hd * 64)


def test_counting_refuses_missing_options_and_sparsities_below_one() -> None:
    """A formula's required option that is unset (the compression layer has no defaults; None overrides a head's
    default) is a one-line ConfigError naming the type and option, not a TypeError; so is k for rho < 1."""
    with pytest.raises(ConfigError, match="^compression: option 't' is required to count FLOPs$"):
        group_cost("compression", h, hd, T, 4, {})
    with pytest.raises(ConfigError, match="^head type 'mosa': option sparsity must be an int, got None$"):
        group_cost("mosa", h, hd, T, 1, {"sparsity": None})  # its slots come from MoSAOptions.kv_per_head
    with pytest.raises(ConfigError, match="^head type 'local': option window must be an int, got None$"):
        group_cost("local", h, hd, T, 1, {"window": None})
    for rho in (0.5, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=f"^sparsity must be a finite number >= 1, got {rho}$"):
            sparse_k(T, rho)
    assert sparse_k(T, 1) == T


def test_counting_validates_options_and_counts_first() -> None:
    """Bad option values are refused by the head type's own validation before its formula runs (no
    ZeroDivisionError, no silent count), and so is a negative head count."""
    with pytest.raises(ConfigError, match="^agent: options.block must be >= 1, got 0$"):
        group_cost("agent", h, hd, T, 1, {"block": 0})
    with pytest.raises(ConfigError, match="^head type 'routing': option sparsity must be an int, got nan$"):
        group_cost("routing", h, hd, T, 1, {"sparsity": float("nan")})
    with pytest.raises(ConfigError, match="^dense: head count must be >= 0, got -3$"):
        group_cost("dense", h, hd, T, -3)


@pytest.mark.parametrize("seconds, peak", [(0.0, 312e12), (-1.0, 312e12), (1.0, 0.0), (1.0, -312e12)])
def test_mfu_refuses_a_step_time_or_peak_that_is_not_positive(seconds: float, peak: float) -> None:
    """No division by zero and no negative utilisation: a ValueError."""
    with pytest.raises(ValueError, match="^seconds_per_step and peak must be > 0$"):
        mfu(156e12, seconds, peak)


def test_finite_number_arguments_refuse_text(capsys: pytest.CaptureFixture[str]) -> None:
    """flops.cli.finite_float (bench.compression_experiment --tolerances) rejects a word as it rejects nan and inf:
    one line, exit status 2, before any checkpoint is read."""
    from bench.compression_experiment import main

    with pytest.raises(SystemExit) as stop:
        main(["--compressed", "a", "--baseline", "b", "--data", "c", "--tolerances", "0.1,abc"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == "error: argument --tolerances: expected a finite number, got 'abc'\n"
