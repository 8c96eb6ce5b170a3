# The boundary: every check of what callers hand kvsimd, one function per concept, used by every
# entry point (ops.*, the caches, the layers), with the GIL, before any kernel runs without it;
# kernels themselves never check anything.  Also the one RoPE spec, the one filling of the
# attention parameters and the one conversion of C status codes.
import itertools as _itertools
import math as _math
import time as _time

import numpy as _np

from kvsimd.errors import (KVSimdCapacityError, KVSimdISAError, KVSimdMemoryError, KVSimdPositionError, KVSimdTypeError,
                           KVSimdValueError)

_F16 = _np.dtype(_np.float16)
_F32 = _np.dtype(_np.float32)
_I64 = _np.dtype(_np.int64)
_I8 = _np.dtype(_np.int8)
_U8 = _np.dtype(_np.uint8)
_KV_DTYPES = (_F16, _F32)
# what attention and shift_keys read: int8, and uint8 holding int4 two values per byte (kvsimd.h
# KV_I4), both with block scales
_KV_STORED = (_F16, _F32, _I8, _U8)
_STYLES = {"gptj": KV_ROPE_GPTJ, "neox": KV_ROPE_NEOX}
_I64_MIN, _I64_MAX = -2 ** 63, 2 ** 63 - 1
_MAX_EXACT_POS = 2 ** 53  # positions and deltas: exact in double, and qpos - kpos cannot overflow int64
_FLT_MAX = 3.4028234663852886e38
_MIN_THETA = 1e-200       # every angle |position| * theta**-1 stays finite
_MAX_INV_FREQ = 1e200     # the same for explicit inverse frequencies
_MAX_HEADS = 1 << 16      # query heads per attention call (bounds workspace sizes)
_SOFTCAP_MIN, _SOFTCAP_MAX = 2.0 ** -126, 2.0 ** 126   # the cap and 1 / cap: normal float32 numbers


cdef inline void *_ptr(cnp.ndarray a) noexcept:
    return cnp.PyArray_DATA(a)


# ---------------------------------------------------------------------------------------------
# The boundary checks: one function per concept, used by every entry point (ops.*, KVCache.*).

cdef object _readonly(a):
    """A zero-copy view of the C-contiguous ``a`` that cannot be made writeable again (a plain
    read-only view of a writeable array, or of an array that owns its data, can: setflags(write=True)
    succeeds): built on a read-only buffer.  What kvsimd hands out of the state C reads."""
    return _np.frombuffer(memoryview(a).toreadonly(), dtype=a.dtype).reshape(a.shape)


# What the checks (and the callers' sizes) read of an array at Python level: an ndarray subclass
# must not redefine them, or what is checked would not be the buffer the kernels get
_ARRAY_FIELDS = ("shape", "dtype", "ndim", "size", "strides", "flags", "itemsize", "nbytes", "data",
                 "__getattribute__", "__len__")


def _need_array(a, str name, dtypes, int ndim, str dims, bint writeable=False, shape=None):
    """Check type (no masked arrays, no subclass that redefines what is checked), dtype (None: any),
    rank (-1: any), shape, contiguity, alignment and, for a buffer kvsimd writes, writability;
    return the array."""
    if not isinstance(a, _np.ndarray):
        raise KVSimdTypeError("%s must be a numpy.ndarray, got %s" % (name, type(a).__name__))
    if isinstance(a, _np.ma.MaskedArray):
        raise KVSimdTypeError("%s is a numpy.ma.MaskedArray: kvsimd would ignore its mask; pass "
                              "%s.filled(...) or the data you mean" % (name, name))
    if type(a) is not _np.ndarray:   # (checked every time: a class can change)
        bad = [f for f in _ARRAY_FIELDS if getattr(type(a), f, None) is not getattr(_np.ndarray, f)]
        if bad:
            raise KVSimdTypeError("%s is a %s, which redefines numpy.ndarray's %s: pass numpy.asarray(%s)"
                                  % (name, type(a).__name__, ", ".join(bad), name))
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


cdef kv_dtype _kv_code(a):
    """The kv_dtype of a validated K/V array (float16, float32, int8, or uint8: packed int4)."""
    return KV_F16 if a.dtype == _F16 else KV_I8 if a.dtype == _I8 else KV_I4 if a.dtype == _U8 else KV_F32


