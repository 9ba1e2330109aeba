"""Token windows from a prepared directory (written by `python -m data_prep.prepare`).

A prepared directory holds `index.json` and flat uint16 shards `{train,val}_NNNNN.bin` (documents
joined by an end-of-document token). Each split is read as one memory-mapped token stream.

- Training: optimizer step s's global batch holds `batch_size * world_size * accumulate` windows of
  T+1 tokens at uniformly random starts drawn from `numpy.random.default_rng([seed, s])`; micro-batch i
  (of `trainer.accumulate_grad_batches`) on rank r takes slice i * world_size + r. The data order is
  therefore a pure function of (seed, step): a resumed run starting at step s sees exactly the batches
  an uninterrupted run would have seen, on any number of workers, and step s's global batch is the
  same windows for every split of it into devices and micro-batches.
- Validation: `val_batches * batch_size` fixed windows with evenly spaced starts over the val split.
Inputs are window[:-1], targets window[1:] (int64).
"""
from __future__ import annotations

import itertools
import json
import signal
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from data_prep.shards import format_problem
from lm.config import DataConfig, ModelConfig
from lm.sanity import validation_warnings, vocab_warnings, warn
from lm.errors import DataError

PREPARE_HINT = "python -m data_prep.prepare --source gutenberg|c4|text --src RAW_INPUT --out DIR"
MAX_OPEN_SHARDS = 128  # memmaps a TokenStream keeps open, least recently read closed first: each holds a file
# descriptor, and a process may commonly hold 1024 (a full C4 is thousands of 50M-token shards)


class TokenStream:
    """The shards of one split as one flat uint16 token sequence; memmaps open lazily (worker-safe), at most
    MAX_OPEN_SHARDS at once."""

    def __init__(self, directory: Path, split: str, shards: list[dict[str, Any]], vocab_size: int,
                 data_vocab: int | None = None) -> None:
        """Checks every shard once: present, the size index.json states, token ids < vocab_size (the model's;
        `data_vocab` is the tokenizer's, from index.json)."""
        self.split, self.data_vocab = split, data_vocab
        try:
            self.paths = [directory / s["file"] for s in shards]
            sizes = [int(s["tokens"]) for s in shards]
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"data.path: {directory / 'index.json'} has a damaged {split} shard entry "
                            f"({type(err).__name__}: {err}); prepare the directory again") from None
        for path, n in zip(self.paths, sizes):
            if not path.is_file():
                raise DataError(f"data.path: shard {path} listed in index.json is missing")
            if path.stat().st_size != 2 * n:
                raise DataError(f"data.path: shard {path} has {path.stat().st_size} bytes, index.json says {n} uint16 tokens")
            check_token_range(path, vocab_size)
        self.paths, sizes = [p for p, n in zip(self.paths, sizes) if n], [n for n in sizes if n]  # an empty one can't map
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # shard i = [starts[i], starts[i+1])
        self._maps: dict[int, np.memmap] = {}  # open shards, least recently read first

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}  # a DataLoader worker opens its own (a memmap pickles as its data)

    def _shard(self, i: int) -> np.memmap:
        """Shard i's memmap, opened if needed (closing the least recently read one past MAX_OPEN_SHARDS)."""
        tokens = self._maps.pop(i, None)
        if tokens is None:
            if len(self._maps) >= MAX_OPEN_SHARDS:
                del self._maps[next(iter(self._maps))]
            tokens = np.memmap(self.paths[i], dtype=np.uint16, mode="r")
        self._maps[i] = tokens
        return tokens

    def read(self, start: int, length: int) -> np.ndarray:
        """tokens[start : start + length] as int64, crossing shard boundaries as needed."""
        out = np.empty(length, dtype=np.int64)
        done = 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while done < length:
            tokens = self._shard(shard)
            lo = start + done - int(self.starts[shard])
            take = min(length - done, len(tokens) - lo)
            out[done : done + take] = tokens[lo : lo + take]
            done, shard = done + take, shard + 1
        return out


