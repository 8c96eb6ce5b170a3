# kvsimd.ops: kernels over NumPy arrays.  Everything is validated here, with the GIL, before
# any kernel runs without it; kernels themselves never check anything.
import itertools as _itertools
import math as _math
import time as _time

import numpy as _np

from kvsimd.errors import KVSimdMemoryError, KVSimdPositionError, KVSimdTypeError, KVSimdValueError

_F16 = _np.dtype(_np.float16)
_F32 = _np.dtype(_np.float32)
_I64 = _np.dtype(_np.int64)
_KV_DTYPES = (_F16, _F32)
_STYLES = {"gptj": KV_ROPE_GPTJ, "neox": KV_ROPE_NEOX}
_I64_MIN, _I64_MAX = -2 ** 63, 2 ** 63 - 1
_MAX_EXACT_POS = 2 ** 53  # positions and deltas: exact in double, and qpos - kpos cannot overflow int64
_FLT_MAX = 3.4028234663852886e38
_MIN_THETA = 1e-200       # every angle |position| * theta**-1 stays finite
_MAX_HEADS = 1 << 16      # query heads per attention call (bounds workspace sizes)


cdef inline void *_ptr(cnp.ndarray a) noexcept:
    return cnp.PyArray_DATA(a)


# ---------------------------------------------------------------------------------------------
# The boundary checks: one function per concept, used by every entry point (ops.*, KVCache.*).

def _need_array(a, str name, dtypes, int ndim, str dims, bint writeable=False, shape=None):
    """Check type (no masked arrays), dtype (None: any), rank (-1: any), shape, contiguity,
    alignment and, for a buffer kvsimd writes, writability; return the array."""
    if not isinstance(a, _np.ndarray):
        raise KVSimdTypeError("%s must be a numpy.ndarray, got %s" % (name, type(a).__name__))
    if isinstance(a, _np.ma.MaskedArray):
        raise KVSimdTypeError("%s is a numpy.ma.MaskedArray: kvsimd would ignore its mask; pass "
                              "%s.filled(...) or the data you mean" % (name, name))
    if dtypes is not None and a.dtype not in dtypes:
        raise KVSimdTypeError("%s must have dtype %s, got %s"
                              % (name, " or ".join(str(d) for d in dtypes), a.dtype))
    if ndim >= 0 and a.ndim != ndim:
        raise KVSimdValueError("%s must be %d-D %s, got shape %s" % (name, ndim, dims, a.shape))
    if shape is not None and a.shape != tuple(shape):
        raise KVSimdValueError("%s must have shape %s, got %s" % (name, tuple(shape), a.shape))
    if not a.flags.c_contiguous:
        raise KVSimdValueError("%s must be C-contiguous (shape %s, strides %s); use numpy.ascontiguousarray"
                               % (name, a.shape, a.strides))
    if not a.flags.aligned:
        raise KVSimdValueError("%s is not aligned to its %d-byte elements" % (name, a.itemsize))
    if writeable and not a.flags.writeable:
        raise KVSimdValueError("%s is read-only, but the operation writes it in place" % name)
    return a


cdef inline size_t _addr(cnp.ndarray a) noexcept:
    return <size_t>cnp.PyArray_DATA(a)


def _need_no_overlap(out, str oname, inputs):
    """Refuse an output (a validated, C-contiguous array) whose bytes overlap any input of the
    call: ``inputs`` lists (name, array or None) or (name, (start address, nbytes))."""
    cdef size_t o0 = _addr(out), o1 = o0 + <size_t>out.nbytes, i0, i1
    if o1 == o0:
        return
    for name, a in inputs:
        if a is None:
            continue
        if isinstance(a, tuple):
            i0, i1 = a[0], a[0] + a[1]
        else:
            i0 = _addr(a)
            i1 = i0 + <size_t>a.nbytes
        if i0 < o1 and o0 < i1:
            raise KVSimdValueError("%s overlaps %s (bytes %#x..%#x and %#x..%#x): an output must not share memory "
                                   "with any input" % (oname, name, o0, o1, i0, i1))


