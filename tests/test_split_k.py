"""Split-K attention ("flash decoding", ops.c): a single query row whose KV heads do not divide
evenly among the threads has each head's keys cut into pieces, each with its own softmax, merged
once.  Checked against the float64 reference with the attention bound, on every native row, with
key ranges, q_alt, ALiBi and soft cap; identical for a given thread count; the pieces themselves
on every compiled row (the emulated avx512fp16 one included) through the ``row`` fixture."""
import numpy as np
import pytest

import kvsimd
import kvsimd._kvsimd as ext
from kvsimd import ops, reference
from kvsimd.bounds import attend_bound

from test_attend import assert_within, make


@pytest.fixture
def threads():
    before = kvsimd.get_num_threads()
    yield
    kvsimd.set_num_threads(before)


@pytest.mark.parametrize("H,Hkv,T,keys,nt,pieces", [
    (9, 3, 1, 5000, 2, 2),      # SmolLM2: 3 KV heads on 2 threads -> 6 items
    (32, 1, 1, 5000, 2, 2),     # MQA
    (32, 1, 1, 5000, 4, 4),
    (12, 3, 1, 5000, 4, 4),     # 3 heads on 4 threads: 12 items
    (12, 6, 1, 5000, 4, 2),
    (32, 8, 1, 5000, 2, 1),     # heads divide evenly: no split
    (9, 3, 1, 5000, 1, 1),      # one thread
    (9, 3, 2, 5000, 2, 1),      # several rows: tiles, not key pieces
    (9, 3, 1, 1000, 2, 1),      # pieces under 512 keys: not worth a thread
    (9, 3, 1, 1024, 2, 2),
])
def test_which_calls_split(H, Hkv, T, keys, nt, pieces):
    assert ext._attend_pieces(H, Hkv, 64, T, keys, nt) == pieces


CASES = [
    dict(H=9, Hkv=3, D=64, N=3000, dtype=np.float16),
    dict(H=4, Hkv=1, D=80, N=2501, dtype=np.float32),
    dict(H=32, Hkv=1, D=128, N=2100, dtype=np.float16),   # G = 32: the query-on-lanes path
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "%d-%d-%d-%d" % (c["H"], c["Hkv"], c["D"], c["N"]))
@pytest.mark.parametrize("extra", ["plain", "ranges", "alibi", "softcap"])
def test_split_attention_within_bound(isa, threads, rng, case, extra):
    H, Hkv, D, N = case["H"], case["Hkv"], case["D"], case["N"]
    q, k, v = make(rng, H, Hkv, N, D, case["dtype"], q_scale=2.0)
    kw = {}
    if extra == "ranges":   # a ring's read: sinks with q_alt, a window that wrapped, cuts inside ranges
        kw = dict(ranges=[(0, 4, True, N + 7), (N - 600, N, False, N + 7), (4, 1100, False, N + 7)],
                  q_alt=rng.standard_normal((H, D)).astype(np.float32))
    elif extra == "alibi":
        kw = dict(alibi_slopes=np.geomspace(0.5, 2 ** -8, H).astype(np.float32))
    elif extra == "softcap":
        kw = dict(softcap=5.0)
    keys = sum(r[1] - r[0] for r in kw["ranges"]) if "ranges" in kw else N
    assert ext._attend_pieces(H, Hkv, D, 1, keys, 2) == 2   # the case does split
    kvsimd.set_num_threads(1)
    one = ops.attend(q, k, v, **kw)
    kvsimd.set_num_threads(2)
    two = ops.attend(q, k, v, **kw)
    np.testing.assert_array_equal(ops.attend(q, k, v, **kw), two)   # same count, same bits
    ref = reference.attend(q, k, v, **kw)
    bound = attend_bound(q, k, v, **kw)
    assert_within(two, ref, bound, "%s, 2 threads" % isa)
    assert_within(one, ref, bound, "%s, 1 thread" % isa)


def test_split_cache_decode_within_bound(isa, threads, rng):
    """KVCache.attend (a decode step) on 2 threads splits SmolLM2's 3 KV heads' keys."""
    H, Hkv, D, N = 9, 3, 64, 2600
    c = kvsimd.KVCache(1, Hkv, D, 3000, batch=2)
    k = rng.standard_normal((Hkv, N, D)).astype(np.float32)
    v = rng.standard_normal((Hkv, N, D)).astype(np.float32)
    c.write(0, k, v, seq=1)
    c.commit(N, seq=1)
    q = rng.standard_normal((H, D)).astype(np.float32)
    kvsimd.set_num_threads(2)
    out = c.attend(0, q, seq=1)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    assert_within(out, reference.attend(q, k16, v16), attend_bound(q, k16, v16), isa)


def test_nan_query_gives_nan_through_the_merge(threads, rng):
    q, k, v = make(rng, 9, 3, 3000, 64, np.float16)
    q[4, 7] = np.nan
    kvsimd.set_num_threads(2)
    out = ops.attend(q, k, v)
    assert np.isnan(out[4]).all()
    assert np.isfinite(np.delete(out, 4, axis=0)).all()


@pytest.fixture(scope="module")
def emulated():
    """The avx512fp16 row in the emulator, on every machine: the native rows' pieces run through
    ops.attend above; this is where the emulated row's are checked."""
    if ext._sanitized():   # as the row fixture: a sanitized object calls the sanitizer runtime
        pytest.skip("a sanitized build's avx512fp16 object calls the sanitizer runtime: not runnable in the emulator")
    import emulator
    from conftest import EmulatedRow
    return EmulatedRow("avx512fp16", emulator.shared_guest(ext.__file__))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_pieces_in_the_emulator(emulated, rng, dtype):
    """The kernel's pieces (part_lo/part_hi/part_ml): cuts inside and across ranges, a piece with
    no key (max -inf, sum 0, zeros); merged here in float64 they equal the reference."""
    H, Hkv, D, N = 6, 2, 40, 300
    q, k, v = make(rng, H, Hkv, N, D, dtype)
    q_alt = rng.standard_normal((H, D)).astype(np.float32)
    ranges = [(0, 4, True, N), (150, N, False, N), (4, 100, False, N)]   # 250 keys end to end
    cuts = [(0, 3), (3, 77), (77, 77), (77, 250)]
    outs, mls = zip(*(emulated.attend(q, k, v, ranges=ranges, q_alt=q_alt, part=c) for c in cuts))
    ml = np.array(mls, np.float64)[:, 0]           # [pieces, H, 2]
    assert (ml[2, :, 0] == -np.inf).all() and (ml[2, :, 1] == 0).all() and not outs[2].any()
    m = ml[:, :, 0].max(axis=0)
    w = np.where(ml[:, :, 1] > 0, np.exp(ml[:, :, 0] - m), 0.0)
    merged = np.einsum("sh,shd->hd", w, np.array(outs, np.float64)) / (w * ml[:, :, 1]).sum(axis=0)[:, None]
    kw = dict(ranges=ranges, q_alt=q_alt)
    assert_within(merged, reference.attend(q, k, v, **kw), attend_bound(q, k, v, **kw), "avx512fp16 (emulated)")
