"""Position-aware RoPE (heads/rope.py) against a direct complex rotation (MoSA App. H, Su et al. 2021).

Reference: for rotated dims r = int(fraction * d) // 2 * 2 and j < r/2, the pair (x_j, x_{j+r/2})
is the complex number z_j = x_j + i x_{j+r/2}, rotated to z_j * exp(i * pos * base^(-2j/r)); the
other d - r dims pass through. The rotation itself is computed in float64.
Tolerances (float64 inputs): with the module's own float32 angles, only the float32 cos/sin rounding
remains (~6e-8 relative): max-abs <= 1e-6. Against exact float64 angles, the module's float32 angle
pos * theta carries a rounding error of up to ~2 * 2^-24 * pos (rad), so the bound is
3 * 2^-24 * max_pos * max|x|: ~6e-5 for positions < 64 and ~4e-3 for positions < 4096.
"""
from __future__ import annotations

import pytest
import torch

from heads.rope import RotaryEmbedding


def complex_rotation(x: torch.Tensor, positions: torch.Tensor, fraction: float, base: float = 10000.0,
                     float32_angles: bool = False) -> torch.Tensor:
    """x[..., T, d] rotated pairwise as complex numbers (float64) by angles pos * base^(-2j/r), the angles
    computed in float64, or in float32 exactly as heads/rope.py does when `float32_angles`."""
    d = x.shape[-1]
    r = int(d * fraction) // 2 * 2
    half = r // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / r)  # [r/2]
    if float32_angles:
        angles = (positions.float()[..., None] * theta.float()).double()
    else:
        angles = positions.double()[..., None] * theta  # [..., T, r/2]
    z = torch.complex(x[..., :half].double(), x[..., half:r].double()) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat((z.real, z.imag, x[..., r:].double()), dim=-1).to(x.dtype)


def inputs(max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 37, 64, generator=g, dtype=torch.float64)
    positions = torch.randint(0, max_pos, (2, 3, 37), generator=g)  # unsorted, repeated: gathered tokens
    return x, positions


@pytest.mark.parametrize("fraction", [0.5, 1.0, 0.25])
@pytest.mark.parametrize("max_pos", [64, 4096, 100_000])
def test_rotation_matches_complex_multiplication(fraction: float, max_pos: int) -> None:
    x, positions = inputs(max_pos)
    out = RotaryEmbedding(64, fraction)(x, positions)
    err = (out - complex_rotation(x, positions, fraction, float32_angles=True)).abs().max().item()
    assert err <= 1e-6, f"max-abs error {err:.2e} (positions < {max_pos}, fraction {fraction})"


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("max_pos", [64, 4096])
def test_angles_match_float64_within_float32_rounding(fraction: float, max_pos: int) -> None:
    x, positions = inputs(max_pos)
    out = RotaryEmbedding(64, fraction)(x, positions)
    err = (out - complex_rotation(x, positions, fraction)).abs().max().item()
    bound = 3 * 2**-24 * max_pos * x.abs().max().item()
    assert err <= bound, f"max-abs error {err:.2e} > {bound:.1e} (positions < {max_pos})"


def test_half_fraction_leaves_other_half_unchanged() -> None:
    rope = RotaryEmbedding(64, 0.5)
    assert rope.rot_dim == 32
    x = torch.randn(4, 50, 64)
    out = rope(x, torch.randint(1, 1000, (4, 50)))
    assert torch.equal(out[..., 32:], x[..., 32:])
    assert (out[..., :32] - x[..., :32]).abs().max() > 0.1  # the rotated half did move


def test_rotated_dims_are_the_fraction_as_written() -> None:
    """rot_dim = the even floor of fraction x head_dim with the fraction read as written: 0.58 x 100 is 58 (float's
    57.99999999999999 gave 56); odd products round down to an even count."""
    assert [RotaryEmbedding(d, f).rot_dim for d, f in ((100, 0.58), (64, 0.25), (7, 1.0), (10, 0.3), (16, 0.0))] == \
        [58, 16, 6, 2, 0]


@pytest.mark.parametrize("fraction,rot_dim", [(1.5, 96), (-0.5, -32)])
def test_a_fraction_beyond_the_head_is_refused(fraction: float, rot_dim: int) -> None:
    with pytest.raises(ValueError, match=rf"^rope fraction {fraction} gives rot_dim {rot_dim} outside \[0, 64\]$"):
        RotaryEmbedding(64, fraction)


@pytest.mark.parametrize("base", [1.0, 0.5, float("inf"), float("nan")])
def test_a_base_without_distinct_finite_frequencies_is_refused(base: float) -> None:
    """base <= 1: constant or growing frequencies; inf: all 0 but the first; nan: NaN angles."""
    with pytest.raises(ValueError, match=rf"^rope base must be finite and > 1, got {base}$"):
        RotaryEmbedding(64, 0.5, base)


