"""IsoFLOP solver (MoSA Sec. 3, App. C/H): the most sparse heads that fit a dense baseline's budget.

Keep `dense_heads` dense heads of the baseline (4 in the paper's hybrids, 0 = pure), and any other kept
head groups (`--with`), and add the largest number n of sparse heads of one type such that the model's
FLOPs per pass do not exceed the budget: the baseline's, or `--budget`. Sparsity 1 is the baseline itself
(Table 5's first column).

    python -m flops.isoflop --size tiny --head mosa --sparsity 8 --dense-heads 4 --json
    python -m flops.isoflop --config configs/quickstart.yaml --head mosa --sparsity 8 --dense-heads 1
    python -m flops.isoflop --size tiny --head mosa --sparsity 8 --dense-heads 2 --with local:2:window=128
    python -m flops.isoflop --size tiny --head mosa --sparsity 8 --budget 50%        # half the baseline's FLOPs

With --config, the baseline is that YAML's model: one head mix in every layer, dense or not (a config of
4 local + 4 routing heads is the baseline of MoSA Sec. 3's long sequences: `--dense-heads 0 --with local:4:...`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from flops.cli import flop_count, positive_int, script_parser
from flops.formulas import Options, sparse_k
from flops.model import model_cost
from flops.presets import SIZES, baseline
from heads.base import ConfigError, head_class, make_options
from lm.config import HeadGroupConfig, ModelConfig, check_group
from lm.config_io import load_config


@dataclass(frozen=True)
class IsoFlopResult:
    head: str
    sparsity: float | None
    k: int | None  # T / rho, MoSA's tokens per head (a capacity_factor c scales what a head keeps: kv_per_layer)
    dense_heads: int
    sparse_heads: int
    flops_per_pass: int
    baseline_flops_per_pass: int
    budget_flops_per_pass: int  # what the sparse heads fill: the baseline's FLOPs unless a budget was given
    budget_used: float  # flops_per_pass / budget_flops_per_pass (<= 1)
    kv_total: int  # summed over layers
    baseline_kv_total: int
    kv_per_layer: int  # MoSA Table 2's "KV Total" (one layer)
    params: int
    baseline_params: int
    heads: list[dict[str, Any]]  # the head mix (dense, kept groups, sparse), ready for ModelConfig.heads / a YAML config
    warning: str | None = None  # the sparse group's one-line advice (e.g. MoSAIC load far from capacity)


def _mix(kept: list[HeadGroupConfig], head: str, n: int, options: dict[str, Any]) -> list[HeadGroupConfig]:
    return kept + ([HeadGroupConfig(head, n, dict(options))] if n else [])


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
    base: ModelConfig, head: str, sparsity: float | None = None, dense_heads: int = 4,
    options: dict[str, Any] | None = None, keep: Sequence[HeadGroupConfig] = (), budget: int | None = None,
) -> IsoFlopResult:
    """FLOP-match `head` heads, next to `dense_heads` dense heads and the groups `keep`, to the budget: `budget` FLOPs
    per pass, or the baseline `base`'s (one head mix in every layer)."""
    fields = option_names(head)  # FORMULAS also counts the compression layer, which is no head type
    if base.layer_heads:
        raise ConfigError("the baseline must have one head mix in every layer (no model.layer_heads)")
    base_dense = sum(g.count for g in base.heads if g.type == "dense")
    if not 0 <= dense_heads <= base_dense:
        dense_only = all(g.type == "dense" for g in base.heads)
        raise ConfigError(f"dense_heads must be in [0, {base_dense}], got {dense_heads}"
                          + ("" if dense_only else f" (the baseline is {base.mix_text()}; other kept heads: --with)"))
    options = dict(options or {})
    if sparsity is not None and "sparsity" in options and options["sparsity"] != sparsity:
        raise ConfigError(f"sparsity {sparsity} conflicts with option sparsity={options['sparsity']}")
    # unknown options, wrong types and bad values: the same check as training's
    if sparsity not in (None, 1) and "sparsity" not in fields:  # 1: the baseline itself, for any type (Table 5)
        raise ConfigError(f"--sparsity does not apply to {head} heads (their options: {', '.join(fields)})")
    given = {"sparsity": sparsity} if sparsity is not None and "sparsity" in fields else {}
    make_options(head, {**options, **given}, base.group_context(0)).validate_length(head, base.seq_len)
    for g in keep:
        if g.type == "dense":
            raise ConfigError("a kept group of dense heads: give their count as dense_heads (--dense-heads)")
        try:
            check_group(base, g)
        except ConfigError as err:
            raise ConfigError(f"kept heads: {err}") from None
    if budget is not None and budget < 1:
        raise ConfigError(f"the FLOP budget must be >= 1 FLOP per pass, got {budget}")
    if sparsity is None:  # the head type's own option or default, e.g. mosa's sparsity 8
        sparsity = Options(head, options).get("sparsity")
    k = None
    if sparsity is not None:
        k = check_sparsity(base.seq_len, sparsity)
        options["sparsity"] = int(sparsity)
    ref = model_cost(base)
    limit = ref.flops_per_pass if budget is None else budget
    kept = ([HeadGroupConfig("dense", dense_heads, {})] if dense_heads else []) + list(keep)

    def cost(n: int):
        return model_cost(dataclasses.replace(base, heads=_mix(kept, head, n, options)))

    if sparsity == 1:  # Table 5: sparsity 1 is the baseline itself
        if keep or budget is not None:
            raise ConfigError("sparsity 1 is the baseline itself: kept groups (--with) and a budget do not apply to it")
        kept, dense_heads, n = list(base.heads), base_dense, 0
    else:
        others = " + ".join(f"{g.count} {g.type}" for g in kept)
        if cost(0).flops_per_pass > limit:  # only with a budget below the baseline's
            raise ConfigError(f"the model without {head} heads ({others + ' heads and ' if others else ''}the FFNs) "
                              f"costs {flop_count(cost(0).flops_per_pass)} per pass, over the FLOP budget of "
                              f"{flop_count(limit)}")
        lo, hi = 0, 1  # cost(lo) fits; grow hi until it does not, then bisect
        if cost(1).flops_per_pass <= limit:
            while cost(hi).flops_per_pass <= limit:
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if cost(mid).flops_per_pass <= limit else (lo, mid)
        n = lo
        if n == 0:  # a "sparse" point without sparse heads would be the baseline under another name
            raise ConfigError(f"not even one {head} head fits in the FLOP budget ({flop_count(limit)} per pass)"
                              + (f" next to {others} heads" if others else ""))
    got = cost(n)
    warning = None
    if n:  # (n = 0: the baseline of sparsity 1)
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
        budget_flops_per_pass=limit,
        budget_used=got.flops_per_pass / limit,
        kv_total=got.kv_total,
        baseline_kv_total=ref.kv_total,
        kv_per_layer=got.kv_per_layer[0],
        params=got.params,
        baseline_params=ref.params,
        heads=[dataclasses.asdict(g) for g in _mix(kept, head, n, options)],
        warning=warning,
    )


