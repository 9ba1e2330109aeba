"""Per-token log-likelihoods of long token sequences with a sliding context window (the one scorer used by
lm/evaluate.py, the lm-evaluation-harness adapter and the unigram-baseline comparison).

A sequence x[0..n) is scored from `first` on: target x[i] is predicted from at most `context` tokens
before it. Targets are cut into chunks; chunk [s, e) is scored by one window of inputs x[lo : e-1],
lo = max(0, e-1-context), whose last e-s predictions are kept. The first chunk ends at
max(context+1, first+stride) (clipped to n), every later one `stride` tokens further, so each target
after the first window sees at least context-stride tokens of history (stride = context: disjoint
windows; stride 1: every token sees a full window). The lm-eval adapter sets the stride per sequence
(its continuation's length), so a continuation that fits is scored in one window with the longest history.

Batching: for a causal model, or leak-free scoring, windows of similar length are right-padded into one
batch (padding cannot move a causal prediction at a real position, and a leak-free prediction reads
only its own prefix). A non-causal model scored teacher-forced never sees padding: windows of equal
length form a batch, and a shorter window (a short document, the start of one) runs at its own length,
so a head that selects k tokens over its input uses MoSA App. F's k = max(floor(T/ρ), 2) for *that* T
(routing/expert_choice.py), as it does on every prefix under leak-free scoring.
`leak_free=True` computes every kept prediction from its own prefix only (lm/leakfree.py), the honest
number for heads that are not causal as published (MoSA expert choice, balanced Routing clusters).
"""
from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from tqdm import tqdm

from lm.leakfree import leak_free_logits


@dataclass(frozen=True)
class Window:
    """Inputs x[lo : e-1] of sequence `seq`, keeping the predictions of targets x[s : e]."""

    seq: int
    lo: int
    s: int
    e: int

    @property
    def length(self) -> int:
        return self.e - 1 - self.lo


def windows(n: int, first: int, context: int, stride: int, seq: int = 0) -> list[Window]:
    """The windows that score targets x[first : n] of a length-n sequence (module docstring)."""
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be in 1..context ({context}), got {stride}")
    if first < 1:
        raise ValueError("the first scored token needs at least one token before it (first >= 1)")
    out, s = [], first
    e = min(n, max(context + 1, first + stride))
    while s < n:
        out.append(Window(seq, max(0, e - 1 - context), s, e))
        s, e = e, min(n, e + stride)
    return out


@dataclass
class Scores:
    """Per target token of one sequence (targets x[first:], in order): negative log-likelihood in nats,
    whether the target was the argmax prediction, and its position in the window that scored it."""

    nll: torch.Tensor  # float64 [n - first]
    greedy: torch.Tensor  # bool [n - first]
    window_pos: torch.Tensor  # int64 [n - first]


def batches(wins: list[Window], batch_size: int, pad: bool) -> list[list[Window]]:
    """Windows grouped for batching: by exact length, or (pad=True) neighbours in length order."""
    if pad:
        ordered = sorted(wins, key=lambda w: w.length)
        return [ordered[b : b + batch_size] for b in range(0, len(ordered), batch_size)]
    by_len: dict[int, list[Window]] = defaultdict(list)
    for w in wins:
        by_len[w.length].append(w)
    return [g[b : b + batch_size] for _, g in sorted(by_len.items()) for b in range(0, len(g), batch_size)]


PROGRESS_LINE_SECONDS = 30.0  # without a terminal: at most one progress line per this many seconds (as training's)


class LogLines:
    """A file for tqdm that writes each redraw as a line of its own: a log gets lines, not carriage-return frames."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        if line := text.strip():  # a redraw is '\r' + the bar + blank padding; the close's '\n' alone is dropped
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable: Any = None, disable: bool = False, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr. When stderr is not a terminal (a log file, a batch job), no bar frames: work that lasts
    longer than PROGRESS_LINE_SECONDS writes a line at most that often (count, rate, time left where the total is
    known, as training's progress lines), shorter work nothing."""
    if sys.stderr.isatty() or disable:
        return tqdm(iterable, disable=disable, file=sys.stderr, **kwargs)
    # miniters=1: no automatic miniters, which would let tqdm's monitor thread redraw every 10 s (maxinterval) between
    return tqdm(iterable, file=LogLines(sys.stderr), mininterval=PROGRESS_LINE_SECONDS, delay=PROGRESS_LINE_SECONDS,
                miniters=1, ascii=True, ncols=80, **kwargs)


@torch.no_grad()
def score(model: nn.Module, sequences: Sequence[Sequence[int]], firsts: Sequence[int], context: int,
          stride: int | Sequence[int], batch_size: int = 8, leak_free: bool = False,
          progress: tqdm | None = None, vocab: int | None = None) -> list[Scores]:
    """Scores of targets x[first:] of each sequence (module docstring); `stride` is one for all or one per
    sequence; `progress`, a bar (progress_bar), gets the number of windows as its total and advances per batch;
    `vocab`: the argmax (`greedy`) is taken over ids below it, the tokenizer's pieces when the model's vocabulary
    is padded beyond them (as generation, lm/generate.sample, never picks a padded id)."""
    strides = [stride] * len(sequences) if isinstance(stride, int) else list(stride)
    wins = [w for i, (x, f, st) in enumerate(zip(sequences, firsts, strides))
            for w in windows(len(x), f, context, st, i)]
    # Right-padding a window cannot move a causal model's predictions at its real positions, nor leak-free
    # ones (each from its own prefix); a non-causal model's teacher-forced windows run at their own length.
    pad = leak_free or bool(getattr(model, "causal", False))
    if progress is not None:
        progress.total = len(wins)
    device = next(model.parameters()).device
    nll = [torch.zeros(len(x) - f, dtype=torch.float64) for x, f in zip(sequences, firsts)]
    greedy = [torch.zeros(len(x) - f, dtype=torch.bool) for x, f in zip(sequences, firsts)]
    pos = [torch.zeros(len(x) - f, dtype=torch.int64) for x, f in zip(sequences, firsts)]
    was_training = model.training
    model.eval()
    try:
        for batch in batches(wins, batch_size, pad):
            L = max(w.length for w in batch)
            tokens = torch.zeros(len(batch), L + 1, dtype=torch.long)
            for j, w in enumerate(batch):
                tokens[j, : w.length + 1] = torch.tensor(list(sequences[w.seq][w.lo : w.e]))
            tokens = tokens.to(device)
            kept = sorted({p for w in batch for p in range(w.length - (w.e - w.s), w.length)})
            at = {p: i for i, p in enumerate(kept)}
            if leak_free:
                logits = leak_free_logits(model, tokens[:, :-1], kept)
            else:
                logits = model(tokens[:, :-1])[:, kept]
            logp = logits.float().log_softmax(-1)
            tgt = tokens[:, 1:][:, kept]
            tok_nll = -logp.gather(-1, tgt[..., None])[..., 0].double().cpu()
            hit = (logp[..., :vocab].argmax(-1) == tgt).cpu()
            for j, w in enumerate(batch):
                cols = [at[p] for p in range(w.length - (w.e - w.s), w.length)]
                out = slice(w.s - firsts[w.seq], w.e - firsts[w.seq])
                nll[w.seq][out] = tok_nll[j, cols]
                greedy[w.seq][out] = hit[j, cols]
                pos[w.seq][out] = torch.arange(w.length - (w.e - w.s), w.length)
            if progress is not None:
                progress.update(len(batch))
    finally:
        model.train(was_training)
    return [Scores(*t) for t in zip(nll, greedy, pos)]
