"""The head-group contract on random configurations of every head type (seeded, so reproducible): random
options (edge values included: window 1, block 1, k > T, sparsity 1 or > T, capacity factors below and above 1),
head counts, training lengths, input lengths up to twice the training length, and RoPE on none, some or all
dims of a head. In fp64, so that any
difference is a bug, not rounding:
- fast path == reference, output and every gradient (rtol 1e-10, atol 1e-12: some gradients are exactly 0 in
  theory, e.g. the router of a one-head MoSAIC group, whose softmax over one logit is 1, and both paths give
  1e-16 noise);
- causal groups: resampling the inputs after a random row t leaves the outputs at rows <= t unchanged, in eval mode
  and in training mode (state frozen, the same random draws in both passes), and so does cutting the input after
  row t (to 1e-10: another length may block the sums differently);
- every group, in eval mode: each sequence's output is what it gets alone, whatever else its batch holds (no batch
  statistic reaches an output), so a validation perplexity does not depend on the batch size or on which documents
  share a batch;
- decodable groups: a prefill of p rows then one row per call == the full forward.
The values drawn are each type's `Options.grid()` (heads/), which every type with options of its own declares.
Configurations the options refuse (ConfigError) are skipped; each test still checks `CASES` real ones, and fails
(instead of drawing forever) when too few of its draws are accepted."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from heads import REGISTRY, ConfigError, GroupContext, HeadGroup, HeadOptions, make_options
from heads.base import frozen_state
from tests.head_checks import AS_PUBLISHED, fast_and_reference, make_group, published_options

CASES = 40  # accepted configurations per head type
DRAWS = 50 * CASES  # ... out of at most this many draws


def random_groups(head_type: str, seed: int):
    """Yield (group, T, batch, description) for CASES accepted random configurations of `head_type`."""
    rng = random.Random(seed)
    accepted, refusal, grid = 0, None, REGISTRY[head_type].Options.grid()
    for _ in range(DRAWS):
        options = {name: rng.choice(values) for name, values in grid.items()}
        seq_len, count, rope = rng.choice([8, 17, 32, 64]), rng.randint(1, 4), rng.choice([0.0, 0.25, 0.5, 1.0])
        T, batch = rng.randint(1, 2 * seq_len), rng.randint(1, 3)
        try:
            group = make_group(head_type, options, seq_len, count=count, d_model=16, head_dim=8, dtype=torch.float64,
                               rope_fraction=rope)
        except ConfigError as err:
            refusal = err
            continue
        accepted += 1
        yield group, T, batch, f"{head_type} {options} count={count} seq_len={seq_len} rope={rope} T={T} batch={batch}"
        if accepted == CASES:
            return
    pytest.fail(f"{head_type}: only {accepted} of {DRAWS} random configurations accepted; last refusal: {refusal}")


def decode(group: HeadGroup, x: torch.Tensor, prefill: int) -> torch.Tensor | None:
    """The group's output computed as decoding does (None if the type has no cache)."""
    B, T, _ = x.shape
    try:
        cache = group.new_cache(B, T, "cpu", torch.float64)
    except NotImplementedError:
        return None
    pos = torch.arange(T).expand(B, T)
    out = [group(x[:, :prefill], pos[:, :prefill], cache)]
    out += [group(x[:, t : t + 1], pos[:, t : t + 1], cache) for t in range(prefill, T)]
    return torch.cat(out, 1)


# Options the random contract does not draw, each with why the forward pass, its causality and decoding do not depend
# on it (they are training-time rates and loss weights). Every other option of a type must be in its grid(): an
# option left out is never varied by the shared tests (a non-causal value of it would pass them all).
NOT_DRAWN = {
    ("mosa", "threshold_momentum"): "EMA rate of the running quantile, updated after the step",
    ("mosa", "predictor_weight"): "weight of the predictor's loss",
    ("mosaic", "alpha"): "weight of the load-balancing loss",
    ("routing", "decay"): "EMA decay of the centroids, updated after the step",
    ("routing", "commitment"): "weight of the commitment loss",
}


