"""Autoregressive decoding speed and KV-cache size: dense baseline vs MoSA and MoSAIC hybrids, side by side.

    OMP_NUM_THREADS=1 python -m bench.decode [--lengths 1024 4096 8192] [--new-tokens 64] \\
        [--d-model 128] [--device cpu] [--compile] [--out bench/results/decode_cpu.md]

For each prompt length L three models (MoSA Table 2's layout, scaled down: 9 dense heads vs 4 dense +
17 MoSA heads at rho = 32 with causal threshold selection, and 4 dense + 17 MoSAIC heads, recency/include,
top-1, at rho = 17 = N / s so that the heads' capacity matches the T choices (at rho = 32 47% of them
would be dropped); seq_len = L + new tokens) get a random prompt,
one prefill call, then `--new-tokens` greedy steps through lm/generate.py's cache, the three models taking
turns for `--repeats` rounds (with `--compile`, each model's steps also through lm.generate.decode_step, in
the same rounds). Reported: prefill seconds, decode tokens/s (median over the repeats), the
cache's allocated bytes after decoding (keys, values, int32 positions, counters), the analytic KV bytes
(kv_total x 2 x head_dim x 4 bytes), and the measured fill: key/value entries actually stored after
decoding, of the slots allocated, per head type (lm/generate.py cache_fill), next to the analytic count
kv_total. MoSA's running thresholds are set by one training-mode pass on a random 1k-token batch so that a
head selects about 1/rho of the tokens, as after training. Weights are random: this measures cost only.
"""
from __future__ import annotations

import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from flops.cli import command_line, hardware, output_file, positive_int, script_parser, torch_device, use_device
from heads import ConfigError, commit_states
from lm.config import HeadGroupConfig, ModelConfig, validate_model
from lm.generate import Cache, cache_fill, cache_nbytes, decode_step, format_fill, kv_bytes_analytic, new_cache
from lm.model import DecoderLM, build_model


def configs(d_model: int, head_dim: int, layers: int, vocab: int, seq_len: int, sparsity: int) -> dict[str, ModelConfig]:
    base = dict(vocab_size=vocab, n_layers=layers, d_model=d_model, head_dim=head_dim, seq_len=seq_len)
    return {
        "dense (9 heads)": ModelConfig(**base, heads=[HeadGroupConfig("dense", 9)]),
        f"MoSA hybrid (4 dense + 17 MoSA, rho={sparsity})": ModelConfig(
            **base, heads=[HeadGroupConfig("dense", 4), HeadGroupConfig("mosa", 17, {"sparsity": sparsity})]
        ),
        "MoSAIC hybrid (4 dense + 17 MoSAIC, top-1, rho=17)": ModelConfig(
            **base, heads=[HeadGroupConfig("dense", 4), HeadGroupConfig("mosaic", 17, {"sparsity": 17, "top_s": 1})]
        ),
    }


@torch.no_grad()
def decode(model: DecoderLM, prompt: torch.Tensor, new_tokens: int,
           step: Callable[..., torch.Tensor] | None = None) -> tuple[float, float, Cache]:
    """(prefill seconds, decode seconds for new_tokens greedy steps through `step` (default the model),
    the cache at the end)."""
    B, L = prompt.shape
    step = model if step is None else step
    cache = new_cache(model, B, L + new_tokens)

    def now() -> float:  # CUDA runs asynchronously: wait for the queued kernels before reading the clock
        if prompt.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    t0 = now()
    logits = model(prompt, torch.arange(L, device=prompt.device).expand(B, -1), cache)[:, -1]
    t1 = now()
    for t in range(L, L + new_tokens):
        nxt = logits.argmax(-1, keepdim=True)
        logits = step(nxt, torch.full((B, 1), t, device=prompt.device), cache)[:, -1]
    t2 = now()
    return t1 - t0, t2 - t1, cache


