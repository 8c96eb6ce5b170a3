"""Threads: attention split across KV heads and row tiles gives bit-identical results for any thread
count (a single row whose heads do not divide among the threads is split along its keys: test_split_k.py)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import kvsimd
from kvsimd import ops


@pytest.fixture
def threads():
    before = kvsimd.get_num_threads()
    yield
    kvsimd.set_num_threads(before)


@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128), (4, 1, 80), (16, 16, 32)])
def test_one_and_two_threads_identical(isa, threads, rng, shape):
    H, Hkv, D = shape
    q = rng.standard_normal((H, D)).astype(np.float32)
    k = rng.standard_normal((Hkv, 777, D)).astype(np.float16)
    v = rng.standard_normal((Hkv, 777, D)).astype(np.float16)
    kvsimd.set_num_threads(1)
    a = ops.attend(q, k, v)
    kvsimd.set_num_threads(2)
    assert kvsimd.get_num_threads() == 2
    np.testing.assert_array_equal(ops.attend(q, k, v), a)


def test_cache_attention_identical_across_threads(threads, rng):
    c = kvsimd.KVCache(1, 4, 64, 300, batch=2)
    k = rng.standard_normal((4, 250, 64)).astype(np.float32)
    c.write(0, k, -k, seq=1)
    c.commit(250, seq=1)
    q = rng.standard_normal((12, 64)).astype(np.float32)
    kvsimd.set_num_threads(1)
    a = c.attend(0, q, seq=1)
    kvsimd.set_num_threads(2)
    np.testing.assert_array_equal(c.attend(0, q, seq=1), a)


def test_env_var_sets_threads():
    env = dict(os.environ, KVSIMD_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", "import kvsimd; print(kvsimd.get_num_threads())"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_thread_counts(bad):
    with pytest.raises(ValueError, match="positive integer"):
        kvsimd.set_num_threads(bad)
