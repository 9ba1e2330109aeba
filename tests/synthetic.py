"""Tiny prepared directories (the data_prep format: index.json + uint16 shards), written with numpy.

The token stream is a noisy first-order Markov chain: next = (5 * prev + 3) mod V with probability
0.9, else uniform; documents of ~200 tokens end with EOS (id 0). A model that learns the rule gets
well below the uniform loss ln V, so "loss falls" is a meaningful check.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np


def markov_tokens(n: int, vocab_size: int, rng: np.random.Generator) -> np.ndarray:
    out = np.empty(n, dtype=np.uint16)
    prev = 1
    for i in range(n):
        if i % 200 == 199:
            prev = 0  # end of document
        elif rng.random() < 0.9:
            prev = (5 * prev + 3) % (vocab_size - 1) + 1
        else:
            prev = int(rng.integers(1, vocab_size))
        out[i] = prev
    return out


def write_prepared(
    out: Path, vocab_size: int = 64, train_tokens: int = 20_000, val_tokens: int = 4_000,
    train_shards: int = 2, seed: int = 0,
) -> Path:
    """Write a prepared directory at `out` and return it."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    splits = {}
    for split, n, n_shards in (("train", train_tokens, train_shards), ("val", val_tokens, 1)):
        tokens = markov_tokens(n, vocab_size, rng)
        shards = []
        for i, part in enumerate(np.array_split(tokens, n_shards)):
            name = f"{split}_{i:05d}.bin"
            part.tofile(out / name)
            shards.append({"file": name, "tokens": int(part.size), "documents": int((part == 0).sum())})
        splits[split] = {"tokens": n, "documents": sum(s["documents"] for s in shards), "shards": shards}
    index = {"vocab_size": vocab_size, "eos_id": 0, "tokenizer_sha256": "synthetic", "sources": ["synthetic"],
             "splits": splits}
    (out / "index.json").write_text(json.dumps(index))
    return out


def run_overrides(data: Path, out: Path, **trainer: object) -> list[str]:
    """Dotted overrides for a tiny CPU training run on a `write_prepared` directory."""
    values = {
        "model.vocab_size": 64, "model.n_layers": 2, "model.d_model": 32, "model.head_dim": 8, "model.seq_len": 32,
        "model.heads": "[{type: dense, count: 4}]", "data.path": data, "data.batch_size": 8, "data.val_batches": 2,
        "optim.lr": 3e-3, "optim.warmup_steps": 5, "trainer.max_steps": 30, "trainer.val_every": 10,
        "trainer.ckpt_every": 10, "trainer.log_every": 5, "trainer.out_dir": out, "trainer.accelerator": "cpu",
    }
    values.update({f"trainer.{k}": v for k, v in trainer.items()})
    return [f"{k}={v}" for k, v in values.items()]


def wait_for_file(proc: subprocess.Popen, path: Path, timeout: float = 120) -> bool:
    """Poll until `path` exists (e.g. a training run's first checkpoint), `proc` ends or `timeout` seconds pass;
    whether it exists."""
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return path.exists()
