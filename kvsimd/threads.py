"""Thread control: attention kernels split across KV heads with OpenMP; BLAS (NumPy's matrix
products) limited through threadpoolctl."""
import operator
import os

from kvsimd import _kvsimd
from kvsimd.errors import KVSimdValueError

# The largest thread count set_num_threads and KVSIMD_NUM_THREADS accept.  Each kernel thread
# gets its own scratch block for every attend call, so an absurd count would mean an absurd
# allocation; no CPU this library targets runs more hardware threads than this.
MAX_THREADS = 1024

_blas_limit = None


def check_thread_count(n, what="set_num_threads(n)"):
    """``n`` as an int if it is an integer in 1..MAX_THREADS; else KVSimdValueError naming
    ``what`` and the value.  (Integers of any kind: Python ints and NumPy integers, not bools.)"""
    try:
        if isinstance(n, bool):
            raise TypeError
        v = operator.index(n)
    except TypeError:
        raise KVSimdValueError("%s needs a positive integer from 1 to %d, got %r" % (what, MAX_THREADS, n)) from None
    if not 1 <= v <= MAX_THREADS:
        raise KVSimdValueError("%s needs a positive integer from 1 to %d (kvsimd.threads.MAX_THREADS), got %d"
                               % (what, MAX_THREADS, v))
    return v


def set_num_threads(n):
    """Use ``n`` threads (1 to MAX_THREADS = 1024): for kvsimd's attention kernels (split by KV
    head, so results are bit-identical for any ``n``) and for the BLAS library behind NumPy's
    matrix products.  A bad ``n`` raises KVSimdValueError and changes nothing."""
    global _blas_limit
    n = check_thread_count(n)
    _kvsimd._set_kernel_threads(n)
    try:
        from threadpoolctl import threadpool_limits
        _blas_limit = threadpool_limits(limits=n, user_api="blas")
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency
        pass


def available_cores():
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow),
    not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def get_num_threads():
    return _kvsimd._get_kernel_threads()


def _init_from_env():
    v = os.environ.get("KVSIMD_NUM_THREADS")
    if v is None or not v.strip():
        return
    try:
        n = int(v.strip())
    except ValueError:
        raise KVSimdValueError("KVSIMD_NUM_THREADS needs a positive integer from 1 to %d, got %r"
                               % (MAX_THREADS, v)) from None
    set_num_threads(check_thread_count(n, "KVSIMD_NUM_THREADS"))
