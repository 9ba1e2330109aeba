"""Training regimes of the compression layer (adaptive_attention_compression.txt, "Pre-Training",
"Multiple Compression Ratios", "Recursive Compression") and long-document sampling.

- fixed:  every batch compresses prefix chunks of P = compression.prefix_len tokens into
          t = round(ratio * P) states;
- random: per batch, P ~ U[P0 (1 - w s_P), P0 (1 + w s_P)] and ratio ~ U[r0 (1 - w s_r), r0 (1 + w s_r)],
          w = min(1, step / ramp_steps): a uniform distribution whose variance grows through training;
- recursion (either regime, compression.max_depth > 1): per batch the depth k ~ U{1..max_depth}, and
          k chunks are compressed one after another, each together with the previous memory;
- full memory (compression.full_prob > 0, our addition): with that probability a batch compresses
          nothing, blocks above L see its k chunks' raw depth-L states. The post's Delta = Loss(compressed) -
          Loss(full) takes "full" as reference; a model that never saw uncompressed memory scores it out of
          distribution (docs/compression.md).
Every sample is one window of k P + S + 1 tokens cut from inside ONE document (a Gutenberg book, a C4
page), so the prefix is context for the suffix.

Training reuses the stack's LightningModule / Trainer (lm/module.py, lm/train.py): CompressedModule
swaps in a CompressedLM and the suffix loss, CompressedDataModule serves (tokens, layout) batches.
    python -m lm.compressed_training --config configs/experiments/compression.yaml [--resume | --resume-from PATH |
        --overwrite] [overrides]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset

from heads import ConfigError
from lm.checkpoint import check_finite, load_weights, read_checkpoint
from lm.cli import exit_status, resume_of, training_parser
from lm.compression import CompressedLM, Layout, tokens_for
from lm.config import CompressionConfig, Config
from lm.config_io import from_dict, load_config
from lm.data import DataError, LMDataModule, enough_for_every_rank, open_split, step_order
from lm.module import LMModule
from lm.train import fit_and_finish, finish_run, process_group_released, start_run


class LayoutSampler:
    """Draws the Layout of each batch for a regime (module docstring)."""

    def __init__(self, comp: CompressionConfig, suffix: int) -> None:
        self.comp, self.suffix = comp, suffix

    def spread(self, step: int) -> float:
        """w in [0, 1]: how far the random regime's ranges have opened at `step`."""
        return 1.0 if self.comp.ramp_steps == 0 else min(1.0, step / self.comp.ramp_steps)

    def sample(self, step: int, rng: np.random.Generator) -> Layout:
        c = self.comp
        P, ratio = c.prefix_len, c.ratio
        if c.regime == "random":
            w = self.spread(step)
            P = max(1, round(rng.uniform(P * (1 - w * c.prefix_spread), P * (1 + w * c.prefix_spread))))
            ratio = rng.uniform(ratio * (1 - w * c.ratio_spread), ratio * (1 + w * c.ratio_spread))
        depth = int(rng.integers(1, c.max_depth + 1))
        if c.full_prob > 0 and rng.random() < c.full_prob:
            return Layout((P,) * depth, 0, self.suffix, full=True)
        return Layout((P,) * depth, tokens_for(ratio, P), self.suffix)

    def at_step(self, seed: int, step: int) -> tuple[Layout, np.random.Generator]:
        """Step `step`'s layout, a pure function of (seed, step), and the generator that goes on to draw its windows
        (LayoutBatches; flops.mfu replays the layouts to count a run's FLOPs)."""
        rng = np.random.default_rng([seed, step])
        return self.sample(step, rng), rng

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
        shard, start, length = [], [], []  # per document, EOS excluded
        for s, arr in enumerate(shards):
            cuts = np.flatnonzero(arr == eos_id)
            starts = np.concatenate([[0], cuts + 1])
            lengths = np.concatenate([cuts, [len(arr)]]) - starts
            starts, lengths = starts[lengths > 0], lengths[lengths > 0]
            shard.append(np.full(len(starts), s, dtype=np.int64))
            start.append(starts.astype(np.int64))
            length.append(lengths.astype(np.int64))
        self.shard, self.start, self.lengths = (np.concatenate(a) if a else np.zeros(0, np.int64)
                                                for a in (shard, start, length))
        self.rng = np.random.default_rng(seed)
        self._cdf: tuple[int, np.ndarray, np.ndarray] | None = None  # (n, starts, cdf) of the last window length

    def _window_cdf(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Each document's number of length-n windows and their normalised cumulative sum, kept for the last n
        (O(documents) to build; the fixed regime draws one n throughout)."""
        if self._cdf is None or self._cdf[0] != n:
            starts = np.maximum(self.lengths - n + 1, 0)
            if starts.sum() == 0:
                raise ValueError(f"no document has {n} tokens (longest: {self.lengths.max(initial=0)})")
            cdf = (starts / starts.sum()).cumsum()
            self._cdf = (n, starts, cdf / cdf[-1])
        return self._cdf[1], self._cdf[2]

    def sample(self, batch: int, n: int, rng: np.random.Generator | None = None, keep: slice = slice(None)) -> torch.Tensor:
        """[batch, n] int64 windows, each inside one document (drawn with `rng`, default own): a document with
        probability proportional to its windows (inverse CDF, as Generator.choice with p draws), then a start.
        Only the rows `keep` selects are read (all are drawn, so the draws do not depend on `keep`)."""
        rng = self.rng if rng is None else rng
        starts, cdf = self._window_cdf(n)
        docs = cdf.searchsorted(rng.random(batch), side="right")
        picks = [(int(self.shard[i]), int(self.start[i]) + int(rng.integers(0, starts[i]))) for i in docs]
        return torch.stack([torch.from_numpy(self.shards[s][off : off + n].astype(np.int64)) for s, off in picks[keep]])


def document_windows(path: str | Path, split: str, cfg: Config) -> DocumentWindows:
    """DocumentWindows over a split of a prepared directory (checked by lm.data.open_split)."""
    stream = open_split(path, split, cfg.model)
    eos = int(json.loads((Path(path) / "index.json").read_text())["eos_id"])
    return DocumentWindows([np.memmap(p, dtype=np.uint16, mode="r") for p in stream.paths], eos, cfg.trainer.seed)


def encode(layout: Layout) -> torch.Tensor:
    """A Layout as a small int64 tensor [t, suffix, full, *spans], so it can travel in a Lightning batch."""
    return torch.tensor([layout.t, layout.suffix, int(layout.full), *layout.spans])


def decode(meta: torch.Tensor) -> Layout:
    t, suffix, full, *spans = meta.tolist()
    return Layout(tuple(spans), t, suffix, bool(full))


class LayoutBatches(IterableDataset):
    """Endless micro-batches (tokens[B, window], encode(layout)) from step `start_step` on, `accumulate` per
    step; step s's global batch (batch * world_size * accumulate windows, one layout) is a pure function of
    (seed, s), so a resumed run sees the batches an uninterrupted one would; rank r takes micro-batch i's slice
    i * world_size + r, as lm/data.py's TrainBatches."""

    def __init__(self, windows: DocumentWindows, sampler: LayoutSampler, batch: int, seed: int, start_step: int = 0,
                 accumulate: int = 1, rank: int = 0, world_size: int = 1) -> None:
        self.windows, self.sampler, self.batch_size, self.seed = windows, sampler, batch, seed
        self.start_step, self.accumulate, self.rank, self.world_size = start_step, accumulate, rank, world_size

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        layout, rng = self.sampler.at_step(self.seed, step)
        first = (micro * self.world_size + self.rank) * self.batch_size
        mine = slice(first, first + self.batch_size)
        return self.windows.sample(self.batch_size * self.world_size * self.accumulate, layout.window, rng, mine), encode(layout)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step, micro in step_order(self.start_step, self.accumulate):
            yield self.batch(step, micro)


class CompressedDataModule(LMDataModule):
    """Long-document windows from a prepared directory: training batches laid out by the regime,
    validation = val_batches fixed batches with one chunk of prefix_len at the centre ratio."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg.data, cfg.model, cfg.trainer.seed)
        self.full = cfg
        self.sampler = LayoutSampler(cfg.compression, cfg.model.seq_len)

    def check(self) -> None:
        self.train_windows = document_windows(self.cfg.path, "train", self.full)
        self.val_windows = document_windows(self.cfg.path, "val", self.full)
        for name, w, need in (("train", self.train_windows, self.sampler.longest()),
                              ("val", self.val_windows, self.val_layout().window)):  # validation has one layout
            if w.lengths.max(initial=0) < need:
                raise DataError(f"data.path: no {name} document has the {need} tokens compression windows need")
        super().check()  # opens the splits again (checked above) and warns about the validation windows

    def validation_warnings(self) -> list[str]:
        """Validation draws val_batches x batch_size windows of P + S + 1 tokens at random inside the validation
        documents: warn when the documents do not hold that many disjoint ones."""
        window = self.val_layout().window
        wanted = self.cfg.val_batches * self.cfg.batch_size
        disjoint = int((self.val_windows.lengths // window).sum())
        if disjoint >= wanted:
            return []
        if disjoint < self.cfg.batch_size:
            return [f"the validation documents hold {disjoint} disjoint windows of {window} tokens (prefix_len + seq_len "
                    f"+ 1), fewer than one batch (data.batch_size={self.cfg.batch_size}): every validation window "
                    f"overlaps others"]
        return [f"validation windows overlap: data.val_batches x data.batch_size = {wanted} windows of {window} tokens "
                f"(prefix_len + seq_len + 1) are drawn inside validation documents that hold {disjoint} disjoint ones "
                f"(lower data.val_batches to {disjoint // self.cfg.batch_size})"]

    def val_layout(self) -> Layout:
        c = self.full.compression
        return Layout((c.prefix_len,), tokens_for(c.ratio, c.prefix_len), self.model_cfg.seq_len)

    def train_dataloader(self) -> Any:
        assert self.trainer is not None
        data = LayoutBatches(self.train_windows, self.sampler, self.cfg.batch_size, self.seed, self.trainer.global_step,
                             self.trainer.accumulate_grad_batches, self.trainer.global_rank, self.trainer.world_size)
        return self._loader(data, batch_size=None)

    def val_dataloader(self) -> Any:
        """The val_batches fixed batches, batch r, r + world_size, ... on rank r (each batch once)."""
        assert self.trainer is not None
        layout = self.val_layout()
        meta = encode(layout)
        enough_for_every_rank(self.cfg.val_batches, "validation batches", self.trainer.world_size)
        windows = fixed_windows(self.val_windows, self.cfg.val_batches, self.cfg.batch_size, layout.window, self.seed)
        mine = windows[self.trainer.global_rank :: self.trainer.world_size]
        return self._loader([(w, meta) for w in mine], batch_size=None)


class CompressedModule(LMModule):
    """LMModule training a CompressedLM on the suffix loss (logging, schedule, checkpoints reused)."""

    def build(self, cfg: Config) -> CompressedLM:
        return CompressedLM(cfg.model, cfg.compression)

    def losses(self, tokens: torch.Tensor, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        ce = self.model.suffix_loss(tokens, decode(meta))
        aux = self.model.lm.aux_losses
        return ce + sum(aux.values()), ce, aux

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, meta = batch
        layout = decode(meta)
        ce = self.model.suffix_loss(tokens, layout, reduce=False).sum() * layout.suffix
        count = torch.tensor(tokens.shape[0] * layout.suffix, dtype=torch.float64, device=self.device)
        self._val_sums += torch.stack([ce.double(), count])


def train_compressed(cfg: Config, resume: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """lm.train.train with CompressedModule / CompressedDataModule: train to trainer.max_steps,
    validate and checkpoint the last step, return metrics.json's content. The run directory rules
    are lm.train.train's (lm/run_dir.py)."""
    if cfg.compression is None:
        raise ConfigError("compression: the config has no compression section; train a plain model with "
                          "python train_lm.py --config CONFIG")
    if cfg.trainer.compile:  # refused here, not at config load, so that such checkpoints still load for evaluation
        raise ConfigError("trainer.compile is not supported with a compression section: every batch has its own "
                          "layout (prefix spans, t), which would need a graph of its own; set trainer.compile=false")
    data = CompressedDataModule(cfg)
    with process_group_released():
        module, trainer, checkpoints, ckpt = start_run(cfg, data, CompressedModule, resume, overwrite)
        fit_and_finish(trainer, module, data, checkpoints, ckpt)
    return finish_run(cfg, trainer, module)


def load_compressed(path: str | Path) -> tuple[CompressedLM, Config]:
    """The CompressedLM saved in a train_compressed checkpoint, weights loaded, in eval mode."""
    return compressed_from_checkpoint(read_checkpoint(path, mmap=False), path)


def compressed_from_checkpoint(ckpt: dict[str, Any], path: str | Path) -> tuple[CompressedLM, Config]:
    """load_compressed on a checkpoint already read from `path` (whose run record a caller also needs)."""
    cfg = from_dict(ckpt["config"])
    if cfg.compression is None:
        raise ConfigError(f"{path}: not a compressed-model checkpoint (no compression section)")
    model = CompressedLM(cfg.model, cfg.compression)
    load_weights(model, ckpt, path)
    check_finite(model, path)
    return model.eval(), cfg


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


def main(argv: list[str] | None = None) -> int:
    parser = training_parser("Train a CompressedLM: python -m lm.compressed_training --config X.yaml [overrides]",
                             "YAML with a compression section (configs/experiments/compression*.yaml)",
                             "compression.ratio=0.25")
    args = parser.parse_intermixed_args(argv)

    def run() -> None:
        metrics = train_compressed(load_config(args.config, *args.overrides), resume=resume_of(args),
                                   overwrite=args.overwrite)
        print(json.dumps({k: v for k, v in metrics.items() if k != "history"}))

    return exit_status(run)  # 2: config or data error, 3: diverged


if __name__ == "__main__":
    sys.exit(main())
