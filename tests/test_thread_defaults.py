"""Thread counts: the accepted range (1..MAX_THREADS) for set_num_threads and KVSIMD_NUM_THREADS,
and the default chosen at import from the cores this process may use."""
import os
import subprocess
import sys

import numpy as np
import pytest

import kvsimd
from kvsimd import threads as kthreads


@pytest.fixture
def restore_threads():
    before = kvsimd.get_num_threads()
    yield
    kvsimd.set_num_threads(before)


def test_max_threads_is_documented_1024():
    assert kthreads.MAX_THREADS == 1024
    assert "1024" in kvsimd.set_num_threads.__doc__


@pytest.mark.parametrize("bad", [2**31, 10**7, 1025, 2**64, -2**31, 0])
def test_too_many_or_too_few_threads_rejected_naming_the_value(restore_threads, bad):
    kvsimd.set_num_threads(2)
    with pytest.raises(kvsimd.KVSimdValueError, match=r"1 to 1024.*got %d" % bad):
        kvsimd.set_num_threads(bad)
    assert kvsimd.get_num_threads() == 2      # a refused count changes nothing


@pytest.mark.parametrize("bad", [1.0, "2", None, True, np.float64(2)])
def test_non_integers_rejected(bad):
    with pytest.raises(kvsimd.KVSimdValueError, match="got %s" % repr(bad).replace("(", r"\(").replace(")", r"\)")):
        kvsimd.set_num_threads(bad)


def test_numpy_integers_and_the_maximum_accepted(restore_threads):
    kvsimd.set_num_threads(np.int64(2))
    assert kvsimd.get_num_threads() == 2
    kvsimd.set_num_threads(kthreads.MAX_THREADS)
    assert kvsimd.get_num_threads() == kthreads.MAX_THREADS


def _import_with(env_value):
    env = dict(os.environ, KVSIMD_NUM_THREADS=env_value)
    return subprocess.run([sys.executable, "-c", "import kvsimd; print(kvsimd.get_num_threads())"],
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("bad", ["2147483648", "10000000", "1025", "0", "-3", "two", "1.5"])
def test_env_var_out_of_range_fails_the_import_naming_it(bad):
    r = _import_with(bad)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvsimd.errors.KVSimdValueError: KVSIMD_NUM_THREADS") and bad in last, r.stderr[-2000:]


def test_env_var_maximum_and_blank_accepted():
    r = _import_with("1024")
    assert r.returncode == 0 and r.stdout.strip() == "1024", r.stderr[-2000:]
    r = _import_with(" ")
    assert r.returncode == 0, r.stderr[-2000:]


def _threads_after_import(cpus=None, **env):
    """(kernel threads, default kernel threads, ({BLAS library: threads} before importing kvsimd, after it,
    inside a kvsimd step's blas_scope)) in a fresh interpreter, restricted to ``cpus``."""
    code = ("import os, sys\n"
            "cpus = %r\n"
            "if cpus is not None: os.sched_setaffinity(0, cpus)\n"
            "import numpy, threadpoolctl\n"
            "def blas(): return {i['internal_api']: i['num_threads'] for i in threadpoolctl.threadpool_info() if i['user_api'] == 'blas'}\n"
            "before = blas()\n"
            "import kvsimd\n"
            "after = blas()\n"
            "with kvsimd.threads.blas_scope(): inside = blas()\n"
            "assert blas() == after\n"
            "print(kvsimd.get_num_threads(), kvsimd.threads.default_num_threads(), (before, after, inside))\n" % (cpus,))
    clean = {k: v for k, v in os.environ.items() if k not in kthreads.BLAS_ENV_VARS + ("KVSIMD_NUM_THREADS",)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(clean, **env), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    kernel, default, blas = r.stdout.split(" ", 2)
    return int(kernel), int(default), eval(blas)


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the machine gives this process one CPU")


@needs_two_cpus
def test_default_kernel_threads_follow_the_cpus_this_process_may_use():
    cpus = sorted(os.sched_getaffinity(0))
    assert _threads_after_import({cpus[0]})[:2] == (1, 1)
    assert _threads_after_import(set(cpus[:2]))[:2] == (2, 2)
    assert _threads_after_import()[:2] == (min(len(cpus), kthreads.DEFAULT_MAX_THREADS),) * 2


def test_default_blas_is_one_thread_unless_the_user_sized_it():
    """BLAS threads sharing a busy core stall every matrix product of a step (see
    kvsimd.threads): inside kvsimd's steps the default is one BLAS thread; a BLAS variable the
    user set wins.  Importing kvsimd never changes the host program's own BLAS threads."""
    _, _, (before, after, inside) = _threads_after_import()
    assert before and after == before and set(inside.values()) == {1}, (before, after, inside)
    _, _, (before, after, inside) = _threads_after_import(OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2",
                                                          MKL_NUM_THREADS="2")
    assert set(before.values()) == {2} and after == inside == before, (before, after, inside)


def test_env_var_sets_kernel_and_blas_threads():
    kernel, _, (before, after, inside) = _threads_after_import(KVSIMD_NUM_THREADS="2")
    assert kernel == 2 and after == before and set(inside.values()) == {2}, (before, after, inside)


def test_use_default_threads_restores_the_default(restore_threads):
    kvsimd.set_num_threads(3)
    kthreads.use_default_threads()
    assert kvsimd.get_num_threads() == kthreads.default_num_threads() == min(kthreads.available_cores(),
                                                                              kthreads.DEFAULT_MAX_THREADS)


def test_decoder_steps_run_inside_the_blas_scope(monkeypatch):
    """prefill and step enter kvsimd.threads.blas_scope (the only place BLAS is sized for kvsimd)."""
    import contextlib

    from test_streaming import random_decoder
    entered = []

    @contextlib.contextmanager
    def scope():
        entered.append(1)
        yield

    monkeypatch.setattr(kthreads, "blas_scope", scope)
    dec = random_decoder()
    cache = dec.new_cache(capacity=16)
    dec.prefill([1, 2, 3], cache=cache)
    dec.step([4], cache=cache)
    assert len(entered) == 2
