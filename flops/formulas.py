"""Analytic cost of one head group: forward FLOPs, KV-cache entries, parameters. One function per head type.

Convention (MoSA App. C), the only one used anywhere in flops/ and bench/:
- a [i, j] x [j, k] matrix product costs 2ijk FLOPs (App. C rounds (2j - 1)ik up to 2jik);
- forward pass of ONE sequence of T tokens; training = 3 x forward (flops/model.py);
- no causal halving: causal attention of T queries over T keys counts T*T scores;
- layer norms, residuals, softmax, RoPE, embeddings and other element-wise work are omitted,
  EXCEPT where App. C counts them explicitly (MoSA's h'k for scaling the head output by router scores);
- FFN h -> m*h -> h costs 2 * 2*h*(m*h)*T = 16 h^2 T for m = 4 (flops/model.py);
- the vocabulary projection is NOT in model totals (Table 4 is reproduced exactly without it);
  flops.model gives it separately (2 h V T) for cross-checks and MFU.
Symbols: h = d_model, h' = head_dim, T = seq_len, n = heads in the group, rho = sparsity,
k = max(floor(T / rho), 2) tokens per sparse head (MoSA App. F; during training rho divides T).

Parameters are the learned weights of the group as the paper describes it. KV entries (MoSA Table 2: tokens
whose key and value a head must keep for decoding; dense T, MoSA/fixed k) are not restated here: group_cost
takes them from the head type's own `Options.kv_per_head` (heads/), as the built model and its cache do.

Adding a head type: write ONE function below the marker line that precedes the later types (topk ... mita),
    @formula("name")
    def name(h: int, hd: int, T: int, n: int, o: Options) -> Work: ...
stating FLOPs and parameters, reading its options with `o.get("field")` (the head type's Options dataclass supplies every default) /
`o.require("field")`, and citing the paper.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from heads.base import REGISTRY, ConfigError, GroupContext, make_options
from routing.capacity import slot_capacity
from routing.expert_choice import tokens_per_head
from routing.landmarks import published_count


@dataclass(frozen=True)
class Cost:
    """Cost of a whole group of n heads for one length-T sequence."""

    flops: int  # forward FLOPs
    kv: int  # KV-cache entries, summed over the group's heads
    params: int  # learned parameters


@dataclass(frozen=True)
class Work:
    """What a formula states for a whole group of n heads and one length-T sequence (group_cost adds KV)."""

    flops: int  # forward FLOPs
    params: int  # learned parameters


class Options:
    """Read-only view of a group's options, from a dict (YAML) or a heads/ Options dataclass. For a
    dict, the registered head type's dataclass defaults fill missing fields (when that type exists)."""

    def __init__(self, head_type: str, values: Any) -> None:
        self.head_type = head_type
        if dataclasses.is_dataclass(values):
            values = dataclasses.asdict(values)  # type: ignore[arg-type]
        merged: dict[str, Any] = {}
        if head_type in REGISTRY:
            cls = REGISTRY[head_type].Options
            merged = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        merged.update(dict(values or {}))
        self.values = merged

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def require(self, name: str) -> Any:
        if self.values.get(name) is None:
            raise ConfigError(f"{self.head_type}: option {name!r} is required to count FLOPs")
        return self.values[name]


Formula = Callable[[int, int, int, int, Options], Work]
FORMULAS: dict[str, Formula] = {}


def formula(name: str) -> Callable[[Formula], Formula]:
    """Decorator: register the cost function of head type `name` (the same name as in heads/)."""

    def wrap(fn: Formula) -> Formula:
        if name in FORMULAS:
            raise RuntimeError(f"FLOP formula for {name!r} registered twice")
        FORMULAS[name] = fn
        return fn

    return wrap


def group_cost(head_type: str, d_model: int, head_dim: int, seq_len: int, count: int, options: Any = None) -> Cost:
    """Cost of `count` heads of `head_type`: FLOPs and parameters from its formula, KV entries from kv_per_head;
    unknown type -> one-line ConfigError."""
    if head_type not in FORMULAS:
        raise ConfigError(f"no FLOP formula for head type {head_type!r}; known: {', '.join(sorted(FORMULAS))} (a new "
                          "type's is a @formula function in flops/formulas.py)")
    if count < 0:
        raise ConfigError(f"{head_type}: head count must be >= 0, got {count}")
    o = Options(head_type, options)
    kv = count * kv_per_head(o, GroupContext(d_model, head_dim, seq_len))  # validates the options first
    work = FORMULAS[head_type](d_model, head_dim, seq_len, count, o)
    return Cost(flops=work.flops, kv=kv, params=work.params)


def kv_per_head(o: Options, ctx: GroupContext) -> int:
    """KV-cache entries of one head, stated once by its head type: `Options.kv_per_head` of the options
    heads.make_options builds, as the model does. 0 for the compression layer, which is no head type (the blocks
    above it count its t states' keys and values)."""
    if o.head_type not in REGISTRY:
        return 0
    return make_options(o.head_type, o.values, ctx).kv_per_head(ctx.seq_len)


