"""kvsimd.ops.attend on every native ISA path, against the float64 reference and the scalar path.

Error bound: kvsimd.bounds.attend_bound, per output element (h, d):
    |out - ref| <= TOL * sum_j p_hj |v_jd|  (+ with ALiBi, the effect of the fp32 rounding of
                                              the bias slope * distance in each score)
where p are the reference softmax weights: the natural scale of a weighted sum, which stays
meaningful when outputs cancel to ~0.  TOL = 1e-5 for float32 K/V; for float16 K/V the
reference does float64 math on the fp16-rounded values and TOL = 1e-4.
"""
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvsimd import ops, reference
from kvsimd.bounds import attend_bound, attend_scale
from kvsimd.testing import use_isa

from conftest import SIMD_ISAS
from strategies import gqa_ratios, head_dims, kv_dtypes, kv_heads, seeds, token_counts


def make(rng, H, Hkv, N, D, dtype, q_scale=1.0):
    q = (rng.standard_normal((H, D)) * q_scale).astype(np.float32)
    k = rng.standard_normal((Hkv, N, D)).astype(dtype)
    v = rng.standard_normal((Hkv, N, D)).astype(dtype)
    return q, k, v


def assert_within(out, ref, bound, what=""):
    err = np.abs(out.astype(np.float64) - ref) / np.maximum(bound, 1e-300)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= 1, f"{what}: error {err.max():.3g} x the bound at {worst}"


# ---------------------------------------------------------------- case bodies (native and emulated)
# ``att`` has ops.attend's signature: kvsimd.ops natively, the avx512fp16 row in the emulator
# (tests/test_avx512fp16_emu.py runs these bodies with the same bounds).
def case_matches_reference(att, isa, hkv, ratio, N, D, dtype, seed, q_scale):
    rng = np.random.default_rng(seed)
    q, k, v = make(rng, hkv * ratio, hkv, N, D, dtype, q_scale)
    out = att.attend(q, k, v)
    assert out.shape == q.shape and out.dtype == np.float32
    assert_within(out, reference.attend(q, k, v), attend_bound(q, k, v), isa)


def case_alibi(att, isa, hkv, ratio, N, D, dtype, seed, explicit):
    rng = np.random.default_rng(seed)
    H = hkv * ratio
    q, k, v = make(rng, H, hkv, N, D, dtype)
    slopes = (2.0 ** -np.arange(1, H + 1, dtype=np.float32) * 8 / H).astype(np.float32)
    kw = {"alibi_slopes": slopes}
    if explicit:  # a ring buffer's positions: not in slot order, query far ahead
        kw["key_positions"] = rng.permutation(np.arange(1000, 1000 + N, dtype=np.int64))
        kw["query_position"] = 1000 + N + int(rng.integers(0, 50))
    out = att.attend(q, k, v, **kw)
    assert_within(out, reference.attend(q, k, v, **kw), attend_bound(q, k, v, **kw), isa)


def case_ranges_with_alternate_query(att, isa, hkv, ratio, N, D, dtype, seed, alibi):
    rng = np.random.default_rng(seed)
    H = hkv * ratio
    q, k, v = make(rng, H, hkv, N, D, dtype)
    q_alt = rng.standard_normal((H, D)).astype(np.float32)
    cuts = np.unique(np.concatenate([[0, N], rng.integers(0, N + 1, 4)]))
    pieces = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]
    keep = [p for p in pieces if rng.random() < 0.7] or pieces[:1]
    ranges = [(a, b, bool(rng.random() < 0.5), N + int(rng.integers(0, 50))) for a, b in keep]
    ranges = [ranges[i] for i in rng.permutation(len(ranges))]
    kw = {}
    if alibi:
        kw = {"alibi_slopes": (2.0 ** -np.arange(1, H + 1, dtype=np.float32)).astype(np.float32),
              "key_positions": rng.permutation(N).astype(np.int64)}
    out = att.attend(q, k, v, ranges=ranges, q_alt=q_alt, **kw)
    ref = reference.attend(q, k, v, ranges=ranges, q_alt=q_alt, **kw)
    assert_within(out, ref, attend_bound(q, k, v, ranges=ranges, q_alt=q_alt, **kw), isa)


# ---------------------------------------------------------------- native rows
@given(hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds,
       q_scale=st.sampled_from([0.0, 0.3, 1.0, 3.0]))
def test_attend_matches_float64_reference(isa, hkv, ratio, N, D, dtype, seed, q_scale):
    case_matches_reference(ops, isa, hkv, ratio, N, D, dtype, seed, q_scale)


@given(hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds,
       explicit=st.booleans())
# distances ~40 with slope 4: biases ~160 whose fp32 rounding (~1e-5 of score) exceeded a bound
# without the ALiBi term by 37% (found by the "dev" profile)
@example(hkv=1, ratio=1, N=40, D=512, dtype="float32", seed=202, explicit=True)
def test_attend_alibi(isa, hkv, ratio, N, D, dtype, seed, explicit):
    case_alibi(ops, isa, hkv, ratio, N, D, dtype, seed, explicit)


