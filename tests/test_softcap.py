"""Attention logit soft-capping (Gemma 2): each scaled dot product s becomes cap * tanh(s / cap),
before the ALiBi bias and the softmax, on every compiled ISA row (the ``row`` fixture: native,
or emulated when this CPU lacks the row).

References: kvsimd.reference.attend / attention_scores (float64 NumPy, np.tanh), and the exact
cap * tanh(s / cap) of dot products that are exact in float32.  Bounds: kvsimd.bounds.attend_bound
(ATTEND_TOL plus the soft cap's own rounding, softcap_score_error / SOFTCAP_REL)."""
import numpy as np
import pytest
from hypothesis import strategies as st

from kvsimd import KVCache, KVSimdTypeError, KVSimdValueError, ops, reference
from kvsimd.bounds import U32, attend_bound, softcap_score_error
from kvsimd.testing import use_isa

from conftest import row_cases
from strategies import gqa_ratios, head_dims, kv_dtypes, kv_heads, seeds, token_counts
from test_attend import ATTN_CASES, EMU_EXAMPLES, alibi_case, assert_within, make, scalar_attend

CAPS = st.sampled_from([1.0, 2.0, 3.0, 5.0, 50.0])
# q_scale 10 gives raw scores of ~N(0, 100): with caps 1..5 many of them saturate
Q_SCALES = st.sampled_from([0.3, 1.0, 3.0, 10.0])


def saturated_fraction(q, k, cap, **kw):
    """Fraction of the raw scores with |s / cap| > 9.1 (where tanh is 1 in float32)."""
    s = reference.attention_scores(q, k, **kw)
    s = s[np.isfinite(s)]
    return float(np.mean(np.abs(s / cap) > 9.1))


# ---------------------------------------------------------------- against float64, every row
@row_cases(EMU_EXAMPLES, hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds,
           cap=CAPS, q_scale=Q_SCALES)
def test_softcap_matches_float64_reference(row, hkv, ratio, N, D, dtype, seed, cap, q_scale):
    rng = np.random.default_rng(seed)
    q, k, v = make(rng, hkv * ratio, hkv, N, D, dtype, q_scale)
    out = row.attend(q, k, v, softcap=cap)
    assert out.shape == q.shape and out.dtype == np.float32 and np.isfinite(out).all()
    assert_within(out, reference.attend(q, k, v, softcap=cap), attend_bound(q, k, v, softcap=cap), row.isa)


@row_cases(EMU_EXAMPLES, hkv=kv_heads, ratio=gqa_ratios, N=token_counts, D=head_dims, dtype=kv_dtypes, seed=seeds,
           cap=CAPS, q_scale=Q_SCALES)
def test_softcap_with_alibi_and_sink_query(row, hkv, ratio, N, D, dtype, seed, cap, q_scale):
    """A ring cache's read (ranges in any order, some scored with q_alt, their own ALiBi query
    positions, keys at permuted positions) with the cap: one softmax over all of it."""
    rng = np.random.default_rng(seed)
    H = hkv * ratio
    q, k, v = make(rng, H, hkv, N, D, dtype, q_scale)
    q_alt = (rng.standard_normal((H, D)) * q_scale).astype(np.float32)
    cuts = np.unique(np.concatenate([[0, N], rng.integers(0, N + 1, 4)]))
    pieces = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]
    keep = [p for p in pieces if rng.random() < 0.7] or pieces[:1]
    ranges = [(a, b, bool(rng.random() < 0.5), N + int(rng.integers(0, 50))) for a, b in keep]
    ranges = [ranges[i] for i in rng.permutation(len(ranges))]
    kw = dict(ranges=ranges, q_alt=q_alt, softcap=cap, alibi_slopes=rng.uniform(0, 0.5, H).astype(np.float32),
              key_positions=rng.permutation(N).astype(np.int64))
    assert_within(row.attend(q, k, v, **kw), reference.attend(q, k, v, **kw), attend_bound(q, k, v, **kw), row.isa)


