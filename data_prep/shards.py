"""Flat uint16 token shards `<split>_NNNNN.bin`, written atomically, resumable shard by shard.

A shard holds whole documents (each followed by EOS) and is closed as soon as it reaches
`shard_tokens` tokens, so shard boundaries depend only on the document stream and the settings.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from data_prep.atomic import atomic_write

FORMAT = "data_prep/2"  # index.json's format; 2: a literal U+2581 is encoded as its bytes (data_prep/tokenizer.py)
DTYPE = "uint16"  # the shards' tokens, little-endian
SHARD_NAME = re.compile(r"^(train|val)_\d{5,}\.bin$")  # SplitWriter's names


def format_problem(index: dict) -> str | None:
    """Why an index.json's shards cannot be read as this version's (another layout, a newer data_prep), else None."""
    found, dtype = str(index.get("format", FORMAT)), index.get("dtype", DTYPE)
    name, _, version = found.partition("/")
    if name == "data_prep" and version.isdigit() and int(version) <= int(FORMAT.split("/")[1]) and dtype == DTYPE:
        return None
    return f"is format {found!r} with {dtype!r} tokens; this version reads data_prep/1 to {FORMAT} with {DTYPE} tokens"


def write_json(path: Path, obj: Any) -> None:
    text = (json.dumps(obj, indent=1, ensure_ascii=False) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(text))


def write_shard(path: Path, tokens: np.ndarray) -> str:
    """Write the tokens as little-endian uint16 and return the SHA-256 of the bytes written."""
    data = tokens.astype("<u2", copy=False).tobytes()
    atomic_write(path, lambda f: f.write(data))
    return hashlib.sha256(data).hexdigest()


class SplitWriter:
    """Collects one split's documents into shards. `state` = {"shards": [...], "documents": n} holds the
    finished shards (from an interrupted run, or grown as shards finish); `on_shard()` is called after each."""

    def __init__(self, out: Path, split: str, shard_tokens: int, state: dict, on_shard: Callable[[], None]) -> None:
        self.out, self.split, self.shard_tokens = out, split, shard_tokens
        self.state, self.on_shard = state, on_shard
        self.resume_documents = state["documents"]  # documents already in finished shards
        self.seen = 0  # documents of this split seen in this pass
        self._buffer: list[np.ndarray] = []
        self._tokens = 0

    def wants(self) -> bool:
        """Count one more document of this split; False while it lies in an already finished shard."""
        self.seen += 1
        return self.seen > self.resume_documents

    def add(self, tokens: np.ndarray) -> None:
        self._buffer.append(tokens)
        self._tokens += len(tokens)
        if self._tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        """Write the buffered documents as the next shard (nothing if empty)."""
        if not self._buffer:
            return
        name = f"{self.split}_{len(self.state['shards']):05d}.bin"
        digest = write_shard(self.out / name, np.concatenate(self._buffer))
        self.state["shards"].append({"file": name, "tokens": self._tokens, "documents": len(self._buffer),
                                     "sha256": digest})
        self.state["documents"] += len(self._buffer)
        self._buffer, self._tokens = [], 0
        self.on_shard()