def check_token_range(path: Path, vocab_size: int) -> None:
    """Every token id of a shard must be < vocab_size (an embedding lookup would fail mid-run); one pass."""
    tokens = np.memmap(path, dtype=np.uint16, mode="r") if path.stat().st_size else np.zeros(0, np.uint16)
    top = int(tokens.max()) if len(tokens) else 0
    if top >= vocab_size:
        where = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"data.path: shard {path} holds token id {top} >= model.vocab_size {vocab_size} "
                        f"(first at token {where}); the shard is damaged or from another tokenizer")


def open_split(path: str | Path, split: str, model: ModelConfig) -> TokenStream:
    """Check a prepared directory against the model config and open one split; DataError if unusable."""
    directory = Path(path)
    if not directory.exists():
        raise DataError(f"data.path: {directory} does not exist; prepare it with: {PREPARE_HINT}")
    if not directory.is_dir():
        raise DataError(f"data.path: {directory} is not a directory; prepare one with: {PREPARE_HINT}")
    index_file = directory / "index.json"
    if not index_file.is_file():
        raise DataError(f"data.path: {directory} has no index.json (not a prepared directory; see {PREPARE_HINT})")
    try:
        index = json.loads(index_file.read_text())
        vocab, shards = int(index["vocab_size"]), index["splits"].get(split, {}).get("shards", [])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise DataError(f"data.path: {index_file} is not a valid index ({type(err).__name__}: {err})") from None
    if problem := format_problem(index):
        raise DataError(f"data.path: {index_file} {problem} (prepare it again with {PREPARE_HINT})")
    if vocab > model.vocab_size:
        raise DataError(
            f"data.path: {directory} has vocab_size {vocab} > model.vocab_size {model.vocab_size}; "
            f"set model.vocab_size={vocab}"
        )
    stream = TokenStream(directory, split, shards, model.vocab_size, vocab)
    if len(stream) == 0:
        raise DataError(f"data.path: split {split!r} of {directory} is empty")
    if len(stream) < model.seq_len + 1:
        raise DataError(
            f"model.seq_len={model.seq_len} needs windows of {model.seq_len + 1} tokens but split {split!r} "
            f"of {directory} has only {len(stream)}"
        )
    return stream


def enough_for_every_rank(count: int, what: str, world_size: int) -> None:
    """DataError unless every rank gets one of `count` validation items (a rank without any stops Lightning)."""
    if count < world_size:
        raise DataError(f"data.val_batches gives {count} {what} for {world_size} ranks: every rank needs one; "
                        f"raise data.val_batches")


def step_order(start_step: int, accumulate: int = 1) -> Iterator[tuple[int, int]]:
    """(step, micro-batch) pairs from `start_step` on, `accumulate` micro-batches per step. In a DataLoader
    worker, that worker's share: worker w of n takes items w, w + n, ...; the loader reads its workers
    round-robin, so the order is kept."""
    worker = get_worker_info()
    first, stride = (0, 1) if worker is None else (worker.id, worker.num_workers)
    for item in itertools.count(start_step * accumulate + first, stride):
        yield divmod(item, accumulate)