def _parse_option(text: str, flag: str) -> tuple[str, Any]:
    if "=" not in text or not text.split("=", 1)[0]:
        raise ConfigError(f"{flag} expects key=value, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_options(texts: list[str], flag: str = "--option") -> dict[str, Any]:
    """--option KEY=VALUE ... -> {key: value} (JSON values where they parse); a key given twice with
    different values is a one-line ConfigError naming `flag`. Types are checked against the head's Options in solve()."""
    out: dict[str, Any] = {}
    for key, value in (_parse_option(text, flag) for text in texts):
        if key in out and out[key] != value:
            raise ConfigError(f"{flag} {key} given twice: {out[key]!r} and {value!r}")
        out[key] = value
    return out


def parse_group(text: str) -> HeadGroupConfig:
    """--with TYPE:COUNT[:KEY=VALUE,...] -> a kept head group, e.g. 'local:4:window=256' (values as JSON where they
    parse); its options are checked against the type's in solve(). One-line ConfigError."""
    parts = text.split(":", 2)
    count = parts[1] if len(parts) > 1 else ""
    if not parts[0] or not (count.isascii() and count.isdecimal()) or int(count) < 1:
        raise ConfigError(f"--with expects TYPE:COUNT[:KEY=VALUE,...] with a count >= 1, got {text!r}")
    option_names(parts[0])  # an unknown type: one line naming the known ones
    options = parse_options(parts[2].split(","), f"--with {parts[0]}:{count}:") if len(parts) > 2 else {}
    return HeadGroupConfig(parts[0], int(count), options)


FLOP_UNITS = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
MAX_BUDGET = 100  # times the baseline's FLOPs: beyond, the baseline's width and depth would hold thousands of heads


def parse_budget(text: str, baseline_flops: int) -> int:
    """--budget: FLOPs per pass as a number ('3.2e10', '27.38G', '400M') or a percentage of the baseline's ('50%'),
    from 1 FLOP to MAX_BUDGET times the baseline's; rounded down to whole FLOPs. One-line ConfigError otherwise."""
    scale, number = (baseline_flops / 100, text[:-1]) if text.endswith("%") else (
        (FLOP_UNITS[text[-1]], text[:-1]) if text[-1:] in FLOP_UNITS else (1, text))
    try:
        flops = float(number) * scale
    except ValueError:
        flops = math.nan
    if not (math.isfinite(flops) and flops >= 1):
        raise ConfigError(f"--budget expects a finite number of FLOPs per pass >= 1 (e.g. 27.38G, 3e10) or a percentage "
                          f"of the baseline's (e.g. 50%), got {text!r}")
    if flops > MAX_BUDGET * baseline_flops:
        raise ConfigError(f"--budget {text} is {flops / baseline_flops:.4g}x the baseline's {flop_count(baseline_flops)}"
                          f" per pass (at most {MAX_BUDGET}x): the model keeps the baseline's width and depth, so it "
                          f"would be heads only; give a larger baseline (--size, --hidden, --layers)")
    return int(flops)


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, "python -m flops.isoflop")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--size", help=f"dense baseline preset: {', '.join(SIZES)} (default tiny)")
    where.add_argument("--config", help="dense baseline: the model of this YAML config (configs/*.yaml)")
    p.add_argument("--head", required=True, help="sparse head type (a registered head, heads/__init__.py)")
    p.add_argument("--sparsity", type=positive_int, help="rho; k = T / rho tokens per sparse head (default: the head "
                   "type's own option, e.g. mosa's 8; 1 = the baseline itself, for any type)")
    p.add_argument("--dense-heads", type=int, default=4, help="dense heads kept (default 4; 0 = pure)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="extra head option, e.g. window=64")
    p.add_argument("--with", dest="keep", action="append", default=[], metavar="TYPE:COUNT[:KEY=VALUE,...]",
                   help="another head group kept in every layer next to the dense heads, e.g. local:4:window=256")
    p.add_argument("--budget", help="FLOPs per pass to fill instead of the baseline's: 27.38G, 3e10, or 50%% of it")
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
                              "(flops.model.compressed_flops); give a config without one")
        base = baseline(size, loaded.model if loaded else None, n_layers=a.layers,
                        d_model=a.hidden, head_dim=a.head_dim, n_heads=a.heads, seq_len=a.seq_len,
                        vocab_size=a.vocab_size, dense=False)
        options = parse_options(a.option)
        budget = None if a.budget is None else parse_budget(a.budget, model_cost(base).flops_per_pass)
        r = solve(base, a.head, a.sparsity, a.dense_heads, options, [parse_group(g) for g in a.keep], budget)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if r.warning:
        print(f"warning: {r.warning}", file=sys.stderr)
    if a.json:
        print(json.dumps(dataclasses.asdict(r)))
    else:
        print(summary(r, a.config or size, base, options))
    return 0