@pytest.mark.parametrize("override,message", [
    ("model.rope_fraction=1.5", "model.rope_fraction must be in [0, 1], got 1.5"),
    ("model.rope_fraction=-0.5", "model.rope_fraction must be in [0, 1], got -0.5"),
    ("model.rope_fraction=.nan", "model.rope_fraction must be in [0, 1], got nan"),  # RotaryEmbedding: no Fraction
    ("model.rope_base=.nan", "model.rope_base must be finite and > 1, got nan"),
    ("model.rope_base=1.0", "model.rope_base must be finite and > 1, got 1.0"),
])
def test_the_config_refuses_them_first_naming_the_field(override: str, message: str) -> None:
    """The model's rope options reach RotaryEmbedding through the config, whose check names the key."""
    from heads import ConfigError
    from lm.config_io import load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    assert str(info.value) == message


def test_norm_preserved_and_position_zero_is_identity() -> None:
    rope = RotaryEmbedding(32, 0.5)
    x = torch.randn(3, 20, 32, dtype=torch.float64)
    out = rope(x, torch.randint(0, 500, (3, 20)))
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-6, atol=0)
    assert torch.equal(rope(x, torch.zeros(3, 20, dtype=torch.long)), x)


def test_gathered_tokens_rotate_by_original_positions() -> None:
    """A sparse head that gathers X[I] and rotates by positions I gets exactly the rows of the full rotation."""
    rope = RotaryEmbedding(16, 0.5)
    x = torch.randn(2, 40, 16)
    positions = torch.arange(40).expand(2, -1)
    idx = torch.tensor([[3, 17, 18, 39], [0, 5, 22, 31]])
    gathered = rope(x.gather(1, idx[..., None].expand(-1, -1, 16)), idx)
    full = rope(x, positions).gather(1, idx[..., None].expand(-1, -1, 16))
    assert torch.equal(gathered, full)


def test_scores_depend_only_on_relative_position() -> None:
    """<R_m q, R_n k> = <R_{m+s} q, R_{n+s} k> for any shift s (Su et al. 2021, eq. 16).
    Positions stay below 1100, so float32 angle rounding keeps the error below 1e-4 on float64 inputs."""
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(64, 0.5)
    q, k = torch.randn(64, dtype=torch.float64, generator=g), torch.randn(64, dtype=torch.float64, generator=g)
    m = torch.randint(0, 100, (50,), generator=g)
    n = torch.randint(0, 100, (50,), generator=g)
    for shift in (1, 37, 1000):
        base = (rope(q.expand(50, -1), m) * rope(k.expand(50, -1), n)).sum(-1)
        shifted = (rope(q.expand(50, -1), m + shift) * rope(k.expand(50, -1), n + shift)).sum(-1)
        assert (base - shifted).abs().max() < 1e-4, f"shift {shift}"
    # ... and the score does change with the relative distance (the test can fail)
    near = (rope(q[None], torch.tensor([10])) * rope(k[None], torch.tensor([9]))).sum()
    far = (rope(q[None], torch.tensor([10])) * rope(k[None], torch.tensor([2]))).sum()
    assert (near - far).abs() > 1e-3


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_head_groups_see_positions_only_relatively(impl: str) -> None:
    """RoPE makes q_i . k_j depend on pos_i - pos_j only: every head type's output is unchanged when all positions
    move by 960 (a multiple of every block, stride and window the tiny options use), and changes when the gaps do
    (positions doubled), so the check can fail. A path that rotated only its keys, or its queries at other
    positions, breaks the first. MoSAIC is built for a training length of 4096: its recency rule pads free slots with
    the last tokens of that frame (frame - position matters), none of which the 32 rows then reach."""
    from heads import REGISTRY
    from tests.head_checks import make_group, tiny_options

    T = 32
    for name in sorted(REGISTRY):
        group = make_group(name, tiny_options(name), 4096 if name == "mosaic" else T, dtype=torch.float64,
                           rope_fraction=1.0)
        group.options.impl = impl
        x, pos = torch.randn(2, T, 32, dtype=torch.float64), torch.arange(T).expand(2, T)
        with torch.no_grad():
            y, shifted, stretched = group(x, pos), group(x, pos + 960), group(x, pos * 2)
        assert (shifted - y).abs().max() < 1e-10, name
        assert (stretched - y).abs().max() > 1e-3, name


@pytest.mark.parametrize("fraction", [0.5, 1.0, 0.0])
def test_in_place_rotation_is_forward_and_its_inverse_undoes_it(fraction: float) -> None:
    """rotate_ (the lean gathered core's no-autograd path) gives forward's rotation, up to one rounding of fused
    multiply-adds (float64 inputs: max-abs <= 1e-12), and with inverse=True R(θ)^T = R(-θ), forward at -pos; that
    undoes the rotation up to the float32 cos/sin (cos² + sin² = 1 within ~2^-23): max-abs <= 2^-22 max|x|."""
    x, positions = inputs(4096)
    rope = RotaryEmbedding(64, fraction)
    cos, sin = rope.cos_sin(positions, x.dtype)
    rotated = rope.rotate_(x.clone(), cos, sin)
    assert (rotated - rope(x, positions)).abs().max() <= 1e-12
    assert (rope.rotate_(x.clone(), cos, sin, inverse=True) - rope(x, -positions)).abs().max() <= 1e-12
    assert (rope.rotate_(rotated.clone(), cos, sin, inverse=True) - x).abs().max() <= 2**-22 * x.abs().max()
    if fraction:  # the check can fail: the rotation moved x
        assert (rotated - x).abs().max() > 0.1
