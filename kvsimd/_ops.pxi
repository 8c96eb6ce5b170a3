# kvsimd.ops: kernels over NumPy arrays.  Everything is validated here, with the GIL, before
# any kernel runs without it; kernels themselves never check anything.
import math as _math
import time as _time

import numpy as _np

from kvsimd.errors import KVSimdPositionError, KVSimdTypeError, KVSimdValueError

_F16 = _np.dtype(_np.float16)
_F32 = _np.dtype(_np.float32)
_I64 = _np.dtype(_np.int64)
_KV_DTYPES = (_F16, _F32)
_STYLES = {"gptj": KV_ROPE_GPTJ, "neox": KV_ROPE_NEOX}
_MAX_EXACT_POS = 2 ** 53  # integers beyond this are not exact in double precision


cdef inline void *_ptr(cnp.ndarray a) noexcept:
    return cnp.PyArray_DATA(a)


def _need_array(a, str name, dtypes, int ndim, str dims, bint writeable=False):
    """Check type, dtype, rank, contiguity and alignment; return the array."""
    if not isinstance(a, _np.ndarray):
        raise KVSimdTypeError("%s must be a numpy.ndarray, got %s" % (name, type(a).__name__))
    if a.dtype not in dtypes:
        raise KVSimdTypeError("%s must have dtype %s, got %s"
                              % (name, " or ".join(str(d) for d in dtypes), a.dtype))
    if ndim >= 0 and a.ndim != ndim:
        raise KVSimdValueError("%s must be %d-D %s, got shape %s" % (name, ndim, dims, a.shape))
    if not a.flags.c_contiguous:
        raise KVSimdValueError("%s must be C-contiguous (shape %s, strides %s); use numpy.ascontiguousarray"
                               % (name, a.shape, a.strides))
    if not a.flags.aligned:
        raise KVSimdValueError("%s is not aligned to its %d-byte elements" % (name, a.itemsize))
    if writeable and not a.flags.writeable:
        raise KVSimdValueError("%s is read-only, but the operation writes it in place" % name)
    return a


def _need_int(x, str name):
    if isinstance(x, (bool, _np.bool_)) or not isinstance(x, (int, _np.integer)):
        raise KVSimdTypeError("%s must be an integer, got %r" % (name, x))
    return int(x)


def _rope_args(x, theta, style, rotary_dim):
    cdef int64_t D = x.shape[2]
    if style not in _STYLES:
        raise KVSimdValueError("style must be 'gptj' or 'neox', got %r" % (style,))
    theta = float(theta)
    if not (theta > 0.0 and _math.isfinite(theta)):
        raise KVSimdValueError("theta must be a positive finite number, got %r" % (theta,))
    if D > KV_MAX_HEAD_DIM:
        raise KVSimdValueError("head_dim (last axis) is %d; at most %d is supported" % (D, KV_MAX_HEAD_DIM))
    rd = D if rotary_dim is None else _need_int(rotary_dim, "rotary_dim")
    if rd <= 0 or rd % 2 or rd > D:
        raise KVSimdValueError("rotary_dim must be even and in 2..head_dim=%d, got %d" % (D, rd))
    return theta, _STYLES[style], rd


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
    if D < 1 or D > KV_MAX_HEAD_DIM:
        raise KVSimdValueError("head_dim must be in 1..%d, got %d" % (KV_MAX_HEAD_DIM, D))
    if Hkv < 1 or H < 1 or H % Hkv:
        raise KVSimdValueError("query heads H=%d must be a positive multiple of KV heads Hkv=%d" % (H, Hkv))
    if N < 1:
        raise KVSimdValueError("the cache is empty (N=0): attention needs at least one key")
    if N > KV_MAX_TOKENS:
        raise KVSimdValueError("N=%d tokens exceeds the supported maximum %d" % (N, KV_MAX_TOKENS))
    if scale is None:
        scale = 1.0 / _math.sqrt(D)
    scale = float(scale)
    if not _math.isfinite(scale):
        raise KVSimdValueError("scale must be finite, got %r" % (scale,))
    cdef const float *alibi = NULL
    cdef const int64_t *kpos = NULL
    cdef int64_t qpos = N - 1
    if alibi_slopes is None:
        if key_positions is not None or query_position is not None:
            raise KVSimdValueError("key_positions and query_position only apply with alibi_slopes")
    else:
        _need_array(alibi_slopes, "alibi_slopes", (_F32,), 1, "[H]")
        if alibi_slopes.shape[0] != H:
            raise KVSimdValueError("alibi_slopes must have H=%d entries, got %d" % (H, alibi_slopes.shape[0]))
        alibi = <const float *>_ptr(alibi_slopes)
        if key_positions is not None:
            _need_array(key_positions, "key_positions", (_I64,), 1, "[N]")
            if key_positions.shape[0] != N:
                raise KVSimdValueError("key_positions must have N=%d entries, got %d" % (N, key_positions.shape[0]))
            kpos = <const int64_t *>_ptr(key_positions)
        if query_position is not None:
            qpos = _need_int(query_position, "query_position")
    if out is None:
        out = _np.empty((H, D), dtype=_np.float32)
    else:
        _need_array(out, "out", (_F32,), 2, "[H, D]", writeable=True)
        if out.shape != (H, D):
            raise KVSimdValueError("out must have shape %s, got %s" % ((H, D), out.shape))
        for name, a in (("q", q), ("k", k), ("v", v)):
            if _np.may_share_memory(out, a):
                raise KVSimdValueError("out overlaps %s" % name)
    if q_alt is not None:
        _need_array(q_alt, "q_alt", (_F32,), 2, "[H, D]")
        if q_alt.shape != q.shape:
            raise KVSimdValueError("q_alt must have the shape of q %s, got %s" % (q.shape, q_alt.shape))
        p.q_alt = <const float *>_ptr(q_alt)
    rng = None
    if ranges is not None:
        rng = _attend_ranges(ranges, N, qpos, q_alt is not None)
        p.ranges = <const kv_attn_range *>_ptr(rng)
        p.n_ranges = rng.shape[0]
    elif q_alt is not None:
        raise KVSimdValueError("q_alt is only used by ranges that ask for it (ranges=...)")
    ml = _np.empty(2 * H, dtype=_np.float32)
    ws = _np.empty(kv_attend_workspace_bytes(H, Hkv, D), dtype=_np.uint8)
    cdef size_t wsp = (<size_t>_ptr(ws) + 63) & ~(<size_t>63)
    p.q = <const float *>_ptr(q)
    p.k = _ptr(k)
    p.v = _ptr(v)
    p.out = <float *>_ptr(out)
    p.m = <float *>_ptr(ml)
    p.l = p.m + H
    p.alibi = alibi
    p.key_pos = kpos
    p.query_pos = qpos
    p.H, p.Hkv, p.D = H, Hkv, D
    p.n_total, p.t0, p.t1 = N, 0, N
    p.g0, p.g1 = 0, Hkv
    p.scale = scale
    p.dtype = KV_F16 if k.dtype == _F16 else KV_F32
    p.init, p.finalize = 1, 1
    with nogil:
        kv_attend(&p, <void *>wsp)
    return out