def summary(r: IsoFlopResult, source: str, base: ModelConfig, options: dict[str, Any]) -> str:
    """The solver's one-line answer: the mix, its FLOPs against the budget (and the baseline's, where a budget was
    given), KV per layer and parameters against the baseline's (named 'dense' when it is a dense model)."""
    dense = all(g.type == "dense" for g in base.heads)
    name = "dense" if dense else "baseline"
    shape = (f"rho={r.sparsity}, k={r.k}" if r.sparsity is not None
             else ", ".join(f"{key}={value}" for key, value in options.items()) or "default options")
    mix = " + ".join(f"{g['count']} {g['type']}" for g in r.heads)
    budget = "" if r.budget_flops_per_pass == r.baseline_flops_per_pass else (
        f"; the budget is {100 * r.budget_flops_per_pass / r.baseline_flops_per_pass:.2f}% of the baseline's "
        f"{flop_count(r.baseline_flops_per_pass)}")
    return (f"{source}{'' if dense else f' ({base.mix_text()})'}: {mix} heads ({shape}); FLOPs/pass "
            f"{flop_count(r.flops_per_pass)} of {flop_count(r.budget_flops_per_pass)} ({100 * r.budget_used:.2f}%"
            f"{budget}); KV/layer {r.kv_per_layer} ({name} {r.baseline_kv_total // base.n_layers}); "
            f"params {r.params / 1e6:.2f}M ({name} {r.baseline_params / 1e6:.2f}M)")


if __name__ == "__main__":
    sys.exit(main())
