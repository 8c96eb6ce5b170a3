"""Attention on every compiled ISA row (the ``row`` fixture: native, or emulated when this CPU
lacks the row), against the float64 reference and the scalar row.

Error bound: kvsimd.bounds.attend_bound, per output element (h, d):
    |out - ref| <= TOL * sum_j p_hj |v_jd|  (+ with ALiBi, the effect of the fp32 rounding of
                                              the bias slope * distance in each score)
where p are the reference softmax weights: the natural scale of a weighted sum, which stays
meaningful when outputs cancel to ~0.  TOL = 1e-5 for float32 K/V; for float16 K/V the
reference does float64 math on the fp16-rounded values and TOL = 1e-4.
"""
import numpy as np
import pytest
from hypothesis import strategies as st

from kvsimd import ops, reference
from kvsimd.bounds import attend_bound, attend_scale
from kvsimd.testing import use_isa

from conftest import row_cases
from strategies import gqa_ratios, head_dims, kv_dtypes, kv_heads, seeds, token_counts

# The emulator runs ~5M instructions/s: the hypothesis cases draw at most this many examples there.
EMU_EXAMPLES = 20


def make(rng, H, Hkv, N, D, dtype, q_scale=1.0):
    q = (rng.standard_normal((H, D)) * q_scale).astype(np.float32)
    k = rng.standard_normal((Hkv, N, D)).astype(dtype)
    v = rng.standard_normal((Hkv, N, D)).astype(dtype)
    return q, k, v


def assert_within(out, ref, bound, what=""):
    err = np.abs(out.astype(np.float64) - ref) / np.maximum(bound, 1e-300)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= 1, f"{what}: error {err.max():.3g} x the bound at {worst}"


def scalar_attend(q, k, v, **kw):
    with use_isa("scalar"):
        return ops.attend(q, k, v, **kw)


# ---------------------------------------------------------------- hypothesis cases, every row
@row_cases(EMU_EXAMPLES, hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds,
           q_scale=st.sampled_from([0.0, 0.3, 1.0, 3.0]))
def test_attend_matches_float64_reference(row, hkv, ratio, N, D, dtype, seed, q_scale):
    rng = np.random.default_rng(seed)
    q, k, v = make(rng, hkv * ratio, hkv, N, D, dtype, q_scale)
    out = row.attend(q, k, v)
    assert out.shape == q.shape and out.dtype == np.float32
    assert_within(out, reference.attend(q, k, v), attend_bound(q, k, v), row.isa)


# distances ~40 with slope 4: biases ~160 whose fp32 rounding (~1e-5 of score) exceeded a bound
# without the ALiBi term by 37% (found by the "dev" profile)
@row_cases(EMU_EXAMPLES, examples=[dict(hkv=1, ratio=1, N=40, D=512, dtype="float32", seed=202, explicit=True)],
           hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds,
           explicit=st.booleans())
def test_attend_alibi(row, hkv, ratio, N, D, dtype, seed, explicit):
    rng = np.random.default_rng(seed)
    H = hkv * ratio
    q, k, v = make(rng, H, hkv, N, D, dtype)
    slopes = (2.0 ** -np.arange(1, H + 1, dtype=np.float32) * 8 / H).astype(np.float32)
    kw = {"alibi_slopes": slopes}
    if explicit:  # a ring buffer's positions: not in slot order, query far ahead
        kw["key_positions"] = rng.permutation(np.arange(1000, 1000 + N, dtype=np.int64))
        kw["query_position"] = 1000 + N + int(rng.integers(0, 50))
    out = row.attend(q, k, v, **kw)
    assert_within(out, reference.attend(q, k, v, **kw), attend_bound(q, k, v, **kw), row.isa)


@row_cases(EMU_EXAMPLES, hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds)
def test_row_agrees_with_scalar(row, hkv, ratio, N, D, dtype, seed):
    rng = np.random.default_rng(seed)
    q, k, v = make(rng, hkv * ratio, hkv, N, D, dtype)
    slopes = rng.uniform(0, 0.5, hkv * ratio).astype(np.float32)
    a = scalar_attend(q, k, v, alibi_slopes=slopes)
    b = row.attend(q, k, v, alibi_slopes=slopes)
    # each is within the bound of the exact value
    assert_within(b, a.astype(np.float64), 2 * attend_bound(q, k, v, alibi_slopes=slopes), row.isa)


@row_cases(EMU_EXAMPLES, hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds,
           alibi=st.booleans())
def test_attend_ranges_with_alternate_query(row, hkv, ratio, N, D, dtype, seed, alibi):
    """Several key ranges (with gaps, in any order) under one softmax, some scored with q_alt and
    their own ALiBi query position: what a ring cache with attention sinks reads in one call."""
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
    out = row.attend(q, k, v, ranges=ranges, q_alt=q_alt, **kw)
    ref = reference.attend(q, k, v, ranges=ranges, q_alt=q_alt, **kw)
    assert_within(out, ref, attend_bound(q, k, v, ranges=ranges, q_alt=q_alt, **kw), row.isa)


# ---------------------------------------------------------------- fixed cases, every row
ATTN_CASES = [(1, 1, 1, 1), (4, 1, 15, 3), (9, 3, 16, 64), (8, 2, 17, 17), (6, 2, 31, 80), (32, 8, 33, 128),
              (16, 2, 100, 64), (3, 3, 1000, 96), (8, 1, 64, 256), (2, 1, 20, 512)]


