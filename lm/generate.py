"""Autoregressive decoding with a KV cache, and a sampling CLI.

The cache is a list per layer of one cache object per head group (`HeadGroup.new_cache`), passed as
`DecoderLM.forward(tokens, positions, cache)`: the first call (the prompt) is the prefill, every later
call feeds one token. Each head type keeps only what its decoding needs (dense: all tokens, local: a
window, sparse heads: the tokens they selected), so `cache_nbytes` is the real allocated size and
`cache_fill` the entries each head type actually stored, to be read next to its slots and the
analytic count `DecoderLM.kv_total(T)` (MoSA Table 2). Generating past the training length
(model.seq_len) warns once, saying what each head type of the model does there (`BEYOND_TRAINING`).

    python -m lm.generate --ckpt runs/x/last.ckpt --prompt "Once upon a time" --max-new-tokens 50 \\
        [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--seed 0] [--compile]

`--compile` (`decode_step`) runs every decoding step through one torch.compile graph: a step's shapes are
static and it reads no host-side counter (heads/kv_cache.py), so the per-op overhead that dominates small
models' decoding goes (bench/results/decode_cpu.md).
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable

import torch

from data_prep import tokenizer as sp_codec
from data_prep.cli import OneLineParser
from lm.loading import TOKENIZER_HELP, load_for_generation
from lm.model import DecoderLM
from lm.sanity import warn

Cache = list[list[Any]]
# torch < 2.13 (2.11 is the GPU image's): inductor's kernel fusion gets hybrid decoding steps wrong (cached keys
# and logits off by O(1) against eager decoding in float64, e.g. MoSAIC next to MiTA, or MoSA next to fixed and
# local heads; aot_eager agrees with eager; bench/results/compat_torch211.md). Without fusion (max_fusion_size=1)
# every step is exact there, and still 3.5-4.4x faster than eager on CPU. From 2.13 on inductor fuses freely.
INDUCTOR_OPTIONS: dict[str, Any] = {} if torch.torch_version.TorchVersion(torch.__version__) >= (2, 13) else \
    {"max_fusion_size": 1}


def decode_step(model: DecoderLM, backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """The model's forward for one-token decoding calls, through torch.compile(fullgraph=True, dynamic=False):
    every head type's decoding step has static shapes and reads no host-side counter (heads/kv_cache.py), so
    one graph serves every step of a generation (a new batch size or cache length compiles another). Pass it
    as `step` to `generate` / `cached_logits`; the prefill stays eager. Inductor runs with INDUCTOR_OPTIONS
    (no kernel fusion on torch < 2.13, whose fusion is wrong here)."""
    options = INDUCTOR_OPTIONS if backend == "inductor" else None
    return torch.compile(model, fullgraph=True, dynamic=False, backend=backend, options=options)


def new_cache(model: DecoderLM, batch: int, max_len: int, device: torch.device | str | None = None) -> Cache:
    """An empty cache for `batch` sequences of up to `max_len` tokens fed (`fed_tokens`), on the model's device
    (or `device`: "meta" sizes a cache without allocating it)."""
    p = next(model.parameters())
    return [[g.new_cache(batch, max_len, device or p.device, p.dtype) for g in block.attn.groups]
            for block in model.blocks]


def cache_nbytes(cache: Cache) -> int:
    """Bytes allocated by every head group's cache."""
    return sum(c.nbytes() for layer in cache for c in layer)


def cache_fill(model: DecoderLM, cache: Cache) -> dict[str, tuple[int, int]]:
    """head type -> (key/value entries stored, slots allocated), summed over layers, sequences and heads."""
    out: dict[str, tuple[int, int]] = {}
    for block, layer in zip(model.blocks, cache):
        for group, c in zip(block.attn.groups, layer):
            stored, slots = out.get(group.type_name, (0, 0))
            out[group.type_name] = (stored + c.entries(), slots + c.capacity())
    return out


