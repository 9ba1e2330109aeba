"""Issue 7 experiment: suffix perplexity of a compression model vs its FLOP-matched baseline after
1, 2 and 3 compressions (adaptive_attention_compression.txt, "Evaluations"), online cache
compression during decoding, the ratio predictor's choices for tolerances Delta*, and decoding with
the predictor choosing each window's t (adaptive) against the fixed t.

Both models are trained first (each run <= 4 min on CPU, under the shared lock):
    flock /tmp/cpu_heavy.lock python -m lm.compressed_training --config configs/experiments/compression.yaml
    flock /tmp/cpu_heavy.lock python -m lm.compressed_training --config configs/experiments/compression_baseline.yaml
    flock /tmp/cpu_heavy.lock python -m lm.compressed_training --config configs/experiments/compression_fixed.yaml  # optional
    flock /tmp/cpu_heavy.lock python -m lm.compressed_training --config configs/experiments/compression_mixed.yaml  # optional
then
    python bench/compression_experiment.py --compressed runs/compression --baseline runs/compression_baseline \\
        [--fixed runs/compression_fixed] [--mixed runs/compression_mixed] --data data/gutenberg_v2k \\
        --out bench/results/compression.md
With --mixed (trained with compression.full_prob > 0, so the reference of Delta = Loss(compressed) - Loss(full)
is in distribution) the ratio predictor and the adaptive decoding use that model, otherwise the compressed one.

Every model/depth is scored on the same suffix tokens: fixed validation windows of 3P + S + 1 tokens
from one book, depth k using the last kP + S + 1 of them. FLOPs: forward, one sample, MoSA App. C
convention (flops/formulas.py), vocabulary projection excluded.
"""
from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flops.cli import command_line, comma_list, finite_float, hardware, output_file, positive_int, script_parser  # noqa: E402
from flops.model import compressed_flops  # noqa: E402
from lm.compressed_generate import CompressedGenerator  # noqa: E402
from lm.compressed_training import document_windows, evaluate, fixed_windows, load_compressed  # noqa: E402
from lm.compression import CompressedLM, Layout, token_nll, tokens_for  # noqa: E402
from lm.perplexity import perplexity  # noqa: E402
from lm.ratio_data import generate, measure  # noqa: E402
from lm.ratio_predictor import AdaptiveRatio, RatioPredictor, check_tolerance, choose_ratio, fit  # noqa: E402


MIXED = "compressed, full_prob"  # the compression_mixed.yaml model's rows


def forward_flops(model: CompressedLM, layout: Layout) -> int:
    """Forward FLOPs of one sample (flops.model.compressed_flops)."""
    return compressed_flops(model.cfg, model.comp, layout)


def heads_per_layer(model: CompressedLM) -> int:
    return sum(g.count for g in model.lm.blocks[0].attn.groups)


def perplexity_table(models: dict[str, CompressedLM], windows: list[torch.Tensor], P: int, t: int, S: int,
                     full: tuple[str, ...] = ()) -> list[str]:
    """k = 0..3 prefix chunks of P compressed to t states per model; for the models named in `full` also
    the same chunks kept uncompressed (Layout full=True, rows "<name>, uncompressed memory", k >= 1)."""
    rows = ["| model | compressions k | context seen (tokens) | suffix loss (nats) | suffix ppl | ppl vs baseline | forward GFLOPs / sample | KV entries (compressed / full cache) |",
            "|---|---|---|---|---|---|---|---|"]
    base_ppl = {}
    runs = [(name, model, False) for name, model in models.items()] + [(name, models[name], True) for name in full]
    for name, model, uncompressed in runs:
        if uncompressed:
            name = f"{name}, uncompressed memory"
        for k in range(1 if uncompressed else 0, 4):
            layout = Layout((P,) * k, 0, S, full=True) if uncompressed else Layout((P,) * k, t, S)
            loss = evaluate(model, windows, layout)
            ppl = perplexity(loss)
            if name == "baseline":
                base_ppl[k] = ppl
            kv, full_kv = model.kv_total(S, layout.memory), model.lm.kv_total(k * P + S)
            rel = f"{ppl / base_ppl[k]:.3f}" if k in base_ppl and name != "baseline" else "1"
            rows.append(f"| {name} | {k} | {k * P + S} | {loss:.4f} | {ppl:.2f} | {rel} | "
                        f"{forward_flops(model, layout) / 1e9:.3f} | {kv} / {full_kv} |")
    return rows