def main(argv: list[str] | None = None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 4096, 8192],
                    help="prompt lengths L, one row each")
    ap.add_argument("--new-tokens", type=positive_int, default=64, help="greedy decoding steps after the prefill")
    ap.add_argument("--d-model", type=positive_int, default=128, help="model width h")
    ap.add_argument("--head-dim", type=positive_int, default=16, help="head width h'")
    ap.add_argument("--layers", type=positive_int, default=2, help="decoder blocks")
    ap.add_argument("--vocab", type=positive_int, default=1000, help="vocabulary size (random weights)")
    ap.add_argument("--sparsity", type=positive_int, default=32, help="rho of the MoSA hybrid's heads")
    ap.add_argument("--repeats", type=positive_int, default=3, help="timed rounds (median reported)")
    ap.add_argument("--device", type=torch_device, default="cpu", help="torch device: cpu, cuda or cuda:N")
    ap.add_argument("--compile", action="store_true",
                    help="also decode through lm.generate.decode_step (torch.compile), in the same rounds")
    ap.add_argument("--out", type=output_file, default=None, help="write a markdown table here")
    args = ap.parse_args(argv)
    try:  # the options against each length (k > T): one line, as a config load gives, before any work
        for L in args.lengths:
            for cfg in configs(args.d_model, args.head_dim, args.layers, args.vocab, L + args.new_tokens,
                               args.sparsity).values():
                validate_model(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    use_device(args.device)
    torch.manual_seed(0)
    rows = []
    modes = ["eager", "compiled"] if args.compile else ["eager"]
    for L in args.lengths:
        torch.compiler.reset()  # the last length's graphs: dynamo allows few recompiles per code object
        results, models = {}, {}
        for name, cfg in configs(args.d_model, args.head_dim, args.layers, args.vocab, L + args.new_tokens,
                                 args.sparsity).items():
            model = build_model(cfg).to(args.device)
            model.train()(torch.randint(0, args.vocab, (1, 1024), device=args.device))
            commit_states(model)  # MoSA thresholds
            models[name] = model.eval()
        prompt = torch.randint(0, args.vocab, (1, L), device=args.device)
        steps = {(name, "eager"): None for name in models}
        for name, model in models.items() if args.compile else ():
            steps[name, "compiled"] = decode_step(model)
        for name, mode in steps:  # one untimed decode each: the compiled steps compile, the eager ones warm up too
            decode(models[name], prompt, args.new_tokens, steps[name, mode])
        timed: dict[tuple[str, str], list] = {key: [] for key in steps}
        for _ in range(args.repeats):  # models and modes alternate, so drift on a shared machine hits all alike
            for name, mode in steps:
                timed[name, mode].append(decode(models[name], prompt, args.new_tokens, steps[name, mode]))
        for name, model in models.items():
            runs = timed[name, "eager"]
            prefill = statistics.median(r[0] for r in runs)
            tok_s = {mode: args.new_tokens / statistics.median(r[1] for r in timed[name, mode]) for mode in modes}
            cache, T = runs[-1][2], L + args.new_tokens
            fill = cache_fill(model, cache)
            results[name] = (prefill, tok_s, cache_nbytes(cache), kv_bytes_analytic(model, T),
                             sum(n for n, _ in fill.values()), sum(c for _, c in fill.values()), model.kv_total(T),
                             format_fill(fill))
            speeds = ", ".join(f"{mode} {v:.1f} tok/s" for mode, v in tok_s.items())
            print(f"L={L} {name}: prefill {prefill:.3f}s, {speeds}, cache {results[name][2] / 2**20:.2f} MiB, "
                  f"stored/slots {results[name][7]}", file=sys.stderr)
        rows.append((L, results))
    compiled = ["compiled tok/s", "compiled tok/s / dense", "compiled / eager"] if args.compile else []
    head = ["prompt", "model", "prefill s", "decode tok/s", "cache MiB (allocated)", "analytic KV MiB", "tok/s / dense",
            *compiled, "cache / dense", "KV entries stored (measured)", "slots allocated", "analytic kv_total",
            "stored / slots per head type"]
    lines = ["| " + " | ".join(head) + " |", "|---:|---|" + "---:|" * (len(head) - 3) + "---|"]
    for L, results in rows:
        d = next(iter(results.values()))  # the dense baseline
        for name, m in results.items():
            speed = m[1]
            more = ([f"{speed['compiled']:.1f}", f"{speed['compiled'] / d[1]['compiled']:.2f}",
                     f"{speed['compiled'] / speed['eager']:.2f}"] if args.compile else [])
            cells = [str(L), name, f"{m[0]:.3f}", f"{speed['eager']:.1f}", f"{m[2] / 2**20:.3f}", f"{m[3] / 2**20:.3f}",
                     f"{speed['eager'] / d[1]['eager']:.2f}", *more, f"{m[2] / d[2]:.3f}", f"{m[4]:,}", f"{m[5]:,}",
                     f"{m[6]:,}", m[7]]
            lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        header = [
            "# Decoding: dense vs MoSA and MoSAIC hybrids (KV cache, lm/generate.py)", "",
            f"Command: `{command_line(['-m', 'bench.decode'], argv)}`  ",
            f"Machine: {hardware(args.device)}, {torch.get_num_threads()} CPU thread(s), "
            f"device {args.device}; Python {platform.python_version()}, torch {torch.__version__}  ",
            f"Model: {args.layers} layers, d_model {args.d_model}, head_dim {args.head_dim}, vocab {args.vocab}, "
            f"fp32, batch 1, random weights; seq_len = prompt + {args.new_tokens}; {args.new_tokens} greedy "
            f"steps, median of {args.repeats}. Ratios: each model / dense at the same prompt length"
            + (", in the same mode; compiled = every decoding step through lm.generate.decode_step "
               "(torch.compile, inductor; compiled once per model before the timed rounds, which alternate "
               "models and modes)" if args.compile else "") + ".  ",
            "Allocated cache = keys + values + int32 position per slot + per-head counters, preallocated "
            "for prompt + new tokens (MoSA: capacity slots per head); analytic KV = kv_total(T) x 2 x "
            "head_dim x 4 bytes (MoSA Table 2). KV entries stored = key/value entries the caches actually hold "
            "after decoding (measured), of the slots allocated; the per-type column is stored/slots (fill %).", "",
        ]
        Path(args.out).write_text("\n".join(header) + "\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