def format_fill(fill: dict[str, tuple[int, int]]) -> str:
    """'mosa 612/1088 (56%), dense 2400/2400 (100%)'."""
    return ", ".join(f"{t} {n}/{c} ({100 * n / max(c, 1):.0f}%)" for t, (n, c) in fill.items())


def beyond_training(model: DecoderLM, length: int) -> str:
    """One line: what each head type of the model does at `length` > model.seq_len."""
    types = dict.fromkeys((g.type_name, g.beyond_training) for block in model.blocks for g in block.attn.groups
                          if g.beyond_training)  # "" for types without a KV cache, which do not decode
    said = "; ".join(f"{name} {what}" for name, what in types)
    return f"generating {length} tokens, past the training length {model.cfg.seq_len}: {said}"


def kv_bytes_analytic(model: DecoderLM, seq_len: int) -> int:
    """Bytes of the analytic KV count: kv_total(T) entries x (key + value) x head_dim x element size."""
    p = next(model.parameters())
    return model.kv_total(seq_len) * 2 * model.cfg.head_dim * p.element_size()


def _positions(start: int, length: int, batch: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + length, device=device).expand(batch, -1)


@torch.no_grad()
def cached_logits(model: DecoderLM, tokens: torch.Tensor, prefill: int,
                  step: Callable[..., torch.Tensor] | None = None) -> tuple[torch.Tensor, Cache]:
    """Logits[B, T, V] of tokens[B, T] computed as decoding does: one prefill call on tokens[:, :prefill],
    then one call per remaining token (through `step`, default the model; see `decode_step`). For checking
    incremental decoding against a full forward."""
    B, T = tokens.shape
    step = model if step is None else step
    cache = new_cache(model, B, T)
    out = [model(tokens[:, :prefill], _positions(0, prefill, B, tokens.device), cache)]
    for t in range(prefill, T):
        out.append(step(tokens[:, t : t + 1], _positions(t, 1, B, tokens.device), cache))
    return torch.cat(out, dim=1), cache


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None, vocab: int | None = None) -> torch.Tensor:
    """logits[B, V] -> next tokens[B]. temperature 0 = greedy; top_k 0 = off; top_p 1 = off; `vocab`: only
    ids < vocab are drawn (the tokenizer's pieces, when the model's vocabulary is padded beyond them; >= 1: a slice
    [:-1] would silently drop the last id)."""
    if vocab is not None and vocab < 1:
        raise ValueError(f"sample: vocab must be >= 1, got {vocab}")
    logits = logits[..., :vocab]
    if temperature <= 0:
        return logits.argmax(-1)
    # shift first: the top logit becomes 0, so a tiny temperature gives -inf elsewhere, never inf - inf = nan
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:  # nucleus: the smallest set of tokens whose probability reaches top_p
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def check_sampling(temperature: float, top_k: int, top_p: float, flags: bool = False) -> None:
    """One-line ValueError unless temperature is finite and >= 0, top_k >= 0 and 0 < top_p <= 1 (`flags`: name
    them as the command line does, --top-k)."""
    for ok, name, rule, value in ((0 <= temperature < math.inf, "temperature", "finite and >= 0", temperature),
                                  (top_k >= 0, "top_k", ">= 0", top_k), (0 < top_p <= 1, "top_p", "in (0, 1]", top_p)):
        if not ok:
            raise ValueError(f"{'--' + name.replace('_', '-') if flags else name} must be {rule}, got {value}")


