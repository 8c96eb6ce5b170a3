"""The int8 and int4 KV caches: the quantization rule against NumPy float32 (kvsimd.reference),
attention over int8 / int4 K/V with block scales on every ISA row against float64 math on the
values the rows stand for (kvsimd.bounds.attend_bound), the quantized shift of keys, the
boundary checks, and KVCache(dtype="int8" / "int4") end to end (written rows, views, decode
steps, the ring policies, transactions)."""
import numpy as np
import pytest

import kvsimd
import kvsimd._kvsimd as ext
from kvsimd import KVCache, ops, reference
from kvsimd.bounds import attend_bound, hadamard_step_bound, pair_norm, quantized_shift_bound, quantized_step_bound
from kvsimd.errors import KVSimdTypeError, KVSimdValueError
from kvsimd.testing import use_isa

from conftest import NATIVE_ISAS
from test_attend_rows import CASES as ROW_CASES


DTYPES = ["int8", "int4"]
QRANGE = {"int8": (-127, 127), "int4": (-8, 7)}
# attention: K and V of one dtype, or "K/V" of two (KVCache(dtype="int8/int4"): int8 keys, int4 values)
KV_DTYPES = DTYPES + ["int8/int4", "int4/int8"]


def sides(dtype):
    """(K's dtype, V's dtype) of a dtype of KV_DTYPES."""
    return tuple(dtype.split("/")) if "/" in dtype else (dtype, dtype)


def quantized(rng, shape, spread=1.0, dtype="int8"):
    """Random rows with a few outlier channels (as real keys have), as (float32, q, scales)."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., :3] *= np.float32(8 * spread)
    q, s = ops.quantize_kv(x, dtype)
    return x, q, s


def values(q, D):
    """The integers of int8 rows, or of int4 (uint8) rows of head_dim D."""
    return reference.unpack_int4(q, D) if q.dtype == np.uint8 else q


def read_query(kind, q, kw):
    """q and the keywords (q_alt) as attention over K of this kind reads them
    (reference.query_as_read: rounded over int8 and int4 keys)."""
    if kw.get("q_alt") is not None:
        kw = dict(kw, q_alt=reference.query_as_read(kw["q_alt"], kind))
    return reference.query_as_read(q, kind), kw


def check(row, q, kq, ks, vq, vs, what="", **kw):
    out = row.attend(q, kq, vq, k_scale=ks, v_scale=vs, **kw)
    assert out.shape == q.shape and out.dtype == np.float32
    D = q.shape[-1]
    kd, vd = reference.dequantize_kv(kq, ks, D), reference.dequantize_kv(vq, vs, D)
    name = {np.dtype(np.int8): "int8", np.dtype(np.uint8): "int4"}
    dt = name[kq.dtype] if kq.dtype == vq.dtype else "int8/int4"   # the float32 tolerance either way
    # over int8 and int4 keys the query is read rounded by the int8 rule (and so is q_alt); rows unturned
    qr, kw = read_query((name[kq.dtype], False), q, kw)
    ref = reference.attend(qr, kd, vd, **kw)
    err = np.abs(out.astype(np.float64) - ref) / np.maximum(attend_bound(qr, kd, vd, dtype=dt, **kw), 1e-300)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= 1, f"{row.isa} {what}: error {err.max():.3g} x the bound at {worst}"
    return out


def thread_counts(counts=(1, 2)):
    """Each kernel thread count in turn (yielded), the process's count put back after."""
    before = ext._get_kernel_threads()
    try:
        for n in counts:
            ext._set_kernel_threads(n)
            yield n
    finally:
        ext._set_kernel_threads(before)


