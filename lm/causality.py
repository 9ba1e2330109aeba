"""The shared causality check (DESIGN.md "Causality, stated once").

A decoder LM may use only tokens <= t to predict t+1. `future_leak` resamples every token after
position t and returns how much the logits at positions <= t moved: 0 (up to float rounding) for a
causal model; clearly positive for one whose selection ranks tokens over the whole sequence.
"""
from __future__ import annotations

import torch
from torch import nn

from heads.base import frozen_state


@torch.no_grad()
def future_leak(model: nn.Module, tokens: torch.Tensor, t: int | None, vocab_size: int, seed: int = 0,
                training: bool = False) -> float:
    """max |logits[:, :t+1](tokens) - logits[:, :t+1](tokens')| where tokens' = tokens with every
    position > t replaced by a random other token (never the same: a redrawn equal token would hide a leak from its
    position); t = None: the largest over every t (a leak between two positions shows at the t between them
    only). The model runs in eval mode, or with `training` in train mode
    (the training-time paths: MoSAIC's training priorities, a head's batch statistics) with its state frozen, so
    that the first pass moves no threshold or centroid the second would see, and the same RNG draws in both."""
    if t is None:
        return max(future_leak(model, tokens, s, vocab_size, seed, training) for s in range(tokens.shape[1] - 1))
    if not 0 <= t < tokens.shape[1] - 1:
        raise ValueError(f"t must be in [0, {tokens.shape[1] - 1}), got {t}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2 to change a token, got {vocab_size}")
    was_training = model.training
    g = torch.Generator(device="cpu").manual_seed(seed)
    perturbed = tokens.clone()
    tail = perturbed[:, t + 1 :]
    shift = torch.randint(1, vocab_size, tail.shape, generator=g).to(tokens.device)
    perturbed[:, t + 1 :] = (tail + shift) % vocab_size
    logits = []
    # the generators the model draws from, CPU's and that of the tokens' GPU, forked and reseeded alone: the caller's
    # streams are left as they were, and a CPU check on a GPU machine leaves CUDA unstarted (torch.manual_seed and
    # forking every device both start it, or queue a reseed for when it starts)
    cuda = []  # the index of the tokens' GPU, if they are on one
    if tokens.is_cuda:
        cuda = [tokens.device.index if tokens.device.index is not None else torch.cuda.current_device()]
    with frozen_state(), torch.random.fork_rng(devices=cuda):
        try:
            model.train(training)
            for x in (tokens, perturbed):
                torch.default_generator.manual_seed(seed)
                for device in cuda:
                    torch.cuda.default_generators[device].manual_seed(seed)
                logits.append(model(x)[:, : t + 1])
        finally:
            model.train(was_training)
    return (logits[0] - logits[1]).abs().max().item()