def _kv_dtype_name(a):
    return "uint8 (int4, two values per byte)" if a.dtype == _U8 else str(a.dtype)


def _need_row_length(x, int64_t D, str xname):
    """The last axis of a validated K/V array ``x`` holds one row of head_dim D as stored: D values,
    or for int4 (uint8) kv_row_bytes = 16 bytes per block of 32 values (the last block padded)."""
    cdef int64_t want = <int64_t>kv_row_bytes(_kv_code(x), D)
    if x.shape[x.ndim - 1] != want:
        if x.dtype == _U8:
            raise KVSimdValueError("%s is uint8 (int4, two values per byte): head_dim %d needs rows of %d bytes "
                                   "(16 per block of 32 values), got shape %s" % (xname, D, want, x.shape))
        raise KVSimdValueError("%s must have head_dim %d as its last axis, got shape %s" % (xname, D, x.shape))


def _need_block_scales(x, scale, str xname, str sname, D=None):
    """The block scales of an int8 or int4 ``x`` [H, N, row] of head_dim D (default: the last axis):
    float32 [H, N, ceil(D / 32)], C-contiguous (None for a float ``x``, which has none).  Returns the
    scales (or None)."""
    if x.dtype != _I8 and x.dtype != _U8:
        if scale is not None:
            raise KVSimdValueError("%s is %s: %s applies to int8 and int4 (uint8) only" % (xname, x.dtype, sname))
        return None
    shape = (x.shape[0], x.shape[1], kv_i8_blocks(x.shape[2] if D is None else D))
    if scale is None:
        raise KVSimdValueError("%s is %s: it needs %s, its float32 block scales %s (one per %d values of a row; "
                               "kvsimd.ops.quantize_kv makes both)" % (xname, _kv_dtype_name(x), sname, shape,
                                                                     KV_I8_BLOCK))
    return _need_array(scale, sname, (_F32,), 3, "[H, N, blocks]", shape=shape)


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


def _need_softcap(softcap):
    """The attention logit soft cap (Gemma 2): None or 0 is off (returns 0.0); else a finite real
    in 2**-126..2**126, so that it and its reciprocal are normal float32 numbers."""
    if softcap is None:
        return 0.0
    c = _need_real(softcap, "softcap")
    if c == 0.0:
        return 0.0
    if not (_SOFTCAP_MIN <= c <= _SOFTCAP_MAX):
        raise KVSimdValueError("softcap must be None or 0 (off), or a finite number in 2**-126..2**126, got %r"
                               % (softcap,))
    return c


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
    if rotary_dim is None and D % 2:
        raise KVSimdValueError("head_dim (last axis) is %d: RoPE turns pairs of dims, and rotary_dim defaults to "
                               "head_dim; give an even rotary_dim below it" % D)
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


def _need_recent(recent, k, int64_t D):
    """ops.attend's ``recent``: None, or (k_recent, v_recent) float16/float32 [Hkv, M, D] of one
    dtype, M >= 1 (k: the cache's keys, for Hkv).  Returns the pair, or (None, None)."""
    if recent is None:
        return None, None
    if not isinstance(recent, (tuple, list)) or len(recent) != 2:
        raise KVSimdTypeError("recent must be a pair (k_recent, v_recent), got %s" % (type(recent).__name__,))
    kr, vr = recent
    _need_array(kr, "recent[0]", (_F16, _F32), 3, "[Hkv, M, D]")
    _need_array(vr, "recent[1]", (_F16, _F32), 3, "[Hkv, M, D]")
    if kr.dtype != vr.dtype or kr.shape != vr.shape:
        raise KVSimdValueError("recent K and V must have one dtype and shape, got %s %s and %s %s"
                               % (kr.dtype, kr.shape, vr.dtype, vr.shape))
    if kr.shape[0] != k.shape[0] or kr.shape[2] != D:
        raise KVSimdValueError("recent rows must be [Hkv=%d, M, D=%d], got shape %s" % (k.shape[0], D, kr.shape))
    if kr.shape[1] < 1:
        raise KVSimdValueError("recent holds no rows (M=0): pass recent=None")
    return kr, vr


def _threads_now():
    """The kernel thread count for one call, read once (see kv_attend in kvsimd.h)."""
    return kv_get_num_threads()


