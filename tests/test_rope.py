"""apply_rope and shift_keys on every compiled ISA row (the ``row`` fixture: native, or emulated
when this CPU lacks the row), against the float64 reference and the scalar row.

The bounds come from :mod:`kvsimd.bounds` (``rope_bound``), keyed by the ISA row that runs:
one rounding per fp16 call on scalar/avx2, the hi + lo complex multiply on avx512fp16.  On an
emulated row the angles come from the extension's own table function (double precision, as
ops.c computes them) and the rotation from the row's kernel.
"""
import numpy as np
import pytest
from hypothesis import strategies as st

from kvsimd import ops, reference
from kvsimd.bounds import pair_norm, rope_bound
from kvsimd.testing import use_isa

from conftest import row_cases
from strategies import kv_dtypes, positions_near_limit, rope_shapes, seeds, styles


def check(out, ref, tol, what):
    err = np.abs(np.asarray(out, np.float64) - ref) - tol
    assert err.max() <= 0, f"{what}: exceeds the bound by {err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}"


shift_deltas = st.one_of(st.integers(-2**20, 2**20), st.sampled_from([-1, 1, -(2**20), 2**20]))
thetas = st.sampled_from([10000.0, 1e5, 500000.0])
pos_kinds = st.sampled_from(["small", "random", "limit"])


# ---------------------------------------------------------------- hypothesis cases, every row
@row_cases(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds, pos_kind=pos_kinds)
def test_apply_rope_matches_reference(row, shape, dtype, style, seed, pos_kind):
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
    row.apply_rope(y, pos, style=style, rotary_dim=rd, theta=10000.0)
    ref = reference.apply_rope(x, pos, style=style, rotary_dim=rd)
    check(y, ref, rope_bound(row.isa, dtype, pair_norm(x, style, rd), ref), f"{row.isa} {dtype} {style}")
    # dims beyond rotary_dim are untouched, bit for bit
    assert np.array_equal(y[..., rd:].view(np.uint8), x[..., rd:].view(np.uint8))


@row_cases(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds, delta=shift_deltas, theta=thetas)
def test_rope_then_shift_equals_rope_at_shifted_position(row, shape, dtype, style, seed, delta, theta):
    H, N, D, rd = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((H, N, D)).astype(dtype)
    pos = rng.integers(0, 2**21, N, dtype=np.int64)
    a = x.copy()
    row.apply_rope(a, pos, style=style, rotary_dim=rd, theta=theta)
    row.shift_keys(a, delta, style=style, rotary_dim=rd, theta=theta)
    ref = reference.apply_rope(x, pos + delta, style=style, rotary_dim=rd, theta=theta)
    check(a, ref, rope_bound(row.isa, dtype, pair_norm(x, style, rd), ref, calls=2), f"{row.isa} {dtype} {style}")


@row_cases(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds, delta=st.integers(-2**20, 2**20))
def test_shift_there_and_back(row, shape, dtype, style, seed, delta):
    H, N, D, rd = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((H, N, D)).astype(dtype)
    y = x.copy()
    row.shift_keys(y, delta, style=style, rotary_dim=rd)
    row.shift_keys(y, -delta, style=style, rotary_dim=rd)
    xr = x.astype(np.float64)
    check(y, xr, rope_bound(row.isa, dtype, pair_norm(x, style, rd), xr, calls=2), f"{row.isa} {dtype} {style}")


@row_cases(pos=positions_near_limit, style=styles)
def test_positions_near_2_31_stay_exact(row, pos, style):
    """Angles are built in double from the integer position, so near 2^31 the result still
    matches float64 math to fp32 rounding (a float32 angle would be off by whole radians)."""
    x = np.random.default_rng(pos).standard_normal((1, 2, 64)).astype(np.float32)
    a = x.copy()
    row.apply_rope(a, np.array([pos, pos + 1], np.int64), style=style)
    ref = reference.apply_rope(x, [pos, pos + 1], style=style)
    check(a, ref, rope_bound(row.isa, "float32", pair_norm(x, style, 64), ref), row.isa)


@row_cases(shape=rope_shapes(), dtype=kv_dtypes, style=styles, seed=seeds)
def test_row_agrees_with_scalar(row, shape, dtype, style, seed):
    H, N, D, rd = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((H, N, D)).astype(dtype)
    pos = rng.integers(0, 100_000, N, dtype=np.int64)
    a, b = x.copy(), x.copy()
    with use_isa("scalar"):
        ops.apply_rope(a, pos, style=style, rotary_dim=rd)
    row.apply_rope(b, pos, style=style, rotary_dim=rd)
    # each is within its own row's bound of the exact value
    ref = reference.apply_rope(x, pos, style=style, rotary_dim=rd)
    norm = pair_norm(x, style, rd)
    check(b, a.astype(np.float64), rope_bound(row.isa, dtype, norm, ref) + rope_bound("scalar", dtype, norm, ref),
          row.isa)


# ---------------------------------------------------------------- fixed cases, every row
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("style", ["gptj", "neox"])
def test_shift_range_only(row, rng, dtype, style):
    k = rng.standard_normal((3, 40, 64)).astype(dtype)
    y = k.copy()
    row.shift_keys(y, -7, style=style, start=10, stop=25)
    assert np.array_equal(y[:, :10], k[:, :10]) and np.array_equal(y[:, 25:], k[:, 25:])
    assert not np.array_equal(y[:, 10:25], k[:, 10:25])
    ref = reference.shift_keys(k, -7, style=style, start=10, stop=25)
    check(y, ref, rope_bound(row.isa, dtype, pair_norm(k, style, 64), ref), f"{row.isa} {dtype} {style}")


