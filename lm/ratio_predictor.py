"""Ratio predictor (adaptive_attention_compression.txt, "Learning the Adaptive Loss Function").

From (prompt, ratio r, Delta = Loss(compressed at r) - Loss(full)) triples (lm/ratio_data.py) learn
r = f(states, Delta): a down-projecting MLP turns the prompt's compressed states into low-dimensional
latents (mean-pooled over the states), a sinusoidal embedding encodes Delta, and an MLP maps both to
log r <= 0 (r = t / P, the post's p / seq_len). At inference a tolerance Delta* gives
r* = f(states, Delta*): how much of the prefix to keep so the loss rises by about Delta*. While decoding,
`CompressedGenerator(model, adaptive=AdaptiveRatio.load("predictor.pt", Delta*))` compresses every window with
the t this gives (lm/compressed_generate.py).

The states are the prompt compressed at one fixed probe ratio (`probe_ratio` in the data file), the
same for every r: compressing at r itself would tell the predictor r through the number of states.

    python -m lm.ratio_predictor train --data ratio_data.pt --out predictor.pt [--steps 2000]
    python -m lm.ratio_predictor choose --predictor predictor.pt --ckpt runs/compression/checkpoints/last.ckpt \
        --data data/gutenberg_v2k --delta 0.05 [--prompts 16]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from data_prep.cli import OneLineParser
from lm.checkpoint import CheckpointError, read_torch_file
from lm.compression import CompressedLM, tokens_for


def sinusoidal(delta: torch.Tensor, dim: int, min_period: float = 0.05, max_period: float = 50.0) -> torch.Tensor:
    """delta[B] -> [B, dim]: sin/cos of delta * 2 pi / p for dim/2 periods p spaced geometrically in
    [min_period, max_period] nats (the transformer timestep embedding, for a loss difference)."""
    periods = torch.logspace(math.log10(min_period), math.log10(max_period), dim // 2, device=delta.device)
    angles = delta[:, None].float() * (2 * math.pi / periods)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


RATIO_DATA_KEYS = ("states", "prompt", "delta", "ratio", "probe_ratio", "prefix_len", "ratios")


class RatioPredictor(nn.Module):
    """(states[B, t0, d], delta[B]) -> ratio[B] in (0, 1]."""

    def __init__(self, d_model: int, latent: int = 16, delta_dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.hparams = {"d_model": d_model, "latent": latent, "delta_dim": delta_dim, "hidden": hidden}
        self.down = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * latent), nn.GELU(), nn.Linear(4 * latent, latent))
        self.head = nn.Sequential(nn.Linear(latent + delta_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def log_ratio(self, states: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        z = self.down(states).mean(1)  # [B, latent]
        e = sinusoidal(delta, self.hparams["delta_dim"])
        return -F.softplus(self.head(torch.cat([z, e], dim=-1)).squeeze(-1))  # log r <= 0

    def forward(self, states: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self.log_ratio(states, delta).exp()

    def save(self, path: str | Path, **extra: object) -> None:
        torch.save({"hparams": self.hparams, "state_dict": self.state_dict(), **extra}, path)

    @classmethod
    def load(cls, path: str | Path, needs: Sequence[str] = ()) -> tuple["RatioPredictor", dict]:
        """The predictor a `save` wrote (on CPU) and the file's other entries, of which `needs` must be there; a
        one-line CheckpointError for an unreadable file or one `python -m lm.ratio_predictor train` did not write."""
        blob = read_torch_file(path, "predictor")
        missing = [k for k in ("hparams", "state_dict", *needs) if not isinstance(blob, dict) or k not in blob]
        if missing:
            raise CheckpointError(f"predictor {path} was not written by `python -m lm.ratio_predictor train` "
                                  f"(no {', '.join(missing)})")
        model = cls(**blob["hparams"])
        model.load_state_dict(blob["state_dict"])
        return model.eval(), blob


def fit(
    predictor: RatioPredictor, states: torch.Tensor, prompt: torch.Tensor, delta: torch.Tensor, ratio: torch.Tensor,
    steps: int = 2000, batch: int = 256, lr: float = 3e-3, seed: int = 0,
) -> list[float]:
    """Regress log r on (states[prompt], delta) with MSE; states[N_prompts, t0, d], prompt/delta/
    ratio[N_rows]. Returns the loss per step."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(predictor.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=lr * 0.05)
    predictor.train()
    losses = []
    for _ in range(steps):
        i = torch.randint(0, len(prompt), (min(batch, len(prompt)),), generator=g)
        loss = F.mse_loss(predictor.log_ratio(states[prompt[i]], delta[i]), ratio[i].log())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    predictor.eval()
    return losses


