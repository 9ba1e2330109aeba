"""Per-token log-likelihoods of long token sequences with a sliding context window (the one scorer used by
lm/evaluate.py, the lm-evaluation-harness adapter and the unigram-baseline comparison).

A sequence x[0..n) is scored from `first` on: target x[i] is predicted from at most `context` tokens
before it. Targets are cut into chunks; chunk [s, e) is scored by one window of inputs x[lo : e-1],
lo = max(0, e-1-context), whose last e-s predictions are kept. The first chunk ends at
max(context+1, first+stride) (clipped to n), every later one `stride` tokens further, so each target
after the first window sees at least context-stride tokens of history (stride = context: disjoint
windows; stride 1: every token sees a full window). The lm-eval adapter sets the stride per sequence
(its continuation's length), so a continuation that fits is scored in one window with the longest history.

Windows are never padded: a shorter window (a short document, the start of one) is run at its own
length, so a head that selects k tokens uses MoSA App. F's k = max(floor(T/ρ), 2) for *that* T
(routing/expert_choice.py). Windows of equal length from any sequences run as one batch.
`leak_free=True` computes every kept prediction from its own prefix only (lm/leakfree.py), the honest
number for heads that are not causal as published (MoSA expert choice, balanced Routing clusters).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

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


@torch.no_grad()
def score(model: nn.Module, sequences: Sequence[Sequence[int]], firsts: Sequence[int], context: int,
          stride: int | Sequence[int], batch_size: int = 8, leak_free: bool = False,
          progress: Callable[[int], Any] | None = None) -> list[Scores]:
    """Scores of targets x[first:] of each sequence (module docstring); `stride` is one for all or one per
    sequence; `progress(n)` is called after each batch with the number of windows done (e.g. tqdm.update)."""
    strides = [stride] * len(sequences) if isinstance(stride, int) else list(stride)
    wins = [w for i, (x, f, st) in enumerate(zip(sequences, firsts, strides))
            for w in windows(len(x), f, context, st, i)]
    by_len: dict[int, list[Window]] = defaultdict(list)
    for w in wins:
        by_len[w.length].append(w)
    device = next(model.parameters()).device
    nll = [torch.zeros(len(x) - f, dtype=torch.float64) for x, f in zip(sequences, firsts)]
    greedy = [torch.zeros(len(x) - f, dtype=torch.bool) for x, f in zip(sequences, firsts)]
    pos = [torch.zeros(len(x) - f, dtype=torch.int64) for x, f in zip(sequences, firsts)]
    was_training = model.training
    model.eval()
    try:
        for length, group in sorted(by_len.items()):
            for b in range(0, len(group), batch_size):
                batch = group[b : b + batch_size]
                tokens = torch.tensor([list(sequences[w.seq][w.lo : w.e]) for w in batch], device=device)
                inputs, targets = tokens[:, :-1], tokens[:, 1:]
                keep = max(w.e - w.s for w in batch)  # positions length-keep .. length-1
                if leak_free:
                    logits = leak_free_logits(model, inputs, range(length - keep, length))
                else:
                    logits = model(inputs)[:, length - keep :]
                logp = logits.float().log_softmax(-1)
                tgt = targets[:, length - keep :]
                tok_nll = -logp.gather(-1, tgt[..., None])[..., 0].double().cpu()
                hit = (logp.argmax(-1) == tgt).cpu()
                for j, w in enumerate(batch):
                    m = w.e - w.s
                    out = slice(w.s - firsts[w.seq], w.e - firsts[w.seq])
                    nll[w.seq][out] = tok_nll[j, keep - m :]
                    greedy[w.seq][out] = hit[j, keep - m :]
                    pos[w.seq][out] = torch.arange(length - m, length)
                if progress is not None:
                    progress(len(batch))
    finally:
        model.train(was_training)
    return [Scores(*t) for t in zip(nll, greedy, pos)]