def online_generation(model: CompressedLM, window: torch.Tensor, P: int, t: int) -> list[str]:
    """Feed a long prompt through the online-compressing decoder; check its logits against the
    training-time forward pass and report the cache it keeps."""
    gen = CompressedGenerator(model, window=P, t=t)
    cache = gen.new_cache(window.shape[0])
    n = window.shape[1]
    logits = torch.cat([gen.feed(cache, window[:, i : i + 7]) for i in range(0, n, 7)], dim=1)  # odd pieces
    k, rest = divmod(n, P)
    layout = Layout((P,) * k, t, rest) if rest else Layout((P,) * (k - 1), t, P)
    with torch.no_grad():
        ref = model(window, layout)
    err = (ref - logits[:, -layout.suffix :]).abs().max().item()
    t0 = time.perf_counter()
    seq, cache2 = gen.generate(window[:, :P], 3 * P)
    dt = time.perf_counter() - t0
    return [f"- prompt of {n} tokens fed online in pieces of 7 tokens: KV entries kept {cache.kv_entries()} vs "
            f"{cache.kv_uncompressed()} for an uncompressed dense cache ({cache.kv_entries() / cache.kv_uncompressed():.3f}x); "
            f"max |logit difference| vs the training-time forward pass with layout {len(layout.spans)} x {P} "
            f"+ {layout.suffix}: {err:.2e}",
            f"- generation of {3 * P} tokens after a {P}-token prompt ({seq.shape[1]} total): KV entries at the end "
            f"{cache2.kv_entries()} vs {cache2.kv_uncompressed()} uncompressed; {dt:.1f} s "
            f"({3 * P * seq.shape[0] / dt:.0f} tokens/s, batch {seq.shape[0]}, CPU)"]


def adaptive_generation(model: CompressedLM, window: torch.Tensor, P: int, t: int, adaptive: AdaptiveRatio) -> list[str]:
    """Feed each sequence of window[B, n] alone through the online decoder, with the fixed t and with the
    predictor's t per window (batch 1: a batch would share its largest choice); compare the next-token loss on the
    tokens after the first window (those that see a memory) and the KV entries kept at the end."""
    def run(gen: CompressedGenerator, row: torch.Tensor) -> tuple[float, list[int], int]:
        cache = gen.new_cache(1)
        logits = gen.feed(cache, row[None, :-1])[:, P - 1 :]
        return token_nll(logits, row[None, P:]).mean().item(), cache.kept, cache.kv_entries()

    fixed = [run(CompressedGenerator(model, window=P, t=t), row) for row in window]
    chosen = [run(CompressedGenerator(model, window=P, adaptive=adaptive), row) for row in window]
    kept = torch.tensor([c[1] for c in chosen], dtype=torch.float)  # [B, compressions]

    def mean(runs: list[tuple[float, list[int], int]], i: int) -> float:
        return sum(r[i] for r in runs) / len(runs)

    return [f"- tolerance Delta* = {adaptive.tolerance:+.4f}; {window.shape[0]} held-out sequences of {window.shape[1]} "
            f"tokens, each decoded alone; loss over the {window.shape[1] - P} tokens after the first window:",
            f"  - fixed t = {t} per window: {mean(fixed, 0):.4f} nats, {mean(fixed, 2):.0f} KV entries at the end",
            f"  - adaptive: t per window {', '.join(f'{a:.1f}' for a in kept.mean(0).tolist())} on average (range "
            f"{int(kept.min())}-{int(kept.max())}): {mean(chosen, 0):.4f} nats, {mean(chosen, 2):.0f} KV entries at the end"]


