"""apply_rope and shift_keys on every native ISA path.

Bounds, per output component, with |pair| the Euclidean norm of the rotated (x, y) pair:
  float32: |out - ref| <= 1e-5 * |pair|                       (fp32 arithmetic, cos/sin in fp32)
  float16: |out - ref| <= 2^-11 * |ref| + 2^-20 * |pair| + 2^-25
           one rounding to fp16 (half an ulp, 2^-11 relative) plus fp32 arithmetic
where ref is float64 math on the (fp16-rounded) input.  Chained calls add one such term per call.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsimd import ops, reference
from kvsimd.testing import use_isa

from conftest import SIMD_ISAS
from strategies import kv_dtypes, positions_near_limit, rope_shapes, seeds, styles

U16 = 2.0 ** -11


def pair_norm(x, style, rd):
    """|pair| broadcast back to every component of the pair (0 for unrotated dims)."""
    x = np.asarray(x, np.float64)
    n = np.zeros_like(x)
    R = rd // 2
    if style == "gptj":
        m = np.hypot(x[..., 0:rd:2], x[..., 1:rd:2])
        n[..., 0:rd:2] = m
        n[..., 1:rd:2] = m
    else:
        m = np.hypot(x[..., :R], x[..., R:rd])
        n[..., :R] = m
        n[..., R:rd] = m
    return n


def bound(dtype, ref, norm, calls=1):
    if dtype == "float32":
        return calls * 1e-5 * norm + 1e-30
    return calls * (U16 * np.abs(ref) + 2.0 ** -20 * norm + 2.0 ** -25) + U16 * norm * (calls - 1)


def check(out, ref, tol, what):
    err = np.abs(np.asarray(out, np.float64) - ref) - tol
    assert err.max() <= 0, f"{what}: exceeds the bound by {err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}"


@given(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds,
       pos_kind=st.sampled_from(["small", "random", "limit"]))
def test_apply_rope_matches_reference(isa, shape, dtype, style, seed, pos_kind):
    H, N, D, rd = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((H, N, D)).astype(dtype)
    if pos_kind == "small":
        pos = np.arange(N, dtype=np.int64)
    elif pos_kind == "random":
        pos = rng.integers(-(2**31), 2**31, N, dtype=np.int64)
    else:
        pos = 2**31 - rng.integers(0, 10_000, N).astype(np.int64)
    y = x.copy()
    ops.apply_rope(y, pos, style=style, rotary_dim=rd, theta=10000.0)
    ref = reference.apply_rope(x, pos, style=style, rotary_dim=rd)
    check(y, ref, bound(dtype, ref, pair_norm(x, style, rd)), f"{isa} {dtype} {style}")
    # dims beyond rotary_dim are untouched, bit for bit
    assert np.array_equal(y[..., rd:].view(np.uint8), x[..., rd:].view(np.uint8))


@given(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds,
       delta=st.one_of(st.integers(-2**20, 2**20), st.sampled_from([-1, 1, -(2**20), 2**20])),
       theta=st.sampled_from([10000.0, 1e5, 500000.0]))
def test_rope_then_shift_equals_rope_at_shifted_position(isa, shape, dtype, style, seed, delta, theta):
    H, N, D, rd = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((H, N, D)).astype(dtype)
    pos = rng.integers(0, 2**21, N, dtype=np.int64)
    a = x.copy()
    ops.apply_rope(a, pos, style=style, rotary_dim=rd, theta=theta)
    ops.shift_keys(a, delta, style=style, rotary_dim=rd, theta=theta)
    ref = reference.apply_rope(x, pos + delta, style=style, rotary_dim=rd, theta=theta)
    check(a, ref, bound(dtype, ref, pair_norm(x, style, rd), calls=2), f"{isa} {dtype} {style}")


@given(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds, delta=st.integers(-2**20, 2**20))
def test_shift_there_and_back(isa, shape, dtype, style, seed, delta):
    H, N, D, rd = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((H, N, D)).astype(dtype)
    y = x.copy()
    ops.shift_keys(y, delta, style=style, rotary_dim=rd)
    ops.shift_keys(y, -delta, style=style, rotary_dim=rd)
    xr = x.astype(np.float64)
    check(y, xr, bound(dtype, xr, pair_norm(x, style, rd), calls=2), f"{isa} {dtype} {style}")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("style", ["gptj", "neox"])
def test_shift_range_only(isa, rng, dtype, style):
    k = rng.standard_normal((3, 40, 64)).astype(dtype)
    y = k.copy()
    ops.shift_keys(y, -7, style=style, start=10, stop=25)
    assert np.array_equal(y[:, :10], k[:, :10]) and np.array_equal(y[:, 25:], k[:, 25:])
    ref = reference.shift_keys(k, -7, style=style, start=10, stop=25)
    check(y, ref, bound(dtype, ref, pair_norm(k, style, 64)), isa)


@given(pos=positions_near_limit, style=styles)
def test_positions_near_2_31_stay_exact(isa, pos, style):
    """Angles are built in double from the integer position, so near 2^31 the result still
    matches float64 math to fp32 rounding (a float32 angle would be off by whole radians)."""
    x = np.random.default_rng(pos).standard_normal((1, 2, 64)).astype(np.float32)
    a = x.copy()
    ops.apply_rope(a, np.array([pos, pos + 1], np.int64), style=style)
    ref = reference.apply_rope(x, [pos, pos + 1], style=style)
    check(a, ref, 1e-5 * pair_norm(x, style, 64) + 1e-30, isa)


@pytest.mark.parametrize("simd", SIMD_ISAS)
@given(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds)
def test_simd_agrees_with_scalar(simd, shape, dtype, style, seed):
    H, N, D, rd = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((H, N, D)).astype(dtype)
    pos = rng.integers(0, 100_000, N, dtype=np.int64)
    a, b = x.copy(), x.copy()
    with use_isa("scalar"):
        ops.apply_rope(a, pos, style=style, rotary_dim=rd)
    with use_isa(simd):
        ops.apply_rope(b, pos, style=style, rotary_dim=rd)
    ar = a.astype(np.float64)
    # both are within one rounding of the exact value, so within two of each other
    check(b, ar, bound(dtype, ar, pair_norm(x, style, rd), calls=2), simd)


def test_fp16_special_values(isa):
    """inf/nan propagate as nan/inf, zeros stay zero, subnormals rotate without flushing."""
    x = np.zeros((1, 4, 4), np.float16)
    x[0, 0] = [np.inf, 0, 0, 0]
    x[0, 1] = [np.nan, 1, 0, 0]
    x[0, 2] = [0.0, -0.0, 0, 0]
    x[0, 3] = [6e-8, 0, 3e-5, 0]  # fp16 subnormals
    y = x.copy()
    ops.apply_rope(y, np.array([0, 5, 7, 0], np.int64))
    assert np.isinf(y[0, 0, 0]) or np.isnan(y[0, 0, 0])
    assert np.isnan(y[0, 1, 0])
    assert np.all(y[0, 2] == 0)
    np.testing.assert_array_equal(y[0, 3], x[0, 3])  # position 0: identity
