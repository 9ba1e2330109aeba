"""Held-out evaluation of a checkpoint on any text: sliding-window perplexity and bits per byte.

    python -m lm.evaluate --ckpt runs/quickstart/checkpoints/last.ckpt --input ../shared/data/gutenberg/pg98*.txt.gz \\
        --format gutenberg [--stride 128] [--context 256] [--leak-free auto] [--out eval.json] [--curve loss.png]

Input (`--format`, default auto): `text` (a .txt/.txt.gz file or a directory of them, one document per
file), `gutenberg` (the same, Project Gutenberg header and licence stripped), `c4` (JSON lines
{"text": ...}, .json(l)(.gz), one document per line) or `prepared` (a directory written by
data_prep.prepare; `--split`, documents split at EOS; its tokenizer must be the checkpoint's). Text is
tokenised with the checkpoint's own tokenizer exactly as data_prep does it (data_prep/tokenizer.py).

Each document is scored on its own, as in training where documents follow an EOS: the sequence is
[EOS] + tokens(document) + [EOS] and every token after the first is predicted (the closing EOS too),
with a sliding window of `--context` tokens (default: the model's seq_len) moved by `--stride`
(lm/scoring.py). Reported per document and in total: mean loss (nats/token), perplexity exp(loss) and
bits per byte = sum of losses / (ln 2 * UTF-8 bytes of the text). Each document is looked up in the checkpoint's
training data (exact text and sampled 13-word sequences, lm/training_overlap.py): one found is marked
"in_training_data" and warned about, its perplexity is not held-out. Heads that are not causal as published
are evaluated leak-free (each prediction from its own prefix) under `--leak-free auto`; short inputs run
at their own length, so heads that select k tokens use k = max(floor(T/ρ), 2) (MoSA App. F).
Results are JSON (stdout or --out); `--curve` plots the mean loss at each window position as PNG.
Bad input (missing/broken checkpoint, undecodable or empty file, wrong tokenizer) is one line, exit 2.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from data_prep import tokenizer as sp_codec
from data_prep.cli import OneLineParser
from data_prep.documents import StrictSkips
from data_prep.errors import DataError
from data_prep.shards import format_problem
from data_prep.sources import open_source
from lm.cli import check_output, check_png
from lm.data import TokenStream
from lm.loading import TOKENIZER_HELP, load_for_generation
from lm.model import DecoderLM
from lm.perplexity import perplexity
from lm.scoring import Scores, progress_bar, score
from lm.training_overlap import TRAIN_DATA_HELP, Overlap, check_train_data, training_overlap

FORMATS = ("auto", "text", "gutenberg", "c4", "prepared")
C4_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")


@dataclass
class TokenDoc:
    """A document ready for scoring: [EOS] + its tokens (ending in EOS), its text (to look it up in a
    checkpoint's training data) and the text's UTF-8 bytes."""

    id: str
    tokens: list[int]
    text: str

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


def guess_format(src: Path) -> str:
    if (src / "index.json").is_file():
        return "prepared"
    if src.is_file() and src.name.endswith(C4_SUFFIXES):
        return "c4"
    return "text"


def read_documents(src: str | Path, fmt: str, sp: Any, split: str = "val",
                   max_docs: int | None = None) -> list[TokenDoc]:
    """The input's documents, tokenised with `sp` (data_prep's encoding). DataError (one line) on bad input."""
    src = Path(src)
    if not src.exists():
        raise DataError(f"--input {src}: no such file or directory")
    fmt = guess_format(src) if fmt == "auto" else fmt
    if fmt == "prepared":
        return _prepared_documents(src, split, sp, max_docs)
    texts = []
    for doc in open_source(fmt, str(src)).read(StrictSkips(consequence="nothing was evaluated")):
        texts.append(doc)
        if max_docs is not None and len(texts) >= max_docs:
            break
    if not texts:
        raise DataError(f"--input {src}: no documents with text")
    encoded = sp_codec.encode_documents(sp, [d.text for d in texts], threads=1)
    return [TokenDoc(d.id, [sp_codec.EOS_ID, *t.tolist()], d.text)
            for d, t in zip(texts, encoded)]


def _prepared_documents(src: Path, split: str, sp: Any, max_docs: int | None) -> list[TokenDoc]:
    if not (src / "index.json").is_file():
        raise DataError(f"--input {src}: not a prepared directory (no index.json; see python -m data_prep.prepare)")
    try:
        index = json.loads((src / "index.json").read_text())
        shards, sha = index["splits"][split]["shards"], index["tokenizer_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"--input {src}: index.json has no usable split {split!r} ({type(err).__name__}: {err})") from None
    if problem := format_problem(index):
        raise DataError(f"--input {src / 'index.json'} {problem}")
    if hashlib.sha256(sp.serialized_model_proto()).hexdigest() != sha:
        raise DataError(f"--input {src} was tokenised with another tokenizer than the checkpoint's")
    try:
        stream = TokenStream(src, split, shards, sp.get_piece_size())
    except ValueError as err:  # a DataError whose message names training's option
        raise DataError(str(err).replace("data.path: ", "--input: ", 1)) from None
    if len(stream) == 0:
        raise DataError(f"--input {src}: split {split!r} is empty")
    tokens = stream.read(0, len(stream))
    ends = np.flatnonzero(tokens == sp_codec.EOS_ID)
    starts = np.concatenate([[0], ends[:-1] + 1])
    docs = []
    for i, (a, b) in enumerate(zip(starts, ends + 1)):
        if max_docs is not None and len(docs) >= max_docs:  # the first max_docs documents scored, not positions
            break
        body = tokens[a:b].tolist()
        if len(body) == 1:  # two EOS in a row: an empty document, no bytes to score (data_prep writes none)
            continue
        text = sp_codec.decode(sp, body)[0]  # the prepared text itself: the tokenizer is lossless
        docs.append(TokenDoc(f"{split}:{i}", [sp_codec.EOS_ID, *body], text))
    if not docs:
        raise DataError(f"--input {src}: split {split!r} holds only empty documents")
    return docs


def summarize(nll: float, tokens: int, nbytes: int) -> dict[str, float]:
    """loss (nats/token), perplexity, bits per byte from a summed loss."""
    loss = nll / tokens
    return {"tokens": tokens, "bytes": nbytes, "loss": loss, "ppl": perplexity(loss),
            "bpb": nll / (math.log(2) * nbytes)}


def evaluate_documents(model: DecoderLM, docs: Sequence[TokenDoc], context: int, stride: int,
                       leak_free: bool, batch_size: int = 8, show_progress: bool = True) -> dict[str, Any]:
    """Per-document and total loss / perplexity / bits per byte, and the mean loss by window position."""
    bar = progress_bar(desc="windows", unit="win", disable=not show_progress)
    try:
        scores: list[Scores] = score(model, [d.tokens for d in docs], [1] * len(docs), context, stride,
                                     batch_size=batch_size, leak_free=leak_free, progress=bar)
    finally:
        bar.close()
    per_doc = [{"id": d.id, **summarize(float(s.nll.sum()), len(s.nll), d.nbytes)} for d, s in zip(docs, scores)]
    nll = torch.cat([s.nll for s in scores])
    pos = torch.cat([s.window_pos for s in scores])
    count = torch.bincount(pos, minlength=context).double()
    by_pos = torch.zeros(context, dtype=torch.float64).index_add_(0, pos, nll) / count.clamp(min=1)
    return {
        "total": summarize(float(nll.sum()), len(nll), sum(d.nbytes for d in docs)),
        "documents": per_doc,
        "loss_by_position": [float(v) if c else None for v, c in zip(by_pos, count)],
    }


def plot_position_curve(losses: list[float | None], path: str | Path, title: str) -> None:
    """PNG of the mean loss at each window position (positions no target was scored at are left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(i + 1, v) for i, v in enumerate(losses) if v is not None]  # position p predicts from p + 1 tokens
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*points), lw=1)
    ax.set_xlabel("tokens of history (window position + 1)")
    ax.set_ylabel("mean loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m lm.evaluate",
                       description="Sliding-window perplexity and bits per byte of a checkpoint on text.")
    ap.add_argument("--ckpt", required=True, help="checkpoint written by train_lm.py")
    ap.add_argument("--input", required=True, help="file, directory, C4 json(.gz) or prepared directory")
    ap.add_argument("--format", default="auto", choices=FORMATS,
                    help="input format (default auto: prepared for a directory with index.json, c4 for "
                         ".json(l)(.gz) names, text otherwise)")
    ap.add_argument("--split", default=None, help="split of a prepared directory (default val)")
    ap.add_argument("--context", type=int, default=None, help="window length (default: model seq_len)")
    ap.add_argument("--stride", type=int, default=None, help="tokens scored per window after the first (default: context/2)")
    ap.add_argument("--leak-free", default="auto", choices=("auto", "on", "off"),
                    help="auto: on iff some head is not causal")
    ap.add_argument("--max-docs", type=int, default=None, help="score only the first N documents (default: all)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    ap.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    ap.add_argument("--train-data", default=None, help=TRAIN_DATA_HELP)
    ap.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    ap.add_argument("--curve", default=None, help="PNG of the mean loss by window position")
    args = ap.parse_args(argv)
    try:
        model, sp, run = load_for_generation(args.ckpt, args.tokenizer)
        T = model.cfg.seq_len
        context = T if args.context is None else args.context
        stride = max(1, context // 2) if args.stride is None else args.stride
        if not 1 <= context <= T:
            raise ValueError(f"--context must be in 1..{T} (the model's seq_len), got {context}")
        if not 1 <= stride <= context:
            raise ValueError(f"--stride must be in 1..{context} (--context), got {stride}")
        if args.batch_size < 1 or (args.max_docs is not None and args.max_docs < 1):
            raise ValueError("--batch-size and --max-docs must be >= 1")
        inputs = {"--ckpt": args.ckpt, "--input": args.input, "--tokenizer": args.tokenizer}
        check_output("--out", args.out, inputs)
        check_png("--curve", args.curve, inputs)
        fmt = guess_format(Path(args.input)) if args.format == "auto" else args.format
        if args.split is not None and fmt != "prepared":
            raise ValueError(f"--split applies to prepared directories only; --input {args.input} is read "
                             f"as --format {fmt}")
        docs = read_documents(args.input, fmt, sp, args.split or "val", args.max_docs)
        check_train_data(run, args.train_data)
    except ValueError as err:  # DataError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    leak_free = {"on": True, "off": False, "auto": not model.causal}[args.leak_free]
    overlap = training_overlap(run, [d.text for d in docs], args.train_data)
    result = evaluate_documents(model, docs, context, stride, leak_free, args.batch_size)
    for i, entry in enumerate(result["documents"]):
        entry.update(overlap.document(i))
    report = {"ckpt": str(args.ckpt), "input": str(args.input), "format": fmt, "context": context,
              "stride": stride, "leak_free": leak_free, "causal": model.causal,
              "training_data": overlap.report(len(docs)),
              **result}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    if args.curve:
        plot_position_curve(result["loss_by_position"], args.curve, f"{Path(args.input).name}: loss by position")
    t = result["total"]
    print(f"{len(docs)} documents, {t['tokens']} tokens: loss {t['loss']:.4f}, ppl {t['ppl']:.2f}, "
          f"bits/byte {t['bpb']:.4f} (context {context}, stride {stride}, leak-free {leak_free})", file=sys.stderr)
    print(overlap_line(overlap, docs), file=sys.stderr)
    return 0


def overlap_line(overlap: Overlap, docs: Sequence[TokenDoc]) -> str:
    """One line on the training-data check: a warning naming the documents found (each as an exact copy or
    with its share of sampled word sequences in training), else what was checked."""
    if overlap.exact is None:
        return f"note: not checked against the training data: {overlap.why_not}"
    found = []
    for i, d in enumerate(docs):
        if overlap.found(i):
            sampled, shared = overlap.ngrams[i] if overlap.ngrams is not None else (0, 0)
            found.append(f"{d.id} (exact copy)" if overlap.exact[i] else
                         f"{d.id} ({shared} of its {sampled} sampled {overlap.words}-word sequences)")
    what = "exact text and sampled word sequences" if overlap.ngrams is not None else overlap.ngrams_why_not
    if not found:
        return f"0 of {len(docs)} documents are in the checkpoint's training data ({overlap.data}; {what})"
    names = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (f"warning: {len(found)} of {len(docs)} documents are in the checkpoint's training data ({overlap.data}): "
            f"{names}; their perplexity is not held-out")


if __name__ == "__main__":
    sys.exit(main())
