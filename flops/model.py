"""Model totals from a ModelConfig (convention: flops/formulas.py), training FLOPs and MFU.

FLOPs per pass = sum over layers of (sum over head groups + FFN 4*m*h^2*T), MoSA App. C; with m = 4
this is 16 h^2 T. The vocabulary projection (2 h V T) is reported separately (`lm_head_flops`) and
left out of `flops_per_pass`, which reproduces MoSA Table 4 exactly.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from flops.formulas import Options, group_cost, sparse_k
from heads.base import ConfigError
from lm.compression import Layout
from lm.config import CompressionConfig, HeadGroupConfig, ModelConfig
from routing.capacity import prefix_quotas, slot_capacity


@dataclass(frozen=True)
class ModelCost:
    flops_per_pass: int  # forward FLOPs of one length-T sequence, vocab projection excluded (Table 4)
    attention_flops: int  # the head groups' share of flops_per_pass
    ffn_flops: int  # the FFNs' share of flops_per_pass
    lm_head_flops: int  # 2 h V T, not in flops_per_pass
    kv_total: int  # KV-cache entries summed over layers and heads (what lm.DecoderLM.kv_total reports)
    kv_per_layer: tuple[int, ...]  # per layer: MoSA Table 2's "KV Total" = T*H_dense + k*H_sparse of one layer
    params: int  # embedding + blocks (incl. layer norms) + final norm + untied vocab projection


def ffn_flops(d_model: int, mult: int, seq_len: int) -> int:
    """h -> m*h -> h on T tokens: two products of 2*h*(m*h)*T (16 h^2 T for m = 4)."""
    return 2 * 2 * d_model * mult * d_model * seq_len


def model_cost(cfg: ModelConfig) -> ModelCost:
    """Analytic cost of the decoder LM described by `cfg` (see lm/model.py for the architecture)."""
    h, hd, T = cfg.d_model, cfg.head_dim, cfg.seq_len
    attn = ffn = params = 0
    kv_layers = []
    for layer in range(cfg.n_layers):
        costs = [group_cost(g.type, h, hd, T, g.count, g.options) for g in cfg.mix(layer)]
        attn += sum(c.flops for c in costs)
        ffn += ffn_flops(h, cfg.ffn_mult, T)
        kv_layers.append(sum(c.kv for c in costs))
        params += sum(c.params for c in costs) + 2 * cfg.ffn_mult * h * h + 4 * h  # + two LayerNorms
    params += 2 * cfg.vocab_size * h + 2 * h  # embedding, untied vocab projection, final LayerNorm
    return ModelCost(
        flops_per_pass=attn + ffn,
        attention_flops=attn,
        ffn_flops=ffn,
        lm_head_flops=2 * h * cfg.vocab_size * T,
        kv_total=sum(kv_layers),
        kv_per_layer=tuple(kv_layers),
        params=params,
    )


def slots_set_by_training_length(g: HeadGroupConfig, window: int, seq_len: int) -> bool:
    """Whether the group's heads size their slots on a `window`-token input from model.seq_len, not from the
    window, so that their formula, which takes k from the window, would miscount them: MoSA's threshold selection
    and Routing's nearest-centroid clusters (capacity ceil(capacity_factor * k(seq_len))) and MoSAIC (k(seq_len)
    per expert) on any other length (4.3x too few for MoSA at a quarter of the length; too many on a longer
    window, e.g. above a compression layer, which sees t + S positions); MoSA's quota and predictor selections,
    whose prefix quota follows the window up to model.seq_len and is capped at the capacity after it, on longer
    windows, and on shorter ones whose quota, min(capacity, ceil(capacity_factor * k(seq_len) * window / seq_len)),
    is not the formula's min(window, ceil(capacity_factor * k(window))) (e.g. 5 slots against 4 at window 18,
    seq_len 32, rho 4; 1 against 2 at window 4)."""
    o = Options(g.type, g.options)
    selection = o.get("selection") if g.type == "mosa" else None
    if g.type == "mosaic" or selection == "threshold" or (g.type == "routing" and o.get("assignment") == "nearest"):
        return window != seq_len
    if selection not in ("quota", "predictor") or window == seq_len:
        return False
    if window > seq_len:
        return True
    sparsity, factor = o.require("sparsity"), o.get("capacity_factor", 1.0)
    k = sparse_k(seq_len, sparsity)
    used = prefix_quotas(k, factor, seq_len, slot_capacity(k, factor))[window - 1]  # heads/mosa.py MosaHeads.quota
    return used != min(window, slot_capacity(sparse_k(window, sparsity), factor))


def layer_flops(cfg: ModelConfig, layer: int, seq_len: int) -> int:
    """Forward FLOPs of block `layer` (its head mix and FFN) on one window of `seq_len` tokens; a ConfigError
    for a window of another length than model.seq_len when a head group's slots are set by model.seq_len."""
    if seq_len != cfg.seq_len:
        for g in cfg.mix(layer):
            if slots_set_by_training_length(g, seq_len, cfg.seq_len):
                raise ConfigError(f"no FLOP count of {g.type} heads ({g.options}) on {seq_len}-token windows: their slots "
                                  f"are set by model.seq_len={cfg.seq_len}, not by the window")
    groups = sum(group_cost(g.type, cfg.d_model, cfg.head_dim, seq_len, g.count, g.options).flops for g in cfg.mix(layer))
    return groups + ffn_flops(cfg.d_model, cfg.ffn_mult, seq_len)