@torch.no_grad()
def choose_ratio(predictor: RatioPredictor, states: torch.Tensor, tolerance: float, ratios: Sequence[float]) -> torch.Tensor:
    """r* = f(states, Delta*) for each prompt, clamped to [min, max] of the ratios its training data measured
    (outside them the predictor, and the Delta it was fit on, would be extrapolated)."""
    delta = torch.full((states.shape[0],), float(tolerance), device=states.device)
    measured = [float(r) for r in ratios]
    return predictor(states, delta).clamp(min(measured), max(measured))


def check_tolerance(tolerance: float, delta_range: Sequence[float] | None) -> None:
    """A tolerance Delta* is a finite number of nats/token within the Deltas the predictor was fit on, where its
    file records them (older files do not): outside them f(states, Delta*) is an extrapolation."""
    if not math.isfinite(tolerance):
        raise ValueError(f"the tolerance Delta* must be a finite number of nats/token, got {tolerance}")
    if delta_range is not None and not (isinstance(delta_range, (list, tuple)) and len(delta_range) == 2 and all(
            isinstance(d, (int, float)) and math.isfinite(d) for d in delta_range) and delta_range[0] <= delta_range[1]):
        raise ValueError(f"the predictor's delta_range must be [min, max] of finite Deltas, got {delta_range!r}")
    if delta_range is not None and not delta_range[0] <= tolerance <= delta_range[1]:
        raise ValueError(f"the tolerance Delta* = {tolerance} is outside the Deltas the predictor was fit on "
                         f"[{delta_range[0]!r}, {delta_range[1]!r}] nats/token: it would extrapolate")


@dataclass
class AdaptiveRatio:
    """The predictor at inference (the post's adaptive compression): for each span to compress, t = round(r* N)
    with r* = f(states, Delta*) (`choose_ratio`), the states being the span compressed at the probe ratio, as in
    the predictor's training data. A batch shares one t, its largest row's: every row keeps at least the states
    its tolerance asks for."""

    predictor: RatioPredictor
    tolerance: float  # Delta*, nats/token
    probe_ratio: float
    ratios: Sequence[float]  # the ratios the predictor's data measured (r* is clamped to them)
    delta_range: Sequence[float] | None = None  # [min, max] of the Deltas it was fit on (None: not recorded)
    prefix_len: int | None = None  # the span length N its data compressed (None: not recorded)

    def __post_init__(self) -> None:
        check_tolerance(self.tolerance, self.delta_range)
        ratios = [self.probe_ratio, *self.ratios] if isinstance(self.ratios, (list, tuple)) else None
        if not ratios or len(ratios) < 2 or not all(isinstance(r, (int, float)) and 0 < r <= 1 for r in ratios):
            raise ValueError(f"the predictor's probe_ratio and ratios must be ratios in (0, 1], got {self.probe_ratio!r} "
                             f"and {self.ratios!r}")

    @classmethod
    def load(cls, path: str | Path, tolerance: float) -> "AdaptiveRatio":
        """A predictor file written by `python -m lm.ratio_predictor train` (it holds probe_ratio and ratios)."""
        predictor, blob = RatioPredictor.load(path, needs=("probe_ratio", "ratios"))
        return cls(predictor, tolerance, blob["probe_ratio"], blob["ratios"], blob.get("delta_range"),
                   blob.get("prefix_len"))

    @torch.no_grad()
    def tokens(self, model: CompressedLM, span: torch.Tensor) -> int:
        """span[B, N, d] (depth-L states of the N tokens to compress) -> t in [1, N]."""
        N = span.shape[1]
        states = model.compress(span, tokens_for(self.probe_ratio, N))
        self.predictor.to(span.device)  # (a module moves in place; a no-op once it is there)
        ratio = choose_ratio(self.predictor, states.float(), self.tolerance, self.ratios)
        return tokens_for(float(ratio.max()), N)