def _as_int(x, str name):
    if isinstance(x, (bool, _np.bool_)) or not isinstance(x, (int, _np.integer)):
        raise KVSimdTypeError("%s must be an integer, got %r" % (name, x))
    return int(x)


def _need_int(x, str name, lo=_I64_MIN, hi=_I64_MAX):
    """The one conversion of an integer argument: an int (not a bool), in lo..hi (by default
    the int64 range C takes), else a KVSimdTypeError/KVSimdValueError naming it."""
    x = _as_int(x, name)
    if not lo <= x <= hi:
        if hi == _I64_MAX:
            raise KVSimdValueError("%s must be >= %d (and < 2**63), got %d" % (name, lo, x))
        raise KVSimdValueError("%s must be in %d..%d, got %d" % (name, lo, hi, x))
    return x


def _need_real(x, str name):
    """A real number (int or float, not a bool or a string) as a Python float."""
    if isinstance(x, (bool, _np.bool_)) or not isinstance(x, (int, float, _np.integer, _np.floating)):
        raise KVSimdTypeError("%s must be a real number, got %r" % (name, x))
    try:
        return float(x)
    except OverflowError:
        raise KVSimdValueError("%s=%r does not fit a double" % (name, x)) from None


def _need_flag(x, str name):
    if isinstance(x, (bool, _np.bool_)) or (isinstance(x, (int, _np.integer)) and x in (0, 1)):
        return bool(x)
    raise KVSimdTypeError("%s must be a bool, got %r" % (name, x))


def _need_pos(x, str name):
    """A token position or position delta: an integer within +-2**53 (exact in double precision,
    and a difference of two cannot overflow int64)."""
    x = _as_int(x, name)
    if not -_MAX_EXACT_POS <= x <= _MAX_EXACT_POS:
        raise KVSimdPositionError("%s must be within +-2**53 to stay exact in double precision, got %d" % (name, x))
    return x


def _need_positions(a, str name, int64_t n, str nname="N"):
    """int64 [n] positions, each within +-2**53 (see _need_pos)."""
    _need_array(a, name, (_I64,), 1, "[%s]" % nname)
    if a.shape[0] != n:
        raise KVSimdValueError("%s must have %s=%d entries, got %d" % (name, nname, n, a.shape[0]))
    if n and (a.min() < -_MAX_EXACT_POS or a.max() > _MAX_EXACT_POS):
        raise KVSimdPositionError("%s must be within +-2**53 to stay exact in double precision, got min %d max %d"
                                  % (name, a.min(), a.max()))
    return a


def _need_scale(scale, int64_t D):
    """The attention scale: default 1/sqrt(D); else a finite real that float32 can hold."""
    if scale is None:
        return 1.0 / _math.sqrt(D)
    s = _need_real(scale, "scale")
    if not (_math.isfinite(s) and abs(s) <= _FLT_MAX):
        raise KVSimdValueError("scale must be finite and within float32 range (|scale| <= %r), got %r"
                               % (_FLT_MAX, s))
    return s


def _need_slopes(a, int64_t H):
    """ALiBi slopes: float32 [H], finite."""
    _need_array(a, "alibi_slopes", (_F32,), 1, "[H]")
    if a.shape[0] != H:
        raise KVSimdValueError("alibi_slopes must have H=%d entries, got %d" % (H, a.shape[0]))
    if not _np.isfinite(a).all():
        raise KVSimdValueError("alibi_slopes must be finite, got %s" % (a.tolist(),))
    return a


def _need_head_dim(int64_t D, str name="head_dim"):
    if not 1 <= D <= KV_MAX_HEAD_DIM:
        raise KVSimdValueError("%s must be in 1..%d, got %d" % (name, KV_MAX_HEAD_DIM, D))