def compressed_flops(cfg: ModelConfig, comp: CompressionConfig, layout: Layout) -> int:
    """Forward FLOPs of one sample of a CompressedLM (lm/compression.py) laid out as prefix chunks,
    each compressed to t states, then a suffix: blocks [0, L) on every chunk and on the suffix
    separately, the compressions (chunk j > 1 is compressed together with the t memory states before
    it), blocks [L, n) on t + suffix. comp.mode = "recent" (the baseline) runs blocks [0, L) only on the
    last chunk(s) holding its t states and compresses nothing; a full layout compresses nothing and runs
    blocks [L, n) on every chunk's states + suffix. Vocabulary projection excluded, as in model_cost."""
    L, compress, t = comp.layer, comp.mode == "compress" and not layout.full, layout.t
    chunks = layout.chunks_used(compress)
    below = sum(layer_flops(cfg, i, n) for n in (*chunks, layout.suffix) for i in range(L))
    above = sum(layer_flops(cfg, i, layout.memory + layout.suffix) for i in range(L, cfg.n_layers))
    options = {"t": t, "ffn_mult": comp.ffn_mult}
    compressions = sum(group_cost("compression", cfg.d_model, cfg.head_dim, n + (t if j else 0), comp.n_heads, options).flops
                       for j, n in enumerate(chunks)) if compress else 0
    return below + compressions + above


TRAINING_PER_FORWARD = 3  # a training step's FLOPs per forward FLOP: backward = 2 x forward


def training_flops(cost: ModelCost, batch_size: int, include_lm_head: bool = False) -> int:
    """FLOPs of one training step: 3 x forward (backward = 2 x forward), for `batch_size` sequences."""
    per_pass = cost.flops_per_pass + (cost.lm_head_flops if include_lm_head else 0)
    return TRAINING_PER_FORWARD * per_pass * batch_size


# Dense bf16 tensor-core peaks (no 2:4 sparsity), TFLOP/s per GPU, from the vendor data sheets. Matched as whole
# words of torch.cuda.get_device_name() ("NVIDIA A100-SXM4-80GB" is an A100, "NVIDIA L40" is not an L4, "NVIDIA
# GH200" not an H200), most specific first.
PEAK_TFLOPS_BF16: dict[str, float] = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM
    "H200 NVL": 835.0,
    "H200": 989.0,
    "H800 PCIe": 756.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
}
# fp16 runs at the bf16 rate on all of those; Volta has fp16 tensor cores only (a bf16 run there has no peak here)
PEAK_TFLOPS_FP16: dict[str, float] = {**PEAK_TFLOPS_BF16, "V100-PCIE": 112.0, "V100": 125.0}
# Dense fp32 peaks without TF32 (the stack never enables it: torch's default "highest" matmul precision runs fp32
# matmuls on the CUDA cores), same sources and matching; a GPU missing here needs --peak-tflops for 32-true runs.
PEAK_TFLOPS_FP32: dict[str, float] = {
    "H100 PCIe": 51.0,
    "H100 NVL": 60.0,
    "H100": 67.0,  # SXM
    "H200 NVL": 60.0,
    "H200": 67.0,
    "H800 PCIe": 51.0,
    "H800": 67.0,
    "GH200": 67.0,
    "A100": 19.5,
    "A800": 19.5,
    "L40S": 91.6,
    "L40": 90.5,
    "L4": 30.3,
    "A10G": 35.0,  # AWS's variant: fewer tensor-core FLOP/s than the A10 (70 vs 125 above), more on the CUDA cores
    "A10": 31.2,
    "V100-PCIE": 14.0,
    "V100": 15.7,  # SXM2
}
PEAKS_BY_PRECISION = {"bf16-mixed": PEAK_TFLOPS_BF16, "bf16-true": PEAK_TFLOPS_BF16, "16-mixed": PEAK_TFLOPS_FP16,
                      "16-true": PEAK_TFLOPS_FP16, "32-true": PEAK_TFLOPS_FP32}


def peak_flops(device_name: str, precision: str = "bf16-mixed") -> float:
    """Dense peak FLOP/s of a GPU at a training precision (Lightning's names: 16-bit ones run on the tensor
    cores, 32-true on the CUDA cores) from its name; ValueError (one line) if not in the table."""
    table = PEAKS_BY_PRECISION.get(precision)
    if re.search(r"(?<![A-Za-z0-9])MIG(?![A-Za-z0-9])", device_name):  # e.g. "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
        raise ValueError(f"device {device_name!r} is a MIG slice, with a fraction of the GPU's peak FLOP/s; "
                         "give its peak with --peak-tflops")
    if table is None:
        raise ValueError(f"no peak FLOP/s table for precision {precision!r}; known: {', '.join(PEAKS_BY_PRECISION)}")
    for key, tflops in table.items():
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name, re.IGNORECASE):
            return tflops * 1e12
    raise ValueError(f"no {precision} peak FLOP/s known for device {device_name!r}; known: {', '.join(table)}")


def mfu(flops_per_step: float, seconds_per_step: float, peak: float, n_devices: int = 1) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the devices' total peak FLOP/s."""
    if seconds_per_step <= 0 or peak <= 0:
        raise ValueError("seconds_per_step and peak must be > 0")
    return flops_per_step / seconds_per_step / (peak * n_devices)
