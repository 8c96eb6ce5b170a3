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
    ((1, 2, 600, 10), {}, "head_dim must be <= 512"),
    ((1, 2, 16, 10), {"dtype": "int8"}, "dtype must be float16 or float32"),
    ((1, 2, 16, 0), {}, "capacity must be >= 1"),
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
