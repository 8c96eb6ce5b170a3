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


FORK_CHILD = r"""
import multiprocessing as mp, sys
import kvsimd
from kvsimd.errors import KVSimdValueError
from kvsimd.testing import random_decoder
m = random_decoder(64, 32, 2, 4, 2, 8, 48, seed=0)
kvsimd.set_num_threads(2)
want = m.forward(list(range(64)) * 5)          # the kernels' OpenMP threads have run
def child(q):
    got = m.forward(list(range(64)) * 5)
    try:
        kvsimd.set_num_threads(2)
        refused = ""
    except KVSimdValueError as e:
        refused = str(e)
    q.put((kvsimd.get_num_threads(), bool((got == want).all()), refused))
if __name__ == "__main__":
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=child, args=(q,))
    p.start()
    p.join(60)
    if p.exitcode is None:
        p.kill()
        sys.exit("the forked child hung")
    print(q.get(timeout=5))
"""


def test_a_child_forked_after_the_threads_ran_runs_on_one_thread(tmp_path):
    """GNU OpenMP cannot start threads in a child forked after a parallel region ran: the child
    (os.register_at_fork) runs its kernels on one thread and gives the parent's results (bit for
    bit: any thread count does), and set_num_threads(2) there is refused, naming why.  Without
    the handler the child hung in its first forward."""
    script = tmp_path / "fork_child.py"
    script.write_text(FORK_CHILD)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, KVSIMD_NUM_THREADS="2"))
    assert p.returncode == 0, p.stderr[-3000:]
    n, same, refused = eval(p.stdout.strip().splitlines()[-1])
    assert n == 1 and same and "forked after kvsimd's kernels ran on several threads" in refused


def test_blas_scopes_on_several_threads_restore_the_hosts_count():
    """blas_scope entered by two threads and left in entry order (the first to enter leaves
    first) leaves the host's BLAS thread count as it was, not at kvsimd's limit."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from kvsimd import threads as kt
    counts = lambda: [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]  # noqa: E731
    saved = kt.blas_threads()
    try:
        with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
            host = counts()
            kt._limit_blas(1)
            a, b = kt.blas_scope(), kt.blas_scope()
            a.__enter__()
            b.__enter__()
            assert all(c == 1 for c in counts())
            a.__exit__(None, None, None)
            assert all(c == 1 for c in counts())       # b is still inside
            b.__exit__(None, None, None)
            assert counts() == host
    finally:
        kt._limit_blas(saved)
