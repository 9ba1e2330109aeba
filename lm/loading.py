"""A train_lm.py checkpoint made ready for use: model in eval mode, its own tokenizer, its provenance record
(for lm.generate, lm.evaluate, lm.lm_eval, lm.export_hf and bench/eval_quickstart.py). One-line ValueErrors."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, NamedTuple

from lm.config import Config
from lm.model import DecoderLM

TOKENIZER_HELP = ("SentencePiece model file; default: the tokenizer the checkpoint carries (else "
                  "<data.path>/tokenizer.model of its config); must be the checkpoint's own (same SHA-256)")


class Loaded(NamedTuple):
    """A checkpoint ready for decoding and evaluation."""

    model: DecoderLM  # in eval mode
    sp: Any  # its SentencePiece processor (`load_tokenizer`)
    run: dict[str, Any]  # its provenance record (lm/run_dir.py): training data directory, hashes, tokenizer


def load_for_generation(ckpt: str | Path, tokenizer: str | Path | None = None) -> Loaded:
    """Model, tokenizer (the one `load_tokenizer` gives) and provenance of a train_lm.py checkpoint.
    One-line ValueError on failure."""
    from heads import ConfigError
    from lm.checkpoint import CheckpointError, check_finite, model_from_checkpoint, read_checkpoint

    path = Path(ckpt)
    if not path.exists():  # a directory gets read_checkpoint's own line
        raise ValueError(f"checkpoint not found: {path}")
    try:
        saved = read_checkpoint(path, mmap=False)  # read once: weights, config and the carried tokenizer
        model, cfg = model_from_checkpoint(saved, path)
        check_finite(model, path)
    except CheckpointError as err:  # empty, truncated, garbled or foreign file; weights that do not fit the config
        raise ValueError(str(err)) from None
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a train_lm.py checkpoint (missing {err})") from None
    except ConfigError as err:
        raise ValueError(f"{path}: incompatible checkpoint config: {err}") from None
    except RuntimeError as err:  # a model its config describes that cannot be built here (e.g. out of memory)
        raise ValueError(f"{path}: incompatible checkpoint: {(str(err).splitlines() or [type(err).__name__])[0][:200]}"
                         ) from None
    run = saved.get("run", {})
    return Loaded(model.eval(), load_tokenizer(path, run, cfg, tokenizer), run)


def trained_tokenizer_sha256(run: dict[str, Any]) -> str | None:
    """The SHA-256 of the tokenizer a checkpoint's run record (lm.run_dir.read_provenance's, saved in every checkpoint)
    trained with: of the tokenizer it carries, else the one it recorded; None when it knows neither."""
    carried = run.get("tokenizer_model")
    return hashlib.sha256(carried).hexdigest() if carried is not None else run.get("tokenizer_sha256")


def load_tokenizer(ckpt: Path, run: dict[str, Any], cfg: Config, tokenizer: str | Path | None) -> Any:
    """The SentencePiece processor for checkpoint `ckpt` (its `run` record, lm/run_dir.py, and config `cfg`):
    the tokenizer it carries, else the file `tokenizer` (default <data.path>/tokenizer.model), which must be
    the one the checkpoint records (same SHA-256) when it records one. At most model.vocab_size pieces (fewer:
    a padded vocabulary, as training allows). One-line ValueError otherwise."""
    import sentencepiece as spm

    carried = run.get("tokenizer_model")
    if tokenizer is None and carried is not None:
        proto, what = carried, f"the tokenizer in {ckpt}"
    else:
        tok_path = Path(tokenizer) if tokenizer is not None else Path(cfg.data.path) / "tokenizer.model"
        if not tok_path.is_file():
            raise ValueError(f"tokenizer not found: {tok_path} (pass --tokenizer PATH)")
        proto, what = tok_path.read_bytes(), f"tokenizer {tok_path}"
    try:
        sp = spm.SentencePieceProcessor(model_proto=proto)
    except RuntimeError:
        sp = None
    if sp is None or sp.get_piece_size() == 0:  # an empty proto loads as a processor without pieces
        raise ValueError(f"{what} is not a SentencePiece model")
    sha = hashlib.sha256(proto).hexdigest()
    expected = trained_tokenizer_sha256(run)
    if expected is not None and sha != expected:
        raise ValueError(f"{what} is not the one {ckpt} was trained with (SHA-256 {sha[:12]}, "
                         f"the checkpoint's {expected[:12]})")
    if sp.get_piece_size() > cfg.model.vocab_size:
        raise ValueError(f"{what} has {sp.get_piece_size()} pieces, more than model.vocab_size {cfg.model.vocab_size}")
    return sp
