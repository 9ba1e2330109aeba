"""A tiny prepared corpus and a train_lm.py-style checkpoint on it, for the evaluation / export tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from conftest import tiny_config
from heads import commit_states
from lm.model import DecoderLM, build_model
from lm.run_dir import read_provenance

MIXES = {
    "dense": [{"type": "dense", "count": 2}],
    "mosa": [{"type": "dense", "count": 1}, {"type": "mosa", "count": 2, "options": {"sparsity": 4}}],
    "mosa_expert_choice": [{"type": "dense", "count": 1},
                           {"type": "mosa", "count": 2, "options": {"sparsity": 4, "selection": "expert_choice"}}],
    "routing": [{"type": "dense", "count": 1}, {"type": "routing", "count": 2, "options": {"sparsity": 4}}],  # causal, no cache
}


def english(seed: int, lines: int) -> str:
    """Deterministic English-like text: lines of words from Python's own documentation."""
    from pydoc_data.topics import topics

    vocab = " ".join(topics.values()).split()[:3000]
    rng = np.random.default_rng(seed)
    return "\n".join(" ".join(rng.choice(vocab, size=10)) for _ in range(lines))


def prepared_corpus(root: Path) -> Path:
    """data_prep output (tokenizer, shards, index.json) for 12 small documents."""
    from data_prep.prepare import prepare

    src = root / "src"
    src.mkdir(parents=True)
    for i in range(12):
        (src / f"doc{i:02d}.txt").write_text(english(i, 30), encoding="utf-8")
    out = root / "data"
    prepare("text", str(src), out, vocab_size=400, val_fraction=0.25, progress=False, threads=1)
    return out


def save_checkpoint(root: Path, data: Path, mix: str = "dense", seq_len: int = 48, seed: int = 0,
                    name: str = "last.ckpt", vocab_size: int | None = None) -> tuple[Path, DecoderLM]:
    """A checkpoint as train_lm.py writes it (config, 'model.'-prefixed state dict, the tokenizer's bytes and
    hash) for data/tokenizer.model; `vocab_size`: the model's, padded beyond the tokenizer's pieces (default
    equal), with train_lm.py's provenance record (lm/run_dir.py). The model has random weights, a few training-mode passes setting MoSA's running thresholds."""
    import sentencepiece as spm

    tokenizer = (data / "tokenizer.model").read_bytes()
    pieces = spm.SentencePieceProcessor(model_proto=tokenizer).get_piece_size()
    vocab = vocab_size or pieces
    torch.manual_seed(seed)
    cfg = tiny_config(MIXES[mix], vocab_size=vocab, seq_len=seq_len, init_std=0.2)
    cfg.data.path = str(data)
    model = build_model(cfg.model)
    model.train()(torch.randint(0, pieces, (4, seq_len)))
    commit_states(model)
    ckpt = root / name
    torch.save({"config": OmegaConf.to_container(OmegaConf.structured(cfg)),
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "run": read_provenance(data.resolve())}, ckpt)
    return ckpt, model.eval()