@pytest.mark.parametrize("H,Hkv,N,D", ATTN_CASES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("cap", [1.0, 50.0])
def test_softcap_shapes_against_scalar_and_float64(row, rng, H, Hkv, N, D, dtype, cap):
    """Every shape of test_attend (GQA, MQA, block and vector tails), with ALiBi; q scaled so
    that with cap 1 most scores saturate."""
    q, k, v, kw = alibi_case(rng, H, Hkv, N, D, dtype)
    q *= 10
    kw["softcap"] = cap
    if cap == 1.0 and D > 1:
        assert saturated_fraction(q, k, cap) > 0.1
    got = row.attend(q, k, v, **kw)
    bound = attend_bound(q, k, v, **kw)
    assert_within(got, scalar_attend(q, k, v, **kw).astype(np.float64), 2 * bound, row.isa + " vs scalar")
    assert_within(got, reference.attend(q, k, v, **kw), bound, row.isa + " vs float64")


@pytest.mark.emulated_slow
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_softcap_long_cache(row, rng, dtype):
    """Several chunks (1024 tokens) and a partial last block, saturating and not."""
    q, k, v = make(rng, 8, 2, 4099, 64, dtype, q_scale=3.0)
    for cap in (2.0, 30.0):
        assert_within(row.attend(q, k, v, softcap=cap), reference.attend(q, k, v, softcap=cap),
                      attend_bound(q, k, v, softcap=cap), row.isa)


def test_cap_comes_before_the_alibi_bias(row, rng):
    """cap(s) - bias, not cap(s - bias): the two differ here by far more than the bound, and the
    kernel matches the first."""
    H, Hkv, N, D, cap = 4, 2, 60, 32, 3.0
    q, k, v = make(rng, H, Hkv, N, D, "float32", q_scale=3.0)
    kw = dict(alibi_slopes=np.full(H, 0.25, np.float32), softcap=cap)
    want = reference.attend(q, k, v, **kw)
    bound = attend_bound(q, k, v, **kw)
    # the other order, in float64: bias first, then the cap
    raw = reference.attention_scores(q, k, alibi_slopes=kw["alibi_slopes"])
    p = np.exp(cap * np.tanh(raw / cap) - cap)
    p /= p.sum(axis=1, keepdims=True)
    wrong = np.einsum("hn,hnd->hd", p, np.repeat(v.astype(np.float64), H // Hkv, axis=0))
    assert np.max(np.abs(wrong - want) / bound) > 100
    assert_within(row.attend(q, k, v, **kw), want, bound, row.isa)


# ---------------------------------------------------------------- the capped scores themselves
def readback_case(dtype, cap, rng):
    """q, k, v whose dot products are exact in float32 and whose weights read back directly.

    Head 0 has q = (4, 0, ...), head 1 q = (-4, 0, ...); key j is (x_j, 0, ...), so with scale 1
    the score is +-4 x_j exactly.  V is the identity (D = N): out[h, j] = p_hj.  The x_j put most
    |capped scores| in [0.6 cap, cap) (weights within e^(-0.4 cap) of the largest: normal floats),
    8 saturated (|s| > 9 cap; for float32 some beyond float32's range: +-inf in the kernel's dot
    product, +-cap in the float64 reference)."""
    N = 256
    c = rng.uniform(0.6, 0.999, N - 8) * cap
    x = np.concatenate([cap * np.arctanh(c / cap) / 4, [30 * cap, 100 * cap, 1e3 * cap, 65504.0]])
    if dtype == "float32":
        x = np.concatenate([x, [1e20, 3e38, 2e38, 1e38]])
    else:
        x = np.concatenate([x, [60000.0, 50000.0, 40000.0, 30000.0]])
    x = rng.permutation(x.astype(dtype))
    k = np.zeros((1, N, N), dtype)
    k[0, :, 0] = x
    q = np.zeros((2, N), np.float32)
    q[0, 0], q[1, 0] = 4.0, -4.0
    v = np.eye(N, dtype=dtype)[None]
    return q, k, v


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("cap", [1.0, 5.0, 50.0])
def test_capped_scores_read_back(row, rng, dtype, cap):
    """log(p_j / p_m) = c_j - c_m (m: the largest score) for exact dot products: the soft cap's
    own rounding within softcap_score_error, plus the softmax's (the subtraction, e^x to a few
    ulp and the final product: U32 * (|c_j - c_m| + 16)); saturated scores give the same weight,
    bit for bit, and scores beyond float32's range are capped, not NaN."""
    q, k, v = readback_case(dtype, cap, rng)
    out = row.attend(q, k, v, scale=1.0, softcap=cap).astype(np.float64)
    assert np.isfinite(out).all() and (out > 0).all()
    c = reference.attention_scores(q, k, scale=1.0, softcap=cap)       # float64 cap * tanh(s / cap)
    e = softcap_score_error(c, cap)
    sat = 4.0 * k[0, :, 0].astype(np.float64) > 9 * cap
    assert sat.sum() == 8
    for h in (0, 1):
        m = int(np.argmax(c[h]))
        got = np.log(out[h]) - np.log(out[h, m])
        want = c[h] - c[h, m]
        slack = U32 * (np.abs(want) + 16)
        err = np.abs(got - want) / (e[h] + e[h, m] + slack)
        assert err.max() <= 1, "%s: error %.3g x the bound at key %d" % (row.isa, err.max(), int(np.argmax(err)))
        # saturated: exactly +cap (head 0: the largest score) or -cap (head 1), one weight
        assert np.all(out[h, sat] == out[h, sat][0]) and (h == 1 or out[h, sat][0] == out[h, m])


def test_capped_scores_read_back_is_sharp(rng):
    """The read-back check can fail: the scores of a cap 20 SOFTCAP_REL too large miss it."""
    q, k, v = readback_case("float32", 50.0, rng)
    c = reference.attention_scores(q, k, scale=1.0, softcap=50.0)
    e = softcap_score_error(c, 50.0)
    c_bad = reference.attention_scores(q, k, scale=1.0, softcap=50.0 * (1 + 20 * 16 * U32))
    m = int(np.argmax(c[0]))
    err = np.abs((c_bad[0] - c_bad[0, m]) - (c[0] - c[0, m])) / (e[0] + e[0, m] + U32 * (np.abs(c[0] - c[0, m]) + 16))
    assert err.max() > 1


# ---------------------------------------------------------------- off means off
def test_softcap_off_is_bit_identical(row, rng):
    """None, 0 and 0.0 all leave the uncapped kernel path: the same bits as no argument."""
    q, k, v = make(rng, 8, 2, 70, 48, "float16", q_scale=3.0)
    q_alt = rng.standard_normal(q.shape).astype(np.float32)
    for kw in ({}, dict(alibi_slopes=rng.uniform(0, 0.3, 8).astype(np.float32)),
               dict(ranges=[(0, 4, True, 20), (30, 70, False, 75), (4, 30)], q_alt=q_alt)):
        base = row.attend(q, k, v, **kw)
        for off in (None, 0, 0.0, -0.0):
            assert np.array_equal(row.attend(q, k, v, softcap=off, **kw).view(np.uint32), base.view(np.uint32)), off
        assert not np.array_equal(row.attend(q, k, v, softcap=2.0, **kw), base)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_kvcache_attend_softcap(isa, rng, dtype):
    """KVCache.attend takes the same cap: the same bits as ops.attend on the cache's contents,
    within the bound of the float64 reference; None/0 the same bits as no argument."""
    c = KVCache(2, 2, 40, 64, dtype=dtype)
    k = rng.standard_normal((2, 50, 40)).astype(np.float32)
    v = rng.standard_normal((2, 50, 40)).astype(np.float32)
    c.write(1, k, v)
    c.commit(50)
    q = (rng.standard_normal((6, 40)) * 10).astype(np.float32)
    kc, vc = np.ascontiguousarray(c.keys(1)), np.ascontiguousarray(c.values(1))
    for cap in (1.5, 50.0):
        got = c.attend(1, q, softcap=cap)
        assert np.array_equal(got.view(np.uint32), ops.attend(q, kc, vc, softcap=cap).view(np.uint32))
        assert_within(got, reference.attend(q, kc, vc, softcap=cap), attend_bound(q, kc, vc, softcap=cap), isa)
    base = c.attend(1, q)
    for off in (None, 0):
        assert np.array_equal(c.attend(1, q, softcap=off).view(np.uint32), base.view(np.uint32))


# ---------------------------------------------------------------- the boundary
BAD = [(float("nan"), KVSimdValueError), (float("inf"), KVSimdValueError), (-float("inf"), KVSimdValueError),
       (-1.0, KVSimdValueError), (-1, KVSimdValueError), (1e-300, KVSimdValueError), (1e300, KVSimdValueError),
       (np.float32(-2.5), KVSimdValueError), ("x", KVSimdTypeError), ("50", KVSimdTypeError),
       (True, KVSimdTypeError), ([50.0], KVSimdTypeError), (1j, KVSimdTypeError), (10 ** 400, KVSimdValueError)]


@pytest.mark.parametrize("bad,exc", BAD, ids=[repr(b) for b, _ in BAD])
def test_bad_softcap_is_refused(bad, exc):
    rng = np.random.default_rng(0)
    q, k, v = make(rng, 4, 2, 10, 16, "float16")
    cache = KVCache(1, 2, 16, 10)
    cache.write(0, k.astype(np.float32), v.astype(np.float32))
    cache.commit(10)
    for call in (lambda: ops.attend(q, k, v, softcap=bad), lambda: cache.attend(0, q, softcap=bad)):
        with pytest.raises(exc) as ei:
            call()
        msg = str(ei.value)
        assert "softcap" in msg and repr(bad)[:20] in msg, msg


def test_softcap_limits_are_accepted():
    """The range ends: 2**-126 and 2**126 (the cap and its reciprocal stay normal floats)."""
    rng = np.random.default_rng(1)
    q, k, v = make(rng, 2, 1, 9, 8, "float32")
    for cap in (2.0 ** -126, 2.0 ** 126, 1, np.float32(50), np.float64(0.5)):
        with use_isa("scalar"):
            out = ops.attend(q, k, v, softcap=cap)
        assert_within(out, reference.attend(q, k, v, softcap=float(cap)), attend_bound(q, k, v, softcap=float(cap)))