def test_every_registered_type_declares_its_test_options() -> None:
    """A type with options of its own defines, next to them, `example()` (tiny options the shared tests build it
    with, valid at seq_len 32) and `grid()` (the values this file draws, for options the type has)."""
    common = {f.name for f in dataclasses.fields(HeadOptions)}
    for name, cls in sorted(REGISTRY.items()):
        own = {f.name for f in dataclasses.fields(cls.Options)} - common
        missing = [f"{method}()" for method in ("example", "grid") if own and method not in vars(cls.Options)]
        assert not missing, (f"head type {name!r}: {cls.Options.__name__} has options {', '.join(sorted(own))} but "
                             f"defines no {' and no '.join(missing)}: add them next to its fields (as heads/local.py "
                             "does): example() returns small valid options for the tests' tiny models (seq_len 32), "
                             "grid() the values of each option the random contract test draws from")
        assert set(cls.Options.grid()) <= own, f"{name}: grid() names options {cls.Options.__name__} does not have"
        undrawn = sorted(own - set(cls.Options.grid()) - {key for head, key in NOT_DRAWN if head == name})
        assert not undrawn, (f"{name}: grid() leaves out {', '.join(undrawn)}: add its values there (edge values "
                             "included), or to NOT_DRAWN in this file with why the forward pass does not depend on it")
        example = make_options(name, cls.Options.example(), GroupContext(d_model=16, head_dim=8, seq_len=32))
        example.validate_length(name, 32)


def check_contract(group: HeadGroup, T: int, batch: int, what: str, rng: random.Random) -> None:
    """fast == reference (output and gradients); causal: no leak from rows after a random t; decoding == forward."""
    for name, ref, fast in fast_and_reference(group, T, batch):  # atol: gradients that are exactly 0 in theory
        torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}; {what}")
    group.options.impl = "fast"
    x = torch.randn(batch, T, group.ctx.d_model, dtype=torch.float64)
    pos = torch.arange(T).expand(batch, T)
    with torch.no_grad():
        y = group(x, pos)
        if batch > 1:
            alone = torch.cat([group(x[b : b + 1], pos[b : b + 1]) for b in range(batch)])
            cross = (alone - y).abs().max().item()
            assert cross < 1e-10, f"a sequence's output moved by {cross:.1e} with the rest of its batch: {what}"
        if group.causal and T > 1:
            t = rng.randint(0, T - 2)
            x2 = x.clone()
            x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :])
            leak = (group(x2, pos)[:, : t + 1] - y[:, : t + 1]).abs().max().item()
            assert leak < 1e-12, f"rows <= {t} moved by {leak:.1e} when later rows changed: {what}"
            # ... nor on how many rows follow (a rule read off the input's length, which resampling keeps)
            cut = (group(x[:, : t + 1], pos[:, : t + 1]) - y[:, : t + 1]).abs().max().item()
            assert cut < 1e-10, f"rows <= {t} moved by {cut:.1e} when the input was cut after row {t}: {what}"
            group.train()  # the training-time paths, state frozen and the same random draws in both passes
            with frozen_state():
                torch.manual_seed(0)
                y_train = group(x, pos)
                torch.manual_seed(0)
                leak = (group(x2, pos)[:, : t + 1] - y_train[:, : t + 1]).abs().max().item()
            group.eval()
            assert leak < 1e-12, f"training mode: rows <= {t} moved by {leak:.1e} when later rows changed: {what}"
        decoded = decode(group, x, rng.randint(1, T)) if group.causal else None
        if decoded is not None:
            err = (decoded - y).abs().max().item()
            assert err < 1e-10, f"decoding differs from the full forward by {err:.1e}: {what}"


@pytest.mark.parametrize("head_type", sorted(REGISTRY))
def test_random_configurations_keep_the_contract(head_type: str) -> None:
    rng = random.Random(1)
    for group, T, batch, what in random_groups(head_type, seed=sorted(REGISTRY).index(head_type)):
        try:
            check_contract(group, T, batch, what, rng)
        except AssertionError:
            raise
        except Exception as err:  # a crash inside a case: name the configuration that raised it
            raise AssertionError(f"{type(err).__name__}: {err}; {what}") from err