def _new_array(shape, dtype, what):
    """numpy.empty(shape, dtype) for an array kvsimd returns, or KVSimdMemoryError naming it."""
    try:
        return _np.empty(shape, dtype=dtype)
    except MemoryError:
        raise KVSimdMemoryError("%s: cannot allocate the %s array of shape %s" % (what, _np.dtype(dtype), tuple(shape))) from None


def _workspace(int64_t H, int64_t Hkv, int64_t D, int nt, int64_t T=1, int64_t sources=1):
    """Scratch for one kv_attend call with ``nt`` threads (plus 64 bytes to align it), or with
    ``sources`` > 1 for a kv_attend_sources call over T query rows."""
    cdef size_t n = kv_attend_workspace_bytes(H, Hkv, D, nt) if sources == 1 else \
        kv_attend_sources_workspace_bytes(H, Hkv, D, T, sources, nt)
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


_STATUS = {    # kv_status -> (exception, what it means)
    KV_ERR_NOMEM: (KVSimdMemoryError, "out of memory"),
    KV_ERR_ARG: (KVSimdValueError, "an argument out of range"),
    KV_ERR_ISA: (KVSimdISAError, "an ISA this CPU cannot run"),
    KV_ERR_CAPACITY: (KVSimdCapacityError, "beyond the capacity"),
    KV_ERR_POSITION: (KVSimdPositionError, "a position out of range"),
}


cdef int _check_status(kv_status rc, str what) except -1:
    """The one conversion of a C status code into the exception it stands for, naming the call."""
    if rc == KV_OK:
        return 0
    exc, meaning = _STATUS.get(rc, (KVSimdValueError, "unknown status"))
    raise exc("%s: %s (C status %d)" % (what, meaning, rc))


def _rope_freqs(inv_freq, int64_t R):
    """Explicit RoPE inverse frequencies: R real numbers, each finite and in (0, 1e200] (every
    angle stays finite), as a read-only float64 copy."""
    if isinstance(inv_freq, _np.ma.MaskedArray):
        raise KVSimdTypeError("inv_freq is a numpy.ma.MaskedArray: kvsimd would ignore its mask")
    if isinstance(inv_freq, _np.ndarray):
        a = inv_freq
    elif isinstance(inv_freq, (list, tuple)):
        try:
            a = _np.array(inv_freq)
        except (TypeError, ValueError):
            raise KVSimdTypeError("inv_freq must be a 1-D sequence of real numbers, got %r" % (inv_freq,)) from None
    else:
        raise KVSimdTypeError("inv_freq must be a numpy array, list or tuple of rotary_dim/2=%d real numbers, got %s"
                              % (R, type(inv_freq).__name__))
    if a.dtype.kind not in "iuf":
        raise KVSimdTypeError("inv_freq must hold real numbers, got dtype %s" % a.dtype)
    if a.shape != (R,):
        raise KVSimdValueError("inv_freq must have rotary_dim/2=%d entries, got shape %s" % (R, a.shape))
    a = _np.array(a, dtype=_np.float64, order="C")
    bad = ~(_np.isfinite(a) & (a > 0) & (a <= _MAX_INV_FREQ))
    if bad.any():
        i = int(_np.argmax(bad))
        raise KVSimdValueError("inv_freq[%d]=%r must be finite and in (0, %g]" % (i, float(a[i]), _MAX_INV_FREQ))
    a.flags.writeable = False
    return a


def _need_attn_factor(x):
    """RoPE's attention factor (cos and sin are multiplied by it): positive, finite, within float32."""
    f = _need_real(x, "attn_factor")
    if not (0.0 < f <= _FLT_MAX):
        raise KVSimdValueError("attn_factor must be positive, finite and within float32 range, got %r" % (f,))
    return f