def _rope_params(theta, style, rotary_dim, int64_t D):
    """RoPE parameters for rows of head_dim D: (theta, kv_rope_style, rotary_dim), validated."""
    if not isinstance(style, str) or style not in _STYLES:
        raise KVSimdValueError("style must be 'gptj' or 'neox', got %r" % (style,))
    th = _need_real(theta, "theta")
    if not (th >= _MIN_THETA and _math.isfinite(th)):
        raise KVSimdValueError("theta must be a positive finite number (at least %g), got %r" % (_MIN_THETA, th))
    if D > KV_MAX_HEAD_DIM:
        raise KVSimdValueError("head_dim (last axis) is %d; at most %d is supported" % (D, KV_MAX_HEAD_DIM))
    rd = D if rotary_dim is None else _need_int(rotary_dim, "rotary_dim")
    if rd <= 0 or rd % 2 or rd > D:
        raise KVSimdValueError("rotary_dim must be even and in 2..head_dim=%d, got %d" % (D, rd))
    return th, _STYLES[style], rd


def _key_ranges(ranges, int64_t N, qpos, bint alt_first):
    """Key ranges, one rule for every path: a non-empty sequence of non-empty, non-overlapping
    integer ranges within 0..N, each with a query position within +-2**53.  Items are
    ``(t0, t1[, use_q_alt[, query_position]])`` (ops.attend; default query position ``qpos``) or,
    with ``alt_first``, ``(use_q_alt, t0, t1, query_position)`` (KVCache.step_plan).
    Returns a list of (use_q_alt, t0, t1, query_position) in the given order."""
    form = "(use_q_alt, t0, t1, query_position)" if alt_first else "(t0, t1[, use_q_alt[, query_position]])"
    if isinstance(ranges, (str, bytes)):
        raise KVSimdTypeError("ranges must be a sequence of %s tuples, got %r" % (form, ranges))
    try:   # non-empty and non-overlapping: at most N ranges of at most 4 items (bounds an endless iterable)
        items = [tuple(_itertools.islice(r, 5)) for r in _itertools.islice(iter(ranges), N + 1)]
    except TypeError:
        raise KVSimdTypeError("ranges must be a sequence of %s tuples, got %r" % (form, ranges)) from None
    if not items:
        raise KVSimdValueError("ranges is empty: attention needs at least one key")
    if len(items) > N:
        raise KVSimdValueError("ranges has more than N=%d ranges: they cannot all be non-empty and disjoint" % N)
    rows = []
    for i, r in enumerate(items):
        if alt_first:
            if len(r) != 4:
                raise KVSimdValueError("range %d must be %s, got %r" % (i, form, r))
            alt, t0, t1, qp = r
        else:
            if not 2 <= len(r) <= 4:
                raise KVSimdValueError("range %d must be %s, got %r" % (i, form, r))
            t0, t1 = r[0], r[1]
            alt = r[2] if len(r) > 2 else False
            qp = r[3] if len(r) > 3 else qpos
        t0, t1 = _need_int(t0, "t0"), _need_int(t1, "t1")
        if not 0 <= t0 < t1 <= N:
            raise KVSimdValueError("key range %d: keys %d..%d must be non-empty and within 0..%d" % (i, t0, t1, N))
        rows.append((_need_flag(alt, "use_q_alt"), t0, t1, _need_pos(qp, "query_position")))
    srt = sorted(rows, key=lambda r: r[1])
    for a, b in zip(srt, srt[1:]):
        if b[1] < a[2]:
            raise KVSimdValueError("key ranges overlap: %d..%d and %d..%d" % (a[1], a[2], b[1], b[2]))
    return rows


def _threads_now():
    """The kernel thread count for one call, read once (see kv_attend in kvsimd.h)."""
    return kv_get_num_threads()


