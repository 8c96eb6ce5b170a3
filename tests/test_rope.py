"""apply_rope and shift_keys on every native ISA path, against the float64 reference.

The bounds come from :mod:`kvsimd.bounds` (``rope_bound``), keyed by the ISA row that runs:
one rounding per fp16 call on scalar/avx2, the hi + lo complex multiply on avx512fp16.  The
case bodies (``case_*``) take the rotation functions as an argument, so that
tests/test_avx512fp16_emu.py runs the very same checks, with the same bounds, on the
avx512fp16 row executed in the emulator: what a CPU with AVX512-FP16 runs natively here.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsimd import ops, reference
from kvsimd.bounds import pair_norm, rope_bound
from kvsimd.testing import use_isa

from conftest import SIMD_ISAS
from strategies import kv_dtypes, positions_near_limit, rope_shapes, seeds, styles


def check(out, ref, tol, what):
    err = np.abs(np.asarray(out, np.float64) - ref) - tol
    assert err.max() <= 0, f"{what}: exceeds the bound by {err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}"


# ---------------------------------------------------------------- case bodies (native and emulated)
def case_apply_rope(rot, isa, shape, dtype, style, seed, pos_kind):
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
    rot.apply_rope(y, pos, style=style, rotary_dim=rd, theta=10000.0)
    ref = reference.apply_rope(x, pos, style=style, rotary_dim=rd)
    check(y, ref, rope_bound(isa, dtype, pair_norm(x, style, rd), ref), f"{isa} {dtype} {style}")
    # dims beyond rotary_dim are untouched, bit for bit
    assert np.array_equal(y[..., rd:].view(np.uint8), x[..., rd:].view(np.uint8))


def case_rope_then_shift(rot, isa, shape, dtype, style, seed, delta, theta):
    H, N, D, rd = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((H, N, D)).astype(dtype)
    pos = rng.integers(0, 2**21, N, dtype=np.int64)
    a = x.copy()
    rot.apply_rope(a, pos, style=style, rotary_dim=rd, theta=theta)
    rot.shift_keys(a, delta, style=style, rotary_dim=rd, theta=theta)
    ref = reference.apply_rope(x, pos + delta, style=style, rotary_dim=rd, theta=theta)
    check(a, ref, rope_bound(isa, dtype, pair_norm(x, style, rd), ref, calls=2), f"{isa} {dtype} {style}")


def case_shift_there_and_back(rot, isa, shape, dtype, style, seed, delta):
    H, N, D, rd = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((H, N, D)).astype(dtype)
    y = x.copy()
    rot.shift_keys(y, delta, style=style, rotary_dim=rd)
    rot.shift_keys(y, -delta, style=style, rotary_dim=rd)
    xr = x.astype(np.float64)
    check(y, xr, rope_bound(isa, dtype, pair_norm(x, style, rd), xr, calls=2), f"{isa} {dtype} {style}")


def case_shift_range_only(rot, isa, rng, dtype, style):
    k = rng.standard_normal((3, 40, 64)).astype(dtype)
    y = k.copy()
    rot.shift_keys(y, -7, style=style, start=10, stop=25)
    assert np.array_equal(y[:, :10], k[:, :10]) and np.array_equal(y[:, 25:], k[:, 25:])
    ref = reference.shift_keys(k, -7, style=style, start=10, stop=25)
    check(y, ref, rope_bound(isa, dtype, pair_norm(k, style, 64), ref), f"{isa} {dtype} {style}")


shift_deltas = st.one_of(st.integers(-2**20, 2**20), st.sampled_from([-1, 1, -(2**20), 2**20]))
thetas = st.sampled_from([10000.0, 1e5, 500000.0])
pos_kinds = st.sampled_from(["small", "random", "limit"])


# ---------------------------------------------------------------- native rows
@given(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds, pos_kind=pos_kinds)
def test_apply_rope_matches_reference(isa, shape, dtype, style, seed, pos_kind):
    case_apply_rope(ops, isa, shape, dtype, style, seed, pos_kind)


@given(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds, delta=shift_deltas, theta=thetas)
def test_rope_then_shift_equals_rope_at_shifted_position(isa, shape, dtype, style, seed, delta, theta):
    case_rope_then_shift(ops, isa, shape, dtype, style, seed, delta, theta)


@given(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds, delta=st.integers(-2**20, 2**20))
def test_shift_there_and_back(isa, shape, dtype, style, seed, delta):
    case_shift_there_and_back(ops, isa, shape, dtype, style, seed, delta)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("style", ["gptj", "neox"])
def test_shift_range_only(isa, rng, dtype, style):
    case_shift_range_only(ops, isa, rng, dtype, style)


@given(pos=positions_near_limit, style=styles)
def test_positions_near_2_31_stay_exact(isa, pos, style):
    """Angles are built in double from the integer position, so near 2^31 the result still
    matches float64 math to fp32 rounding (a float32 angle would be off by whole radians)."""
    x = np.random.default_rng(pos).standard_normal((1, 2, 64)).astype(np.float32)
    a = x.copy()
    ops.apply_rope(a, np.array([pos, pos + 1], np.int64), style=style)
    ref = reference.apply_rope(x, [pos, pos + 1], style=style)
    check(a, ref, rope_bound(isa, "float32", pair_norm(x, style, 64), ref), isa)


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
    # each is within its own row's bound of the exact value
    ref = reference.apply_rope(x, pos, style=style, rotary_dim=rd)
    norm = pair_norm(x, style, rd)
    check(b, a.astype(np.float64), rope_bound(simd, dtype, norm, ref) + rope_bound("scalar", dtype, norm, ref), simd)


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
