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