@pytest.mark.parametrize("head_type", sorted(REGISTRY))
@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_an_empty_sequence_is_refused_in_one_line(head_type: str, impl: str) -> None:
    """T = 0 is refused alike by every type and path (MoSAIC's, local's and agent's fast paths crashed deep inside
    torch, the others returned an empty output)."""
    group = make_group(head_type, {**REGISTRY[head_type].Options.example(), "impl": impl}, 16, count=2)
    with pytest.raises(ValueError, match=rf"^{head_type}: empty sequence \(T = 0\); give at least one token$"):
        group(torch.randn(1, 0, 32), torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.parametrize("head_type", sorted(REGISTRY))
def test_causal_in_training_mode(head_type: str) -> None:
    """The training-time paths (MoSAIC's training priorities, batch statistics) leak no future token either; a
    non-causal option is flagged as such (AS_PUBLISHED), and leaks in training mode as in eval."""
    import lm
    from lm.causality import future_leak
    from tests.conftest import tiny_config
    from tests.head_checks import tiny_options

    heads = [{"type": "dense", "count": 1}, {"type": head_type, "count": 3, "options": tiny_options(head_type)}]
    model = lm.build_model(tiny_config(heads, init_std=0.3).model).double()  # float64: any leak is above rounding
    assert model.causal
    assert future_leak(model, torch.randint(0, 97, (2, 64)), t=None, vocab_size=97, training=True) <= 1e-12
    if head_type in AS_PUBLISHED:
        heads[1]["options"] = published_options(head_type)
        leaky = lm.build_model(tiny_config(heads, init_std=0.3).model)
        assert not leaky.causal
        assert future_leak(leaky, torch.randint(0, 97, (2, 64)), t=27, vocab_size=97, training=True) > 1e-2


@pytest.mark.parametrize("head_type", sorted(AS_PUBLISHED))
def test_a_method_not_causal_as_published_is_flagged_leaks_and_refuses_to_decode(head_type: str) -> None:
    """Each method kept as published although it is not causal (AS_PUBLISHED): the model declares it, the shared
    causality check measures its leak in eval mode at two rows (outputs move when later tokens change; not row 0:
    under MoSA's expert choice row 0 attends only to itself, so it moves only when its own membership flips), and
    decoding it is refused in one line naming the option."""
    import lm
    from lm.causality import future_leak
    from tests.conftest import tiny_config

    torch.manual_seed(0)
    heads = [{"type": "dense", "count": 1}, {"type": head_type, "count": 2, "options": published_options(head_type)}]
    model = lm.build_model(tiny_config(heads, init_std=0.3).model).double()
    assert not model.causal
    tokens = torch.randint(0, 97, (2, 64))
    assert min(future_leak(model, tokens, t, 97) for t in (10, 30)) > 1e-2
    with pytest.raises(ValueError, match=rf"^{head_type}: .+ is not causal and cannot be decoded incrementally$"):
        model.blocks[0].attn.groups[1].new_cache(1, 64)


@pytest.mark.parametrize("head_type", sorted(REGISTRY))
def test_training_passes_move_no_state_until_the_commit(head_type: str) -> None:
    """heads/base.py: state moved by training batches never moves inside a forward pass (a compiled backward or an
    activation-checkpointing replay would read it moved); two training-mode passes leave every buffer a checkpoint
    keeps as it was, and only `commit_states` (after the optimizer step) moves it, once, for both passes."""
    from heads import commit_states
    from tests.head_checks import tiny_options

    T = 32
    group = make_group(head_type, tiny_options(head_type), T).train()
    before = {k: v.clone() for k, v in group.state_dict().items() if k in dict(group.named_buffers())}
    for _ in range(2):
        group(torch.randn(2, T, 32), torch.arange(T).expand(2, T))
    assert all(torch.equal(group.state_dict()[k], v) for k, v in before.items()), head_type
    commit_states(group)
    moved = [k for k, v in before.items() if not torch.equal(group.state_dict()[k], v)]
    assert moved == [k for k in before if head_type in ("mosa", "routing")], moved