def predictor_section(model: CompressedLM, train_windows: list[torch.Tensor], val_windows: list[torch.Tensor],
                      P: int, probe: float, tolerances: list[float] | None) -> tuple[list[str], AdaptiveRatio]:
    """Fit the predictor on training prompts; for each tolerance (default: the mean training Delta
    at each grid ratio, so the tolerances span what the data holds) report the ratios it picks for
    held-out prompts and the Delta measured there."""
    ratios = [1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2]
    data = generate(model, train_windows, P, ratios, probe)
    delta_range = [data["delta"].min().item(), data["delta"].max().item()]  # what the predictor is fit on
    if tolerances is None:
        tolerances = data["delta"].view(len(ratios), -1).mean(1).tolist()
    for tol in tolerances:  # (one line: main)
        check_tolerance(tol, delta_range)
    torch.manual_seed(0)
    predictor = RatioPredictor(model.cfg.d_model)
    fit(predictor, data["states"], data["prompt"], data["delta"], data["ratio"], steps=1500)
    with torch.no_grad():
        log_r = data["ratio"].log()
        fit_err = (predictor.log_ratio(data["states"][data["prompt"]], data["delta"]) - log_r).abs().mean().item()
        const_err = (log_r - log_r.mean()).abs().mean().item()
    held = generate(model, val_windows, P, ratios, probe)
    mean_delta = held["delta"].view(len(ratios), -1).mean(1).tolist()
    rows = [f"Delta = Loss(compressed at r) - Loss(full), nats/token, {len(data['states'])} training prompts "
            f"(train split), {len(held['states'])} held-out prompts (val book); mean held-out Delta per ratio: "
            + ", ".join(f"r={r:.4g}: {d:+.4f}" for r, d in zip(ratios, mean_delta))
            + f". Predictor fit (train prompts): mean |log r error| {fit_err:.3f} (predicting the mean log r: {const_err:.3f}).",
            "", "| tolerance Delta* | mean chosen r | min / max chosen r | mean achieved Delta (held-out, at the chosen r) |",
            "|---|---|---|---|"]
    rows_flat = torch.cat(val_windows)
    for tol in tolerances:
        chosen = choose_ratio(predictor, held["states"], tol, ratios)
        achieved = [measure(model, w[None], P, [float(r)], probe)["delta"].item() for w, r in zip(rows_flat, chosen)]
        rows.append(f"| {tol:+.4f} | {chosen.mean():.4f} | {chosen.min():.4f} / {chosen.max():.4f} | {sum(achieved) / len(achieved):+.4f} |")
    return rows, AdaptiveRatio(predictor, tolerances[len(tolerances) // 2], probe, ratios, delta_range)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--compressed", required=True, help="run dir of configs/experiments/compression.yaml")
    parser.add_argument("--baseline", required=True, help="run dir of configs/experiments/compression_baseline.yaml")
    parser.add_argument("--fixed", default=None, help="optional run dir of configs/experiments/compression_fixed.yaml")
    parser.add_argument("--mixed", default=None,
                        help="optional run dir of configs/experiments/compression_mixed.yaml (trained with some "
                             "uncompressed batches); if given, the ratio predictor and adaptive decoding use it")
    parser.add_argument("--data", required=True,
                        help="prepared data directory (data_prep.prepare) of the models' tokenizer")
    parser.add_argument("--out", type=output_file, default="bench/results/compression.md", help="write the markdown report here")
    parser.add_argument("--batches", type=positive_int, default=8, help="validation batches")
    parser.add_argument("--batch", type=positive_int, default=16, help="validation windows per batch")
    parser.add_argument("--tolerances", type=comma_list(finite_float), default=None,
                        help="comma-separated Delta* (default: mean training Delta per ratio)")
    parser.add_argument("--predictor-batches", type=positive_int, default=16,
                        help="x 16 training prompts for the predictor")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models, cfgs = {}, {}
    runs = [("baseline", args.baseline), ("compressed", args.compressed)] + ([("compressed, fixed r", args.fixed)] if args.fixed else [])
    runs += [(MIXED, args.mixed)] if args.mixed else []
    try:  # missing or foreign checkpoints, data that does not fit them
        for name, run in runs:
            models[name], cfgs[name] = load_compressed(Path(run) / "checkpoints" / "last.ckpt")
        cfg = cfgs["compressed"]
        val_docs, train_docs = document_windows(args.data, "val", cfg), document_windows(args.data, "train", cfg)
        P, S = cfg.compression.prefix_len, cfg.model.seq_len
        val = fixed_windows(val_docs, args.batches, args.batch, 3 * P + S + 1, seed=0)  # (documents too short)
        train = fixed_windows(train_docs, args.predictor_batches, 16, P + S + 1, seed=1)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    t = tokens_for(cfg.compression.ratio, P)
    started = time.time()
    held = [w[:, -(P + S + 1):] for w in val[:2]]
    chooser = MIXED if args.mixed else "compressed"
    try:  # first: --tolerances outside the Deltas the predictor is fit on are refused before the longer parts
        pred, adaptive = predictor_section(models[chooser], train, held, P, cfg.compression.ratio, args.tolerances)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    table = perplexity_table(models, val, P, t, S, full=(MIXED,) if args.mixed else ())
    online = online_generation(models["compressed"], val[0][:2, : 3 * P + S // 2], P, t)
    adapt = adaptive_generation(models[chooser], val[0], P, t, adaptive)
    c = cfg.compression
    lines = [
        "# Adaptive-attention compression on Gutenberg", "",
        f"Machine: {hardware()}, {platform.system()}, Python {platform.python_version()}, torch {torch.__version__}, 1 thread. "
        f"Evaluation took {time.time() - started:.0f} s.", "",
        "Commands (each training run <= 4 min, under the shared lock):", "```",
        "python -m data_prep.prepare --source gutenberg --src ../shared/data/gutenberg --out data/gutenberg_v2k --vocab-size 2048 --max-docs 40",
        "flock /tmp/cpu_heavy.lock python -m lm.compressed_training --config configs/experiments/compression.yaml data.path=data/gutenberg_v2k",
        "flock /tmp/cpu_heavy.lock python -m lm.compressed_training --config configs/experiments/compression_baseline.yaml data.path=data/gutenberg_v2k",
        "flock /tmp/cpu_heavy.lock python -m lm.compressed_training --config configs/experiments/compression_fixed.yaml data.path=data/gutenberg_v2k",
        "flock /tmp/cpu_heavy.lock python -m lm.compressed_training --config configs/experiments/compression_mixed.yaml data.path=data/gutenberg_v2k",
        command_line(["bench/compression_experiment.py"], argv),
        "```", "",
        f"Model: {cfg.model.n_layers} blocks, d_model {cfg.model.d_model}, {heads_per_layer(models['compressed'])} dense heads x {cfg.model.head_dim}, "
        f"vocab {cfg.model.vocab_size}; compression before block L = {c.layer}, {c.n_heads} heads; P = {P}, t = {t} (r = {c.ratio}), S = {S}. "
        f"Trained {cfg.trainer.max_steps} steps x {cfg.data.batch_size} samples, regime `{c.regime}` (P and r uniform, spread "
        f"{c.prefix_spread}/{c.ratio_spread} reached at step {c.ramp_steps}), recursion depth 1..{c.max_depth} per batch. "
        f"Baseline: identical, but the t states prepended above L are the previous chunk's last t raw depth-L states "
        f"(`compression.mode=recent`), so blocks above L see the same t + S positions. FLOP-matched at k = 1 up to the "
        f"compression layer itself; at k >= 2 the compressed model also runs the blocks below L on the older chunks, "
        f"which the baseline does not need (FLOPs column)."
        + (f" `{MIXED}`: the compressed model's config with compression.full_prob = {cfgs[MIXED].compression.full_prob} "
           "(that fraction of the training batches keeps its prefix chunks uncompressed, so the ratio predictor's "
           "reference Loss(full) is in distribution); its `uncompressed memory` rows keep all k P raw prefix states "
           "above L." if args.mixed else ""), "",
        f"Validation: {args.batches} x {args.batch} windows of {3 * P + S + 1} tokens from the held-out book; "
        "each row scores the same suffix tokens (the last S + 1 of each window).", "",
        *table, "",
        "## Online KV-cache compression while decoding (compressed model)", "", *online, "",
        f"## Ratio predictor ({chooser} model)", "", *pred, "",
        f"## Adaptive ratio while decoding ({chooser} model, the predictor above at the middle tolerance)", "", *adapt, "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
