"""Token-choice routing with per-head capacity (MoSA App. E, "MoSAIC").

Each token t picks its top-s heads from router probabilities p_t = softmax(x_t W^r) over the N heads
of the group. Head i has capacity k = max(floor(capacity_factor * T / rho), 2) slots (routing/capacity.py; T = the
model's training length, so the capacity is a constant of the model and decoding is well defined).
When more than k tokens choose head i it is *overloaded*: the routing priority decides who is kept.
When fewer choose it, the free slots are *padded* with tokens that did not choose it (App. E.2).

Priorities:
- "recency" (causal): earlier tokens first. The first k tokens that chose head i are kept. Free slots
  are filled with the *last* tokens of the frame: an unchosen token at position t is taken as padding
  iff the head's free slots are >= T - t, i.e. the head could not fill up otherwise. Padding then never
  displaces a token that chose the head, and every decision at t depends only on tokens <= t.
  (Padding with the *earliest* unchosen tokens would depend on how many later tokens choose the head,
  which leaks the future into positions <= t; this implementation therefore pads at the tail.)
- "random" (NOT causal): tokens are ranked by a random priority, chosen tokens before unchosen ones,
  and the top k form the head. Whether a token is kept depends on later tokens' choices.

Outputs: member[B, N, T] (token occupies a slot of head i) and selected[B, N, T] (member that chose i;
members that did not are padding).
"""
from __future__ import annotations

import torch


GATES = ("softmax", "renorm", "sigmoid")


def resolve_top_s(count: int, top_s: int, sparsity: float) -> int:
    """Heads per token: `top_s`, or for 0 max(1, round(N / rho)), so that the s*T choices fill the
    N*k = N*T/rho slots (at capacity_factor 1); at most N."""
    return min(count, top_s or max(1, round(count / sparsity)))


def load_mismatch(count: int, top_s: int, sparsity: float, capacity_factor: float = 1.0) -> str | None:
    """A one-line warning when a head's expected load s*T/N and its capacity capacity_factor*T/rho differ
    by more than 2x (most routing choices dropped, or most slots tail padding), else None."""
    s = resolve_top_s(count, top_s, sparsity)
    ratio = s * sparsity / (count * capacity_factor)  # load / capacity
    if 0.5 <= ratio <= 2.0:
        return None
    lost = f"~{(1 - 1 / ratio) * 100:.0f}% of routing choices dropped" if ratio > 1 else f"~{(1 - ratio) * 100:.0f}% of slots padding"
    return (f"mosaic: {count} heads, top_s {s}, sparsity {sparsity:g}, capacity_factor {capacity_factor:g}: expected "
            f"load / capacity = s*rho/(N*capacity_factor) = {ratio:.2f} ({lost}); set top_s ~ N/rho or capacity_factor ~ s*rho/N")


def gate_weights(logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor, kind: str) -> torch.Tensor:
    """Output weight of head i for token t [B, T, N]: "softmax" p_ti (the standard token-choice MoE gate, MoSA
    §2.1), "renorm" p_ti / sum of p over the token's chosen heads, "sigmoid" σ(logit_ti) (MoSA's non-competitive
    score)."""
    if kind == "renorm":
        return probs / (probs * chosen).sum(-1, keepdim=True)
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    return probs