@pytest.mark.parametrize("simd", SIMD_ISAS)
@given(hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds)
def test_simd_agrees_with_scalar(simd, hkv, ratio, N, D, dtype, seed):
    rng = np.random.default_rng(seed)
    q, k, v = make(rng, hkv * ratio, hkv, N, D, dtype)
    slopes = rng.uniform(0, 0.5, hkv * ratio).astype(np.float32)
    with use_isa("scalar"):
        a = ops.attend(q, k, v, alibi_slopes=slopes)
    with use_isa(simd):
        b = ops.attend(q, k, v, alibi_slopes=slopes)
    # each is within the bound of the exact value
    assert_within(b, a.astype(np.float64), 2 * attend_bound(q, k, v, alibi_slopes=slopes), simd)


@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128), (32, 32, 128), (8, 1, 256), (4, 2, 80)])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fast_shapes_long_cache(isa, rng, shape, dtype):
    H, Hkv, D = shape
    N = 4099  # not a multiple of any block size
    q, k, v = make(rng, H, Hkv, N, D, dtype)
    assert_within(ops.attend(q, k, v), reference.attend(q, k, v), attend_bound(q, k, v), isa)


def test_scale_and_out_argument(isa, rng):
    q, k, v = make(rng, 6, 2, 50, 24, "float32")
    out = np.full((6, 24), np.nan, dtype=np.float32)
    k0, v0, q0 = k.copy(), v.copy(), q.copy()
    res = ops.attend(q, k, v, scale=0.37, out=out)
    assert res is out
    assert_within(out, reference.attend(q, k, v, scale=0.37), attend_bound(q, k, v, scale=0.37))
    # inputs are read only
    assert np.array_equal(k, k0) and np.array_equal(v, v0) and np.array_equal(q, q0)


def test_single_key_returns_its_value(isa, rng):
    q, k, v = make(rng, 4, 1, 1, 33, "float16")
    out = ops.attend(q, k, v)
    np.testing.assert_array_equal(out, np.repeat(v[:, 0].astype(np.float32), 4, axis=0))


def test_large_scores_do_not_overflow(isa, rng):
    """Online softmax subtracts the running max: scores of +-1e4 must not give inf/nan."""
    q, k, v = make(rng, 2, 1, 300, 16, "float32", q_scale=2000.0)
    out = ops.attend(q, k, v)
    assert np.isfinite(out).all()
    # scores of +-1e4 carry fp32 rounding errors of ~1e-3 themselves: 10x the usual tolerance
    assert_within(out, reference.attend(q, k, v), 1e-4 * attend_scale(q, k, v))


def test_gqa_uses_the_right_kv_head(isa, rng):
    """query head h reads KV head h // G: give each KV head a constant V and check."""
    H, Hkv, N, D = 8, 4, 20, 16
    q, k, _ = make(rng, H, Hkv, N, D, "float32")
    v = np.broadcast_to(np.arange(Hkv, dtype=np.float32)[:, None, None], (Hkv, N, D)).copy()
    out = ops.attend(q, k, v)
    np.testing.assert_allclose(out[:, 0], np.arange(H) // (H // Hkv), atol=1e-6)


@given(hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds,
       alibi=st.booleans())
def test_attend_ranges_with_alternate_query(isa, hkv, ratio, N, D, dtype, seed, alibi):
    """Several key ranges (with gaps, in any order) under one softmax, some scored with q_alt and
    their own ALiBi query position: what a ring cache with attention sinks reads in one call."""
    case_ranges_with_alternate_query(ops, isa, hkv, ratio, N, D, dtype, seed, alibi)


def test_attend_ranges_equal_the_single_range(isa, rng):
    """Splitting [0, N) into pieces without q_alt changes nothing but rounding."""
    q, k, v = make(rng, 8, 2, 2500, 64, "float16")
    whole = ops.attend(q, k, v)
    # starts off the block and chunk grid; a range across a chunk boundary (1024, 2048)
    for ranges in ([(200, 2500), (0, 4), (4, 200)], [(0, 5), (5, 1030), (1030, 2500)], [(0, 2047), (2047, 2500)]):
        split = ops.attend(q, k, v, ranges=ranges)
        np.testing.assert_allclose(split, whole, rtol=0, atol=1e-5 * np.abs(whole).max(), err_msg=str(ranges))


@pytest.mark.parametrize("ranges,q_alt,msg", [
    ([], False, "ranges is empty"),
    ([(0, 0)], False, "non-empty"),
    ([(5, 3)], False, "non-empty"),
    ([(0, 11)], False, "within 0..10"),
    ([(0, 5), (4, 8)], False, "overlap"),
    ([(0, 5, True)], False, "q_alt was not given"),
    ([(0, 5, False, 1, 2)], False, "must be (t0, t1"),
    (None, True, "q_alt is only used"),
])
def test_attend_ranges_bad_input(rng, ranges, q_alt, msg):
    q, k, v = make(rng, 4, 2, 10, 16, "float32")
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        ops.attend(q, k, v, ranges=ranges, q_alt=q if q_alt else None)
