"""Thread control: attention kernels split across KV heads with OpenMP; BLAS (NumPy's matrix
products) limited through threadpoolctl."""
import os

from kvsimd import _kvsimd
from kvsimd.errors import KVSimdValueError

_blas_limit = None


def set_num_threads(n):
    """Use ``n`` threads: for kvsimd's attention kernels (split by KV head, so results are
    bit-identical for any ``n``) and for the BLAS library behind NumPy's matrix products."""
    global _blas_limit
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KVSimdValueError("set_num_threads needs a positive integer, got %r" % (n,))
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
    if v:
        try:
            n = int(v)
        except ValueError:
            raise KVSimdValueError("KVSIMD_NUM_THREADS must be a positive integer, got %r" % v) from None
        set_num_threads(n)
