"""Attention of several query rows of one sequence (q ``[T, H, D]``: a prefill chunk) on every
ISA row, against the float64 reference (kvsimd.reference.attend, row by row through
reference.query_rows) within kvsimd.bounds.attend_bound; and against the single-query kernel
row by row; results the same for any thread count."""
import numpy as np
import pytest

from kvsimd import ops, reference
from kvsimd.bounds import ATTEND_TOL, attend_bound, attend_scale
from kvsimd.errors import KVSimdValueError
from kvsimd.testing import use_isa

from conftest import NATIVE_ISAS

import kvsimd._kvsimd as ext


def make(rng, T, H, Hkv, N, D, dtype):
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((Hkv, N, D)).astype(dtype)
    v = rng.standard_normal((Hkv, N, D)).astype(dtype)
    return q, k, v


def check(row, q, k, v, what="", tight=False, **kw):
    """row's attention within attend_bound of float64 math; tight: also within the tolerance
    alone, ATTEND_TOL x attend_scale, without the dot products' worst-case rounding (which
    random scores stay far below: what shows a longer chain of roundings in a score)."""
    out = row.attend(q, k, v, **kw)
    assert out.shape == q.shape and out.dtype == np.float32
    ref = reference.attend(q, k, v, **kw)
    diff = np.abs(out.astype(np.float64) - ref)
    err = diff / np.maximum(attend_bound(q, k, v, **kw), 1e-300)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= 1, f"{row.isa} {what}: error {err.max():.3g} x the bound at {worst}"
    if tight:
        scale = np.stack([attend_scale(q[t], k, v, **rkw) for t, rkw in
                          enumerate(reference.query_rows(len(q), k.shape[1], **kw))]) if q.ndim == 3 else \
            attend_scale(q, k, v, **kw)
        err = diff / np.maximum(ATTEND_TOL[k.dtype.name] * scale, 1e-300)
        assert err.max() <= 1, f"{row.isa} {what}: error {err.max():.3g} x the tolerance"
    return out


# T rows, N keys (offset N - T by default), heads: tails of blocks (16) and chunks (1024),
# GQA / MQA / MHA, head dims with and without a vector tail.  Past a chunk on either path: keys
# on the lanes (33/2/2/1100), queries on the lanes (8/8/1/1100: 64 query vectors); 256 rows of
# 8/1 over 1300 keys is the largest, and CI's sanitizer step, where it took 10-28 s a case,
# leaves it to the suite (sanitizer_slow).
CASES = [
    (1, 9, 3, 40, 64), (2, 9, 3, 2, 64), (7, 4, 1, 7, 17), (7, 8, 8, 30, 80), (64, 9, 3, 64, 64),
    (64, 6, 2, 100, 48), (256, 4, 4, 256, 32), pytest.param(256, 8, 1, 1300, 64, marks=pytest.mark.sanitizer_slow),
    (33, 2, 2, 1100, 16), (8, 8, 1, 1100, 32),
    # the query-on-lanes path with head dims whose last register tile is short: 23 = 2 x 8 + 7 = 5 x 4 + 3,
    # 30 = 3 x 8 + 6
    (16, 4, 2, 40, 23), (8, 8, 1, 50, 30),
]