def choose(logits: torch.Tensor, top_s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits[B, T, N] -> probabilities p = softmax(logits) [B, T, N] and the boolean top-s
    choice of each token, chosen[B, T, N]."""
    probs = logits.softmax(-1)
    top = probs.topk(top_s, dim=-1).indices
    chosen = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, top, True)
    return probs, chosen


def balance_loss(probs: torch.Tensor, chosen: torch.Tensor, alpha: float) -> torch.Tensor:
    """MoSA eq. 4 (GShard / Switch): alpha * N * sum_i f_i p_i, f_i = fraction of the token choices that
    went to head i (before capacity), p_i = mean router probability of head i, over all B*T tokens.
    Our reading for top_s = s > 1, which App. E.1 does not state: f sums to 1 (each token's s choices count 1/s
    each), so the loss is alpha at uniform routing for any s and alpha keeps its meaning. Counting "the fraction of
    tokens dispatched to head i" literally would sum to s and multiply the loss by s (our alpha = that alpha * s);
    GShard counts only each token's first choice. With s = 1 all three agree."""
    n = probs.shape[-1]
    counts = chosen.flatten(0, -2).float().sum(0)  # [N] token choices per head
    f = counts / counts.sum()
    p = probs.flatten(0, -2).mean(0)
    return alpha * n * (f * p).sum()


def assign_recency(chosen: torch.Tensor, positions: torch.Tensor, k: int, frame: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched recency assignment. chosen[B, T, N], positions[B, T] (increasing) -> member, selected
    [B, N, T]. Same decisions as the walk in `assign_reference`, written with cumulative sums."""
    c = chosen.transpose(1, 2)  # [B, N, T]
    before = c.long().cumsum(-1) - c.long()  # choosers strictly before t
    free = k - before.clamp(max=k)  # free slots at t while no padding has been taken yet
    pos = positions[:, None, :]  # [B, 1, T]
    start = (free >= frame - pos) & (free > 0)  # first such t starts the padded tail
    T = c.shape[-1]
    idx = torch.arange(T, device=c.device)
    t0 = torch.where(start, idx, T).min(-1, keepdim=True).values  # [B, N, 1]
    free0 = free.gather(-1, t0.clamp(max=T - 1))  # free slots when the tail starts
    tail = (idx >= t0) & (idx < t0 + free0)  # every token of the tail takes a slot
    member = (c & (before < k) & (idx < t0)) | tail
    return member, member & c


def assign_random(chosen: torch.Tensor, priority: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched random-priority assignment (not causal). chosen[B, T, N], priority[B, T] in [0, 1) ->
    member, selected [B, N, T]: the k tokens with the highest (chose head, priority)."""
    c = chosen.transpose(1, 2)
    score = c.float() * 2 + priority[:, None, :]  # chosen tokens rank above all unchosen ones
    top = score.topk(min(k, c.shape[-1]), dim=-1).indices
    member = torch.zeros_like(c).scatter_(-1, top, True)
    return member, member & c


def assign_reference(
    chosen: torch.Tensor, positions: torch.Tensor, k: int, frame: int, priority: torch.Tensor | None = None
) -> list[list[tuple[list[int], list[int]]]]:
    """Plain-Python assignment, for tests: per batch row, per head, (member indices, selected indices),
    both in increasing position order. priority None = recency, else random priority[B, T]."""
    B, T, N = chosen.shape
    out = []
    for b in range(B):
        heads = []
        for i in range(N):
            wants = [bool(chosen[b, t, i]) for t in range(T)]
            if priority is None:  # walk forward in time: decisions use tokens <= t only
                members, count = [], 0
                for t in range(T):
                    free = k - count
                    if free > 0 and (wants[t] or free >= frame - int(positions[b, t])):
                        members.append(t)
                        count += 1
            else:
                order = sorted(range(T), key=lambda t: (not wants[t], -float(priority[b, t])))
                members = sorted(order[:k])
            heads.append((members, [t for t in members if wants[t]]))
        out.append(heads)
    return out


def slots(member: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """member[B, N, T] -> idx[B, N, k'] token index of each slot in increasing position order, and
    valid[B, N, k'] (False for empty slots, whose idx is a harmless 0); k' = min(k, T)."""
    T = member.shape[-1]
    order = torch.arange(T, device=member.device)
    key = torch.where(member, order, order + T)  # members first, by position; then empty slots
    vals, idx = key.topk(min(k, T), dim=-1, largest=False, sorted=True)
    valid = vals < T
    return torch.where(valid, idx, 0), valid