class TrainBatches(IterableDataset):
    """Endless micro-batches (x[B, T], y[B, T]) from step `start_step` on, `accumulate` per step; this
    rank's share of step s's global batch = f(seed, s) (module doc)."""

    def __init__(
        self, stream: TokenStream, seq_len: int, batch_size: int, seed: int,
        start_step: int = 0, rank: int = 0, world_size: int = 1, accumulate: int = 1,
    ) -> None:
        self.stream, self.seq_len, self.batch_size, self.seed = stream, seq_len, batch_size, seed
        self.start_step, self.rank, self.world_size, self.accumulate = start_step, rank, world_size, accumulate

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.stream) - self.seq_len, size=self.batch_size * self.world_size * self.accumulate)
        first = (micro * self.world_size + self.rank) * self.batch_size
        windows = [self.stream.read(int(s), self.seq_len + 1) for s in starts[first : first + self.batch_size]]
        windows = torch.from_numpy(np.stack(windows))
        return windows[:, :-1], windows[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step, micro in step_order(self.start_step, self.accumulate):
            yield self.batch(step, micro)


class ValWindows(Dataset):
    """`count` fixed windows with evenly spaced starts over the validation stream; rank r of `world_size` holds
    windows r, r + world_size, ...: every window once over the ranks (no padding repeats, unlike Lightning's
    DistributedSampler, which would count some twice when world_size does not divide count)."""

    def __init__(self, stream: TokenStream, seq_len: int, count: int, rank: int = 0, world_size: int = 1) -> None:
        self.stream, self.seq_len = stream, seq_len
        self.starts = np.linspace(0, len(stream) - seq_len - 1, count).round().astype(np.int64)[rank::world_size]

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(self.stream.read(int(self.starts[i]), self.seq_len + 1))
        return window[:-1], window[1:]

    def tokens(self) -> torch.Tensor:
        """Every window whole, int64 [N, T+1], as lm.leakfree.evaluate takes them (inputs w[:, :-1], targets w[:, 1:])."""
        return torch.stack([torch.from_numpy(self.stream.read(int(s), self.seq_len + 1)) for s in self.starts]).long()


def ignore_sigint(worker_id: int) -> None:
    """A loader worker ignores Ctrl-C, which the terminal sends to the whole process group: the training process
    stops after its step (lm/preemption.py) and ends its workers itself; a worker killed by it would crash the next
    batch's fetch ("DataLoader worker exited unexpectedly")."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class LMDataModule(L.LightningDataModule):
    """Train/val loaders over a prepared directory. `data.batch_size` is per device."""

    def __init__(self, data: DataConfig, model: ModelConfig, seed: int) -> None:
        super().__init__()
        self.cfg, self.model_cfg, self.seed = data, model, seed
        self.train_stream: TokenStream | None = None
        self.val_stream: TokenStream | None = None

    def check(self) -> None:
        """Open both splits (raises a one-line DataError; warns about overlapping validation windows);
        cheap, so entry points call it up front."""
        self.train_stream = open_split(self.cfg.path, "train", self.model_cfg)
        self.val_stream = open_split(self.cfg.path, "val", self.model_cfg)
        for message in [*self.validation_warnings(), *vocab_warnings(self.model_cfg, self.train_stream.data_vocab)]:
            warn(message)

    def validation_warnings(self) -> list[str]:
        """Warnings about the validation windows this module draws (lm/sanity.py), once the splits are open."""
        assert self.val_stream is not None
        return validation_warnings(self.cfg, self.model_cfg, len(self.val_stream))

    def setup(self, stage: str) -> None:
        if self.train_stream is None:
            self.check()

    def _loader(self, dataset: Dataset | IterableDataset, **kw: Any) -> DataLoader:
        # Own generator: creating a loader iterator must not consume the global torch RNG.
        return DataLoader(dataset, num_workers=self.cfg.num_workers, generator=torch.Generator(),
                          worker_init_fn=ignore_sigint if self.cfg.num_workers else None, **kw)

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        assert trainer is not None and self.train_stream is not None
        batches = TrainBatches(
            self.train_stream, self.model_cfg.seq_len, self.cfg.batch_size, self.seed,
            start_step=trainer.global_step, rank=trainer.global_rank, world_size=trainer.world_size,
            accumulate=trainer.accumulate_grad_batches,
        )
        return self._loader(batches, batch_size=None)

    def val_dataloader(self) -> DataLoader:
        trainer = self.trainer
        assert trainer is not None and self.val_stream is not None
        count = self.cfg.val_batches * self.cfg.batch_size
        enough_for_every_rank(count, "validation windows", trainer.world_size)
        windows = ValWindows(self.val_stream, self.model_cfg.seq_len, count, trainer.global_rank, trainer.world_size)
        return self._loader(windows, batch_size=self.cfg.batch_size, shuffle=False)