def sparse_k(seq_len: int, sparsity: float) -> int:
    """Tokens per sparse head, k = max(floor(T / rho), 2) (MoSA App. F; k = T / rho when rho | T), <= T."""
    if not (math.isfinite(sparsity) and sparsity >= 1):
        raise ConfigError(f"sparsity must be a finite number >= 1, got {sparsity}")
    return int(tokens_per_head(seq_len, sparsity))


@formula("dense")
def dense(h: int, hd: int, T: int, n: int, o: Options) -> Work:
    """App. C: 8hh'T (Q, K, V, O) + 4h'T^2 (QK^T and AV) per head."""
    return Work(flops=n * (8 * h * hd * T + 4 * hd * T * T), params=n * 4 * h * hd)


@formula("mosa")
def mosa(h: int, hd: int, T: int, n: int, o: Options) -> Work:
    """App. C: 8hh'k + 4h'k^2 + 2hT (router scores r = sigma(X W^r), W^r in R^h) + h'k (output
    scaled by the scores) per head; params 4hh' + h (projections + router). The causal selections of
    heads/mosa.py ("threshold", "quota", "predictor") compute on their capacity, ceil(capacity_factor * k)
    slots (= k at the default capacity_factor 1), and "predictor" adds its classifier z = x W^p + b:
    2hT FLOPs and h + 1 params per head; expert-choice TopK uses exactly k."""
    k = kv_per_head(o, GroupContext(h, hd, T))  # the slots it computes on (MoSAOptions.kv_per_head)
    predictor = o.get("selection") == "predictor"
    return Work(flops=n * (8 * h * hd * k + 4 * hd * k * k + 2 * h * T + hd * k) + (n * 2 * h * T if predictor else 0),
                params=n * (4 * h * hd + h) + (n * (h + 1) if predictor else 0))


@formula("fixed")
def fixed(h: int, hd: int, T: int, n: int, o: Options) -> Work:
    """App. C: fixed strided sparse attention on k tokens, 8hh'k + 4h'k^2 per head, with k = ceil(T / rho), the
    tokens heads/fixed.py selects (every multiple of rho below T; T / rho when rho divides T, as in App. C)."""
    k = kv_per_head(o, GroupContext(h, hd, T))  # the tokens it selects (FixedOptions.kv_per_head)
    return Work(flops=n * (8 * h * hd * k + 4 * hd * k * k), params=n * 4 * h * hd)


@formula("routing")
def routing(h: int, hd: int, T: int, n: int, o: Options) -> Work:
    """App. C: Routing Transformer head, 6hh'T (Q = K, V, O on all T tokens) + rho * 4h'k^2 (rho
    clusters of k tokens) + 2h'T ("cluster selection", as the paper writes it; a nearest-centroid
    search over rho centroids would be 2h'T*rho). Centroids are EMA k-means buffers, not parameters.
    With the causal "nearest" assignment of heads/routing_attn.py each cluster has
    ceil(capacity_factor * k) slots (= k at the default 1.0)."""
    clusters = int(o.require("sparsity"))  # heads/routing_attn.py keeps rho centroids, whatever T
    k = sparse_k(T, clusters)
    if o.get("assignment") == "nearest":
        k = min(T, slot_capacity(k, o.get("capacity_factor")))
    return Work(flops=n * (6 * h * hd * T + 4 * hd * k * k * clusters + 2 * hd * T), params=n * 3 * h * hd)


@formula("local")
def local(h: int, hd: int, T: int, n: int, o: Options) -> Work:
    """Sliding-window attention (each query sees the last w tokens, itself included):
    8hh'T (Q, K, V, O on all tokens) + 4h'T*min(w, T) (each query scores w keys, no causal halving,
    App. C's convention with T^2 replaced by T*w). An algorithmic count, like
    "no causal halving": the SDPA fast path (heads/local.py band_layout) scores blocks of w queries against 2w
    keys, 4h'T*2w, so it executes 1.2x this at h = 512, h' = 64, w = 256 (a window near T: the causal square);
    flash-attn's window executes ~w."""
    w = min(int(o.require("window")), T)
    return Work(flops=n * (8 * h * hd * T + 4 * hd * T * w), params=n * 4 * h * hd)


# ---- Later head types: add ONE @formula("name") function per type below this line (keep it short,
# ---- cite the paper's equations, state FLOPs and parameters). Model totals pick it up automatically.


@formula("topk")
def topk(h: int, hd: int, T: int, n: int, o: Options) -> Work:
    """Per-query top-k (Gupta et al. 2021, eq. 4) as implemented there and in heads/topk.py: all scores QK^T
    (2h'T^2, needed to select) and the k kept weights, scattered into a dense row, times all values (2h'T^2;
    the paper's §5 says its implementation "does not leverage this sparsity"). So 8hh'T + 4h'T^2, dense's
    App. C cost: the head saves activation memory (O(Tk) kept, not O(T^2)), not FLOPs; selection not counted.
    Params: dense's 4hh'."""
    return Work(flops=n * (8 * h * hd * T + 4 * hd * T * T), params=n * 4 * h * hd)


