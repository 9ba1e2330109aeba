"""Training regimes of the compression layer (adaptive_attention_compression.txt, "Pre-Training",
"Multiple Compression Ratios", "Recursive Compression") and long-document sampling.

- fixed:  every batch compresses prefix chunks of P = compression.prefix_len tokens into
          t = round(ratio * P) states;
- random: per batch, P ~ U[P0 (1 - w s_P), P0 (1 + w s_P)] and ratio ~ U[r0 (1 - w s_r), r0 (1 + w s_r)],
          w = min(1, step / ramp_steps): a uniform distribution whose variance grows through training;
- recursion (either regime, compression.max_depth > 1): per batch the depth k ~ U{1..max_depth}, and
          k chunks are compressed one after another, each together with the previous memory.
Every sample is one window of k P + S + 1 tokens cut from inside ONE document (a Gutenberg book, a C4
page), so the prefix is context for the suffix.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from lm.compression import CompressedLM, Layout, tokens_for
from lm.config import CompressionConfig


class LayoutSampler:
    """Draws the Layout of each batch for a regime (module docstring)."""

    def __init__(self, comp: CompressionConfig, suffix: int, seed: int = 0) -> None:
        self.comp, self.suffix = comp, suffix
        self.rng = random.Random(seed)

    def spread(self, step: int) -> float:
        """w in [0, 1]: how far the random regime's ranges have opened at `step`."""
        return 1.0 if self.comp.ramp_steps == 0 else min(1.0, step / self.comp.ramp_steps)

    def sample(self, step: int) -> Layout:
        c, rng = self.comp, self.rng
        P, ratio = c.prefix_len, c.ratio
        if c.regime == "random":
            w = self.spread(step)
            P = round(rng.uniform(P * (1 - w * c.prefix_spread), P * (1 + w * c.prefix_spread)))
            ratio = rng.uniform(ratio * (1 - w * c.ratio_spread), ratio * (1 + w * c.ratio_spread))
        depth = rng.randint(1, c.max_depth)
        return Layout((max(1, P),) * depth, tokens_for(ratio, max(1, P)), self.suffix)

    def longest(self) -> int:
        """The longest window any batch can need (to check the documents are long enough)."""
        c = self.comp
        P = round(c.prefix_len * (1 + c.prefix_spread)) if c.regime == "random" else c.prefix_len
        return c.max_depth * P + self.suffix + 1


class DocumentWindows:
    """Windows of consecutive tokens that never cross a document boundary (EOS) or a shard end.

    `tokens` are flat uint16 shards (data_prep format: EOS between documents). `sample(batch, n)`
    draws each window uniformly among all length-n windows inside a document."""

    def __init__(self, shards: list[np.ndarray], eos_id: int, seed: int = 0) -> None:
        self.shards = shards
        self.docs: list[tuple[int, int, int]] = []  # (shard, start, length), EOS excluded
        for s, arr in enumerate(shards):
            cuts = np.flatnonzero(arr == eos_id)
            starts = np.concatenate([[0], cuts + 1])
            ends = np.concatenate([cuts, [len(arr)]])
            self.docs += [(s, int(a), int(b - a)) for a, b in zip(starts, ends) if b > a]
        self.lengths = np.array([d[2] for d in self.docs], dtype=np.int64)
        self.rng = np.random.default_rng(seed)

    def sample(self, batch: int, n: int, rng: np.random.Generator | None = None) -> torch.Tensor:
        """[batch, n] int64 windows, each inside one document (drawn with `rng`, default own)."""
        rng = self.rng if rng is None else rng
        starts = np.maximum(self.lengths - n + 1, 0)
        if starts.sum() == 0:
            raise ValueError(f"no document has {n} tokens (longest: {self.lengths.max(initial=0)})")
        docs = rng.choice(len(self.docs), size=batch, p=starts / starts.sum())
        rows = []
        for i in docs:
            s, a, _ = self.docs[i]
            off = a + int(rng.integers(0, starts[i]))
            rows.append(torch.from_numpy(self.shards[s][off : off + n].astype(np.int64)))
        return torch.stack(rows)


def load_split(path: str | Path, split: str) -> tuple[list[np.ndarray], dict]:
    """The shards of a split of a data_prep directory (index.json + <split>_NNNNN.bin) and the index."""
    root = Path(path)
    index_file = root / "index.json"
    if not index_file.is_file():
        raise FileNotFoundError(f"{index_file} not found: run `python -m data_prep.prepare ...` first")
    index = json.loads(index_file.read_text())
    if split not in index["splits"]:
        raise ValueError(f"{root}: no split {split!r}; have {', '.join(index['splits'])}")
    shards = [np.memmap(root / s["file"], dtype=np.uint16, mode="r") for s in index["splits"][split]["shards"]]
    return shards, index


def batches(windows: DocumentWindows, sampler: LayoutSampler, batch: int) -> Iterator[tuple[Layout, torch.Tensor]]:
    """Endless (layout, tokens[batch, layout.window]) pairs, the layout drawn per batch."""
    step = 0
    while True:
        layout = sampler.sample(step)
        yield layout, windows.sample(batch, layout.window)
        step += 1


def train_steps(
    model: CompressedLM,
    data: Iterator[tuple[Layout, torch.Tensor]],
    steps: int,
    lr: float,
    warmup: int,
    grad_clip: float,
    lr_factor: Callable[[int], float] | None = None,
    log: Callable[[int, float, Layout], None] | None = None,
) -> list[float]:
    """AdamW on the suffix loss (+ head aux losses); returns the per-step losses.
    Default schedule: linear warmup then cosine to 10% of lr."""
    if lr_factor is None:
        def lr_factor(s: int) -> float:
            if s < warmup:
                return (s + 1) / warmup
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, steps - warmup))))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    losses = []
    for step in range(steps):
        layout, tokens = next(data)
        loss = model.suffix_loss(tokens, layout) + model.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log is not None:
            log(step, losses[-1], layout)
    return losses


def fixed_windows(windows: DocumentWindows, n_batches: int, batch: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    """The same evaluation windows for every model: n_batches x [batch, n] from a seeded generator."""
    rng = np.random.default_rng(seed)
    return [windows.sample(batch, n, rng) for _ in range(n_batches)]


@torch.no_grad()
def evaluate(model: CompressedLM, windows: list[torch.Tensor], layout: Layout) -> float:
    """Mean suffix loss (nats/token) with `layout`, on the LAST layout.window tokens of each window,
    so layouts of different depths are scored on the same suffix tokens."""
    was = model.training
    model.eval()
    total = sum(model.suffix_loss(w[:, w.shape[1] - layout.window :], layout).item() for w in windows)
    model.train(was)
    return total / len(windows)