def _attend_ranges(ranges, int64_t N, int64_t qpos, bint have_alt):
    """int64 [n, 4] rows (use q_alt, t0, t1, query position) of kv_attn_range, validated."""
    try:
        items = [tuple(r) for r in ranges]
    except TypeError:
        raise KVSimdValueError("ranges must be a sequence of (t0, t1[, use_q_alt[, query_position]]) tuples") from None
    if not items:
        raise KVSimdValueError("ranges is empty: attention needs at least one key")
    rng = _np.empty((len(items), 4), dtype=_np.int64)
    for i, r in enumerate(items):
        if not 2 <= len(r) <= 4:
            raise KVSimdValueError("range %d must be (t0, t1[, use_q_alt[, query_position]]), got %r" % (i, r))
        t0, t1 = _need_int(r[0], "t0"), _need_int(r[1], "t1")
        if not 0 <= t0 < t1 <= N:
            raise KVSimdValueError("range %d: keys %d..%d must be non-empty and within 0..%d" % (i, t0, t1, N))
        alt = bool(r[2]) if len(r) > 2 else False
        if alt and not have_alt:
            raise KVSimdValueError("range %d uses q_alt, but q_alt was not given" % i)
        rng[i] = (1 if alt else 0, t0, t1, _need_int(r[3], "query_position") if len(r) > 3 else qpos)
    order = _np.argsort(rng[:, 1], kind="stable")
    if (rng[order[1:], 1] < rng[order[:-1], 2]).any():
        raise KVSimdValueError("ranges overlap: %s" % [(int(a), int(b)) for a, b in rng[:, 1:3]])
    return rng


