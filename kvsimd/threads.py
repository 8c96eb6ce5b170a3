"""Thread control: attention kernels split across KV heads with OpenMP; BLAS (NumPy's matrix
products) limited through threadpoolctl, only inside kvsimd's own prefill and decode steps
(:func:`blas_scope`): importing or using kvsimd never changes the thread count of the host
program's own matrix products.

The default, applied at import unless ``KVSIMD_NUM_THREADS`` says otherwise (measured with
``python -m kvsimd.bench decode --contention``): the attention kernels use every core this process
may use (up to ``DEFAULT_MAX_THREADS``), and BLAS one thread inside kvsimd's steps.  OpenMP threads wait passively (see
``kvsimd/__init__.py``), so a busy neighbour core costs them little; BLAS threads that share a
busy core stall every matrix-vector product of a step: a SmolLM2-shaped decode step with 2 BLAS
threads ran 2-8x slower than with 1 beside one spinning process on a 2-core machine.  An
explicit BLAS thread variable (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ...) is respected:
kvsimd then leaves BLAS alone."""
import contextlib
import operator
import os
import threading

from kvsimd import _kvsimd
from kvsimd.errors import KVSimdValueError

# The largest thread count set_num_threads and KVSIMD_NUM_THREADS accept (the C core's
# KV_MAX_THREADS).  Each kernel thread gets its own scratch block for every attend call, so an
# absurd count would mean an absurd allocation.
MAX_THREADS = _kvsimd.MAX_THREADS

# The default kernel thread count never exceeds this: each thread has its own attend scratch,
# and a decode step has few KV heads to share out.
DEFAULT_MAX_THREADS = 8
# Variables through which a user sizes the BLAS thread pool; when one is set, the default leaves BLAS alone.
BLAS_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                 "GOTO_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")

_blas_threads = None   # BLAS threads inside kvsimd's steps (None: leave BLAS alone)
_controller = None
_scope_lock = threading.Lock()   # blas_scope: one process-wide limit, however many threads are inside
_scope_depth = 0                 # ... how many are
_scope_limit = None              # ... and the threadpoolctl limit that restores the host's counts
_fork_single = False             # forked after kernel threads ran: one kernel thread (see _after_fork_in_child)


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


def _limit_blas(n):
    """BLAS threads inside kvsimd's steps from now on (None: leave BLAS as it is)."""
    global _blas_threads
    _blas_threads = n


def blas_threads():
    """BLAS threads kvsimd's prefill and decode steps run with (None: whatever BLAS has)."""
    return _blas_threads


@contextlib.contextmanager
def blas_scope():
    """Limit BLAS to :func:`blas_threads` for the duration of one kvsimd call, then restore it
    (about 7 us).  The limit is process-wide while it lasts: host threads running matrix
    products at the same moment share it.  Calls on several threads at once share one limit,
    set by the first to enter and lifted by the last to leave, so the host's own count is what
    is restored (nested threadpoolctl scopes, one per thread, restored it in entry order, and a
    thread leaving last put back the limited count for good)."""
    global _controller, _scope_depth, _scope_limit
    n = _blas_threads
    if n is None:
        yield
        return
    with _scope_lock:
        if _scope_depth == 0:
            if _controller is None:
                from threadpoolctl import ThreadpoolController
                _controller = ThreadpoolController()   # the BLAS libraries loaded now (NumPy's)
            _scope_limit = _controller.limit(limits=n, user_api="blas")
        _scope_depth += 1
    try:
        yield
    finally:
        with _scope_lock:
            _scope_depth -= 1
            if _scope_depth == 0:
                limit, _scope_limit = _scope_limit, None
                limit.restore_original_limits()


def _after_fork_in_child():
    """os.register_at_fork: in a child forked after kvsimd's kernels ran on several threads, GNU
    OpenMP's thread pool belongs to the parent and a parallel region would wait for it forever,
    so the child runs its kernels on one thread (set_num_threads refuses more).  The scope state
    starts afresh: threads inside blas_scope at the fork do not exist in the child."""
    global _scope_lock, _scope_depth, _scope_limit, _fork_single
    _scope_lock, _scope_depth, _scope_limit = threading.Lock(), 0, None
    if _kvsimd._threads_started():
        _fork_single = True
        _kvsimd._set_kernel_threads(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _need_unforked(n, what):
    if n > 1 and _fork_single:
        raise KVSimdValueError("%s=%d: this process was forked after kvsimd's kernels ran on several threads, and "
                               "GNU OpenMP cannot start threads in such a child: it runs on 1 (start the child with "
                               "the 'spawn' or 'forkserver' method, or before kvsimd runs, for more)" % (what, n))


def set_num_threads(n):
    """Use ``n`` threads (1 to MAX_THREADS = 1024): for kvsimd's attention kernels (split by KV
    head, so results are bit-identical for any ``n``; a single query row whose KV heads do not
    divide among the ``n`` threads is split along its keys too, identical for a given ``n`` and
    within the attention bound otherwise) and for the BLAS library behind NumPy's
    matrix products inside kvsimd's prefill and decode steps (the host's own products keep
    their thread count).  A bad ``n`` raises KVSimdValueError and changes nothing, as does
    ``n`` > 1 in a child forked after the kernels ran on several threads (_after_fork_in_child)."""
    n = check_thread_count(n)
    _need_unforked(n, "set_num_threads(n)")
    _kvsimd._set_kernel_threads(n)
    _limit_blas(n)


def default_num_threads():
    """The kernel thread count kvsimd uses unless told otherwise: the cores this process may
    use, at most DEFAULT_MAX_THREADS."""
    return min(available_cores(), DEFAULT_MAX_THREADS)


def use_default_threads():
    """Back to the default (as at import without KVSIMD_NUM_THREADS): default_num_threads()
    kernel threads and one BLAS thread inside kvsimd's steps, unless a BLAS thread variable is
    set in the environment (then BLAS is left as the user sized it)."""
    _kvsimd._set_kernel_threads(1 if _fork_single else default_num_threads())
    _limit_blas(None if any(os.environ.get(v, "").strip() for v in BLAS_ENV_VARS) else 1)


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
        use_default_threads()
        return
    try:
        n = int(v.strip())
    except ValueError:
        raise KVSimdValueError("KVSIMD_NUM_THREADS needs a positive integer from 1 to %d, got %r"
                               % (MAX_THREADS, v)) from None
    set_num_threads(check_thread_count(n, "KVSIMD_NUM_THREADS"))