def check_prompt(prompt: torch.Tensor, vocab_size: int, max_new_tokens: int) -> torch.Tensor:
    """The prompt as int64 ids (any integer dtype, e.g. data_prep's uint16, which the embedding does not take);
    one-line ValueError unless it is a [B, T0] tensor of token ids in [0, vocab_size) with B, T0 >= 1, and
    max_new_tokens >= 0 (an id out of range would fail deep in the embedding, or as a device-side assert)."""
    if prompt.dim() != 2 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
        raise ValueError(f"generate: the prompt must be a [batch, tokens] tensor of integer token ids, "
                         f"got shape {list(prompt.shape)} of {prompt.dtype}")
    if prompt.shape[0] == 0:
        raise ValueError("generate: the prompt holds no sequences (batch size 0)")
    if prompt.shape[1] == 0 or max_new_tokens < 0:
        raise ValueError(f"generate: need a prompt of at least one token and max_new_tokens >= 0, "
                         f"got {prompt.shape[1]} tokens and {max_new_tokens}")
    prompt = prompt.long()
    lo, hi = (int(v) for v in torch.aminmax(prompt))
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"generate: prompt token id {lo if lo < 0 else hi} is outside the model's vocabulary "
                         f"[0, {vocab_size})")
    return prompt


def fed_tokens(prompt_len: int, max_new_tokens: int) -> int:
    """Tokens `generate` runs through the model (and caches): the prompt and every new token but the last."""
    return prompt_len + max(max_new_tokens - 1, 0)


@torch.no_grad()
def generate(model: DecoderLM, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None,
             stop_id: int | None = None, cache: Cache | None = None,
             step: Callable[..., torch.Tensor] | None = None, vocab: int | None = None) -> torch.Tensor:
    """prompt[B, T0] -> tokens[B, T0 + n] with n <= max_new_tokens: stops early when every sequence has
    produced stop_id, and a sequence that has is padded with stop_id after it. `cache`: an empty one for
    `fed_tokens(T0, max_new_tokens)` tokens, to read its fill afterwards; `step`: what decodes each new token
    (default the model; `decode_step(model)` compiles it); `vocab`: only ids below it are generated (`sample`).
    Runs the model in eval mode and leaves it in the mode it found. Warns when the tokens it feeds go past the
    training length. One-line ValueError for a prompt that is not [B, T0 >= 1] ids in the vocabulary
    (`check_prompt`), max_new_tokens < 0, sampling settings out of range (`check_sampling`) or a `cache` that is
    not new, not for B sequences or smaller than the tokens fed need (a short cache would drop or overwrite keys)."""
    prompt = check_prompt(prompt, model.cfg.vocab_size, max_new_tokens)
    B, T0 = prompt.shape
    check_sampling(temperature, top_k, top_p)
    fed = fed_tokens(T0, max_new_tokens)
    if cache is not None:
        need = new_cache(model, B, fed, device="meta")
        if not all(c.fresh and c.batch == B and c.capacity() >= n.capacity()
                   for layer, needed in zip(cache, need, strict=True) for c, n in zip(layer, needed, strict=True)):
            raise ValueError(f"generate: `cache` must be new, for the prompt's {B} sequences and for {fed} tokens "
                             f"(new_cache(model, {B}, fed_tokens({T0}, {max_new_tokens})))")
    if fed > model.cfg.seq_len:  # the last new token is sampled, never fed
        warn(beyond_training(model, T0 + max_new_tokens))
    was_training = model.training
    model.eval()
    try:
        cache = new_cache(model, B, fed) if cache is None else cache
        step = model if step is None else step
        logits = model(prompt, _positions(0, T0, B, prompt.device), cache)[:, -1]
        tokens = [prompt]
        done = torch.zeros(B, dtype=torch.bool, device=prompt.device)
        for t in range(T0, T0 + max_new_tokens):
            nxt = sample(logits, temperature, top_k, top_p, generator, vocab)
            if stop_id is not None:
                nxt = nxt.masked_fill(done, stop_id)  # a finished sequence only pads
                done |= nxt == stop_id
            tokens.append(nxt[:, None])
            if stop_id is not None and bool(done.all()):
                break
            if t + 1 < T0 + max_new_tokens:
                logits = step(nxt[:, None], _positions(t, 1, B, prompt.device), cache)[:, -1]
    finally:
        model.train(was_training)
    return torch.cat(tokens, dim=1)