@pytest.mark.emulated_slow
@pytest.mark.parametrize("T,H,Hkv,N,D", CASES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_match_float64(row, rng, T, H, Hkv, N, D, dtype):
    q, k, v = make(rng, T, H, Hkv, N, D, dtype)
    check(row, q, k, v, "causal")
    if N > T:   # an earlier offset: the last keys are in no row's past
        check(row, q, k, v, "offset", causal_offset=int(rng.integers(0, N - T)))


@pytest.mark.emulated_slow
@pytest.mark.parametrize("T,H,Hkv,N,D", [(7, 4, 2, 50, 64), (64, 9, 3, 200, 64), (256, 4, 1, 300, 32)])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_alibi_softcap_window(row, rng, T, H, Hkv, N, D, dtype):
    q, k, v = make(rng, T, H, Hkv, N, D, dtype)
    q *= 3
    slopes = (2.0 ** -np.arange(1, H + 1, dtype=np.float32)).astype(np.float32)
    check(row, q, k, v, "alibi", alibi_slopes=slopes)
    check(row, q, k, v, "alibi at other positions", alibi_slopes=slopes, query_position=1000,
          key_positions=np.arange(1000 - N + T, 1000 + T, dtype=np.int64))
    check(row, q, k, v, "softcap", softcap=2.0)
    for W in (1, 5, 16, 100):
        check(row, q, k, v, "window %d" % W, window=W, softcap=3.0, alibi_slopes=slopes)
    check(row, q, k, v, "not causal", causal=False)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_ranges_and_alternate_query(row, rng, dtype):
    """Shared key ranges (sinks + a recent span, the later first) cut at each row's causal end; a
    range scored with q_alt and its own ALiBi position."""
    T, H, Hkv, N, D = 20, 6, 2, 90, 64
    q, k, v = make(rng, T, H, Hkv, N, D, dtype)
    q_alt = rng.standard_normal(q.shape).astype(np.float32)
    slopes = rng.uniform(0, 0.3, H).astype(np.float32)
    check(row, q, k, v, "ranges", ranges=[(40, 90), (0, 4)])
    check(row, q, k, v, "ranges, q_alt", ranges=[(40, 90), (0, 4, True, 3)], q_alt=q_alt, alibi_slopes=slopes)
    check(row, q, k, v, "ranges, window", ranges=[(0, 4), (60, 90)], window=12)


@pytest.mark.emulated_slow
def test_rows_equal_single_query_calls(row, rng):
    """Row t of a multi-row call is the single-query call over keys 0..offset+t (same rounding
    bound; fp32 K/V)."""
    T, H, Hkv, N, D = 40, 8, 2, 77, 64
    q, k, v = make(rng, T, H, Hkv, N, D, "float32")
    many = row.attend(q, k, v)
    for t in range(T):
        one = row.attend(q[t], k, v, ranges=[(0, N - T + t + 1)])
        b = attend_bound(q[t], k, v, ranges=[(0, N - T + t + 1)])
        assert (np.abs(many[t] - one) <= 2 * b).all(), t


@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_rows_same_bits_for_any_thread_count(isa, rng):
    T, H, Hkv, N, D = 130, 9, 3, 700, 64
    q, k, v = make(rng, T, H, Hkv, N, D, "float16")
    before = ext._get_kernel_threads()
    outs = []
    try:
        with use_isa(isa):
            for n in (1, 2, 3, 7):
                ext._set_kernel_threads(n)
                outs.append(ops.attend(q, k, v, window=50))
    finally:
        ext._set_kernel_threads(before)
    for o in outs[1:]:
        assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32))


@pytest.mark.parametrize("kw,msg", [
    (dict(causal_offset=-1), "causal_offset must be in"),
    (dict(causal_offset=9), "causal_offset must be in"),
    (dict(causal_offset=True), "causal_offset must be an integer"),
    (dict(window=0), "window must be"),
    (dict(window=3, causal=False), "window needs a causal pass"),
    (dict(causal_offset=0, causal=False), "causal_offset applies"),
    (dict(ranges=[(7, 10)], causal_offset=0), "query row 0 sees no key"),
    (dict(ranges=[(0, 2)], window=2), "sees no key"),
])
def test_rows_bad_input(rng, kw, msg):
    q, k, v = make(rng, 4, 2, 1, 10, 8, "float32")
    with pytest.raises((KVSimdValueError, TypeError)) as e:
        ops.attend(q, k, v, **kw)
    assert msg in str(e.value)


