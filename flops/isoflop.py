"""IsoFLOP solver (MoSA Sec. 3, App. C/H): the most sparse heads that fit a dense baseline's budget.

Keep `dense_heads` dense heads of the baseline (4 in the paper's hybrids, 0 = pure) and add the
largest number n of sparse heads of one type such that the model's FLOPs per pass do not exceed
the baseline's. Sparsity 1 is the dense baseline itself (Table 5's first column).

    python -m flops.isoflop --size tiny --head mosa --sparsity 8 --dense-heads 4 --json
    python -m flops.isoflop --config configs/quickstart.yaml --head mosa --sparsity 8 --dense-heads 1

With --config, the baseline is that YAML's model (it must be dense: one dense head group in every layer).
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

from flops.cli import flop_count, positive_int, script_parser
from flops.formulas import Options, sparse_k
from flops.model import model_cost
from flops.presets import SIZES, baseline
from heads.base import ConfigError, head_class, make_options
from lm.config import HeadGroupConfig, ModelConfig, load_config


@dataclass(frozen=True)
class IsoFlopResult:
    head: str
    sparsity: float | None
    k: int | None  # T / rho, MoSA's tokens per head (a capacity_factor c scales what a head keeps: kv_per_layer)
    dense_heads: int
    sparse_heads: int
    flops_per_pass: int
    baseline_flops_per_pass: int
    budget_used: float  # flops_per_pass / baseline_flops_per_pass (<= 1)
    kv_total: int  # summed over layers
    baseline_kv_total: int
    kv_per_layer: int  # MoSA Table 2's "KV Total" (one layer)
    params: int
    baseline_params: int
    heads: list[dict[str, Any]]  # the head mix, ready for ModelConfig.heads / a YAML config
    warning: str | None = None  # the sparse group's one-line advice (e.g. MoSAIC load far from capacity)


def _mix(dense: int, head: str, n: int, options: dict[str, Any]) -> list[HeadGroupConfig]:
    groups = [HeadGroupConfig("dense", dense, {})] if dense else []
    return groups + ([HeadGroupConfig(head, n, dict(options))] if n else [])


def check_sparsity(seq_len: int, sparsity: float) -> int:
    """k = T / rho for an IsoFLOP point: rho must divide T and leave k >= 2 (one-line errors)."""
    if not (math.isfinite(sparsity) and sparsity >= 1 and sparsity == int(sparsity)):
        raise ConfigError(f"sparsity must be a positive integer, got {sparsity}")
    if seq_len % int(sparsity):
        raise ConfigError(f"sparsity {int(sparsity)} does not divide seq_len {seq_len}")
    if seq_len // int(sparsity) < 2:
        raise ConfigError(f"sparsity {int(sparsity)} leaves k = {seq_len // int(sparsity)} < 2 tokens per head (T = {seq_len})")
    return sparse_k(seq_len, sparsity)


def option_names(head: str) -> list[str]:
    """The options of head type `head` (a one-line ConfigError naming the known types if there is no such type)."""
    return [f.name for f in dataclasses.fields(head_class(head).Options)]


def solve(
    base: ModelConfig, head: str, sparsity: float | None = None, dense_heads: int = 4, options: dict[str, Any] | None = None
) -> IsoFlopResult:
    """FLOP-match `head` heads to the dense baseline `base` (one dense group in every layer)."""
    fields = option_names(head)  # FORMULAS also counts the compression layer, which is no head type
    if base.layer_heads or len(base.heads) != 1 or base.heads[0].type != "dense":
        raise ConfigError("the baseline must be one dense head group in every layer")
    total_heads = base.heads[0].count
    if not 0 <= dense_heads <= total_heads:
        raise ConfigError(f"dense_heads must be in [0, {total_heads}], got {dense_heads}")
    options = dict(options or {})
    if sparsity is not None and "sparsity" in options and options["sparsity"] != sparsity:
        raise ConfigError(f"sparsity {sparsity} conflicts with option sparsity={options['sparsity']}")
    # unknown options, wrong types and bad values: the same check as training's
    if sparsity not in (None, 1) and "sparsity" not in fields:  # 1: the dense baseline, for any type (Table 5)
        raise ConfigError(f"--sparsity does not apply to {head} heads (their options: {', '.join(fields)})")
    given = {"sparsity": sparsity} if sparsity is not None and "sparsity" in fields else {}
    make_options(head, {**options, **given}, base.group_context(0)).validate_length(head, base.seq_len)
    if sparsity is None:  # the head type's own option or default, e.g. mosa's sparsity 8
        sparsity = Options(head, options).get("sparsity")
    k = None
    if sparsity is not None:
        k = check_sparsity(base.seq_len, sparsity)
        options["sparsity"] = int(sparsity)
    ref = model_cost(base)

    def cost(dense: int, n: int):
        return model_cost(dataclasses.replace(base, heads=_mix(dense, head, n, options)))

    if sparsity == 1:  # Table 5: sparsity 1 is the dense baseline
        dense_heads, n = total_heads, 0
    else:
        lo, hi = 0, 1  # cost(lo) fits; grow hi until it does not, then bisect
        if cost(dense_heads, 1).flops_per_pass <= ref.flops_per_pass:
            while cost(dense_heads, hi).flops_per_pass <= ref.flops_per_pass:
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if cost(dense_heads, mid).flops_per_pass <= ref.flops_per_pass else (lo, mid)
        n = lo
        if n == 0:  # a "sparse" point without sparse heads would be the dense baseline under another name
            raise ConfigError(f"not even one {head} head fits in the baseline's FLOP budget next to "
                              f"{dense_heads} dense heads")
    got = cost(dense_heads, n)
    warning = None
    if n:  # (n = 0: the dense baseline of sparsity 1)
        made = make_options(head, options, base.group_context(0))
        try:  # options that need a head count (MoSAIC's top_s): training's check, on the count found
            made.validate_count(n)
        except ConfigError as err:
            raise ConfigError(f"{err}: {n} {head} heads fit the FLOP budget, a mix training would refuse") from None
        warning = made.advice(n)
    return IsoFlopResult(
        head=head,
        sparsity=sparsity,
        k=k,
        dense_heads=dense_heads,
        sparse_heads=n,
        flops_per_pass=got.flops_per_pass,
        baseline_flops_per_pass=ref.flops_per_pass,
        budget_used=got.flops_per_pass / ref.flops_per_pass,
        kv_total=got.kv_total,
        baseline_kv_total=ref.kv_total,
        kv_per_layer=got.kv_per_layer[0],
        params=got.params,
        baseline_params=ref.params,
        heads=[dataclasses.asdict(g) for g in _mix(dense_heads, head, n, options)],
        warning=warning,
    )


def _parse_option(text: str) -> tuple[str, Any]:
    if "=" not in text or not text.split("=", 1)[0]:
        raise ConfigError(f"--option expects key=value, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_options(texts: list[str]) -> dict[str, Any]:
    """--option KEY=VALUE ... -> {key: value} (JSON values where they parse); a key given twice with
    different values is a one-line ConfigError. Types are checked against the head's Options in solve()."""
    out: dict[str, Any] = {}
    for key, value in map(_parse_option, texts):
        if key in out and out[key] != value:
            raise ConfigError(f"--option {key} given twice: {out[key]!r} and {value!r}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, "python -m flops.isoflop")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--size", help=f"dense baseline preset: {', '.join(SIZES)} (default tiny)")
    where.add_argument("--config", help="dense baseline: the model of this YAML config (configs/*.yaml)")
    p.add_argument("--head", required=True, help="sparse head type (a registered head, heads/__init__.py)")
    p.add_argument("--sparsity", type=positive_int, help="rho; k = T / rho tokens per sparse head (default: the head "
                   "type's own option, e.g. mosa's 8; 1 = the dense baseline, for any type)")
    p.add_argument("--dense-heads", type=int, default=4, help="dense heads kept (default 4; 0 = pure)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="extra head option, e.g. window=64")
    for name in ("seq-len", "hidden", "layers", "heads", "head-dim"):
        p.add_argument(f"--{name}", type=int, help="override the preset's or config's")
    p.add_argument("--vocab-size", type=positive_int, help="override the preset's or config's vocabulary (parameters "
                   "count it: the sweep's or a run's model.vocab_size)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    size = None if a.config else a.size or "tiny"  # (no default in the parser: --size tiny would pass with --config)
    try:
        loaded = load_config(a.config, warnings=False) if a.config else None
        if loaded is not None and loaded.compression is not None:
            raise ConfigError(f"{a.config} has a compression section: its FLOPs depend on the layout "
                              "(flops.model.compressed_flops); give a dense model's config")
        base = baseline(size, loaded.model if loaded else None, n_layers=a.layers,
                        d_model=a.hidden, head_dim=a.head_dim, n_heads=a.heads, seq_len=a.seq_len,
                        vocab_size=a.vocab_size)
        options = parse_options(a.option)
        r = solve(base, a.head, a.sparsity, a.dense_heads, options)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if r.warning:
        print(f"warning: {r.warning}", file=sys.stderr)
    if a.json:
        print(json.dumps(dataclasses.asdict(r)))
    else:
        shape = (f"rho={r.sparsity}, k={r.k}" if r.sparsity is not None
                 else ", ".join(f"{key}={value}" for key, value in options.items()) or "default options")
        print(
            f"{a.config or size}: {r.dense_heads} dense + {r.sparse_heads} {r.head} heads ({shape}); "
            f"FLOPs/pass {flop_count(r.flops_per_pass)} of {flop_count(r.baseline_flops_per_pass)} "
            f"({100 * r.budget_used:.2f}%); KV/layer {r.kv_per_layer} (dense {r.baseline_kv_total // base.n_layers}); "
            f"params {r.params / 1e6:.2f}M (dense {r.baseline_params / 1e6:.2f}M)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
