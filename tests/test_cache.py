"""KVCache: C-owned storage, zero-copy read-only views, write/commit, capacity errors."""
import numpy as np
import pytest

import kvsimd
from kvsimd import KVCache, KVSimdCapacityError, ops


def filled(rng, dtype="float16", batch=2, capacity=50):
    c = KVCache(3, 2, 16, capacity, batch=batch, dtype=dtype)
    k = rng.standard_normal((2, 20, 16)).astype(np.float32)
    v = rng.standard_normal((2, 20, 16)).astype(np.float32)
    c.write(1, k, v, seq=1)
    c.commit(20, seq=1)
    return c, k, v


def test_layout_views_and_nbytes(rng):
    c, k, v = filled(rng)
    assert c.nbytes == 3 * 2 * 2 * 2 * 50 * 16 * 2
    assert c.lengths.tolist() == [0, 20]
    kv = c.keys(1, 1)
    assert kv.shape == (2, 20, 16) and kv.dtype == np.float16
    np.testing.assert_array_equal(kv, k.astype(np.float16))
    np.testing.assert_array_equal(c.values(1, 1), v.astype(np.float16))
    assert not kv.flags.writeable
    with pytest.raises(ValueError):
        kv[0, 0, 0] = 1
    assert kv.ctypes.data % 64 == 0                        # each block starts 64-byte aligned
    assert kv.strides == (50 * 16 * 2, 16 * 2, 2)          # a head's slots are contiguous
    # zero-copy: a later write shows through an earlier view
    more = np.ones((2, 1, 16), np.float32)
    c.write(1, more, more, seq=1)
    c.commit(1, seq=1)
    assert kv.base is not None and c.keys(1, 1)[0, 20, 0] == 1
    assert c.keys(0, 0).shape == (2, 0, 16)


def test_float32_cache_and_attend_in_place(rng):
    c, k, v = filled(rng, dtype="float32")
    np.testing.assert_array_equal(c.keys(1, 1), k)
    q = rng.standard_normal((6, 16)).astype(np.float32)
    np.testing.assert_array_equal(c.attend(1, q, seq=1), ops.attend(q, k, v))
    c16, k, v = filled(np.random.default_rng(5))
    np.testing.assert_array_equal(c16.attend(1, q, seq=1), ops.attend(q, k.astype(np.float16), v.astype(np.float16)))


def test_overflow_raises_and_changes_nothing(rng):
    c, k, v = filled(rng, capacity=25)
    before = c.keys(1, 1).copy()
    big = np.zeros((2, 6, 16), np.float32)
    with pytest.raises(KVSimdCapacityError, match="exceed capacity 25"):
        c.write(1, big, big, seq=1)
    with pytest.raises(KVSimdCapacityError, match="cannot commit 6"):
        c.commit(6, seq=1)
    assert c.lengths.tolist() == [0, 20]
    np.testing.assert_array_equal(c.keys(1, 1), before)


def test_reset(rng):
    c, _, _ = filled(rng)
    c.write(0, np.zeros((2, 3, 16), np.float32), np.zeros((2, 3, 16), np.float32), seq=0)
    c.commit(3, seq=0)
    c.reset(1)
    assert c.lengths.tolist() == [3, 0]
    c.reset()
    assert c.lengths.tolist() == [0, 0]


