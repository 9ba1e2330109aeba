"""MoSAIC: Mixture of Sparse Attention with Independent Choice (MoSA §2.2 and App. E).

Token-choice routing over a group of N attention heads (routing/token_choice.py): each token t picks
its top-s heads from p_t = softmax(x_t W^r), W^r in R^{h x N} (s defaults to max(1, round(N / rho)),
so the N*k slots match the s*T choices; the expected load of a head is s*T/N against its capacity
k = capacity_factor*T/rho, and a mismatch over 2x is warned about); head i keeps at most
k = max(floor(capacity_factor * T / rho), 2) tokens (T = the model's training length, so k is a
constant of the model). Overloaded heads keep tokens by `priority` (recency: earliest first, causal;
random: not causal); free slots of underloaded heads are padded with tokens that did not choose the
head, handled by `padded` (App. E.2):
- include:  padded tokens are ordinary members: they attend (causally) and are attended to;
- identity: a padded token attends only to itself (its output is x W^V W^O, scaled by the token's gate for the head
  like every slot's output: App. E.2 names no gate for padded tokens) and is invisible to others;
- ignore:   padded tokens are masked out entirely (no output, invisible) though they use a slot.
Per head, on its members X^s (rotated at their original positions): A = Attention(X^s W^Q, X^s W^K,
X^s W^V, M) with M_jl = 0 iff I_j >= I_l (and the padding rules above), output diag(p_{:,i}) A W^O
scattered back to the members' positions (as MoSA eq. 3 and the line above it, with the token-choice
probability p in place of MoSA's sigmoid score; option `gate`: "softmax" p, the standard token-choice MoE
gate y = sum_i r_i E_i of MoSA §2.1 (App. E names "standard token-choice routing" but no gate), ≈ 1/N for a
large group; "renorm" p renormalised over the token's s chosen heads; "sigmoid" σ(x_t W^r_i)). Load balancing
(eq. 4): alpha * N * sum_i f_i p_i (f_i normalised to sum to 1 for any top_s: routing/token_choice.balance_loss),
reported as aux loss "mosaic_balance" (already weighted).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from heads.base import ConfigError, GroupContext, HeadGroup, HeadOptions, register
from heads.gathered import gathered_heads_fast
from heads.kv_cache import AroundSlots, SlotKV, gathered_prefill, one_token
from routing.selection import Selection
from routing.capacity import token_choice_capacity
from routing.token_choice import (GATES, assign_random, assign_recency, assign_reference, balance_loss, choose,
                                  gate_weights, load_mismatch, resolve_top_s, slots)

PRIORITIES = ("recency", "random")
PADDED = ("include", "identity", "ignore")


@dataclass
class MosaicOptions(HeadOptions):
    sparsity: float = 8.0  # rho; capacity k = capacity_factor * T / rho tokens per head
    top_s: int = 0  # heads chosen by each token; 0 = max(1, round(N / rho)): capacity matches demand
    gate: str = "softmax"  # output weight: softmax over the N heads | renorm (over the chosen s) | sigmoid
    capacity_factor: float = 1.0
    alpha: float = 0.1  # load-balancing loss weight (eq. 4)
    priority: str = "recency"  # recency (causal) | random (not causal)
    padded: str = "include"  # include | identity | ignore (App. E.2)

    @classmethod
    def example(cls) -> dict[str, Any]:
        return {"sparsity": 4}

    @classmethod
    def grid(cls) -> dict[str, list[Any]]:
        return {"sparsity": [1.0, 2.0, 3.5, 8.0], "top_s": [0, 1, 2, 3], "gate": ["softmax", "renorm", "sigmoid"],
                "capacity_factor": [0.5, 1.0, 2.0], "priority": ["recency", "random"],
                "padded": ["include", "identity", "ignore"]}

    @property
    def causal(self) -> bool:
        return self.priority == "recency"

    def validate(self, ctx: GroupContext) -> None:
        super().validate(ctx)
        if self.sparsity < 1:
            raise ConfigError(f"mosaic: sparsity must be >= 1, got {self.sparsity}")
        if self.top_s < 0:
            raise ConfigError(f"mosaic: top_s must be >= 1 (or 0 = round(heads / sparsity)), got {self.top_s}")
        if self.gate not in GATES:
            raise ConfigError(f"mosaic: gate must be one of {', '.join(GATES)}, got {self.gate!r}")
        if self.capacity_factor <= 0:
            raise ConfigError(f"mosaic: capacity_factor must be > 0, got {self.capacity_factor}")
        if token_choice_capacity(ctx.seq_len, self.sparsity, self.capacity_factor) >= 2**62:
            raise ConfigError(f"mosaic: capacity_factor {self.capacity_factor} gives more than 2^62 slots per head "
                              f"(capacity_factor * seq_len / sparsity), past what int64 positions can count")
        if self.alpha < 0:
            raise ConfigError(f"mosaic: alpha must be >= 0, got {self.alpha}")
        if self.priority not in PRIORITIES:
            raise ConfigError(f"mosaic: priority must be one of {', '.join(PRIORITIES)}, got {self.priority!r}")
        if self.padded not in PADDED:
            raise ConfigError(f"mosaic: padded must be one of {', '.join(PADDED)}, got {self.padded!r}")

    def validate_count(self, count: int) -> None:
        if self.top_s > count:
            raise ConfigError(f"mosaic: top_s ({self.top_s}) must be <= the group's head count ({count})")
        if self.gate == "renorm" and resolve_top_s(count, self.top_s, self.sparsity) == 1:
            raise ConfigError("mosaic: gate 'renorm' with one head per token (top_s 1) weights every chosen head by "
                              "p / p = 1, so the router gets no gradient from the LM loss; use gate 'softmax' or "
                              "'sigmoid', or top_s >= 2")

    def kv_per_head(self, seq_len: int) -> int:
        return min(token_choice_capacity(seq_len, self.sparsity, self.capacity_factor), seq_len)

    def advice(self, count: int) -> str | None:
        """A router over one head under a normalising gate (warned, not refused: such checkpoints still load), else
        a load / capacity mismatch."""
        if count == 1 and self.gate != "sigmoid":
            return (f"mosaic: one head with gate {self.gate!r} is weighted 1 whatever the router says (a normalisation "
                    "over one head), so the router gets no gradient; use gate 'sigmoid' or more heads")
        return load_mismatch(count, self.top_s, self.sparsity, self.capacity_factor)


@dataclass
class MosaicCache(AroundSlots):
    """Decoding state: K/V of the tokens other tokens can see (SlotKV with k slots per head) and the
    number of slots each head has filled (padding under identity/ignore uses a slot but no K/V)."""

    kv: SlotKV
    members: torch.Tensor  # [B, N]

    def nbytes(self) -> int:
        return self.kv.nbytes() + self.members.numel() * self.members.element_size()

    def entries(self) -> int:
        return self.kv.entries()

    def capacity(self) -> int:
        return self.kv.capacity()


@register("mosaic")
class MosaicHeads(HeadGroup):
    Options = MosaicOptions
    beyond_training = "adds no member once its k slots (sized for the training length) are full"
    options: MosaicOptions

    def __init__(self, ctx: GroupContext, count: int, options: MosaicOptions) -> None:
        super().__init__(ctx, count, options)
        self.top_s = resolve_top_s(count, options.top_s, options.sparsity)
        self.k = token_choice_capacity(ctx.seq_len, options.sparsity, options.capacity_factor)
        self.frame = ctx.seq_len
        self.router = nn.Linear(ctx.d_model, count, bias=False)  # W^r
        self.qkv = nn.Linear(ctx.d_model, 3 * count * ctx.head_dim, bias=False)  # rows: (q|k|v, head, h')
        self.out = nn.Linear(count * ctx.head_dim, ctx.d_model, bias=False)  # columns: (head, h')

    def kv_entries(self, seq_len: int) -> int:
        """k slots per head, k fixed by the training length (a shorter sequence fills at most T)."""
        return self.count * min(self.k, seq_len)

    # ---- routing -------------------------------------------------------------------------------
    def _priority(self, positions: torch.Tensor) -> torch.Tensor:
        """Random priorities [B, T]: fresh in training; in eval a fixed draw per position (seeded by the
        layer), so evaluation is deterministic."""
        if self.training:
            return torch.rand(positions.shape, device=positions.device)
        g = torch.Generator().manual_seed(self.ctx.layer)
        return torch.rand(int(positions.max()) + 1, generator=g).to(positions.device)[positions]

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x[B, T, h] -> output weights (option `gate`), chosen [B, T, N]; records the balance loss
        (on the softmax probabilities, eq. 4) and routing stats."""
        logits = self.router(x)
        probs, chosen = choose(logits, self.top_s)
        self.aux_losses = {"mosaic_balance": balance_loss(probs, chosen, self.options.alpha)}
        entropy = -(probs * probs.clamp_min(1e-9).log()).sum(-1).mean().detach()
        load = chosen.float().mean((0, 1)).detach()  # f_i: fraction of tokens choosing head i [N]
        self.stats = {"mosaic_router_entropy": entropy, "mosaic_load": load}
        return gate_weights(logits, probs, chosen, self.options.gate), chosen

    def _record(self, chosen: torch.Tensor, member: torch.Tensor, selected: torch.Tensor) -> None:
        kept = selected.sum().float()
        self.stats["mosaic_dropped"] = 1.0 - kept / chosen.sum().clamp_min(1)
        self.stats["mosaic_padded"] = 1.0 - kept / member.sum().clamp_min(1)

    # ---- reference: explicit loops over sequences and heads --------------------------------------
    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """App. E per head: the tokens that chose it (top-s of p_t, by `priority` when over capacity, padded by
        `padded`), masked causal attention on them at their RoPE positions, diag(gate) A W^O scattered back (eq. 3),
        one head at a time."""
        B, T, h = x.shape
        d, o = self.ctx.head_dim, self.options
        weights, chosen = self._route(x)
        priority = self._priority(positions) if o.priority == "random" else None
        plan = assign_reference(chosen, positions, self.k, self.frame, priority)
        wq, wk, wv = self.qkv.weight.view(3, self.count, d, h)
        wo = self.out.weight.view(h, self.count, d)
        y = x.new_zeros(B, T, h)
        member = torch.zeros(B, self.count, T, dtype=torch.bool, device=x.device)
        is_selected = torch.zeros_like(member)
        for b in range(B):
            for i in range(self.count):
                members, selected = plan[b][i]
                member[b, i, members], is_selected[b, i, selected] = True, True
                if not members:
                    continue
                idx = torch.tensor(members, device=x.device)
                is_sel = torch.tensor([t in selected for t in members], device=x.device)  # [m]
                xs, pos = x[b, idx], positions[b, idx]  # [m, h], [m]
                q, k, v = self.rope(xs @ wq[i].T, pos), self.rope(xs @ wk[i].T, pos), xs @ wv[i].T
                allowed = pos[:, None] >= pos[None, :]  # M_jl = 0 iff I_j >= I_l
                if o.padded != "include":  # padded keys are invisible to every other token
                    allowed &= is_sel[None, :]
                if o.padded == "identity":  # a padded query sees only itself
                    allowed[~is_sel] = torch.eye(len(members), dtype=torch.bool, device=x.device)[~is_sel]
                rows = is_sel if o.padded == "ignore" else torch.ones_like(is_sel)
                scores = (q @ k.T / d**0.5).masked_fill(~allowed, float("-inf"))[rows]
                a = scores.softmax(-1) @ v  # [rows, h']
                gate = weights[b, idx[rows], i]  # p_{t,i} (option gate)
                y = y.index_put((torch.full_like(idx[rows], b), idx[rows]), (gate[:, None] * (a @ wo[:, i].T)).to(y.dtype),
                                accumulate=True)
        self._record(chosen, member, is_selected)
        return y

    # ---- fast path: all heads at once (the gathered core, heads/gathered.py) -----------------------
    def _fast(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Selection, torch.Tensor, torch.Tensor]:
        """Returns y[B, T, h], the slots (idx, valid [B, N, K]), the slots other tokens may see [B, N, K]
        and members per head [B, N] (the last three for the decoding cache)."""
        o = self.options
        weights, chosen = self._route(x)
        if o.priority == "recency":
            member, selected = assign_recency(chosen, positions, self.k, self.frame)
        else:
            member, selected = assign_random(chosen, self._priority(positions), self.k)
        self._record(chosen, member, selected)
        idx, valid = slots(member, self.k)  # [B, N, K], ascending members first
        sel = selected.gather(-1, idx) & valid
        visible = valid if o.padded == "include" else sel
        self_only = valid & ~sel if o.padded == "identity" else None  # a padded query sees only itself
        counted = sel if o.padded == "ignore" else valid
        gate = weights.transpose(1, 2).gather(-1, idx) * counted  # p_{t,i}; 0 on slots without output
        # under `include` every valid slot is visible and valid slots come first, so the causal mask over slots is
        # exact for them (empty slots, gate 0, give nothing): no [B, N, K, K] mask, SDPA's causal kernels on CUDA
        mask = None if o.padded == "include" else visible
        y = gathered_heads_fast(x, positions, Selection(idx, valid), gate, self.qkv.weight, self.out.weight,
                                self.rope, mask, self_only)
        return y, Selection(idx, valid), visible, member.sum(-1)

    def forward_fast(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._fast(x, positions)[0]

    # ---- decoding --------------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> MosaicCache:
        if not self.causal:
            raise ValueError("mosaic: priority 'random' is not causal and cannot be decoded incrementally")
        kv = SlotKV.empty(batch, self.count, min(self.k, max_len), self.ctx.head_dim, device, dtype)
        return MosaicCache(kv, torch.zeros(batch, self.count, dtype=torch.long, device=device))

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: MosaicCache) -> torch.Tensor:
        """Prefill (empty cache, any length: the fast path, keeping the visible members' K/V) or one
        decoding step (x[B, 1, h]) that applies the recency rule with the cached slot counts."""
        if cache.kv.fresh:
            y, sel, visible, members = self._fast(x, positions)
            gathered_prefill(cache.kv, x, positions, sel.idx, visible, self.qkv.weight, self.rope)
            cache.members += members
            return y
        one_token("mosaic", x)
        B = x.shape[0]
        N, o = self.count, self.options
        weights, chosen = self._route(x)
        c = chosen[:, 0]  # [B, N]
        p = positions[:, :1]  # [B, 1]
        free = self.k - cache.members
        sel = c & (free > 0)
        pad = ~c & (free > 0) & (free >= self.frame - p)  # the padded tail (routing/token_choice.py)
        member = sel | pad
        cache.members += member
        spos = p[:, :, None].expand(B, N, 1)
        q, k, v = self.qkv(x).view(B, 3, N, 1, self.ctx.head_dim).unbind(1)  # every head, one token
        q, k = self.rope(q, spos), self.rope(k, spos)
        visible = member if o.padded == "include" else sel
        cache.kv.write(visible[..., None], k, v, spos)
        a = cache.kv.attend(q, p)  # [B, N, 1, h']
        if o.padded == "identity":  # a padded token sees only itself: softmax over one key = its value
            a = torch.where(pad[..., None, None], v, a)
        counted = sel if o.padded == "ignore" else member
        a = a * (weights[:, 0] * counted)[..., None, None]  # diag(p) A; heads the token is not in give 0
        return self.out(a.reshape(B, 1, N * self.ctx.head_dim))  # sum_i A_i W^O_i