def test_rows_shapes_refused(rng):
    q, k, v = make(rng, 4, 2, 1, 10, 8, "float32")
    with pytest.raises(KVSimdValueError, match="causal_offset and window apply"):
        ops.attend(q[0], k, v, causal_offset=3)
    with pytest.raises(KVSimdValueError, match="2-D"):
        ops.attend(q[None], k, v)
    with pytest.raises(KVSimdValueError, match="out must have shape"):
        ops.attend(q, k, v, out=np.empty((3, 2, 8), np.float32))
    with pytest.raises(KVSimdValueError, match="q_alt must have shape"):
        ops.attend(q, k, v, ranges=[(0, 10, True)], q_alt=q[:2])
    with pytest.raises(KVSimdValueError, match="q has 4 query rows, more than the N=3 keys"):   # not "N-T=-1"
        ops.attend(q, k[:, :3].copy(), v[:, :3].copy())


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_both_tile_paths_in_one_call(row, rng, dtype):
    """attn.inc.h computes a tile of >= 32 query vectors with the queries on the lanes and a
    smaller one with one vector per query: 70 MHA rows are a tile of 64 (lanes, 4 vectors of 16
    lanes or 8 of 8) and one of 6.  Both within the bound, with a window that leaves some lanes
    of a chunk without any key (their state must stay untouched), ALiBi and the soft cap."""
    T, H, Hkv, N, D = 70, 2, 2, 1500, 24
    q, k, v = make(rng, T, H, Hkv, N, D, dtype)
    q *= 2
    slopes = np.array([0.5, 0.01], np.float32)
    check(row, q, k, v, "two tiles")
    check(row, q, k, v, "two tiles, window 3", window=3, alibi_slopes=slopes, softcap=4.0)
    # keys come in chunks of 1024: rows 0..22 see keys of the first chunk only, row 63 (the
    # lanes tile's last) none of it
    check(row, q, k, v, "two tiles, window 40 across a chunk end", causal_offset=1000, window=40)


@pytest.mark.parametrize("D", [256, 512])
def test_rows_lanes_path_accurate_with_large_scores(row, rng, D):
    """Scores with std ~8 over a long head dimension: the lanes path sums each score in partial
    chains of 16 elements of d (a single chain over all of D was up to 1.9x the bound on avx2,
    where the one-vector path of the same rows stays near 0.25x)."""
    T, H, N = 64, 1, 200
    q = (8 * rng.standard_normal((T, H, D))).astype(np.float32)
    k = rng.standard_normal((1, N, D)).astype(np.float32)
    v = rng.standard_normal((1, N, D)).astype(np.float32)
    check(row, q, k, v, "lanes, D=%d, large scores" % D, tight=True, causal=False)


@pytest.mark.parametrize("D", [256, 512])
@pytest.mark.parametrize("H,Hkv", [(4, 1), (8, 1), (3, 3)])
def test_decode_one_vector_path_accurate_with_large_scores(row, rng, D, H, Hkv):
    """The same scores on the one-vector path (a decode step of a small group): each lane chains
    D / (KV_W / KV_KP) FMAs (64 at D = 512 on the AVX-512 rows, whose vectors hold two keys of 8
    elements each, as on avx2) before the add tree."""
    q = (8 * rng.standard_normal((1, H, D))).astype(np.float32)
    k = rng.standard_normal((Hkv, 200, D)).astype(np.float32)
    v = rng.standard_normal((Hkv, 200, D)).astype(np.float32)
    check(row, q, k, v, "one vector, D=%d, large scores" % D, tight=True, causal=False)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("T,H,Hkv,D,scale", [(1, 1, 1, 64, 1.0), (1, 32, 1, 64, 1.0), (1, 6, 2, 256, 3.0),
                                             (40, 1, 1, 64, 3.0)])
def test_rows_within_the_bound_with_scores_in_the_hundreds(row, rng, T, H, Hkv, D, scale, dtype):
    """Scores of +-100 and more (q ~ 8 randn, scale 1 or 3): the dot products' rounding grows with
    the scores, and the output's error with it (up to 3.3x the tolerance alone on the scalar row,
    12x over int8 keys); attend_bound's score term (score_rounding_error) covers it on every row,
    on the one-vector path and on the lanes path (MQA, several rows)."""
    for trial in range(8):
        q = (8 * rng.standard_normal((T, H, D))).astype(np.float32)
        k = rng.standard_normal((Hkv, 24, D)).astype(dtype)
        v = rng.standard_normal((Hkv, 24, D)).astype(dtype)
        kw = dict(scale=scale, causal=False) if T > 1 else dict(scale=scale)
        check(row, q if T > 1 else q[0], k, v, "trial %d" % trial, **kw)