def _train(args: argparse.Namespace) -> dict:
    data = read_torch_file(args.data, "--data")
    missing = [k for k in RATIO_DATA_KEYS if not isinstance(data, dict) or k not in data]
    if missing:
        raise ValueError(f"--data {args.data} was not written by `python -m lm.ratio_data` (no {', '.join(missing)})")
    n = len(data["states"])
    if n < 2:
        raise ValueError(f"--data {args.data} measured {n} prompt(s); the predictor holds out every 5th prompt "
                         "(prompt 0 first), so it needs at least 2 (python -m lm.ratio_data --prompts)")
    held = torch.arange(n) % 5 == 0  # every 5th prompt is held out
    rows_tr, rows_te = ~held[data["prompt"]], held[data["prompt"]]
    predictor = RatioPredictor(data["states"].shape[-1], args.latent)
    fit(predictor, data["states"], data["prompt"][rows_tr], data["delta"][rows_tr], data["ratio"][rows_tr],
        steps=args.steps, lr=args.lr, seed=args.seed)
    with torch.no_grad():
        def err(rows: torch.Tensor) -> float:
            pred = predictor.log_ratio(data["states"][data["prompt"][rows]], data["delta"][rows])
            return (pred - data["ratio"][rows].log()).abs().mean().item()
        report = {"train_rows": int(rows_tr.sum()), "heldout_rows": int(rows_te.sum()),
                  "train_mean_abs_log_ratio_error": err(rows_tr), "heldout_mean_abs_log_ratio_error": err(rows_te)}
    fitted = data["delta"][rows_tr]
    predictor.save(args.out, probe_ratio=data["probe_ratio"], prefix_len=data["prefix_len"], ratios=data["ratios"],
                   delta_range=[fitted.min().item(), fitted.max().item()], report=report)
    return report


def _choose(args: argparse.Namespace) -> dict:
    from lm.compressed_training import document_windows, fixed_windows, load_compressed
    from lm.ratio_data import measure

    predictor, blob = RatioPredictor.load(args.predictor, needs=("probe_ratio", "prefix_len", "ratios"))
    check_tolerance(args.delta, blob.get("delta_range"))
    model, cfg = load_compressed(args.ckpt)
    if predictor.hparams["d_model"] != cfg.model.d_model:
        raise ValueError(f"--predictor {args.predictor} reads states of width {predictor.hparams['d_model']}, "
                         f"--ckpt {args.ckpt} has model.d_model {cfg.model.d_model}: not a predictor of this model")
    P, S = blob["prefix_len"], cfg.model.seq_len
    windows = fixed_windows(document_windows(args.data, args.split, cfg), 1, args.prompts, P + S + 1, seed=args.seed)[0]
    states = measure(model, windows, P, [], blob["probe_ratio"])["states"]
    ratios = choose_ratio(predictor, states, args.delta, blob["ratios"])
    achieved = [measure(model, w[None], P, [float(r)], blob["probe_ratio"])["delta"].item() for w, r in zip(windows, ratios)]
    return {"tolerance": args.delta, "chosen_ratio": [round(float(r), 4) for r in ratios],
            "achieved_delta": [round(d, 4) for d in achieved],
            "mean_achieved_delta": sum(achieved) / len(achieved)}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m lm.ratio_predictor",
                           description="Train / use the compression-ratio predictor")
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="fit the predictor on a file written by python -m lm.ratio_data")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--latent", type=int, default=16)
    t.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("choose", help="pick ratios for a tolerance Delta* and measure the Delta they give")
    c.add_argument("--predictor", required=True)
    c.add_argument("--ckpt", required=True, help="train_compressed checkpoint")
    c.add_argument("--data", required=True, help="prepared data directory")
    c.add_argument("--split", default="val")
    c.add_argument("--delta", type=float, required=True, help="tolerance Delta* in nats/token")
    c.add_argument("--prompts", type=int, default=8)
    c.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        for name in ("data", "predictor", "ckpt"):
            path = getattr(args, name, None)
            if path is not None and not Path(path).exists():
                raise ValueError(f"--{name} {path} not found")
        if args.cmd == "train" and (args.steps < 1 or args.latent < 1 or not 0 < args.lr < math.inf):
            raise ValueError(f"need --steps >= 1, --latent >= 1 and a finite --lr > 0, got {args.steps}, {args.latent} "
                             f"and {args.lr}")
        if args.cmd == "choose" and args.prompts < 1:
            raise ValueError(f"need --prompts >= 1, got {args.prompts}")
        result = _train(args) if args.cmd == "train" else _choose(args)
    except ValueError as err:  # also ConfigError and DataError (an unknown --split, a missing directory)
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
