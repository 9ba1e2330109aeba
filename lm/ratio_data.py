"""(prompt, ratio, Delta) data for the ratio predictor (adaptive_attention_compression.txt, "Learning
the Adaptive Loss Function"): Delta = Loss(compressed) - Loss(full), suffix NLL in nats/token.

Each prompt is one window of P + S + 1 tokens from one document. Loss(compressed at r): the model as
trained, the P prefix states at depth L compressed into t = round(r P). Loss(full): the same model with
full attention, the P prefix states passed to blocks [L, n) as they are (Layout(full=True): no
compression layer; not the model at r = 1, which still runs the layer). Only a model trained with
compression.full_prob > 0 has seen that reference; for one that never saw uncompressed memory it is out
of distribution and can score worse than its compressions (docs/compression.md). Also stored: the
prompt compressed at the fixed probe ratio, the predictor's input (lm/ratio_predictor.py).

    python -m lm.ratio_data --ckpt runs/compression/checkpoints/last.ckpt --data data/gutenberg_v2k \
        --out ratio_data.pt [--prompts 512] [--ratios 0.03125,0.0625,0.125,0.25,0.5] [--probe-ratio R]

--probe-ratio defaults to the model's compression.ratio; it is stored with the predictor, and `choose` and
AdaptiveRatio probe prompts at it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from data_prep.cli import OneLineParser
from lm.compression import CompressedLM, token_nll, tokens_for

DEFAULT_RATIOS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)


@torch.no_grad()
def measure(model: CompressedLM, windows: torch.Tensor, P: int, ratios: list[float], probe_ratio: float) -> dict[str, torch.Tensor]:
    """windows[B, P + S + 1] -> {"states": probe-compressed prefix [B, t0, d], "full": Loss(full) [B],
    "loss": Loss(compressed at r) [R, B], "delta": loss - full [R, B]} (per-sample mean suffix NLL)."""
    model.eval()
    prefix, suffix, target = windows[:, :P], windows[:, P:-1], windows[:, P + 1 :]

    def nll(mem: torch.Tensor) -> torch.Tensor:
        return token_nll(model.lm.lm_head(model.upper(x, mem)), target).mean(1)

    h, x = model.lower(prefix), model.lower(suffix)
    full = nll(h)
    loss = torch.stack([nll(model.compress(h, tokens_for(r, P))) for r in ratios]) if ratios else torch.zeros(0, len(windows))
    return {"states": model.compress(h, tokens_for(probe_ratio, P)), "full": full, "loss": loss, "delta": loss - full}


def generate(model: CompressedLM, windows: list[torch.Tensor], P: int, ratios: list[float], probe_ratio: float) -> dict:
    """Rows (prompt index, ratio, delta) over all windows x ratios, and each prompt's probe states."""
    parts = [measure(model, w, P, ratios, probe_ratio) for w in windows]
    states = torch.cat([p["states"] for p in parts])
    delta = torch.cat([p["delta"] for p in parts], dim=1)  # [R, N]
    R, N = delta.shape
    return {
        "states": states, "prompt": torch.arange(N).repeat(R), "ratio": torch.tensor(ratios).repeat_interleave(N),
        "delta": delta.reshape(-1), "full": torch.cat([p["full"] for p in parts]),
        "ratios": list(ratios), "probe_ratio": probe_ratio, "prefix_len": P,
    }


def main(argv: list[str] | None = None) -> int:
    from heads import ConfigError
    from lm.compressed_training import document_windows, fixed_windows, load_compressed
    from lm.data import DataError

    parser = OneLineParser(prog="python -m lm.ratio_data",
                           description="Measure Delta = Loss(compressed) - Loss(full) over ratios")
    parser.add_argument("--ckpt", required=True, help="checkpoint written by python -m lm.compressed_training")
    parser.add_argument("--data", required=True, help="prepared data directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--split", default="train", help="train (many documents, default) or val")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--ratios", default=",".join(str(r) for r in DEFAULT_RATIOS))
    parser.add_argument("--probe-ratio", type=float, default=None, help="default: the model's compression.ratio")
    parser.add_argument("--prefix-len", type=int, default=None, help="P; default: the model's compression.prefix_len")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        try:
            ratios = [float(r) for r in args.ratios.split(",")]
        except ValueError:
            raise ValueError(f"--ratios expects comma-separated numbers, got {args.ratios!r}") from None
        if not all(0 < r <= 1 for r in ratios):
            raise ValueError(f"--ratios must be in (0, 1], got {args.ratios}")
        if args.prompts < 2 or args.batch < 1 or (args.prefix_len is not None and args.prefix_len < 1):
            raise ValueError(f"need --prompts >= 2 (the predictor holds out every 5th prompt), --batch >= 1 and "
                             f"--prefix-len >= 1, got {args.prompts}, {args.batch} and {args.prefix_len}")
        if args.probe_ratio is not None and not 0 < args.probe_ratio <= 1:
            raise ValueError(f"--probe-ratio must be in (0, 1], got {args.probe_ratio}")
        if not Path(args.ckpt).is_file():
            raise ValueError(f"--ckpt {args.ckpt} not found")
        model, cfg = load_compressed(args.ckpt)
        P = cfg.compression.prefix_len if args.prefix_len is None else args.prefix_len
        probe = cfg.compression.ratio if args.probe_ratio is None else args.probe_ratio
        n_batches = -(-args.prompts // args.batch)
        windows = fixed_windows(document_windows(args.data, args.split, cfg), n_batches, args.batch, P + cfg.model.seq_len + 1, args.seed)
        windows[-1] = windows[-1][: args.prompts - (n_batches - 1) * args.batch]  # exactly --prompts prompts
    except (ValueError, ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    data = generate(model, windows, P, ratios, probe)
    torch.save(data, args.out)
    per_ratio = data["delta"].view(len(ratios), -1).mean(1).tolist()
    print(json.dumps({"rows": len(data["delta"]), "prompts": len(data["states"]), "mean_full_loss": data["full"].mean().item(),
                      "mean_delta_per_ratio": dict(zip(map(str, ratios), per_ratio))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