def alibi_case(rng, H, Hkv, N, D, dtype):
    """Random q, k, v and ALiBi slopes at key positions 500..500+N-1, the query at 500+N."""
    q, k, v = make(rng, H, Hkv, N, D, dtype)
    kw = dict(alibi_slopes=rng.uniform(0, 0.3, H).astype(np.float32),
              key_positions=np.arange(500, 500 + N, dtype=np.int64), query_position=500 + N)
    return q, k, v, kw


@pytest.mark.parametrize("H,Hkv,N,D", ATTN_CASES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_alibi_shapes_against_scalar_and_float64(row, rng, H, Hkv, N, D, dtype):
    q, k, v, kw = alibi_case(rng, H, Hkv, N, D, dtype)
    got = row.attend(q, k, v, **kw)
    bound = attend_bound(q, k, v, **kw)
    assert_within(got, scalar_attend(q, k, v, **kw).astype(np.float64), 2 * bound, row.isa + " vs scalar")
    assert_within(got, reference.attend(q, k, v, **kw), bound, row.isa + " vs float64")


@pytest.mark.emulated_slow
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128), (32, 32, 128), (8, 1, 256), (4, 2, 80)])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fast_shapes_long_cache(row, rng, shape, dtype):
    H, Hkv, D = shape
    N = 4099  # not a multiple of any block size
    q, k, v = make(rng, H, Hkv, N, D, dtype)
    assert_within(row.attend(q, k, v), reference.attend(q, k, v), attend_bound(q, k, v), row.isa)


def test_scale_and_out_argument(row, rng):
    q, k, v = make(rng, 6, 2, 50, 24, "float32")
    out = np.full((6, 24), np.nan, dtype=np.float32)
    k0, v0, q0 = k.copy(), v.copy(), q.copy()
    res = row.attend(q, k, v, scale=0.37, out=out)
    assert res is out
    assert_within(out, reference.attend(q, k, v, scale=0.37), attend_bound(q, k, v, scale=0.37))
    # inputs are read only
    assert np.array_equal(k, k0) and np.array_equal(v, v0) and np.array_equal(q, q0)


def test_single_key_returns_its_value(row, rng):
    q, k, v = make(rng, 4, 1, 1, 33, "float16")
    out = row.attend(q, k, v)
    np.testing.assert_array_equal(out, np.repeat(v[:, 0].astype(np.float32), 4, axis=0))


def test_large_scores_do_not_overflow(row, rng):
    """Online softmax subtracts the running max: scores of +-1e4 must not give inf/nan."""
    q, k, v = make(rng, 2, 1, 300, 16, "float32", q_scale=2000.0)
    out = row.attend(q, k, v)
    assert np.isfinite(out).all()
    # scores of +-1e4 carry fp32 rounding errors of ~1e-3 themselves: 10x the usual tolerance
    assert_within(out, reference.attend(q, k, v), 1e-4 * attend_scale(q, k, v))


def test_gqa_uses_the_right_kv_head(row, rng):
    """query head h reads KV head h // G: give each KV head a constant V and check."""
    H, Hkv, N, D = 8, 4, 20, 16
    q, k, _ = make(rng, H, Hkv, N, D, "float32")
    v = np.broadcast_to(np.arange(Hkv, dtype=np.float32)[:, None, None], (Hkv, N, D)).copy()
    out = row.attend(q, k, v)
    np.testing.assert_allclose(out[:, 0], np.arange(H) // (H // Hkv), atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_ring_cache_read(row, rng, dtype):
    """A ring cache's read: sinks scored with q_alt at their own ALiBi query position, the
    window in two pieces (wrapped), one softmax; against the float64 reference."""
    q, k, v = make(rng, 8, 2, 90, 64, dtype)
    q_alt = rng.standard_normal(q.shape).astype(np.float32)
    kw = dict(alibi_slopes=rng.uniform(0, 0.3, 8).astype(np.float32), key_positions=rng.permutation(90).astype(np.int64),
              ranges=[(0, 4, True, 40), (57, 90, False, 95), (4, 50, False, 95)], q_alt=q_alt)
    assert_within(row.attend(q, k, v, **kw), reference.attend(q, k, v, **kw), attend_bound(q, k, v, **kw), row.isa)


def test_attention_without_alibi(row, rng):
    q, k, v = make(rng, 9, 3, 257, 64, "float16")
    assert_within(row.attend(q, k, v), reference.attend(q, k, v), attend_bound(q, k, v), row.isa)


@pytest.mark.emulated_slow
def test_attend_ranges_equal_the_single_range(row, rng):
    """Splitting [0, N) into pieces without q_alt changes nothing but rounding."""
    q, k, v = make(rng, 8, 2, 2500, 64, "float16")
    whole = row.attend(q, k, v)
    # starts off the block and chunk grid; a range across a chunk boundary (1024, 2048)
    for ranges in ([(200, 2500), (0, 4), (4, 200)], [(0, 5), (5, 1030), (1030, 2500)], [(0, 2047), (2047, 2500)]):
        split = row.attend(q, k, v, ranges=ranges)
        np.testing.assert_allclose(split, whole, rtol=0, atol=1e-5 * np.abs(whole).max(), err_msg=str(ranges))


# ---------------------------------------------------------------- the Python API's checks (native)
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