cdef class RopeSpec:
    """Validated RoPE parameters for rows of ``head_dim``: ``theta``, ``style`` ("gptj" pairs
    adjacent values, "neox" the two halves) and ``rotary_dim`` (None: head_dim).  Scaled RoPE
    (linear, llama3, YaRN: see kvsimd.nn.config.rope_frequencies) gives ``inv_freq``, the
    rotary_dim/2 inverse frequencies (default ``theta ** (-2i / rotary_dim)``), and
    ``attn_factor``, which multiplies cos and sin (so q.k by its square; default 1).  The one
    RoPE check of kvsimd: ops.apply_rope / shift_keys, prefill, decode steps and the shift
    policy.  A shift rotates by the delta's angles alone: the factor is in a key once."""
    cdef readonly double theta, attn_factor
    cdef readonly int64_t rotary_dim, head_dim
    cdef kv_rope_style st
    cdef object _inv          # float64 [rotary_dim/2], read-only: the frequencies C reads
    cdef bint _given          # _inv came from the caller (else from theta)
    cdef const double *inv    # _inv's data

    def __cinit__(self, theta, style, rotary_dim, head_dim, inv_freq=None, attn_factor=1.0):
        D = _need_int(head_dim, "head_dim")
        _need_head_dim(D)
        self.theta, self.st, self.rotary_dim = _rope_params(theta, style, rotary_dim, D)
        self.head_dim = D
        cdef int64_t R = self.rotary_dim // 2
        self._given = inv_freq is not None
        if self._given:
            self._inv = _rope_freqs(inv_freq, R)
        else:
            self._inv = _np.empty(R, dtype=_np.float64)
            kv_rope_inv_freq(<double *>_ptr(self._inv), self.theta, R, self.rotary_dim)
            self._inv.flags.writeable = False
        self.inv = <const double *>_ptr(self._inv)
        self.attn_factor = _need_attn_factor(attn_factor)

    @property
    def style(self):
        return "gptj" if self.st == KV_ROPE_GPTJ else "neox"

    @property
    def inv_freq(self):
        """The inverse frequencies given (read-only float64 array), or None (from theta)."""
        return _readonly(self._inv) if self._given else None

    @property
    def frequencies(self):
        """The inverse frequencies the kernels use (read-only float64 [rotary_dim/2])."""
        return _readonly(self._inv)

    def _key(self):
        return (self.theta, self.style, self.rotary_dim, self.head_dim, self.attn_factor,
                self._inv.tobytes() if self._given else None)

    def __eq__(self, other):
        if not isinstance(other, RopeSpec):
            return NotImplemented
        return self._key() == (<RopeSpec>other)._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        extra = ""
        if self._given:
            extra += ", inv_freq=(%s,)" % ", ".join(map(repr, self._inv.tolist()))
        if self.attn_factor != 1.0:
            extra += ", attn_factor=%r" % self.attn_factor
        return "RopeSpec(theta=%r, style=%r, rotary_dim=%d, head_dim=%d%s)" % (self.theta, self.style,
                                                                                self.rotary_dim, self.head_dim, extra)

    def __reduce__(self):
        return RopeSpec, (self.theta, self.style, self.rotary_dim, self.head_dim,
                          tuple(self._inv.tolist()) if self._given else None, self.attn_factor)


cdef inline void _attn_init(kv_attn_params *p, const float *q, const float *q_alt, const void *k, const void *v,
                            float *out, const float *alibi, const int64_t *key_pos, const int64_t *ranges,
                            int64_t n_ranges, int64_t H, int64_t Hkv, int64_t D, int64_t n_total, float scale,
                            float softcap, kv_dtype dtype, int64_t T=1, int64_t q_stride=0, int64_t out_stride=0,
                            int64_t causal_end=0, int64_t window=0, const float *k_scale=NULL,
                            const float *v_scale=NULL, int v_dtype=-1) noexcept nogil:
    """The one filling of kv_attn_params: every field, every caller (ranges as kv_attn_range rows;
    softcap 0: no soft cap, else a value _need_softcap accepted).  T query rows at q + t * q_stride
    (q_alt the same), out + t * out_stride; causal_end > 0: row t reads keys < causal_end + t, and
    with window > 0 keys >= causal_end + t - window (kvsimd.h).  dtype: of K, and of V unless
    v_dtype >= 0 gives V's (a cache with int8 keys and int4 values)."""
    memset(p, 0, sizeof(kv_attn_params))
    p.q, p.q_alt, p.k, p.v, p.out = q, q_alt, k, v, out
    p.alibi, p.key_pos = alibi, key_pos
    p.ranges = <const kv_attn_range *>ranges
    p.n_ranges = n_ranges
    p.H, p.Hkv, p.D = H, Hkv, D
    p.n_total = n_total
    p.T, p.q_stride, p.out_stride = T, q_stride, out_stride
    p.causal_end, p.window = causal_end, window
    p.scale = scale
    p.softcap = softcap
    p.dtype = dtype
    p.v_dtype = dtype if v_dtype < 0 else v_dtype
    p.k_scale, p.v_scale = k_scale, v_scale