@pytest.mark.parametrize("args, kwargs, msg", [
    ((0, 2, 16, 10), {}, "n_layers must be >= 1"),
    ((1, 2, 600, 10), {}, "head_dim must be in 1..512, got 600"),
    ((1, 2, 16, 10), {"dtype": "int16"}, "dtype must be float16, float32, int8, int4 or"),
    ((1, 2, 16, 0), {}, "capacity must be in 1..16777216, got 0"),
])
def test_bad_construction(args, kwargs, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        KVCache(*args, **kwargs)


def test_bad_calls(rng):
    c, _, _ = filled(rng)
    z = np.zeros((2, 1, 16), np.float32)
    with pytest.raises(ValueError, match="layer must be in 0..2"):
        c.keys(3)
    with pytest.raises(ValueError, match="seq must be in 0..1"):
        c.write(0, z, z, seq=2)
    with pytest.raises(ValueError, match="start must be >= 0.*got -1"):
        c.write(0, z, z, start=-1)
    with pytest.raises(ValueError, match=r"k and v must be \[2, T, 16\]"):
        c.write(0, np.zeros((3, 1, 16), np.float32), np.zeros((3, 1, 16), np.float32))
    with pytest.raises(TypeError, match="k must have dtype float32"):
        c.write(0, z.astype(np.float16), z)
    with pytest.raises(ValueError, match="attention needs 1..50 cached tokens"):
        c.attend(0, np.zeros((2, 16), np.float32), seq=0)
    with pytest.raises(ValueError, match="q must be"):
        c.attend(1, np.zeros((3, 16), np.float32), seq=1)


def test_memory_is_freed():
    import gc
    c = KVCache(1, 1, 8, 4)
    view = c.keys(0, 0, length=4)
    del c
    gc.collect()
    assert view.base is not None  # the view keeps the cache alive: reading it is safe
    assert view.sum() == 0
    assert isinstance(repr(kvsimd.KVCache(1, 1, 8, 4)), str)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("mode", ["rope", "sink_query", "alibi"])
def test_step_attend_matches_the_separate_ops(rng, dtype, mode):
    """The fused decode-step call equals rope + write + attend done one by one (float64 reference)."""
    from kvsimd import reference as ref
    H, Hkv, D, C, B = 6, 2, 16, 40, 2
    c = KVCache(2, Hkv, D, C, batch=B, dtype=dtype)
    lens = [30, 17]
    kp = np.zeros((B, C), np.int64)          # the positions ALiBi reads (a ring's bookkeeping)
    for b, n in enumerate(lens):
        c.write(1, rng.standard_normal((Hkv, n, D)).astype(np.float32),
                rng.standard_normal((Hkv, n, D)).astype(np.float32), seq=b)
        c.commit(n, seq=b)
        kp[b, :n] = np.arange(n) + 5 * b
    qkv = rng.standard_normal((B, (H + 2 * Hkv) * D)).astype(np.float32)
    slots = np.array(lens, np.int64)
    kpos = np.array([lens[0] + 100, lens[1] + 7], np.int64)
    spos = kpos - (40 if mode == "sink_query" else 0)
    ranges = [[(True, 0, 3, int(spos[b])), (False, 3, lens[b] + 1, int(kpos[b]))] for b in range(B)]
    rope = None if mode == "alibi" else (1e4, "neox", 12)
    slopes = np.linspace(0.1, 0.6, H).astype(np.float32) if mode == "alibi" else None
    if mode == "alibi":
        for b in range(B):
            kp[b, slots[b]] = kpos[b]
    out = np.empty((B, H * D), np.float32)
    c.step_attend(1, qkv.copy(), out, slots, kpos, spos, ranges, rope=rope, alibi_slopes=slopes, key_positions=kp)
    for b in range(B):
        q = qkv[b, :H * D].reshape(H, D).astype(np.float64)
        k = qkv[b, H * D:(H + Hkv) * D].reshape(Hkv, 1, D).astype(np.float64)
        v = qkv[b, (H + Hkv) * D:].reshape(Hkv, 1, D)
        qs = q.copy()
        if rope:
            qs = ref.apply_rope(q[:, None], np.array([spos[b]]), theta=1e4, style="neox", rotary_dim=12)[:, 0]
            q = ref.apply_rope(q[:, None], np.array([kpos[b]]), theta=1e4, style="neox", rotary_dim=12)[:, 0]
            k = ref.apply_rope(k, np.array([kpos[b]]), theta=1e4, style="neox", rotary_dim=12)
        kc = c.keys(1, b, length=lens[b] + 1).astype(np.float64)
        vc = c.values(1, b, length=lens[b] + 1).astype(np.float64)
        np.testing.assert_allclose(kc[:, -1:], k.astype(c.dtype), rtol=1e-3 if dtype == "float16" else 1e-6, atol=1e-3)
        np.testing.assert_array_equal(c.values(1, b, length=lens[b] + 1)[:, -1:], v.astype(c.dtype))
        # expected: one softmax over the sinks (seen by qs) and the rest (seen by q)
        G = H // Hkv
        s = np.empty((H, lens[b] + 1))
        for h in range(H):
            s[h, :3] = kc[h // G, :3] @ qs[h] / np.sqrt(D)
            s[h, 3:] = kc[h // G, 3:] @ q[h] / np.sqrt(D)
            if slopes is not None:
                qp = np.where(np.arange(lens[b] + 1) < 3, spos[b], kpos[b])
                s[h] -= slopes[h] * (qp - kp[b, :lens[b] + 1])
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        want = np.stack([p[h] @ vc[h // G] for h in range(H)]).reshape(-1)
        np.testing.assert_allclose(out[b], want, rtol=1e-4, atol=1e-4)


def test_step_attend_bad_input_changes_nothing(rng):
    c = KVCache(1, 2, 8, 10, dtype="float32")
    c.write(0, np.ones((2, 4, 8), np.float32), np.ones((2, 4, 8), np.float32))
    c.commit(4)
    before = c.keys(0, length=10).copy()
    qkv = np.zeros((1, 8 * 8), np.float32)
    out = np.empty((1, 32), np.float32)
    one = np.array([4], np.int64)
    ok = [[(False, 0, 5, 4)]]
    with pytest.raises(ValueError, match="qkv"):
        c.step_attend(0, qkv[:, :-8], out, one, one, one, ok)
    with pytest.raises(KVSimdCapacityError, match="slots"):
        c.step_attend(0, qkv, out, np.array([10], np.int64), one, one, ok)
    with pytest.raises(ValueError, match="key range"):
        c.step_attend(0, qkv, out, one, one, one, [[(False, 0, 11, 4)]])
    with pytest.raises(ValueError, match="empty"):
        c.step_attend(0, qkv, out, one, one, one, [[(False, 3, 3, 4)]])
    with pytest.raises(TypeError, match="kpos"):
        c.step_attend(0, qkv, out, one, one.astype(np.int32), one, ok)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        c.step_attend(0, qkv, out, one, one, one, ok, rope=(1e4, "neox", 7))
    np.testing.assert_array_equal(c.keys(0, length=10), before)