@formula("mosaic")
def mosaic(h: int, hd: int, T: int, n: int, o: Options) -> Work:
    """MoSAIC (App. E): MoSA's per-head cost on its k = max(floor(capacity_factor * T / rho), 2)
    slots, 8hh'k + 4h'k^2 + h'k (output scaled by the router probability), plus the token-choice
    router X W^r with W^r in R^{h x n}: 2hT per head, as MoSA's. Softmax and top-s not counted.
    Params: 4hh' + h per head (projections + router column)."""
    k = kv_per_head(o, GroupContext(h, hd, T))  # its slots (MosaicOptions.kv_per_head)
    return Work(flops=n * (8 * h * hd * k + 4 * hd * k * k + 2 * h * T + hd * k), params=n * (4 * h * hd + h))


@formula("agent")
def agent(h: int, hd: int, T: int, n: int, o: Options) -> Work:
    """Causal agent attention (Agent Attention eq. 3 / eq. 7's 2nNC + 2NnC terms, as 2ijk products):
    8hh'T + 4h'mT (aggregation: m = T // b agents over T keys) + 4h'Tm (broadcast: T queries over m
    agents) + 4h'T*min(w, T) (local window) + 2Kh'T (option dwc = K: the causal depthwise convolution over V,
    eq. 7's k^2 NC term with K taps). Variant published (eq. 6 over the whole sequence): m = max(1, T // b) agents
    and no window term. Pooling and the agent biases' additions not counted (elementwise). Params:
    dense's 4hh' + (K + 1)h' for the convolution's taps and bias + 2 x (option bias) distance buckets of B1 and B2.
    An algorithmic count: the fast path scores each block of b queries against 2b window keys whatever w, 8h'Tb
    where this counts 4h'Tw (1.06x this at h = 512, b = w = 64, T = 1024; more when w < b)."""
    m, w, K = T // int(o.require("block")), min(int(o.require("window")), T), int(o.get("dwc"))
    if o.get("variant") == "published":
        m, w = published_count(T, int(o.require("block"))), 0
    dwc = (2 * K * hd * T, (K + 1) * hd) if K else (0, 0)
    params = 4 * h * hd + dwc[1] + 2 * int(o.get("bias"))
    return Work(flops=n * (8 * h * hd * T + 8 * hd * m * T + 4 * hd * T * w + dwc[0]), params=n * params)


@formula("mita")
def mita(h: int, hd: int, T: int, n: int, o: Options) -> Work:
    """Causal MiTA (eqs. 5-12, Alg. 1) with m = T // b landmarks: 8hh'T + 2h'mT (landmark scores
    S = Q~ K^T, eq. 7) + 2h'Tm (routing logits Q Q~^T, the same product as the shared expert's scores) + if
    shared: 2h'mT (landmark values, eq. 8) + 2h'Tm (shared expert A V~, eq. 9) + 4h'T*s*min(k, T) (routed
    experts; s at most the landmarks a query can route to, min(m, (T - 1) // b - L + 1): none when the local
    blocks cover every block) + 4h'T*min(L b, T) (own block and the L - 1 before it, option local_blocks). Variant
    published (Alg. 1 over the whole sequence): m = max(1, T // b), s at most m, no local term. Pooling, top-k and
    gathers not counted. Params: dense's 4hh'. An algorithmic count: with the shared expert heads/mita.py takes
    the routing decisions from S and Q Q~^T computed once more without autograd (+4h'mT); its grouped layout pads
    each expert's queries to multiples of b (on CPU the groups this routing needs, 1.04x this at h = 512,
    b = k = 64, s = 1; on CUDA where the varlen path is not taken, s > 1 or torch.compile, a static
    ceil(T s / b) + m groups, up to about twice the routed pairs)."""
    b, k, L = int(o.require("block")), int(o.require("k")), int(o.get("local_blocks"))
    m = T // b
    s = min(int(o.require("s")), max(min(m, (T - 1) // b - L + 1), 0))  # the landmarks before the local blocks
    local = min(L * b, T)
    if o.get("variant") == "published":
        m = published_count(T, b)
        s, local = min(int(o.require("s")), m), 0
    shared = 4 * hd * m * T if o.get("shared") else 0
    attend = 4 * hd * m * T + shared + 4 * hd * T * s * min(k, T) + 4 * hd * T * local
    return Work(flops=n * (8 * h * hd * T + attend), params=n * 4 * h * hd)


@formula("compression")
def compression(h: int, hd: int, T: int, n: int, o: Options) -> Work:
    """Adaptive-attention compression layer (lm/compression.py), T = span length N compressed into
    t states: per head 2hh't (Q) + 4hh'N (K, V on the span) + 2h'th (O) + 4h'tN (scores and AV over
    all N, the post's O(Nt)), plus a SwiGLU MLP on the t states, 3 * 2th*m with m = 2/3 * ffn_mult * h.
    Params: the projections and the MLP; the layer's three LayerNorms (6h parameters) are not counted."""
    t, m = int(o.require("t")), 2 * int(o.get("ffn_mult", 4)) * h // 3
    attn = n * (4 * h * hd * t + 4 * h * hd * T + 4 * hd * t * T)
    return Work(flops=attn + 6 * t * h * m, params=n * 4 * h * hd + 3 * h * m)