def _workspace(int64_t H, int64_t Hkv, int64_t D, int nt):
    """Scratch for one kv_attend call with ``nt`` threads (plus 64 bytes to align it)."""
    cdef size_t n = kv_attend_workspace_bytes(H, Hkv, D, nt)
    if n == 0:
        raise KVSimdValueError("attention with H=%d query heads, Hkv=%d KV heads, head_dim=%d: sizes out of range"
                               % (H, Hkv, D))
    try:
        return _np.empty(n + 64, dtype=_np.uint8)
    except MemoryError:
        raise KVSimdMemoryError("attention with H=%d query heads, Hkv=%d KV heads, head_dim=%d and %d threads needs "
                                "%d bytes of scratch: cannot allocate them" % (H, Hkv, D, nt, n + 64)) from None


cdef inline void *_aligned64(cnp.ndarray ws) noexcept:
    return <void *>((<size_t>cnp.PyArray_DATA(ws) + 63) & ~(<size_t>63))


def attend(q, k, v, *, scale=None, alibi_slopes=None, key_positions=None, query_position=None, out=None,
           ranges=None, q_alt=None):
    """Single-query attention over a KV cache: ``out[h] = softmax(scale * k[g] @ q[h] + bias) @ v[g]``.

    q: float32 ``[H, D]``; k, v: float16 or float32 ``[Hkv, N, D]`` (same dtype); H a multiple of
    Hkv (GQA/MQA: query head h uses KV head ``h // (H // Hkv)``).  ``scale`` defaults to
    ``1/sqrt(D)``.  ALiBi: with ``alibi_slopes`` (float32 ``[H]``) the score of head h and key j
    gets ``- alibi_slopes[h] * (query_position - key_positions[j])``; ``key_positions`` (int64
    ``[N]``) defaults to ``0..N-1`` and ``query_position`` to ``N-1``.  One pass over K/V, online
    softmax, fp32 accumulation.  Returns float32 ``[H, D]`` (``out`` if given).

    Several key ranges under one softmax (a ring cache with attention sinks): ``ranges`` lists
    ``(t0, t1)``, ``(t0, t1, use_q_alt)`` or ``(t0, t1, use_q_alt, query_position)`` tuples,
    non-empty and non-overlapping; only those keys are read, a range with ``use_q_alt`` is
    scored with ``q_alt`` (float32 ``[H, D]``, e.g. the query rotated at another position) and
    its ALiBi distances use its own ``query_position``.  One kernel call for all ranges."""
    cdef kv_attn_params p
    cdef kv_attn_range whole
    memset(&p, 0, sizeof(p))
    _need_array(q, "q", (_F32,), 2, "[H, D]")
    _need_array(k, "k", _KV_DTYPES, 3, "[Hkv, N, D]")
    _need_array(v, "v", _KV_DTYPES, 3, "[Hkv, N, D]")
    if k.dtype != v.dtype:
        raise KVSimdTypeError("k and v must have the same dtype, got %s and %s" % (k.dtype, v.dtype))
    if k.shape != v.shape:
        raise KVSimdValueError("k and v must have the same shape, got %s and %s" % (k.shape, v.shape))
    cdef int64_t H = q.shape[0], D = q.shape[1], Hkv = k.shape[0], N = k.shape[1]
    if k.shape[2] != D:
        raise KVSimdValueError("head_dim mismatch: q is %s but k/v are %s" % (q.shape, k.shape))
    _need_head_dim(D)
    if Hkv < 1 or H < 1 or H % Hkv:
        raise KVSimdValueError("query heads H=%d must be a positive multiple of KV heads Hkv=%d" % (H, Hkv))
    if N < 1:
        raise KVSimdValueError("the cache is empty (N=0): attention needs at least one key")
    if N > KV_MAX_TOKENS:
        raise KVSimdValueError("N=%d tokens exceeds the supported maximum %d" % (N, KV_MAX_TOKENS))
    cdef float sc = _need_scale(scale, D)
    cdef const float *alibi = NULL
    cdef const int64_t *kpos = NULL
    cdef int64_t qpos = N - 1
    if alibi_slopes is None:
        if key_positions is not None or query_position is not None:
            raise KVSimdValueError("key_positions and query_position only apply with alibi_slopes")
    else:
        alibi = <const float *>_ptr(_need_slopes(alibi_slopes, H))
        if key_positions is not None:
            kpos = <const int64_t *>_ptr(_need_positions(key_positions, "key_positions", N))
        if query_position is not None:
            qpos = _need_pos(query_position, "query_position")
    if q_alt is not None:
        _need_array(q_alt, "q_alt", (_F32,), 2, "[H, D]", shape=q.shape)
        p.q_alt = <const float *>_ptr(q_alt)
    if out is None:
        out = _np.empty((H, D), dtype=_np.float32)
    else:
        _need_array(out, "out", (_F32,), 2, "[H, D]", writeable=True, shape=(H, D))
        _need_no_overlap(out, "out", (("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes),
                                      ("key_positions", key_positions), ("q_alt", q_alt)))
    rng = None
    if ranges is not None:
        rng = _np.array(_key_ranges(ranges, N, qpos, False), dtype=_np.int64).reshape(-1, 4)
        if q_alt is None and rng[:, 0].any():
            raise KVSimdValueError("range %d uses q_alt, but q_alt was not given" % int(_np.argmax(rng[:, 0])))
        p.ranges = <const kv_attn_range *>_ptr(rng)
        p.n_ranges = rng.shape[0]
    elif q_alt is not None:
        raise KVSimdValueError("q_alt is only used by ranges that ask for it (ranges=...)")
    else:
        whole.query, whole.t0, whole.t1, whole.query_pos = 0, 0, N, qpos
        p.ranges = &whole
        p.n_ranges = 1
    cdef int nt = _threads_now()
    ws = _workspace(H, Hkv, D, nt)
    cdef void *wsp = _aligned64(ws)
    p.q = <const float *>_ptr(q)
    p.k = _ptr(k)
    p.v = _ptr(v)
    p.out = <float *>_ptr(out)
    p.alibi = alibi
    p.key_pos = kpos
    p.H, p.Hkv, p.D = H, Hkv, D
    p.n_total = N
    p.scale = sc
    p.dtype = KV_F16 if k.dtype == _F16 else KV_F32
    with nogil:
        kv_attend(&p, wsp, nt)
    return out


def apply_rope(x, positions, *, theta=10000.0, style="gptj", rotary_dim=None):
    """Rotate ``x`` (float32 or float16 ``[H, N, D]``) in place by RoPE at ``positions`` (int64 ``[N]``).

    ``style="gptj"`` pairs ``(x[2i], x[2i+1])``; ``style="neox"`` pairs ``(x[i], x[i + rotary_dim/2])``.
    Only the first ``rotary_dim`` dims (even, default D) rotate; pair i turns by
    ``position * theta ** (-2i / rotary_dim)``, the angle computed in double precision from the
    integer position.  fp16 results are rounded as :func:`kvsimd.bounds.rope_bound` states (once on
    the scalar and avx2 rows, each component twice on avx512fp16)."""
    _need_array(x, "x", _KV_DTYPES, 3, "[H, N, D]", writeable=True)
    cdef int64_t H = x.shape[0], N = x.shape[1], D = x.shape[2]
    if N == 0 or H == 0 or D == 0:
        raise KVSimdValueError("x is empty (shape %s)" % (x.shape,))
    _need_positions(positions, "positions", N)
    _need_no_overlap(x, "x", (("positions", positions),))
    theta, st, rd = _rope_params(theta, style, rotary_dim, D)
    cdef double th = theta
    cdef kv_rope_style cst = st
    cdef int64_t crd = rd
    cdef kv_dtype dt = KV_F16 if x.dtype == _F16 else KV_F32
    cdef void *xp = _ptr(x)
    cdef const int64_t *pp = <const int64_t *>_ptr(positions)
    cdef kv_status s
    with nogil:
        s = kv_apply_rope(xp, dt, H, N, D, pp, th, cst, crd)
    if s != KV_OK:
        raise KVSimdValueError("apply_rope: bad arguments (status %d)" % s)


def shift_keys(k, delta, *, theta=10000.0, style="gptj", rotary_dim=None, start=0, stop=None):
    """Rotate an already-RoPE'd cache ``k`` (float16 or float32 ``[Hkv, N, D]``) in place, as if
    tokens ``start..stop-1`` had moved by the integer ``delta`` positions (negative after a discard).

    Same pairing and frequencies as :func:`apply_rope`; the angle comes from the integer delta in
    double precision and each call adds at most one :func:`kvsimd.bounds.rope_bound` of rounding, so ``apply_rope`` at p then
    ``shift_keys(delta)`` equals ``apply_rope`` at ``p + delta`` up to rounding."""
    _need_array(k, "k", _KV_DTYPES, 3, "[Hkv, N, D]", writeable=True)
    cdef int64_t H = k.shape[0], N = k.shape[1], D = k.shape[2]
    if N == 0 or H == 0 or D == 0:
        raise KVSimdValueError("k is empty (shape %s)" % (k.shape,))
    theta, st, rd = _rope_params(theta, style, rotary_dim, D)
    d = _need_pos(delta, "delta")
    t0 = _need_int(start, "start")
    t1 = N if stop is None else _need_int(stop, "stop")
    if not (0 <= t0 <= t1 <= N):
        raise KVSimdPositionError("need 0 <= start <= stop <= N=%d, got start=%d stop=%d" % (N, t0, t1))
    cdef double th = theta
    cdef kv_rope_style cst = st
    cdef int64_t crd = rd, cd = d, c0 = t0, c1 = t1
    cdef kv_dtype dt = KV_F16 if k.dtype == _F16 else KV_F32
    cdef void *kp = _ptr(k)
    cdef kv_status s
    with nogil:
        s = kv_shift_keys(kp, dt, H, N, D, cd, th, cst, crd, c0, c1)
    if s != KV_OK:
        raise KVSimdValueError("shift_keys: bad arguments (status %d)" % s)


def _convert_out(x, out, dtype):
    if out is None:
        return _np.empty(x.shape, dtype=dtype)
    _need_array(out, "out", (dtype,), -1, "", writeable=True, shape=x.shape)
    _need_no_overlap(out, "out", (("x", x),))
    return out


def to_float16(x, out=None):
    """float32 -> float16, round to nearest even; bit-identical to ``x.astype(numpy.float16)``."""
    _need_array(x, "x", (_F32,), -1, "")
    out = _convert_out(x, out, _F16)
    cdef uint16_t *d = <uint16_t *>_ptr(out)
    cdef const float *s = <const float *>_ptr(x)
    cdef size_t n = x.size
    with nogil:
        kv_f32_to_f16(d, s, n)
    return out


def to_float32(x, out=None):
    """float16 -> float32, exact; bit-identical to ``x.astype(numpy.float32)``."""
    _need_array(x, "x", (_F16,), -1, "")
    out = _convert_out(x, out, _F32)
    cdef float *d = <float *>_ptr(out)
    cdef const uint16_t *s = <const uint16_t *>_ptr(x)
    cdef size_t n = x.size
    with nogil:
        kv_f16_to_f32(d, s, n)
    return out


def _bench_read(buf):
    """Stream-read ``buf`` once (benchmark roofline); returns a checksum."""
    _need_array(buf, "buf", None, -1, "")
    cdef const void *p = _ptr(buf)
    cdef size_t n = buf.nbytes
    cdef uint64_t r
    with nogil:
        r = kv_bench_read(p, n)
    return r


def _bench_copy(dst, src):
    """Copy ``src`` into ``dst`` with plain loads and stores (benchmark roofline)."""
    _need_array(src, "src", None, -1, "")
    _need_array(dst, "dst", None, -1, "", writeable=True)
    _need_no_overlap(dst, "dst", (("src", src),))
    cdef void *d = _ptr(dst)
    cdef const void *s = _ptr(src)
    cdef size_t n = min(dst.nbytes, src.nbytes)
    with nogil:
        kv_bench_copy(d, s, n)


_BENCH_OPS = {"read": KV_BENCH_READ, "write": KV_BENCH_WRITE, "copy": KV_BENCH_COPY}


def _bench_mem(op, dst, src, threads=1):
    """Stream ``op`` ("read" src, "write" dst, "copy" src to dst) over the whole buffer, split
    across ``threads`` OpenMP threads (benchmark roofline)."""
    if not isinstance(op, str) or op not in _BENCH_OPS:
        raise KVSimdValueError("op must be one of %s, got %r" % (", ".join(_BENCH_OPS), op))
    cdef int o = _BENCH_OPS[op]
    _need_array(src, "src", None, -1, "")
    _need_array(dst, "dst", None, -1, "", writeable=op != "read")
    if op == "copy":
        _need_no_overlap(dst, "dst", (("src", src),))
    cdef int nt = _need_int(threads, "threads", 1, KV_MAX_THREADS)
    cdef void *d = _ptr(dst)
    cdef const void *s = _ptr(src)
    cdef size_t n = min(dst.nbytes, src.nbytes)
    cdef uint64_t r
    with nogil:
        r = kv_bench_run(o, d, s, n, nt)
    return r


def _fma_peak(isa, iters):
    """(flops, seconds) of ``iters`` rounds of the fp32 multiply-add probe on ISA row ``isa``."""
    cdef const kv_kernels *row = NULL
    for i in range(kv_isa_count()):
        if isinstance(isa, str) and kv_isa_name(i).decode() == isa and kv_isa_supported(i):
            row = kv_isa_row(i)
    if row == NULL:
        raise KVSimdValueError("ISA %r is not supported here" % (isa,))
    cdef int64_t n = _need_int(iters, "iters", 0, 2 ** 40)
    cdef float sink
    cdef uint64_t flops
    t0 = _time.perf_counter()
    with nogil:
        flops = row.fma_peak(n, &sink)
    return flops, _time.perf_counter() - t0


def _attn_workspace_bytes(H, Hkv, D):
    """Bytes of scratch the attention kernel needs (for tests driving kernels directly)."""
    cdef int64_t h = _need_int(H, "H", 1), g = _need_int(Hkv, "Hkv", 1), d = _need_int(D, "D", 1, KV_MAX_HEAD_DIM)
    if h % g:
        raise KVSimdValueError("H=%d must be a multiple of Hkv=%d" % (h, g))
    cdef size_t n = kv_attn_workspace_bytes(h, g, d)
    if n == 0:
        raise KVSimdValueError("H=%d query heads: the workspace size does not fit a size_t" % h)
    return n


def _rope_table(units, theta, R, rotary_dim):
    """The (cos, sin) float32 pairs ops.c hands the rotation kernel for ``units`` positions."""
    u = _need_real(units, "units")
    if not _math.isfinite(u):
        raise KVSimdValueError("units must be finite, got %r" % (u,))
    cdef int64_t rd = _need_int(rotary_dim, "rotary_dim", 2, KV_MAX_HEAD_DIM)
    th, _, rd = _rope_params(theta, "gptj", rd, KV_MAX_HEAD_DIM)
    cdef int64_t r = _need_int(R, "R", 0, rd // 2)
    cs = _np.empty(2 * r, dtype=_np.float32)
    kv_rope_table(<float *>_ptr(cs), u, th, r, rd)
    return cs