def check_memory(model: DecoderLM, max_len: int) -> None:
    """Refuse a KV cache for `max_len` tokens larger than the free host memory (one-line ValueError): the bytes the
    cache allocates (slots, positions, counters), which can exceed the analytic count's (a Routing head's clusters
    each have room for the capacity)."""
    need = cache_nbytes(new_cache(model, 1, max_len, device="meta"))
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > free:
        raise ValueError(f"{max_len} tokens fed (the prompt and --max-new-tokens but the last) need a "
                         f"{need / 2**30:.1f} GiB KV cache, more "
                         f"than the {free / 2**30:.1f} GiB of free memory; lower --max-new-tokens")


def check_command(max_new_tokens: int, seed: int, prompt: str) -> None:
    """The generation commands' --max-new-tokens (>= 1), --seed (torch.Generator's range) and --prompt (UTF-8): a
    one-line ValueError otherwise."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not -2**63 <= seed < 2**64:
        raise ValueError(f"--seed must be in [-2**63, 2**64), got {seed}")
    check_utf8("--prompt", prompt)


def check_utf8(option: str, text: str) -> None:
    """A one-line ValueError if a command-line string is not valid UTF-8 (Python keeps such bytes as lone
    surrogates, which the tokenizer cannot take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{option} is not valid UTF-8 (byte 0x{ord(text[err.start]) - 0xDC00:02x} at character "
                         f"{err.start})") from None


def check_decodable(model: DecoderLM) -> None:
    """Every head group of the model supports KV-cached decoding (one-line ValueError otherwise, naming every
    group that does not: a non-causal option, or a type without a cache)."""
    problems = []
    for block in model.blocks:
        for group in block.attn.groups:
            try:
                group.new_cache(1, 1, "meta")
            except (ValueError, NotImplementedError) as err:
                problems.append(str(err))
    if problems:
        raise ValueError(f"{'; '.join(dict.fromkeys(problems))}; this checkpoint cannot be sampled with lm.generate")


def decodable(model: DecoderLM) -> bool:
    """Whether check_decodable accepts the model."""
    try:
        check_decodable(model)
    except ValueError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m lm.generate",
                       description="Sample from a train_lm.py checkpoint with the KV cache.")
    ap.add_argument("--ckpt", required=True, help="Lightning checkpoint written by train_lm.py")
    ap.add_argument("--prompt", required=True, help="text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=100,
                    help="tokens to generate at most (fewer if the end-of-document token comes first; default 100)")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    ap.add_argument("--compile", action="store_true",
                    help="decode through torch.compile (one graph for every step; compiling takes a while first)")
    ap.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    args = ap.parse_args(argv)
    try:
        check_command(args.max_new_tokens, args.seed, args.prompt)
        check_sampling(args.temperature, args.top_k, args.top_p, flags=True)
        model, sp, _ = load_for_generation(args.ckpt, args.tokenizer)
        check_decodable(model)
        ids = sp_codec.encode_text(sp, args.prompt)
        if not ids:
            raise ValueError("--prompt encodes to no tokens")
        fed = fed_tokens(len(ids), args.max_new_tokens)
        check_memory(model, fed)
        prompt = torch.tensor([ids])
        g = torch.Generator().manual_seed(args.seed)
        cache = new_cache(model, 1, fed)
        step = decode_step(model) if args.compile else None
        out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, g,
                       stop_id=sp.eos_id() if sp.eos_id() >= 0 else None, cache=cache, step=step,
                       vocab=sp.get_piece_size())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    T = out.shape[1] - 1  # the last token is sampled, never fed
    print(f"KV cache after the {T} tokens fed (prompt and new tokens but the last): entries stored / slots allocated "
          f"{format_fill(cache_fill(model, cache))}; "
          f"{cache_nbytes(cache)} bytes allocated (keys and values, and each cache's positions, fill counters and "
          f"block state); analytic kv_total({T}) = {model.kv_total(T)} entries = {kv_bytes_analytic(model, T)} bytes "
          f"of keys and values", file=sys.stderr)
    print(sp.decode(out[0].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