ROT_SHAPES = [(1, 1, 2, 2), (2, 15, 64, 64), (3, 16, 80, 80), (2, 17, 128, 128), (1, 33, 64, 32),
              (2, 31, 34, 34), (1, 5, 512, 512), (2, 9, 96, 16), (1, 3, 40, 38)]


@pytest.mark.parametrize("H,N,D,rd", ROT_SHAPES)
@pytest.mark.parametrize("style", ["gptj", "neox"])
@pytest.mark.parametrize("delta", [1, -7, 2**20, -(2**20)])
def test_shift_fp16_against_float64_and_scalar(row, rng, H, N, D, rd, style, delta):
    """fp16 K-cache shifts (on avx512fp16: VFMULCPH + VFMADDCPH) over vector-width tails."""
    x = rng.standard_normal((H, N, D)).astype(np.float16)
    got = x.copy()
    row.shift_keys(got, delta, style=style, rotary_dim=rd)
    assert np.array_equal(got[..., rd:].view(np.uint16), x[..., rd:].view(np.uint16))
    exact = reference.shift_keys(x, delta, style=style, rotary_dim=rd)
    norm = pair_norm(x, style, rd)
    check(got, exact, rope_bound(row.isa, "float16", norm, exact), row.isa + " vs float64")
    with use_isa("scalar"):
        native = x.copy()
        ops.shift_keys(native, delta, style=style, rotary_dim=rd)
    check(got, native, rope_bound(row.isa, "float16", norm, exact) + rope_bound("scalar", "float16", norm, exact),
          row.isa + " vs scalar")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("style", ["gptj", "neox"])
def test_apply_rope_per_token(row, rng, dtype, style):
    H, N, D, rd = 3, 37, 80, 64
    x = rng.standard_normal((H, N, D)).astype(dtype)
    pos = rng.integers(0, 2**31, N, dtype=np.int64)
    got = x.copy()
    row.apply_rope(got, pos, style=style, rotary_dim=rd)
    exact = reference.apply_rope(x, pos, style=style, rotary_dim=rd)
    check(got, exact, rope_bound(row.isa, dtype, pair_norm(x, style, rd), exact), row.isa)


def test_rope_then_shift_fixed_deltas(row, rng):
    """The accuracy statement of kvsimd.ops: two calls, two per-call bounds."""
    H, N, D = 2, 24, 64
    x = rng.standard_normal((H, N, D)).astype(np.float16)
    pos = rng.integers(0, 2**21, N, dtype=np.int64)
    for delta in (-(2**20), -1, 3, 2**20):
        a = x.copy()
        row.apply_rope(a, pos, style="neox", theta=1e5)
        row.shift_keys(a, delta, style="neox", theta=1e5)
        exact = reference.apply_rope(x, pos + delta, style="neox", theta=1e5)
        check(a, exact, rope_bound(row.isa, "float16", pair_norm(x, "neox", 64), exact, calls=2), f"{row.isa} {delta}")


def test_fp16_special_values(row):
    """inf/nan propagate as nan/inf, zeros stay zero, subnormals rotate without flushing."""
    x = np.zeros((1, 4, 4), np.float16)
    x[0, 0] = [np.inf, 0, 0, 0]
    x[0, 1] = [np.nan, 1, 0, 0]
    x[0, 2] = [0.0, -0.0, 0, 0]
    x[0, 3] = [6e-8, 0, 3e-5, 0]  # fp16 subnormals
    y = x.copy()
    row.apply_rope(y, np.array([0, 5, 7, 0], np.int64))
    assert np.isinf(y[0, 0, 0]) or np.isnan(y[0, 0, 0])
    assert np.isnan(y[0, 1, 0])
    assert np.all(y[0, 2] == 0)
    np.testing.assert_array_equal(y[0, 3], x[0, 3])  # position 0: identity


def test_fp16_special_values_shifted(row):
    """The same rows through a K-cache shift by 0 (identity) and by 1 (inf * cos - 0 * sin)."""
    x = np.zeros((1, 4, 32), np.float16)
    x[0, 0, :2] = [np.inf, 0]
    x[0, 1, :2] = [np.nan, 1]
    x[0, 2, :2] = [0.0, -0.0]
    x[0, 3, :4] = [6e-8, 0, 3e-5, 0]   # subnormals
    got = x.copy()
    row.shift_keys(got, 0)
    # inf stays non-finite (x * lo = inf * 0 is NaN on avx512fp16: inf or NaN), NaN stays NaN
    assert (np.isinf(got[0, 0, 0]) or np.isnan(got[0, 0, 0])) and np.isnan(got[0, 1, 0])
    assert np.all(got[0, 2] == 0) and np.array_equal(got[0, 3], x[0, 3])  # no flush to zero
    got = x.copy()
    row.shift_keys(got, 1)
    assert np.isnan(got[0, 0, :2]).any() or np.isinf(got[0, 0, :2]).all()
    assert np.isnan(got[0, 1, 0])