# ---------------------------------------------------------------------------- the rule

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 7, 64, 80, 128, 512])
def test_quantize_kv_is_the_numpy_rule_bit_for_bit(rng, D, dtype):
    x = rng.standard_normal((3, 50, D)).astype(np.float32) * rng.uniform(1e-6, 1e4, (3, 50, 1)).astype(np.float32)
    x[0, 0] = 0.0                        # a zero row: scale 0, q 0
    x[0, 1, 0] = np.float32(1e-40)       # a subnormal maximum
    q, s = ops.quantize_kv(x, dtype)
    rq, rs = reference.quantize_kv(x, dtype)
    nb, (qmin, qmax) = -(-D // 32), QRANGE[dtype]
    shape = x.shape if dtype == "int8" else x.shape[:2] + (16 * nb,)
    assert q.dtype == rq.dtype == (np.int8 if dtype == "int8" else np.uint8) and q.shape == shape
    assert s.dtype == np.float32 and s.shape == x.shape[:2] + (nb,)
    assert np.array_equal(q, rq) and np.array_equal(s.view(np.uint32), rs.view(np.uint32))
    v = values(q, D)
    assert v.shape == x.shape and qmin <= v.min() and v.max() <= qmax
    if dtype == "int4":   # the padding of a short last block holds value 0 (nibble 8)
        full = reference.unpack_int4(q, 32 * nb)
        assert (full[..., D:] == 0).all()
    err = np.abs(reference.dequantize_kv(q, s, D).astype(np.float64) - x)
    assert (err <= quantized_step_bound(s, D)).all()
    for b in range(nb):
        vb, xb = v[..., 32 * b:32 * b + 32].astype(np.int32), x[..., 32 * b:32 * b + 32].astype(np.float64)
        if dtype == "int8":   # the largest value of each block is +-127
            assert (np.abs(vb).max(axis=-1)[s[..., b] > 0] == qmax).all()
            continue
        # int4: no step smaller by more than float32 rounding keeps every value within half a step:
        # levels -8..7 reach -8.5 and 7.5 steps, on the side the scale's sign chooses
        pos, neg = np.maximum(xb, 0).max(axis=-1), np.maximum(-xb, 0).max(axis=-1)
        best = np.minimum(np.maximum(neg / 8.5, pos / 7.5), np.maximum(pos / 8.5, neg / 7.5))
        assert (np.abs(s[..., b]) <= best * (1 + 2.0 ** -20) + 4 * 2.0 ** -149).all()   # (subnormal steps)
        # and the range is used: a value at -8 or +7 in every block with a step
        live = s[..., b] != 0
        assert ((vb.min(axis=-1) == -8) | (vb.max(axis=-1) == 7))[live].all()
    if D > 32:   # a block of its own scale: a row's small block is not crushed by a large one
        y = x.copy()
        y[..., :32] *= 1000
        qy, sy = ops.quantize_kv(y, dtype)
        assert np.array_equal(values(qy, D)[..., 32:], v[..., 32:]) and np.array_equal(sy[..., 1:], s[..., 1:])


def test_int4_layout_by_hand():
    """The packing of kvsimd.h KV_I4, written out: value i of a block in the low nibble of byte i,
    value 16 + i in the high nibble, each as q + 8 (independent of reference.pack_int4); and the
    step's sign: the side with the larger magnitude gets level -8 (8.5 steps of room)."""
    x = np.zeros(40, np.float32)
    x[0], x[16], x[1], x[31], x[32], x[39] = 3.0, -8.0, 1.0, -1.0, 2.0, 4.0
    q, s = ops.quantize_kv(x, "int4")
    # block 0: negatives reach 8 (8.5 steps of room below 0), positives 3: s = 8 / 8.5 > 0
    # block 1: positives reach 4, negatives none: s = -4 / 8.5 < 0, so 4 is level -8
    assert q.shape == (32,) and s[0] > 0 > s[1]
    assert abs(s[0] - 8 / 8.5) <= 1e-6 and abs(s[1] + 4 / 8.5) <= 1e-6
    assert q[0] == (3 + 8) | ((-8 + 8) << 4) and q[1] == (1 + 8) | (8 << 4) and q[15] == 8 | ((-1 + 8) << 4)
    assert q[16] == (-4 + 8) | (8 << 4) and q[16 + 7] == (-8 + 8) | (8 << 4) and q[16 + 8] == 8 | (8 << 4)


def sylvester(n=32):
    """The n x n Hadamard matrix of +-1, built as Sylvester did: [[H, H], [H, -H]]."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def test_hadamard_rows_is_the_sylvester_matrix(rng):
    H = sylvester()
    assert np.array_equal(H @ H, 32 * np.eye(32)) and np.array_equal(H, H.T)
    x = rng.standard_normal((3, 80))
    got = reference.hadamard_rows(x)
    want = x.copy()
    want[:, :64] = (x[:, :64].reshape(3, 2, 32) @ H).reshape(3, 64)   # H symmetric: row @ H == H row
    assert np.allclose(got, want, rtol=0, atol=1e-12) and np.array_equal(got[:, 64:], x[:, 64:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [7, 64, 80, 128])
def test_quantize_kv_hadamard_is_the_numpy_rule_bit_for_bit(rng, D, dtype):
    """The turned rule (ops.quantize_kv(hadamard=True), the C butterflies) against the NumPy float32
    one, bit for bit; the row read back (H of the values) within hadamard_step_bound of x; an
    outlier channel no longer sets the step of its whole block."""
    x = rng.standard_normal((4, 30, D)).astype(np.float32)
    x[..., 1] *= 50                        # an outlier channel, as real keys have
    q, s = ops.quantize_kv(x, dtype, hadamard=True)
    rq, rs = reference.quantize_kv(x, dtype, hadamard=True)
    assert np.array_equal(q, rq) and np.array_equal(s.view(np.uint32), rs.view(np.uint32))
    back = reference.hadamard_rows(reference.dequantize_kv(q, s, D).astype(np.float64))
    assert (np.abs(back - x) <= hadamard_step_bound(s, x)).all()
    plain = reference.dequantize_kv(*ops.quantize_kv(x, dtype), D).astype(np.float64)
    if D >= 32:   # the turned blocks read back closer than the plain ones (the outlier's step shared)
        w = D // 32 * 32
        assert np.abs(back - x)[..., 2:w].mean() < 0.6 * np.abs(plain - x)[..., 2:w].mean()
    else:         # no whole block: nothing turns
        assert np.array_equal(back, plain)


@pytest.mark.parametrize("dtype", ["int8", "int4", "int8/int4"])
def test_turned_rows_near_the_top_of_float32(rng, dtype):
    """Finite K/V however large: a block of 32 values of 2e37 sums to 6.4e38 under H, past float32's
    range (it stored a NaN scale, and attention over it was NaN); the turn takes the block times
    1/32 first, so the rows read back and attention over them stay finite and right, as an
    unturned int8 cache's are."""
    kd, vd = sides(dtype)
    x = np.full((1, 3, 64), 2e37, np.float32)
    x[0, 1] = rng.standard_normal(64).astype(np.float32) * np.float32(1e37)
    for side in (kd, vd):
        q, s = ops.quantize_kv(x, side, hadamard=True)
        rq, rs = reference.quantize_kv(x, side, hadamard=True)
        assert np.isfinite(s).all() and np.array_equal(q, rq) and np.array_equal(s, rs)
        back = reference.hadamard_rows(reference.dequantize_kv(q, s, 64).astype(np.float64))
        assert (np.abs(back - x) <= hadamard_step_bound(s, x)).all()
    c = KVCache(1, 1, 64, 8, dtype=dtype)
    f = KVCache(1, 1, 64, 8, dtype="float32")
    for cache in (c, f):
        cache.write(0, x, x)
        cache.commit(3)
    qv = np.full((2, 64), 1e-38, np.float32)        # scores in range: the values set the output
    got, want = c.attend(0, qv), f.attend(0, qv)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 0.2 * np.abs(want).max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_kv_non_finite_rows(rng, dtype):
    x = rng.standard_normal((4, 16)).astype(np.float32)
    x[1, 3], x[2, 0], x[3, 5] = np.nan, np.inf, -np.inf
    q, s = ops.quantize_kv(x, dtype)
    assert np.isfinite(s[0]) and np.isnan(s[1:]).all() and not values(q[1:], 16).any()
    # a NaN row reads as NaN: attention over it is NaN for every head that sees it (as float rows)
    out = ops.attend(rng.standard_normal((2, 16)).astype(np.float32), q[None], q[None], k_scale=s[None],
                     v_scale=s[None])
    assert np.isnan(out).all()


def test_quantize_kv_bad_input():
    with pytest.raises(KVSimdTypeError, match="x must have dtype float32"):
        ops.quantize_kv(np.zeros((2, 4), np.float64))
    with pytest.raises(KVSimdValueError, match="non-empty last axis"):
        ops.quantize_kv(np.zeros((2, 0), np.float32))
    with pytest.raises(KVSimdValueError, match="C-contiguous"):
        ops.quantize_kv(np.zeros((4, 4), np.float32)[:, ::2])
    with pytest.raises(KVSimdValueError, match="dtype must be 'int8' or 'int4', got 'int2'"):
        ops.quantize_kv(np.zeros((2, 4), np.float32), "int2")
    with pytest.raises(KVSimdTypeError, match="hadamard"):
        ops.quantize_kv(np.zeros((2, 4), np.float32), "int4", hadamard="yes")


# ---------------------------------------------------------------------------- attention on every row

@pytest.mark.parametrize("H,Hkv,N,D", [(9, 3, 700, 64), (4, 1, 1100, 80), (8, 8, 40, 7), (32, 1, 300, 128),
                                       (64, 8, 90, 128), (2, 2, 1, 16), (6, 2, 50, 96), (8, 4, 40, 256)])
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_attend_quantized_single_query(row, rng, H, Hkv, N, D, dtype):
    """One query over int8 / int4 K/V (or int8 K with int4 V, and the other way round): MHA, GQA,
    MQA on the query-on-lanes path (G = 32), head dims with a vector tail (int4: a padded last
    block), a partial last block of keys, one key; over int8 keys the integer dot products' block
    scales taken 2, 3, 4 and 8 blocks per row (D = 64, 96, 128, 256)."""
    q = rng.standard_normal((H, D)).astype(np.float32)
    _, kq, ks = quantized(rng, (Hkv, N, D), dtype=sides(dtype)[0])
    _, vq, vs = quantized(rng, (Hkv, N, D), dtype=sides(dtype)[1])
    check(row, q, kq, ks, vq, vs, "plain")
    slopes = (2.0 ** -np.arange(1, H + 1)).astype(np.float32)
    check(row, 3 * q, kq, ks, vq, vs, "alibi, softcap", alibi_slopes=slopes, softcap=2.0)
    if N > 8:
        q_alt = rng.standard_normal((H, D)).astype(np.float32)
        check(row, q, kq, ks, vq, vs, "ranges, q_alt", ranges=[(N // 2, N), (0, 4, True, 3)], q_alt=q_alt)


@pytest.mark.emulated_slow
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("T,H,Hkv,N,D", ROW_CASES)
def test_attend_quantized_rows(row, rng, T, H, Hkv, N, D, dtype):
    """Several query rows (a prefill chunk) over int8 / int4 / mixed K/V: both tile paths, causal
    cuts, windows."""
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    _, kq, ks = quantized(rng, (Hkv, N, D), dtype=sides(dtype)[0])
    _, vq, vs = quantized(rng, (Hkv, N, D), dtype=sides(dtype)[1])
    check(row, q, kq, ks, vq, vs, "causal")
    check(row, q, kq, ks, vq, vs, "window", window=5)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("T,H,Hkv,N,D", [(20, 4, 2, 37, 64), (40, 1, 1, 45, 96)])
def test_attend_quantized_rows_lane_tails(row, rng, T, H, Hkv, N, D, dtype):
    """Tiles of 40 query vectors on the query-on-lanes path (over int8 keys on the AVX-512 rows:
    three 16-lane vectors of queries, a tile of 2 and a tail of 1) and a last block of an odd
    number of keys (tiles of 4 keys and a tail of 1 to 3); the values' int16 products take the
    full blocks, fp32 the last."""
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    _, kq, ks = quantized(rng, (Hkv, N, D), dtype=sides(dtype)[0])
    _, vq, vs = quantized(rng, (Hkv, N, D), dtype=sides(dtype)[1])
    check(row, q, kq, ks, vq, vs, "causal")
    check(row, q, kq, ks, vq, vs, "not causal", causal=False)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("H,Hkv,N,D", [(16, 2, 1100, 64), (12, 3, 300, 128), (16, 1, 200, 32), (32, 1, 1100, 128),
                                       (64, 1, 300, 64), (96, 1, 200, 32)])
def test_attend_quantized_values_int16_weights(row, rng, H, Hkv, N, D, dtype):
    """Values with several query vectors per KV head (on the SIMD rows: int16 weights per span of
    up to V_SPAN keys, kernels/attn.inc.h kv_accumulate_i16, VPDPWSSD or on avx2 VPMADDWD over
    half-blocks of 16 values; with 32 to 64 query vectors on the lanes of the AVX-512 rows, per
    span of one or two blocks of keys, lane_accum_i16; 96 keep fp32) within attend_bound: spans cut by the
    grid, by ranges that start and end off it, by a window and by the chunk (1,024 keys, where the
    softmax rescales); a peaked softmax (large scores), where the weights of a span differ most; the
    outliers of some values' blocks at 100x the others (a span's largest scale far above a key's)."""
    q = rng.standard_normal((H, D)).astype(np.float32)
    _, kq, ks = quantized(rng, (Hkv, N, D), dtype=sides(dtype)[0])
    x = rng.standard_normal((Hkv, N, D)).astype(np.float32)
    x[:, ::7, :32] *= 100
    vq, vs = ops.quantize_kv(x, sides(dtype)[1])
    check(row, q, kq, ks, vq, vs, "all")
    check(row, q * np.float32(4), kq, ks, vq, vs, "peaked")
    ks_, kq_ = ks.copy(), kq.copy()   # an attention sink: key 0 takes almost all of each head's weight
    sink = q.reshape(Hkv, H // Hkv, D).sum(axis=1, keepdims=True) * np.float32(3)
    kq_[:, :1], ks_[:, :1] = ops.quantize_kv(np.ascontiguousarray(sink), sides(dtype)[0])
    check(row, q, kq_, ks_, vq, vs, "sink")
    # A sink far above the rest: score 55..90 (head by head) against about 0, so the largest weight
    # of a later span is e^-55 down to exp's floor (1.2e-38): from 1e-24 to below 2^-100 (7.9e-31;
    # kernels/attn.inc.h KV_W16_RCP_MIN: such spans take the quotient, the rest the factor
    # 32766 / P, up to 2^115) and below 32766 / FLT_MAX (9.6e-35, where the factor would overflow).
    # The sink's value is 0, so those tiny weights make the whole output.  (A span whose largest
    # weight is below 2^-100 weighs at most that much of the output, under what the bound resolves:
    # this checks that nothing breaks there, e.g. a saturated or NaN weight, not its last bits.)
    kf = np.float32(0.01) * rng.standard_normal((Hkv, N, D)).astype(np.float32)
    kf[:, 0] = rng.standard_normal((Hkv, D))
    kq_, ks_ = ops.quantize_kv(kf, sides(dtype)[0])
    k0 = reference.dequantize_kv(kq_[:, :1], ks_[:, :1], D)[:, 0].astype(np.float64)   # [Hkv, D]
    alpha = np.linspace(55.0, 90.0, H)
    qf = (alpha[:, None] * np.sqrt(D) * np.repeat(k0, H // Hkv, axis=0)
          / np.repeat((k0 * k0).sum(axis=1, keepdims=True), H // Hkv, axis=0)).astype(np.float32)
    vq0 = vq.copy()
    vq0[:, 0] = 0
    check(row, qf, kq_, ks_, vq0, vs, "far sink")
    check(row, q, kq, ks, vq, vs, "ranges", ranges=[(N - 77, N), (3, 70), (90, 91)])
    rows = rng.standard_normal((5, H, D)).astype(np.float32)
    check(row, rows, kq, ks, vq, vs, "rows, window", window=100)


@pytest.mark.parametrize("H,Hkv", [(16, 2), (32, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_quantized_values_non_finite_scale_reads_nan(row, rng, dtype, H, Hkv):
    """A NaN value scale in a block of keys a query sees makes its output NaN on every row, as fp32
    products would (also under the int16 weights: the span's sums take the NaN), with the query
    vectors on the lanes (32/1) too."""
    N, D, G = 128, 64, H // Hkv
    q = rng.standard_normal((H, D)).astype(np.float32)
    _, kq, ks = quantized(rng, (Hkv, N, D), dtype=dtype)
    _, vq, vs = quantized(rng, (Hkv, N, D), dtype=dtype)
    vs[0, 70, 1] = np.nan
    out = row.attend(q, kq, vq, k_scale=ks, v_scale=vs)
    assert np.isnan(out[:G, 32:]).all() and np.isfinite(out[:G, :32]).all() and np.isfinite(out[G:]).all()


@pytest.mark.parametrize("H,Hkv,N,D", [(9, 3, 70, 64), (32, 1, 40, 128), (2, 2, 33, 64)])
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_attend_quantized_queries_near_the_top_of_float32(row, rng, H, Hkv, N, D, dtype):
    """A finite query of about 3e36 whose scores stay in float32's range: over int8 keys an
    integer sum times the query's step alone went past it (every output NaN on the rows with
    integer dot products), so the step takes the keys' block scale first.  Keys on the lanes
    (9/3, 2/2) and queries on the lanes (32/1), one query and several rows."""
    q = rng.standard_normal((3, H, D)).astype(np.float32) * np.float32(3e36)
    _, kq, ks = quantized(rng, (Hkv, N, D), spread=0.125, dtype=sides(dtype)[0])
    _, vq, vs = quantized(rng, (Hkv, N, D), dtype=sides(dtype)[1])
    assert np.isfinite(check(row, q[0], kq, ks, vq, vs, "one query")).all()
    assert np.isfinite(check(row, q, kq, ks, vq, vs, "rows", causal=False)).all()


@pytest.mark.parametrize("H,Hkv,N,D", [(4, 2, 24, 256), (32, 1, 24, 64)])
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_attend_quantized_scores_in_the_hundreds(row, rng, H, Hkv, N, D, dtype):
    """Scores of +-100 and more (q ~ 8 randn, scale 3) over int8 / int4 / mixed keys: errors up to
    12x the tolerance alone over int8 keys (the dot products' rounding grows with the scores),
    within attend_bound's score term on every row, keys on the lanes (4/2) and queries (32/1)."""
    for trial in range(4):
        q = (8 * rng.standard_normal((H, D))).astype(np.float32)
        _, kq, ks = quantized(rng, (Hkv, N, D), dtype=sides(dtype)[0])
        _, vq, vs = quantized(rng, (Hkv, N, D), dtype=sides(dtype)[1])
        check(row, q, kq, ks, vq, vs, "trial %d" % trial, scale=3.0)


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (32, 1, 128)])
def test_attend_quantized_split_k_on_two_threads(isa, rng, H, Hkv, D, dtype):
    """Split-K pieces (2 threads, heads that do not divide among them) read int8 / int4 / mixed
    rows and their scales from the right keys: within the bound, and the same bits on a repeat."""
    N = 3000
    q = rng.standard_normal((H, D)).astype(np.float32)
    _, kq, ks = quantized(rng, (Hkv, N, D), dtype=sides(dtype)[0])
    _, vq, vs = quantized(rng, (Hkv, N, D), dtype=sides(dtype)[1])
    assert ext._attend_pieces(H, Hkv, D, 1, N, 2) > 1
    before = ext._get_kernel_threads()
    try:
        ext._set_kernel_threads(2)

        class Native:
            def attend(self, *a, **kw):
                with use_isa(isa):
                    return ops.attend(*a, **kw)
        Native.isa = isa
        one = check(Native(), q, kq, ks, vq, vs, "2 threads", ranges=[(N - 2000, N), (0, 4)])
        two = check(Native(), q, kq, ks, vq, vs, "2 threads", ranges=[(N - 2000, N), (0, 4)])
        assert np.array_equal(one.view(np.uint32), two.view(np.uint32))
    finally:
        ext._set_kernel_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_quantized_ignores_the_scales_of_keys_it_does_not_read(rng, dtype):
    """The scale of a row outside the ranges is never read: NaN there changes nothing."""
    H, Hkv, N, D = 4, 2, 64, 32
    q = rng.standard_normal((H, D)).astype(np.float32)
    _, kq, ks = quantized(rng, (Hkv, N, D), dtype=dtype)
    _, vq, vs = quantized(rng, (Hkv, N, D), dtype=dtype)
    a = ops.attend(q, kq, vq, k_scale=ks, v_scale=vs, ranges=[(0, 20), (40, 64)])
    ks2, vs2 = ks.copy(), vs.copy()
    ks2[:, 20:40] = np.nan
    vs2[:, 20:40] = np.nan
    b = ops.attend(q, kq, vq, k_scale=ks2, v_scale=vs2, ranges=[(0, 20), (40, 64)])
    assert np.array_equal(a, b)


def test_attend_int8_bad_input(rng):
    q = rng.standard_normal((2, 8)).astype(np.float32)
    _, kq, ks = quantized(rng, (1, 10, 8))
    kf = kq.astype(np.float32)
    with pytest.raises(KVSimdValueError, match="k is int8: it needs k_scale"):
        ops.attend(q, kq, kq, v_scale=ks)
    with pytest.raises(KVSimdValueError, match="v is int8: it needs v_scale"):
        ops.attend(q, kq, kq, k_scale=ks)
    with pytest.raises(KVSimdValueError, match="k is float32: k_scale applies to int8 and int4"):
        ops.attend(q, kf, kf, k_scale=ks)
    with pytest.raises(KVSimdValueError, match=r"k_scale must have shape \(1, 10, 1\)"):
        ops.attend(q, kq, kq, k_scale=ks[:, :5].copy(), v_scale=ks)
    with pytest.raises(KVSimdValueError, match=r"k_scale must be 3-D"):
        ops.attend(q, kq, kq, k_scale=ks[..., 0].copy(), v_scale=ks)
    with pytest.raises(KVSimdTypeError, match="v_scale must have dtype float32"):
        ops.attend(q, kq, kq, k_scale=ks, v_scale=ks.astype(np.float64))
    with pytest.raises(KVSimdTypeError, match="same dtype"):
        ops.attend(q, kq, kf, k_scale=ks)
    with pytest.raises(KVSimdValueError, match="out overlaps k_scale"):
        big = np.zeros(64, np.float32)
        ops.attend(q, kq, kq, k_scale=big[:10].reshape(1, 10, 1), v_scale=ks, out=big[:16].reshape(2, 8))
    # int4: uint8 rows of 16 bytes per block of 32 values, head_dim from q
    _, k4, s4 = quantized(rng, (1, 10, 40), dtype="int4")
    q40 = rng.standard_normal((2, 40)).astype(np.float32)
    with pytest.raises(KVSimdValueError, match=r"k is uint8 \(int4, two values per byte\): head_dim 8 needs rows of 16 "
                                               r"bytes .* got shape \(1, 10, 32\)"):
        ops.attend(q, k4, k4, k_scale=s4, v_scale=s4)
    with pytest.raises(KVSimdValueError, match=r"k is uint8 \(int4, two values per byte\): it needs k_scale"):
        ops.attend(q40, k4, k4, v_scale=s4)
    with pytest.raises(KVSimdValueError, match=r"k_scale must have shape \(1, 10, 2\)"):
        ops.attend(q40, k4, k4, k_scale=ks, v_scale=s4)
    # int4 keys with int8 values (and the other way round) are a pair a cache stores; each side its
    # own row length
    with pytest.raises(KVSimdValueError, match=r"head_dim mismatch: q is \(2, 40\) but k/v are \(1, 10, 32\)"):
        ops.attend(q40, k4, k4.view(np.int8), k_scale=s4, v_scale=s4)
    with pytest.raises(KVSimdValueError, match=r"v is uint8 \(int4, two values per byte\): head_dim 8 needs rows"):
        ops.attend(q, kq, k4, k_scale=ks, v_scale=s4)
    with pytest.raises(KVSimdValueError, match="same shape"):
        ops.attend(q40, k4, k4[:, :5].view(np.int8), k_scale=s4, v_scale=s4)


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,Hkv,N,D", [(None, 9, 3, 700, 64), (None, 4, 1, 1100, 80), (None, 2, 2, 1, 32),
                                         (5, 8, 2, 40, 96), (7, 4, 4, 30, 64)])
def test_attend_hadamard_over_the_unturned_values(isa, rng, T, H, Hkv, N, D, dtype):
    """ops.attend(..., hadamard=True) over K/V quantized turned by the NumPy rule
    (reference.quantize_kv(..., hadamard=True)) against float64 attention over the rows they stand
    for, H of the stored values (the rows as they were, within a step), within
    attend_bound(hadamard=True); bit for bit the kernel over the turned query with its output turned
    back (reference.hadamard_rows in float32: the C butterflies' roundings); the caller's q and q_alt
    unchanged.  The call without the turn is far outside the bound: the check can fail."""
    q = rng.standard_normal((H, D) if T is None else (T, H, D)).astype(np.float32)
    x = rng.standard_normal((2, Hkv, N, D)).astype(np.float32)
    x[..., :3] *= 8                                   # outlier channels, as real keys have
    (kq, ks), (vq, vs) = (reference.quantize_kv(x[i], dtype, hadamard=True) for i in range(2))
    kd, vd = reference.dequantize_kv(kq, ks, D), reference.dequantize_kv(vq, vs, D)   # as stored: turned
    kh, vh = (reference.hadamard_rows(a.astype(np.float64)) for a in (kd, vd))       # the rows they stand for
    if T is None:
        slopes = (2.0 ** -np.arange(1, H + 1)).astype(np.float32)
        cases = [{}, dict(alibi_slopes=slopes, softcap=2.0)]
        if N > 8:
            q_alt = rng.standard_normal((H, D)).astype(np.float32)
            cases.append(dict(ranges=[(N // 2, N), (0, 4, True, 3)], q_alt=q_alt))
    else:
        cases = [{}, dict(window=5), dict(causal=False)]
    for kw in cases:
        before = [a.copy() for a in (q, kw.get("q_alt")) if a is not None]
        out = np.full(q.shape, np.nan, np.float32)
        with use_isa(isa):
            got = ops.attend(q, kq, vq, k_scale=ks, v_scale=vs, hadamard=True, out=out, **kw)
            alt = {} if "q_alt" not in kw else dict(q_alt=reference.hadamard_rows(kw["q_alt"]))
            plain = ops.attend(q, kq, vq, k_scale=ks, v_scale=vs, **kw)
            turned = reference.hadamard_rows(ops.attend(reference.hadamard_rows(q), kq, vq, k_scale=ks, v_scale=vs,
                                                        **dict(kw, **alt)))
        assert got is out and all(np.array_equal(a, b) for a, b in zip(before, [q, kw.get("q_alt")]))
        assert np.array_equal(got, turned), (isa, kw)
        qr, rkw = read_query((dtype, True), q, kw)   # over int8 / int4 keys: rounded, turned as they are
        ref = reference.attend(qr, kh, vh, **rkw)
        bound = np.maximum(attend_bound(qr, kd, vd, dtype=dtype, hadamard=True, **rkw), 1e-300)
        err = np.abs(got.astype(np.float64) - ref) / bound
        assert err.max() <= 1, f"{isa} {kw}: error {err.max():.3g} x the bound"
        assert (np.abs(plain.astype(np.float64) - ref) / bound).max() > 100, (isa, kw)


def test_attend_hadamard_refuses_float_rows(rng):
    """hadamard=True names the quantized rows it applies to; a float k/v is refused, as is a non-bool."""
    q = rng.standard_normal((2, 64)).astype(np.float32)
    k16 = rng.standard_normal((1, 10, 64)).astype(np.float16)
    q0 = q.copy()
    for k in (k16, k16.astype(np.float32)):
        with pytest.raises(KVSimdValueError, match="hadamard=True applies to quantized K/V .* dtype %s" % k.dtype):
            ops.attend(q, k, k, hadamard=True)
    _, kq, ks = quantized(rng, (1, 10, 64), dtype="int4")
    with pytest.raises(KVSimdTypeError, match="hadamard must be a bool, got 'yes'"):
        ops.attend(q, kq, kq, k_scale=ks, v_scale=ks, hadamard="yes")
    assert np.array_equal(q, q0)
    assert np.array_equal(ops.attend(q, k16, k16, hadamard=False), ops.attend(q, k16, k16))


# ---------------------------------------------------------------------------- shift of int8 keys

@pytest.mark.parametrize("dtype,D,had", [("int8", 64, False), ("int4", 64, False), ("int4", 80, False),
                                         ("int4", 64, True), ("int4", 80, True), ("int8", 96, True)])
@pytest.mark.parametrize("style", ["gptj", "neox"])
def test_shift_quantized_keys_within_the_stated_bound(row, rng, style, dtype, D, had):
    Hkv, N, rd = 2, 40, 48 if D < 96 else 96
    x = rng.standard_normal((Hkv, N, D)).astype(np.float32)
    x[..., :3] *= 8
    kq, ks = ops.quantize_kv(x, dtype, hadamard=had)
    def read(k, s):   # the values the rows stand for, turned back
        y = reference.dequantize_kv(k, s, D).astype(np.float64)
        return reference.hadamard_rows(y) if had else y
    before = read(kq, ks)
    k2, s2 = kq.copy(), ks.copy()
    hd = {"head_dim": D} if dtype == "int4" else {}
    row.shift_keys(k2, -37, style=style, rotary_dim=rd, start=5, stop=33, k_scale=s2, hadamard=had, **hd)
    exact = reference.shift_keys(before, -37, style=style, rotary_dim=rd, start=5, stop=33)
    got = read(k2, s2)
    bound = quantized_shift_bound(row.isa, pair_norm(before, style, rd), exact, s2, hadamard=had)
    assert (np.abs(got - exact) <= bound).all()
    # rows outside start..stop untouched, bit for bit
    assert np.array_equal(k2[:, :5], kq[:, :5]) and np.array_equal(k2[:, 33:], kq[:, 33:])
    assert np.array_equal(s2[:, :5], ks[:, :5]) and np.array_equal(s2[:, 33:], ks[:, 33:])
    # and the rotation moved them: not a no-op
    assert np.abs(got[:, 5:33] - before[:, 5:33]).max() > 0.2 * np.abs(before[:, 5:33]).max()   # requantizing alone: <= 1/14


def test_shift_quantized_keys_bad_input(rng):
    _, kq, ks = quantized(rng, (1, 10, 8))
    with pytest.raises(KVSimdValueError, match="k is int8: it needs k_scale"):
        ops.shift_keys(kq, 3)
    with pytest.raises(KVSimdValueError, match="k_scale is read-only"):
        ro = ks.copy()
        ro.flags.writeable = False
        ops.shift_keys(kq, 3, k_scale=ro)
    with pytest.raises(KVSimdValueError, match="k_scale applies to int8 and int4"):
        ops.shift_keys(kq.astype(np.float32), 3, k_scale=ks)
    _, k4, s4 = quantized(rng, (1, 10, 40), dtype="int4")   # 32 bytes per row: head_dim 33..64
    with pytest.raises(KVSimdValueError, match=r"k is uint8 \(int4, two values per byte\): head_dim 32 needs rows of 16"):
        ops.shift_keys(k4, 3, k_scale=s4, head_dim=32)
    with pytest.raises(KVSimdValueError, match="head_dim applies to int4"):
        ops.shift_keys(kq, 3, k_scale=ks, head_dim=8)
    with pytest.raises(KVSimdValueError, match=r"rotary_dim"):
        ops.shift_keys(k4, 3, k_scale=s4, head_dim=40, rotary_dim=48)
    with pytest.raises(KVSimdValueError, match=r"k_scale must have shape \(1, 10, 2\)"):
        ops.shift_keys(k4, 3, k_scale=s4[..., :1].copy(), head_dim=40)
    with pytest.raises(KVSimdValueError, match="hadamard=True applies to quantized keys"):
        ops.shift_keys(kq.astype(np.float32), 3, hadamard=True)


# ---------------------------------------------------------------------------- KVCache(dtype="int8" / "int4")

@pytest.mark.parametrize("dtype,D,had", [("int8", 64, None), ("int4", 64, None), ("int4", 80, None), ("int4", 64, False),
                                         ("int8", 64, True), ("int8/int4", 64, None), ("int8/int4", 80, None),
                                         ("int4/int8", 96, None), ("int8/int4", 64, False)])
def test_cache_quantized_write_views_and_attend(rng, dtype, D, had):
    """Rows written as the rule stores them (turned by H when K or V is int4, unless
    hadamard=False), read in place by attention (with the query turned and the output turned
    back), close to a float32 cache; "int8/int4": int8 keys and int4 values, each side as its own
    dtype's cache stores it."""
    L, Hkv, C = 2, 3, 50
    c = KVCache(L, Hkv, D, C, dtype=dtype, hadamard=had)
    had = "int4" in sides(dtype) if had is None else had
    assert c.hadamard == had
    f = KVCache(L, Hkv, D, C, dtype="float32")
    nb = -(-D // 32)
    row = {"int8": D, "int4": 16 * nb}
    kd, vd = sides(dtype)
    np_dt = {"int8": np.int8, "int4": np.uint8}
    assert c.dtype == np_dt[kd] and c.kv_dtype == dtype and f.kv_dtype == "float32"
    assert "dtype=%s, hadamard=%s" % (dtype, had) in repr(c) and "hadamard" not in repr(f)
    # values and scales: rows of D bytes (int4: 16 per block of 32) + 4 bytes per 32 values, a 64-byte
    # aligned gap at most between them
    need = L * Hkv * C * (row[kd] + row[vd] + 8 * nb)
    assert need <= c.nbytes <= need + 64
    k = rng.standard_normal((Hkv, 20, D)).astype(np.float32)
    v = rng.standard_normal((Hkv, 20, D)).astype(np.float32)
    for cache in (c, f):
        cache.write(1, k, v)
        cache.commit(20)
    assert c.keys(1).shape == (Hkv, 20, row[kd]) and c.values(1).shape == (Hkv, 20, row[vd])
    assert c.keys(1).dtype == np_dt[kd] and c.values(1).dtype == np_dt[vd]
    rq, rs = reference.quantize_kv(k, kd, had)
    assert np.array_equal(c.keys(1), rq) and np.array_equal(c.key_scales(1), rs)
    vq, vs = reference.quantize_kv(v, vd, had)
    assert np.array_equal(c.values(1), vq) and np.array_equal(c.value_scales(1), vs)
    # layer 0 untouched: the blocks of different row lengths do not overlap
    assert not c.keys(0, length=C).any() and not c.values(0, length=C).any()
    assert not c.key_scales(0, length=C).any() and not c.value_scales(0, length=C).any()
    assert c.key_scales(1).shape == (Hkv, 20, nb) and not c.key_scales(1).flags.writeable
    assert c.key_scales(0, length=C).shape == (Hkv, C, nb)
    assert c._layer_view(1, 0).shape == (1, Hkv, C, row[kd]) and c._layer_view(1, 1).shape == (1, Hkv, C, row[vd])
    q = rng.standard_normal((6, D)).astype(np.float32)
    got = c.attend(1, q)
    cp = np.ascontiguousarray
    turn = reference.hadamard_rows if had else (lambda a: a)
    want = turn(ops.attend(turn(q), cp(c.keys(1)), cp(c.values(1)), k_scale=cp(c.key_scales(1)),
                           v_scale=cp(c.value_scales(1))))
    assert np.array_equal(got, want)
    assert np.array_equal(got, ops.attend(q, cp(c.keys(1)), cp(c.values(1)), k_scale=cp(c.key_scales(1)),
                                          v_scale=cp(c.value_scales(1)), hadamard=had))
    # within the quantization's reach of the float32 cache: |dq| <= scale / 2 per component
    assert np.abs(got - f.attend(1, q)).max() < (0.05 if dtype == "int8" else 0.5)
    if "/" in dtype:    # each side read as its own width: the same as two one-dtype caches' views
        one_k, one_v = (KVCache(L, Hkv, D, C, dtype=d, hadamard=had) for d in (kd, vd))
        for cache in (one_k, one_v):
            cache.write(1, k, v)
            cache.commit(20)
        assert np.array_equal(c.keys(1), one_k.keys(1)) and np.array_equal(c.values(1), one_v.values(1))
    with pytest.raises(KVSimdValueError, match="hadamard=True applies to quantized caches"):
        KVCache(1, 1, 8, 4, dtype="float16", hadamard=True)
    with pytest.raises(KVSimdTypeError, match="has no scales"):
        f.key_scales(0)
    with pytest.raises(KVSimdTypeError, match="float16, float32, int8, int4 or"):
        KVCache(1, 1, 8, 4, dtype="int16")
    for bad in ("float16/int4", "int8/", "int8/int4/int4", "int4/float32"):
        with pytest.raises(KVSimdTypeError, match=r"dtype \"K/V\" takes int8 or int4 on each side .* got '%s'" % bad):
            KVCache(1, 1, 8, 4, dtype=bad)


def _model(seed=0):
    from kvsimd.testing import random_decoder
    # GQA with RoPE (the shift policy needs it), head_dim 32
    return random_decoder(64, 64, 2, 4, 2, 32, 96, seed=seed, position="rope")


# (dtype, hadamard): int4 turned by default; int8 keys with int4 values
CACHE_KINDS = [("int8", False), ("int4", True), ("int4", False), ("int8/int4", True)]


@pytest.mark.parametrize("dtype,had", CACHE_KINDS)
def test_decoder_quantized_cache_layer0_rows_are_the_float32_rows_quantized(dtype, had):
    """The write path of a forward pass: layer 0's K/V (the same on both caches: its input does
    not depend on the cache) are stored as the float32 cache's rows quantized by the rule."""
    m = _model()
    toks = list(range(1, 30))
    c8, c32 = m.new_cache(capacity=64, dtype=dtype, hadamard=had), m.new_cache(capacity=64, dtype="float32")
    m.prefill(toks, cache=c8)
    m.prefill(toks, cache=c32)
    for which, scales, f32, side in ((c8.keys, c8.key_scales, c32.keys, 0),
                                     (c8.values, c8.value_scales, c32.values, 1)):
        ref_q, ref_s = reference.quantize_kv(np.ascontiguousarray(f32(0)), sides(dtype)[side], had)
        assert np.array_equal(which(0), ref_q) and np.array_equal(scales(0), ref_s)
    # a decode step writes its rows the same way
    m.step([7], cache=c8)
    m.step([7], cache=c32)
    rq, rs = reference.quantize_kv(np.ascontiguousarray(c32.keys(0)[:, -1:]), sides(dtype)[0], had)
    assert np.array_equal(c8.keys(0)[:, -1:], rq) and np.array_equal(c8.key_scales(0)[:, -1:], rs)
    rq, rs = reference.quantize_kv(np.ascontiguousarray(c32.values(0)[:, -1:]), sides(dtype)[1], had)
    assert np.array_equal(c8.values(0)[:, -1:], rq) and np.array_equal(c8.value_scales(0)[:, -1:], rs)


# the largest logit difference (relative to the largest logit) from a float32 cache, per dtype:
# measured 0.007 (int8), 0.09-0.11 (int4 turned by H) and 0.14 (int4 plain) on this model and prompt
STREAM_CLOSE = {("int8", False): 0.05, ("int4", True): 0.25, ("int4", False): 0.25, ("int8/int4", True): 0.25}


@pytest.mark.parametrize("dtype,had", CACHE_KINDS)
@pytest.mark.parametrize("policy", ["sink_query", "shift", "reevaluate"])
def test_decoder_quantized_cache_streams_past_its_window(policy, dtype, had):
    """Every ring policy runs on an int8 / int4 cache past its window, and stays close to the same
    run on a float32 cache (the logits differ by the quantization of K/V only)."""
    m = _model()
    kw = dict(capacity=24, n_keep=4, policy=policy)
    c8, c32 = m.new_cache(dtype=dtype, hadamard=had, **kw), m.new_cache(dtype="float32", **kw)
    toks = [int(t) for t in np.random.default_rng(1).integers(1, 50, 60)]
    a, b = m.prefill(toks[:10], cache=c8), m.prefill(toks[:10], cache=c32)
    worst = 0.0
    for t in toks[10:]:
        a, b = m.step([t], cache=c8)[0], m.step([t], cache=c32)[0]
        worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    assert c8.length() <= 24 and c8.length() == c32.length() and c8.tokens == c32.tokens
    assert 0 < worst < STREAM_CLOSE[dtype, had]


@pytest.mark.parametrize("dtype,had", CACHE_KINDS)
def test_sink_query_never_rewrites_quantized_keys(dtype, had):
    """sink_query rotates the query, never K: the kept rows and scales keep their bits."""
    m = _model()
    c = m.new_cache(capacity=16, n_keep=2, policy="sink_query", dtype=dtype, hadamard=had)
    toks = list(range(1, 17))
    m.prefill(toks, cache=c)
    before = [(np.array(c.keys(l)), np.array(c.key_scales(l))) for l in range(c.n_layers)]
    m.step([3], cache=c)          # drops one window token, writes the new one in its slot
    slot = int(np.flatnonzero([not np.array_equal(c.keys(0)[:, t], before[0][0][:, t]) for t in range(16)])[0])
    for l in range(c.n_layers):
        keep = [t for t in range(16) if t != slot]
        assert np.array_equal(c.keys(l)[:, keep], before[l][0][:, keep])
        assert np.array_equal(c.key_scales(l)[:, keep], before[l][1][:, keep])


@pytest.mark.parametrize("dtype,had", CACHE_KINDS)
@pytest.mark.parametrize("policy", ["shift", "reevaluate", "sink_query"])
def test_quantized_transaction_rollback_restores_bits(policy, dtype, had):
    """A step that fails after the discard rewrote K (shift) or the ring (every policy) leaves the
    int8 / int4 values and scales exactly as they were."""
    m = _model()
    c = m.new_cache(capacity=12, n_keep=2, policy=policy, dtype=dtype, hadamard=had)
    m.prefill(list(range(1, 13)), cache=c)
    snap = [(np.array(c.keys(l, length=12)), np.array(c.key_scales(l, length=12)),
             np.array(c.values(l, length=12)), np.array(c.value_scales(l, length=12))) for l in range(c.n_layers)]
    state = (c.lengths.copy(), c.positions.copy(), c.tokens)
    with pytest.raises(RuntimeError, match="boom"):
        with c.transaction():
            m.step([5], cache=c)
            raise RuntimeError("boom")
    for l in range(c.n_layers):
        got = (c.keys(l, length=12), c.key_scales(l, length=12), c.values(l, length=12), c.value_scales(l, length=12))
        for g, s in zip(got, snap[l]):
            assert np.array_equal(np.asarray(g).view(np.uint8), s.view(np.uint8))
    assert np.array_equal(c.lengths, state[0]) and np.array_equal(c.positions, state[1]) and c.tokens == state[2]


def test_attend_bound_names_a_pair_of_dtypes(rng):
    """attend_bound takes a cache's "K/V" dtype (either order) with the larger tolerance of the two,
    and names a dtype it does not know."""
    q = rng.standard_normal((4, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, 10, 32)).astype(np.float32) for _ in range(2))
    # the values' dtype sets the int16 weights' term (V_SCALE_RATIO): int4 values' is larger
    i8, i4, f16, f32 = (attend_bound(q, k, v, dtype=d) for d in ("int8", "int4", "float16", "float32"))
    assert (i4 > i8).all() and (i8 > f32).all()
    assert np.array_equal(attend_bound(q, k, v, dtype="int8/int4"), i4)
    assert np.array_equal(attend_bound(q, k, v, dtype="int4/int8"), i8)
    assert np.allclose(attend_bound(q, k, v, dtype="float16/int8") - f16, i8 - f32, rtol=1e-9, atol=0)
    with pytest.raises(KVSimdValueError, match="got 'int3/int4'"):
        attend_bound(q, k, v, dtype="int3/int4")
    with pytest.raises(KVSimdValueError, match="N=0"):   # a bare ValueError of NumPy's before
        attend_bound(q, k[:, :0], v[:, :0], dtype="int8")


def _full_ring(dtype, policy, D=64, C=8):
    """A cache of one layer whose sequence fills its ring (C tokens, 2 sinks), as written."""
    c = KVCache(1, 2, D, C, dtype=dtype, n_keep=2, policy=policy)
    k, v = np.random.default_rng(3).standard_normal((2, 2, C, D)).astype(np.float32)
    c.write(0, k, v)
    c.append(0, C, np.arange(C, dtype=np.int64))
    return c


def _cache_state(c, n=None):
    """Everything a caller can see of a cache: bookkeeping, and the K/V (and scales) of the first
    ``n`` slots (default: all) of every layer, as stored."""
    n = c.capacity if n is None else n
    views = [c.keys, c.values] + ([c.key_scales, c.value_scales] if c.dtype not in ("float16", "float32") else [])
    rows = [np.array(f(l, length=n)).tobytes() for l in range(c.n_layers) for f in views]
    return c.lengths.tolist(), c.positions.tolist(), c.tokens, rows


@pytest.mark.parametrize("dtype", ["float16", "int8", "int4", "int8/int4"])
@pytest.mark.parametrize("policy", ["reevaluate", "shift", "sink_query"])
def test_begin_step_checks_its_arguments_before_a_discard(policy, dtype):
    """A begin_step whose window is full refuses a bad scale, softcap, head count, window or RoPE
    spec before its policy discards tokens: the cache keeps every token, position and stored bit
    (the RoPE spec's error names both head dims, not the shift it would have failed in)."""
    from kvsimd.cache import RopeSpec
    D = 64
    good = RopeSpec(10000.0, "gptj", None, D)
    bad = [(dict(rope=RopeSpec(10000.0, "gptj", None, 32)), "rope is for head_dim 32, the cache has 64"),
           (dict(rope=RopeSpec(10000.0, "gptj", None, 128)), "rope is for head_dim 128, the cache has 64"),
           (dict(rope=good, scale=float("nan")), "scale"),
           (dict(rope=good, softcap=-1.0), "softcap"),
           (dict(rope=good, n_heads=3), "3 query heads"),
           (dict(rope=good, windows=[0]), "windows")]
    c = _full_ring(dtype, policy, D)
    before = _cache_state(c)
    for kw, msg in bad:
        with pytest.raises(kvsimd.KVSimdError, match=msg):
            c.begin_step(np.array([1], np.int64), **kw)
        assert _cache_state(c) == before, kw
    p = c.begin_step(np.array([1], np.int64), rope=good)   # and a good call still discards as its policy does
    assert (c.length() < 8) == (policy != "reevaluate") or p.refill


@pytest.mark.parametrize("dtype", ["float16", "int8", "int4", "int8/int4"])
def test_transaction_undoes_shift_range_and_writes_over_committed_tokens(dtype):
    """shift_range, and write() over committed slots, inside a transaction that raises are undone bit for
    bit (the K/V and scales they rewrote); a write past the committed tokens keeps them as it did."""
    c = KVCache(2, 2, 64, 8, dtype=dtype)
    rng = np.random.default_rng(4)
    for l in range(2):
        k, v = rng.standard_normal((2, 2, 6, 64)).astype(np.float32)
        c.write(l, k, v)
    c.commit(6)
    before = _cache_state(c, 6)
    new = rng.standard_normal((2, 2, 3, 64)).astype(np.float32)
    for act in (lambda: c.shift_range(0, 1, 5, 3, 10000.0, "gptj", None),
                lambda: c.write(1, new[0], new[1], start=4),          # slots 4, 5 held, 6 not
                lambda: c.write(0, new[0], new[1], start=0)):
        with pytest.raises(RuntimeError, match="boom"):
            with c.transaction():
                act()
                assert _cache_state(c, 6) != before
                raise RuntimeError("boom")
        assert _cache_state(c, 6) == before


def test_quantize_kv_names_a_dtype_that_is_not_a_string():
    """ops.quantize_kv refuses an array, a NumPy dtype or None as ``dtype`` with a KVSimdTypeError naming it."""
    x = np.zeros((2, 32), np.float32)
    for bad in (np.array(["int8", "int4"]), np.dtype(np.int8), None, 8):
        with pytest.raises(KVSimdTypeError, match="dtype must be 'int8' or 'int4', got"):
            ops.quantize_kv(x, bad)


@pytest.mark.parametrize("dtype", ["float16", "int8", "int8/int4"])
def test_restore_rows_checks_every_array_before_storing_any(dtype):
    """_restore_rows (the rollbacks' and the transformers cache's way back) takes only the tuple
    _saved_rows gives, with each array's dtype and shape, else a KVSimdError and nothing stored:
    float rows are not cast into int8 storage, a short tuple or a wrong width is named."""
    c = KVCache(1, 2, 64, 8, dtype=dtype)
    k, v = np.random.default_rng(5).standard_normal((2, 2, 4, 64)).astype(np.float32)
    c.write(0, k, v)
    c.commit(4)
    rows = c._saved_rows(0, 0, 0, 4)
    before = _cache_state(c)
    bad = [rows[:1], list(rows), (rows[0].astype(np.float32),) + rows[1:], (rows[0][:, :3],) + rows[1:],
           (rows[0][:1],) + rows[1:], rows[:-1] + (rows[-1][..., :1],)]
    for b in bad:
        with pytest.raises(kvsimd.KVSimdError, match="rows"):
            c._restore_rows(0, 0, 0, b)
        assert _cache_state(c) == before
    with pytest.raises(kvsimd.KVSimdError, match="slots 6"):
        c._restore_rows(0, 0, 6, rows)
    c._restore_rows(0, 0, 2, tuple(r[:, :2] for r in rows))     # slots 2, 3 take slots 0, 1's rows
    assert np.array_equal(np.asarray(c.keys(0))[:, 2:4].view(np.uint8), np.asarray(rows[0])[:, :2].view(np.uint8))


# ---------------------------------------------------------------------------- recent rows as computed

@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("dtype,had,rdt", [("int4", True, np.float16), ("int4", False, np.float32),
                                           ("int8", False, np.float16), ("int8/int4", True, np.float32)])
@pytest.mark.parametrize("T,H,Hkv,N,M,D", [(None, 9, 3, 700, 32, 64), (None, 32, 1, 1300, 32, 128),
                                           (None, 4, 2, 5, 1, 80), (6, 8, 2, 40, 32, 64), (40, 9, 3, 50, 16, 64)])
def test_attend_recent_rows_under_one_softmax(isa, rng, dtype, had, rdt, T, H, Hkv, N, M, D):
    """ops.attend(..., recent=(k, v)): quantized rows and M float rows after them under one softmax
    (kv_attend_sources: each part computed on its own, then merged) against float64 attention over
    all N + M keys (the quantized ones as they stand for, read with the query their rule rounds;
    the recent ones with q), within attend_bound; with ALiBi, a window, ranges over the quantized
    rows; 1 and 2 threads (split-K pieces of both parts merged at once), each the same bits on a
    repeat.  Reading the recent rows as another quantized block is far outside the bound."""
    kd_, vd_ = sides(dtype)
    q = rng.standard_normal((H, D) if T is None else (T, H, D)).astype(np.float32)
    x = rng.standard_normal((2, Hkv, N, D)).astype(np.float32)
    x[..., :3] *= 8
    (kq, ks), (vq, vs) = reference.quantize_kv(x[0], kd_, had), reference.quantize_kv(x[1], vd_, had)
    kr, vr = (rng.standard_normal((Hkv, M, D)) * 2).astype(rdt), rng.standard_normal((Hkv, M, D)).astype(rdt)
    kd, vd = reference.dequantize_kv(kq, ks, D), reference.dequantize_kv(vq, vs, D)     # as stored
    turn = (lambda a: reference.hadamard_rows(a, _back=False)) if had else (lambda a: a)
    kr, vr = (turn(a.astype(np.float32)).astype(rdt) for a in (kr, vr))                  # given as stored
    K = np.concatenate([kd, kr.astype(np.float32)], 1).astype(np.float64)                # stored, as read
    V = np.concatenate([vd, vr.astype(np.float32)], 1).astype(np.float64)
    Kf = reference.hadamard_rows(K) if had else K                                        # what they stand for
    Vf = reference.hadamard_rows(V) if had else V
    slopes = (2.0 ** -np.arange(1, H + 1)).astype(np.float32)
    if T is None:
        cases = [{}, dict(alibi_slopes=slopes)]
        if N > 8:
            cases.append(dict(ranges=[(N // 2, N), (0, 4)]))
    else:
        cases = [{}, dict(window=T + 5), dict(alibi_slopes=slopes, causal_offset=N + M - T - 3)]
    tol = ("float16/" if rdt == np.float16 else kd_ + "/") + vd_   # the recent rows' tolerance, the values' weights
    qr = reference.query_as_read(q, (dtype, had))
    for threads in thread_counts():
        for kw in cases:
            with use_isa(isa):
                got = ops.attend(q, kq, vq, k_scale=ks, v_scale=vs, hadamard=had, recent=(kr, vr), **kw)
                again = ops.attend(q, kq, vq, k_scale=ks, v_scale=vs, hadamard=had, recent=(kr, vr), **kw)
            assert np.array_equal(got.view(np.uint32), again.view(np.uint32)), (isa, threads, kw)
            # the reference: main keys (their ranges) read with qr, the recent ones with q (as q_alt)
            main = kw.get("ranges", [(0, N)])
            rkw = {k: v for k, v in kw.items() if k != "ranges"}
            rkw["ranges"] = [(a, b, False) for a, b in main] + [(N, N + M, True)]
            rkw["q_alt"] = q
            if "alibi_slopes" in kw and T is None:
                rkw["ranges"] = [r + (N + M - 1,) for r in rkw["ranges"]]
            ref = reference.attend(qr, Kf, Vf, **rkw)
            bound = attend_bound(qr, K, V, dtype=tol, hadamard=had, **rkw)
            err = np.abs(got.astype(np.float64) - ref) / np.maximum(bound, 1e-300)
            assert err.max() <= 1, f"{isa} {threads} threads {kw}: error {err.max():.3g} x the bound"
            if M >= 16:   # the recent rows read as int4 would be far off
                rq = reference.quantize_kv(Kf[:, N:].astype(np.float32), "int4", had)
                Kq = K.copy()
                Kq[:, N:] = reference.dequantize_kv(*rq, D)
                wrong = reference.attend(qr, reference.hadamard_rows(Kq) if had else Kq, Vf, **rkw)
                # (5: int4 values turned by H spend part of the margin on the int16 weights' term)
                far = 5 if had and vd_ == "int4" else 10
                assert (np.abs(wrong - ref) / np.maximum(bound, 1e-300)).max() > far, (isa, kw)


def test_attend_recent_bad_input(rng):
    """recent: a pair of float16/float32 [Hkv, M, D] arrays of one dtype and shape, M >= 1;
    key_positions then have N + M entries and causal_offset reaches N + M - T; out may not
    overlap them.  A KVSimdError naming the argument, nothing written."""
    H, Hkv, N, M, D = 4, 2, 10, 3, 32
    q = rng.standard_normal((H, D)).astype(np.float32)
    kq, ks = ops.quantize_kv(rng.standard_normal((Hkv, N, D)).astype(np.float32), "int8")
    kr = rng.standard_normal((Hkv, M, D)).astype(np.float32)
    base = dict(k_scale=ks, v_scale=ks)
    for recent, err, words in [((kr,), KVSimdTypeError, "pair"), (kr, KVSimdTypeError, "pair"),
                               ((kr, kr.astype(np.float16)), KVSimdValueError, "one dtype"),
                               ((kr[:1], kr[:1]), KVSimdValueError, "Hkv=2"),
                               ((kr[..., :16].copy(), kr[..., :16].copy()), KVSimdValueError, "D=32"),
                               ((kr[:, :0], kr[:, :0]), KVSimdValueError, "M=0"),
                               ((kr.astype(np.int8), kr.astype(np.int8)), KVSimdTypeError, "recent\\[0\\] must have dtype"),
                               ((kr[:, ::2], kr[:, ::2]), KVSimdValueError, "C-contiguous")]:
        with pytest.raises(err, match=words):
            ops.attend(q, kq, kq, recent=recent, **base)
    slopes = np.ones(H, np.float32)
    with pytest.raises(KVSimdValueError, match="N\\+M=13"):
        ops.attend(q, kq, kq, recent=(kr, kr), alibi_slopes=slopes, key_positions=np.arange(N), **base)
    qt = rng.standard_normal((2, H, D)).astype(np.float32)
    with pytest.raises(KVSimdValueError, match="N\\+M-T=11"):
        ops.attend(qt, kq, kq, recent=(kr, kr), causal_offset=12, **base)
    buf = np.zeros((Hkv, M, D), np.float32)
    with pytest.raises(KVSimdValueError, match="recent"):
        ops.attend(q, kq, kq, recent=(buf, kr), out=buf.reshape(-1, D)[:H], **base)
    assert not buf.any()


def _overlay_reference(q, qr, Kq, Vq, Kr, Vr, off, W, window, ranges):
    """Float64 attention of rows q [T, H, D] (qr: as read over the quantized keys) where key j of
    row t (j <= off + t, in ``ranges``, within ``window``) is read from the float rows Kr/Vr
    (standing for the keys up to the last row's, off + T - M..off + T - 1) when it is one of them
    and j > off + t - W, else from Kq/Vq ([Hkv, N, D]); both given as the values they stand for.
    Returns (out [T, H, D], per-row reference.attend kwargs)."""
    M, N = Kr.shape[1], Kq.shape[1]
    lo = off + q.shape[0] - M
    K = np.concatenate([Kq, Kr], 1)
    V = np.concatenate([Vq, Vr], 1)
    out, kws = [], []
    for t in range(q.shape[0]):
        end = off + t + 1
        first = max(0, end - window) if window else 0
        cut = max(lo, end - W)           # keys at or above it (and >= lo) read as float
        rr = []
        for a, b in ranges:
            a, b = max(a, first), min(b, end)
            if a < min(b, cut):
                rr.append((a, min(b, cut), False))
            fa, fb = max(a, cut), b
            if fa < fb:
                rr.append((N + fa - lo, N + fb - lo, True))
        kw = dict(ranges=rr, q_alt=q[t])
        out.append(reference.attend(qr[t], K, V, **kw))
        kws.append(kw)
    return np.stack(out), kws


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("dtype,had,rdt", [("int4", True, np.float16), ("int4", False, np.float32),
                                           ("int8", False, np.float16), ("int8/int4", True, np.float32)])
@pytest.mark.parametrize("T,H,Hkv,N,M,W,D", [(None, 9, 3, 700, 31, 32, 64), (None, 8, 1, 90, 5, 32, 48),
                                             (6, 8, 2, 40, 32, 32, 64), (40, 9, 3, 50, 32, 8, 64),
                                             (12, 4, 2, 30, 20, 32, 80)])
def test_attend_recent_window_reads_each_rows_last_keys_as_float(isa, rng, dtype, had, rdt, T, H, Hkv, N, M, W, D):
    """ops.attend(..., recent=(k, v), recent_window=W): the M float rows stand for k/v's own last M
    keys, each row reading its last W keys from them (where they hold the key) and older ones
    quantized -- against float64 attention that picks, row by row, the float or the quantized
    version of each key (float keys read with q, quantized ones with the query their rule
    rounds), within attend_bound; with ranges, a window shorter and longer than W, rows before
    the float rows start, 1 and 2 threads, the same bits on a repeat.  Reading every key quantized
    is far outside the bound where int4 keys are replaced."""
    kd_, vd_ = sides(dtype)
    rows = T is not None
    q = rng.standard_normal((T or 1, H, D)).astype(np.float32)
    x = rng.standard_normal((2, Hkv, N, D)).astype(np.float32)
    x[..., :3] *= 8
    (kq, ks), (vq, vs) = reference.quantize_kv(x[0], kd_, had), reference.quantize_kv(x[1], vd_, had)
    kd, vd = reference.dequantize_kv(kq, ks, D), reference.dequantize_kv(vq, vs, D)     # as stored
    Kq, Vq = (reference.hadamard_rows(a) if had else a for a in (kd.astype(np.float64), vd.astype(np.float64)))
    turn = (lambda a: reference.hadamard_rows(a, _back=False)) if had else (lambda a: a)
    if rows:
        cases = [dict(), dict(window=T + 5), dict(window=max(2, W // 2)), dict(causal_offset=N - T - 3)]
    else:
        cases = [dict(), dict(ranges=[(N // 2, N), (0, 4)])]
    tol = ("float16/" if rdt == np.float16 else kd_ + "/") + vd_   # the recent rows' tolerance, the values' weights
    qr = reference.query_as_read(q, (dtype, had))
    for threads in thread_counts():
        for kw in cases:
            off = kw.get("causal_offset", N - q.shape[0])
            hi = off + q.shape[0]          # the float rows of the same tokens: the M keys up to the last row's
            kr, vr = (turn(x[w][:, hi - M:hi]).astype(rdt) for w in (0, 1))          # given as stored
            Kr, Vr = ((reference.hadamard_rows(a.astype(np.float32)) if had else a).astype(np.float64)
                      for a in (kr, vr))                                          # what they stand for
            K = np.concatenate([kd, kr.astype(np.float32)], 1).astype(np.float64)     # stored, as read
            V = np.concatenate([vd, vr.astype(np.float32)], 1).astype(np.float64)
            args = dict(k_scale=ks, v_scale=vs, hadamard=had, recent=(kr, vr), recent_window=W, **kw)
            with use_isa(isa):
                got = ops.attend(q if rows else q[0], kq, vq, **args)
                again = ops.attend(q if rows else q[0], kq, vq, **args)
            assert np.array_equal(got.view(np.uint32), again.view(np.uint32)), (isa, threads, kw)
            got = got.reshape(q.shape)
            ref, rkws = _overlay_reference(q, qr, Kq, Vq, Kr, Vr, off, W, kw.get("window", 0),
                                           kw.get("ranges", [(0, N)]))
            for t in range(q.shape[0]):
                bound = attend_bound(qr[t], K, V, dtype=tol, hadamard=had, **rkws[t])
                err = np.abs(got[t].astype(np.float64) - ref[t]) / np.maximum(bound, 1e-300)
                assert err.max() <= 1, f"{isa} {threads} threads {kw} row {t}: error {err.max():.3g} x the bound"
            if kd_ == "int4" and kw == {}:      # the float rows are read: all-quantized is far off
                wrong, _ = _overlay_reference(q, qr, Kq, Vq, Kq[:, hi - M:hi], Vq[:, hi - M:hi], off, W, 0,
                                              [(0, N)])
                assert (np.abs(wrong - ref)).max() > 100 * np.abs(got - ref).max(), (isa, kw)


def test_attend_recent_window_bad_input(rng):
    """recent_window: an integer >= 1 with recent given, at most N float rows, a causal pass
    without ALiBi or q_alt; a KVSimdError naming it."""
    H, Hkv, N, D = 4, 2, 10, 32
    q = rng.standard_normal((H, D)).astype(np.float32)
    kq, ks = ops.quantize_kv(rng.standard_normal((Hkv, N, D)).astype(np.float32), "int8")
    kr = rng.standard_normal((Hkv, 3, D)).astype(np.float32)
    base = dict(k_scale=ks, v_scale=ks)
    big = rng.standard_normal((Hkv, N + 1, D)).astype(np.float32)
    qt = rng.standard_normal((2, H, D)).astype(np.float32)
    for kw, err, words in [(dict(recent_window=4), KVSimdValueError, "recent=\\(k_recent"),
                           (dict(recent=(kr, kr), recent_window=0), KVSimdValueError, "recent_window"),
                           (dict(recent=(kr, kr), recent_window=1.5), KVSimdTypeError, "recent_window"),
                           (dict(recent=(big, big), recent_window=4), KVSimdValueError, "11 rows"),
                           (dict(recent=(kr, kr), recent_window=4, q=qt, causal_offset=0), KVSimdValueError,
                            "the 2 keys up to"),
                           (dict(recent=(kr, kr), recent_window=4, alibi_slopes=np.ones(H, np.float32)),
                            KVSimdValueError, "alibi_slopes"),
                           (dict(recent=(kr, kr), recent_window=4, q_alt=q, ranges=[(0, N, True)]),
                            KVSimdValueError, "q_alt")]:
        with pytest.raises(err, match=words):
            ops.attend(kw.pop("q", q), kq, kq, **base, **kw)
    with pytest.raises(KVSimdValueError, match="causal=False"):
        ops.attend(qt, kq, kq, recent=(kr, kr), recent_window=4, causal=False, **base)
    with pytest.raises(KVSimdValueError, match="N-T=8"):
        ops.attend(qt, kq, kq, recent=(kr, kr), recent_window=4, causal_offset=9, **base)
