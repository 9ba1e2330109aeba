"""Export a train_lm.py checkpoint as a Hugging Face model directory.

    python -m lm.export_hf --ckpt runs/quickstart/checkpoints/last.ckpt --out hf/quickstart

DIR then holds config.json (SparseHeadsConfig with this package's model config), model.safetensors,
generation_config.json (a vocabulary padded beyond the tokenizer's pieces lists the extra ids in
`suppress_tokens`, so `generate` never emits an id the tokenizer cannot decode), the checkpoint's
SentencePiece tokenizer (tokenizer.model + tokenizer_config.json) and modeling_sparse_heads.py, which only
imports lm/hf_model.py and lm/hf_tokenizer.py: the heads are this package's code, so the reader needs
`pip install sparse-heads-lm` (no second implementation):

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)

The directory is written next to DIR and renamed into place, so DIR is either complete or absent.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf

from data_prep.atomic import temp_path
from data_prep.cli import OneLineParser
from data_prep.tokenizer import EOS_ID
from lm.cli import exit_without_eval_extra
from lm.loading import TOKENIZER_HELP, load_for_generation

try:
    from lm.hf_model import SparseHeadsConfig, SparseHeadsForCausalLM
    from lm.hf_tokenizer import SparseHeadsTokenizer
except ImportError as err:
    if __name__ != "__main__":
        raise
    exit_without_eval_extra("lm.export_hf", "transformers", err)

MODULE = "modeling_sparse_heads"
MODULE_TEXT = '''"""sparse-heads-lm model for transformers: the classes live in the sparse-heads-lm package
(pip install sparse-heads-lm); this file only points AutoModelForCausalLM / AutoTokenizer at them."""
from lm.hf_model import SparseHeadsConfig, SparseHeadsForCausalLM  # noqa: F401
from lm.hf_tokenizer import SparseHeadsTokenizer  # noqa: F401
'''


def export(ckpt: str | Path, out: str | Path, tokenizer: str | Path | None = None) -> Path:
    """Write the Hugging Face directory for `ckpt` at `out` (which must not exist or be empty)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty directory")
    model, sp, _ = load_for_generation(ckpt, tokenizer)
    config = SparseHeadsConfig(lm_model=OmegaConf.to_container(OmegaConf.structured(model.cfg)),
                               eos_token_id=EOS_ID, bos_token_id=EOS_ID)
    config.architectures = [SparseHeadsForCausalLM.__name__]
    config.auto_map = {"AutoConfig": f"{MODULE}.SparseHeadsConfig",
                       "AutoModelForCausalLM": f"{MODULE}.SparseHeadsForCausalLM"}
    hf = SparseHeadsForCausalLM(config)
    hf.lm.load_state_dict(model.state_dict())
    hf.generation_config.eos_token_id = EOS_ID
    hf.generation_config.pad_token_id = EOS_ID
    # a vocabulary padded beyond the tokenizer: `generate` never emits an id the tokenizer cannot decode
    hf.generation_config.suppress_tokens = list(range(sp.get_piece_size(), model.cfg.vocab_size)) or None

    tmp = temp_path(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf.save_pretrained(tmp)
        (tmp / "tokenizer.model").write_bytes(sp.serialized_model_proto())
        SparseHeadsTokenizer(vocab_file=str(tmp / "tokenizer.model")).save_pretrained(tmp)
        tok_cfg = tmp / "tokenizer_config.json"
        values = json.loads(tok_cfg.read_text())
        values["auto_map"] = {"AutoTokenizer": [f"{MODULE}.SparseHeadsTokenizer", None]}
        values["tokenizer_class"] = SparseHeadsTokenizer.__name__
        tok_cfg.write_text(json.dumps(values, indent=2) + "\n")
        (tmp / f"{MODULE}.py").write_text(MODULE_TEXT)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m lm.export_hf",
                       description="Export a train_lm.py checkpoint as a Hugging Face model directory.")
    ap.add_argument("--ckpt", required=True, help="checkpoint written by train_lm.py")
    ap.add_argument("--out", required=True, help="new (or empty) directory")
    ap.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    args = ap.parse_args(argv)
    if not sys.stderr.isatty():  # transformers' "Writing model shards" bar: no frames in log files, as in training
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    try:
        out = export(args.ckpt, args.out, args.tokenizer)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