def apply_rope(x, positions, *, theta=10000.0, style="gptj", rotary_dim=None):
    """Rotate ``x`` (float32 or float16 ``[H, N, D]``) in place by RoPE at ``positions`` (int64 ``[N]``).

    ``style="gptj"`` pairs ``(x[2i], x[2i+1])``; ``style="neox"`` pairs ``(x[i], x[i + rotary_dim/2])``.
    Only the first ``rotary_dim`` dims (even, default D) rotate; pair i turns by
    ``position * theta ** (-2i / rotary_dim)``, the angle computed in double precision from the
    integer position.  fp16 values are rounded once."""
    _need_array(x, "x", _KV_DTYPES, 3, "[H, N, D]", writeable=True)
    _need_array(positions, "positions", (_I64,), 1, "[N]")
    cdef int64_t H = x.shape[0], N = x.shape[1], D = x.shape[2]
    if positions.shape[0] != N:
        raise KVSimdValueError("positions must have N=%d entries (x is %s), got %d" % (N, x.shape, positions.shape[0]))
    if N == 0 or H == 0 or D == 0:
        raise KVSimdValueError("x is empty (shape %s)" % (x.shape,))
    theta, st, rd = _rope_args(x, theta, style, rotary_dim)
    if N and int(_np.abs(positions).max()) > _MAX_EXACT_POS:
        raise KVSimdPositionError("positions must be within +-2**53 to stay exact in double precision")
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
    double precision and each element is rounded once per call, so ``apply_rope`` at p then
    ``shift_keys(delta)`` equals ``apply_rope`` at ``p + delta`` up to rounding."""
    _need_array(k, "k", _KV_DTYPES, 3, "[Hkv, N, D]", writeable=True)
    cdef int64_t H = k.shape[0], N = k.shape[1], D = k.shape[2]
    if N == 0 or H == 0 or D == 0:
        raise KVSimdValueError("k is empty (shape %s)" % (k.shape,))
    theta, st, rd = _rope_args(k, theta, style, rotary_dim)
    d = _need_int(delta, "delta")
    if abs(d) > _MAX_EXACT_POS:
        raise KVSimdPositionError("delta must be within +-2**53, got %d" % d)
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


def to_float16(x, out=None):
    """float32 -> float16, round to nearest even; bit-identical to ``x.astype(numpy.float16)``."""
    _need_array(x, "x", (_F32,), -1, "")
    if out is None:
        out = _np.empty(x.shape, dtype=_np.float16)
    else:
        _need_array(out, "out", (_F16,), -1, "", writeable=True)
        if out.shape != x.shape:
            raise KVSimdValueError("out must have shape %s, got %s" % (x.shape, out.shape))
    cdef uint16_t *d = <uint16_t *>_ptr(out)
    cdef const float *s = <const float *>_ptr(x)
    cdef size_t n = x.size
    with nogil:
        kv_f32_to_f16(d, s, n)
    return out


def to_float32(x, out=None):
    """float16 -> float32, exact; bit-identical to ``x.astype(numpy.float32)``."""
    _need_array(x, "x", (_F16,), -1, "")
    if out is None:
        out = _np.empty(x.shape, dtype=_np.float32)
    else:
        _need_array(out, "out", (_F32,), -1, "", writeable=True)
        if out.shape != x.shape:
            raise KVSimdValueError("out must have shape %s, got %s" % (x.shape, out.shape))
    cdef float *d = <float *>_ptr(out)
    cdef const uint16_t *s = <const uint16_t *>_ptr(x)
    cdef size_t n = x.size
    with nogil:
        kv_f16_to_f32(d, s, n)
    return out


def _bench_read(cnp.ndarray buf):
    """Stream-read ``buf`` once (benchmark roofline); returns a checksum."""
    cdef const void *p = _ptr(buf)
    cdef size_t n = buf.nbytes
    cdef uint64_t r
    with nogil:
        r = kv_bench_read(p, n)
    return r


def _bench_copy(cnp.ndarray dst, cnp.ndarray src):
    """Copy ``src`` into ``dst`` with plain loads and stores (benchmark roofline)."""
    cdef void *d = _ptr(dst)
    cdef const void *s = _ptr(src)
    cdef size_t n = min(dst.nbytes, src.nbytes)
    with nogil:
        kv_bench_copy(d, s, n)


_BENCH_OPS = {"read": KV_BENCH_READ, "write": KV_BENCH_WRITE, "copy": KV_BENCH_COPY}


def _bench_mem(op, cnp.ndarray dst, cnp.ndarray src, int threads=1):
    """Stream ``op`` ("read" src, "write" dst, "copy" src to dst) over the whole buffer, split
    across ``threads`` OpenMP threads (benchmark roofline)."""
    cdef int o = _BENCH_OPS[op]
    cdef void *d = _ptr(dst)
    cdef const void *s = _ptr(src)
    cdef size_t n = min(dst.nbytes, src.nbytes)
    cdef uint64_t r
    if threads < 1:
        raise KVSimdValueError("threads must be >= 1")
    with nogil:
        r = kv_bench_run(o, d, s, n, threads)
    return r


def _fma_peak(isa, int64_t iters):
    """(flops, seconds) of ``iters`` rounds of the fp32 multiply-add probe on ISA row ``isa``."""
    cdef const kv_kernels *row = NULL
    for i in range(kv_isa_count()):
        if kv_isa_name(i).decode() == isa and kv_isa_supported(i):
            row = kv_isa_row(i)
    if row == NULL:
        raise KVSimdValueError("ISA %r is not supported here" % (isa,))
    cdef float sink
    cdef uint64_t flops
    t0 = _time.perf_counter()
    with nogil:
        flops = row.fma_peak(iters, &sink)
    return flops, _time.perf_counter() - t0


def _attn_workspace_bytes(int64_t H, int64_t Hkv, int64_t D):
    """Bytes of scratch the attention kernel needs (for tests driving kernels directly)."""
    return kv_attn_workspace_bytes(H, Hkv, D)


def _rope_table(double units, double theta, int64_t R, int64_t rotary_dim):
    """The (cos, sin) float32 pairs ops.c hands the rotation kernel for ``units`` positions."""
    if R < 0 or 2 * R > rotary_dim or rotary_dim > KV_MAX_HEAD_DIM:
        raise KVSimdValueError("bad rotary sizes")
    cs = _np.empty(2 * R, dtype=_np.float32)
    kv_rope_table(<float *>_ptr(cs), units, theta, R, rotary_dim)
    return cs
