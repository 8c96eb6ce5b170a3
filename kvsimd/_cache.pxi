# The caches: C-owned K/V storage (_KVStore), the self-attention cache with its ring buffer and
# streaming policies (KVCache), and the encoder-output cache of cross-attention (CrossAttentionCache).
import os as _cache_os
import signal as _signal
import threading as _threading

from kvsimd.errors import KVSimdBusyError, KVSimdCapacityError, KVSimdISAError

# name: (kv_dtype, the NumPy dtype of the storage views); int4 is viewed as its bytes (uint8)
_DTYPES = {"float16": (KV_F16, _F16), "float32": (KV_F32, _F32), "int8": (KV_I8, _I8), "int4": (KV_I4, _U8)}
_QUANTIZED = ("int8", "int4")


def _cache_dtypes(dtype):
    """(K's name, V's name) of a cache ``dtype``: one name for both, or "K/V" for quantized keys and
    values of different widths ("int8/int4": int8 keys, int4 values)."""
    if isinstance(dtype, str) and "/" in dtype:
        kn, _, vn = dtype.partition("/")
        if kn in _QUANTIZED and vn in _QUANTIZED:
            return kn, vn
        raise KVSimdTypeError("dtype \"K/V\" takes int8 or int4 on each side (e.g. \"int8/int4\": int8 keys, int4 "
                              "values), got %r" % (dtype,))
    if isinstance(dtype, str) and dtype == "int4":
        key = dtype
    else:
        try:
            key = _np.dtype(dtype).name
        except (TypeError, ValueError):
            key = None
    if key not in _DTYPES:
        raise KVSimdTypeError("dtype must be float16, float32, int8, int4 or \"int8/int4\" (int8 keys, int4 values), "
                              "got %r" % (dtype,))
    return key, key


def _cache_kind(dtype, hadamard):
    """(name, K's name, V's name, hadamard) of a cache's ``dtype`` and ``hadamard`` arguments (the
    one rule: KVCache and the transformers caches): hadamard None means on when K or V is int4;
    True needs quantized K/V."""
    kn, vn = _cache_dtypes(dtype)
    name = kn if kn == vn else kn + "/" + vn
    if hadamard is None:
        return name, kn, vn, "int4" in (kn, vn)
    had = _need_flag(hadamard, "hadamard")
    if had and kn not in _QUANTIZED:
        raise KVSimdValueError("hadamard=True applies to quantized caches (dtype int8 or int4), got dtype=%s" % name)
    return name, kn, vn, had


def _cache_recent(recent, name, kn):
    """A cache's ``recent`` argument (the one rule: KVCache and the transformers caches), for a
    cache of dtype ``name`` whose keys are ``kn``: an integer >= 0, and 0 unless K/V are quantized."""
    rn = _need_int(recent, "recent", 0, KV_MAX_TOKENS)
    if rn and kn not in _QUANTIZED:
        raise KVSimdValueError("recent keeps float16 rows of a quantized cache's last tokens (dtype int8, int4 or "
                               "\"int8/int4\"), got recent=%d with dtype=%s" % (rn, name))
    return rn
POLICIES = ("fixed", "reevaluate", "shift", "sink_query", "auto")
cdef enum:
    _P_FIXED, _P_REEVALUATE, _P_SHIFT, _P_SINK_QUERY, _P_AUTO


cdef class _KVStore:
    """K/V storage for every layer of a model and every sequence of a batch (the part every cache
    shares).

    Storage is one 64-byte-aligned C block, ``[layer][K|V][sequence][kv head][slot][head_dim]``,
    so attention reads each (layer, sequence, head) as one contiguous run.  ``dtype`` "float16",
    "float32", "int8" or "int4": a quantized cache also keeps, for every (slot, kv head) row of K
    and of V, one float32 scale per block of 32 values (value d stands for its integer times scale
    d // 32: :func:`kvsimd.ops.quantize_kv` quantizes, once, as K/V are written; :meth:`key_scales`
    / :meth:`value_scales` view the scales; over int8 and int4 keys attention reads each query
    rounded by the int8 rule, :func:`kvsimd.ops.attend`).  An int4 cache stores two values per
    byte, 16 bytes per block of 32 (the last block of a row padded): its :meth:`keys` / :meth:`values` views are
    those bytes, uint8 ``[..., 16 * ceil(head_dim / 32)]`` (:func:`kvsimd.reference.unpack_int4`
    reads them).  ``dtype="int8/int4"`` (any "K/V" pair of int8 and int4): keys of the first width and
    values of the second; int8 keys with int4 values cost 0.44x float16's bytes and keep most of
    int8's accuracy (4-bit keys are what costs: README).  ``hadamard`` (default: True when K or V is
    int4, False otherwise; quantized caches only):
    every whole block of 32 values of K and V rows is stored turned by the 32 x 32 Hadamard matrix H
    (``kvsimd.reference.hadamard_rows``; ``kv_hadamard_rows`` in kvsimd.h): an outlier channel is
    spread over its block before the block's scale is taken.  Attention turns the query by H first
    and its output back, so the scores and outputs are those of the unturned rows; the views show
    the rows as stored (H of their values is the row again).  A forward pass
    writes the new tokens' K/V of each layer with :meth:`write` at slots beyond the committed
    length, then :meth:`commit` makes them part of the cache: a pass that fails half-way
    leaves the cache as it was.  Writing past ``capacity`` raises
    :class:`kvsimd.KVSimdCapacityError` and changes nothing.

    One thread at a time: every method that reads or writes the storage or the bookkeeping holds
    the cache for its duration (see ``_claim``, which a decoder holds for a whole step), and a call
    from another thread meanwhile raises :class:`kvsimd.KVSimdBusyError`.  The views that
    keys() and values() return are the caller's to synchronise.
    """
    cdef kv_cache c
    cdef readonly int64_t n_layers, n_kv_heads, head_dim, capacity, batch
    cdef object _np_dtype, _v_np_dtype   # of the keys() and values() views
    cdef kv_dtype _kv_dtype, _v_dtype     # what K and V store
    cdef str _dtype_name                  # the dtype argument's name ("int8/int4": K/V differ)
    cdef int64_t _row_len, _v_row_len     # last axis of the K / V views: head_dim, or int4's bytes per row
    cdef readonly bint hadamard   # K/V rows stored turned by H (see the class docstring)
    cdef object _lengths
    cdef unsigned long _owner     # thread holding the claim (see _claim), valid while _depth > 0
    cdef int _depth
    cdef object _ws               # attention workspace kept between calls
    cdef object _fws              # attend(float_rows=True)'s gathered float rows, kept (_float_scratch)
    cdef int64_t _gen             # bumped by every change of what is committed (see _changed)
    cdef int64_t _nplans          # plans made on this store (each plan's serial)
    cdef int64_t _writer          # serial of the plan that last wrote K/V here (0: write() did; -1: nothing yet)
    # KVCache(recent=R): float16 rows of each sequence's last tokens beside the quantized ones (see
    # KVCache); here so that the compiled layers (_attend_rows) read them with the storage
    cdef readonly int64_t recent  # R; 0: none
    cdef int64_t _keep, _ring     # committed rows the ring keeps (2R: a truncate of up to R leaves R), its entries
    cdef object _tail             # uint16 [n_layers, K|V, batch, n_kv_heads, 4R, head_dim]: float16 bits, a ring
    cdef object _th, _tn          # int64 [batch]: ring entry of the oldest committed row, committed rows (<= R)
    cdef object _ttag             # int64 [batch, 4R]: the slot whose token each ring entry holds
    cdef object _pend             # int64 [batch, 3]: float rows write() stored beyond the committed ones,
    cdef object _pend_l           #   (first slot, rows m, ring entry of the first), m = 0: none; bool
                                  #   [batch, n_layers]: the layers that stored them (append takes them)
    cdef object _rtmp             # float32 [n_kv_heads * head_dim]: write()'s scratch for turning rows

    def __cinit__(self, n_layers, n_kv_heads, head_dim, capacity, *, batch=1, dtype="float16", hadamard=None,
                  **streaming):
        self._depth = 0
        self._writer = -1
        self._owner = 0
        cdef int64_t nl = _need_int(n_layers, "n_layers", 1), hkv = _need_int(n_kv_heads, "n_kv_heads", 1)
        cdef int64_t hd = _need_int(head_dim, "head_dim", 1, KV_MAX_HEAD_DIM)
        cdef int64_t cap = _need_int(capacity, "capacity", 1, KV_MAX_TOKENS), bt = _need_int(batch, "batch", 1)
        key, kn, vn, self.hadamard = _cache_kind(dtype, hadamard)
        self._kv_dtype, self._np_dtype = _DTYPES[kn]
        self._v_dtype, self._v_np_dtype = _DTYPES[vn]
        self._dtype_name = key
        self._row_len = <int64_t>kv_row_bytes(self._kv_dtype, hd) // self._np_dtype.itemsize
        self._v_row_len = <int64_t>kv_row_bytes(self._v_dtype, hd) // self._v_np_dtype.itemsize
        # exact: Python ints
        nbytes = int(nl) * int(bt) * int(hkv) * int(cap) * (kv_row_bytes(self._kv_dtype, hd) +
                                                            kv_row_bytes(self._v_dtype, hd))
        if kv_dtype_scaled(self._kv_dtype):   # the block scales (cache.c)
            nbytes = (nbytes + 63) // 64 * 64 + int(nl) * 2 * int(bt) * int(hkv) * int(cap) * kv_i8_blocks(hd) * 4
        what = ("%s(n_layers=%d, n_kv_heads=%d, head_dim=%d, capacity=%d, batch=%d, dtype=%s) needs %d bytes"
                % (type(self).__name__, nl, hkv, hd, cap, bt, key, nbytes))
        # the storage is zero-filled at once, and the bookkeeping (positions, rotations, token
        # lists) grows with batch x capacity: both must fit what the machine can give now
        need = nbytes + int(bt) * (12 * int(cap) + 128)
        avail = _available_memory()
        if need > avail:
            raise KVSimdMemoryError("%s (%d with its bookkeeping), more than the %d bytes of memory available now"
                                    % (what, need, avail))
        cdef kv_status s = kv_cache_create(&self.c, nl, bt, hkv, cap, hd, self._kv_dtype, self._v_dtype)
        if s == KV_ERR_NOMEM or s == KV_ERR_CAPACITY:
            raise KVSimdMemoryError("%s: cannot allocate them" % what)
        _check_status(s, what)
        self.n_layers, self.n_kv_heads, self.head_dim = nl, hkv, hd
        self.capacity, self.batch = cap, bt
        self._lengths = _np.zeros(bt, dtype=_np.int64)

    def __dealloc__(self):
        kv_cache_destroy(&self.c)

    cdef inline void _changed(self) noexcept:
        """Every change of the committed tokens or their bookkeeping (commit, forget, reset, a
        policy's discard, a shift, a rollback) calls this: a plan records the count when it is made
        and is refused once it differs (a stale plan's slots, ranges and positions are wrong)."""
        self._gen += 1

    cdef int _before_write(self, int64_t l, int64_t s, int64_t t0, int64_t t1) except -1:
        """Called by write() before it stores slots t0..t1-1 of layer l and sequence s (KVCache: an
        open transaction saves the committed tokens' K/V there).  1: some of them are committed."""
        return 0

    cdef int _need_current(self, _Plan plan, str ending=None) except -1:
        """Refuse a stale plan; with ``ending`` (end_step / end_prefill) also one whose K/V were
        not written for every layer, or were overwritten by another plan since (committing it would
        make slots of other contents visible).  K/V the caller stored with write() after the plan
        was made count as the plan's (the low-level way: begin_prefill, write, end_prefill)."""
        if plan.gen != self._gen:
            raise KVSimdValueError("stale plan: the cache changed since %s made it (a commit, reset, discard, shift or "
                                   "rollback came in between); make a new plan"
                                   % ("begin_step" if plan.kind == 0 and not plan.explicit else
                                      "step_plan" if plan.kind == 0 else "begin_prefill" if plan.kind == 1
                                      else "_local_plan"))
        if ending is None or self._writer == 0:
            return 0
        if plan.done < self.n_layers and (self._writer == plan.serial or plan.done == 0):
            raise KVSimdValueError("%s: the plan's K/V were written for %d of the cache's %d layers; run it through "
                                   "the layers (Layers.run) before committing it" % (ending, plan.done, self.n_layers))
        if self._writer != plan.serial:
            raise KVSimdValueError("%s: another plan wrote K/V into this cache's uncommitted slots after "
                                   "this one, so its slots no longer hold its tokens; make a new plan" % ending)
        return 0

    def __reduce__(self):
        raise KVSimdTypeError("a %s cannot be pickled or copied (it owns C memory); make a new cache and "
                              "prefill it, or copy its keys()/values() views" % type(self).__name__)

    def __repr__(self):
        return ("%s(n_layers=%d, n_kv_heads=%d, head_dim=%d, capacity=%d, batch=%d, dtype=%s%s%s, lengths=%s)"
                % (type(self).__name__, self.n_layers, self.n_kv_heads, self.head_dim, self.capacity, self.batch,
                   self._dtype_name, ", hadamard=%s" % self.hadamard if kv_dtype_scaled(self._kv_dtype) else "",
                   ", recent=%d" % self.recent if self.recent else "", self._lengths.tolist()))

    cdef int _acquire(self) except -1:
        """Take the one-user claim for the calling thread (re-entrant).  With the GIL held and no
        Python call between the check and the set, so two threads cannot both take it."""
        cdef unsigned long me = PyThread_get_thread_ident()
        if self._depth > 0 and self._owner != me:
            raise KVSimdBusyError("%s(n_layers=%d, n_kv_heads=%d, head_dim=%d, capacity=%d, batch=%d) at %#x is "
                                  "in use by thread %d (this is thread %d): one cache serves one thread at a time; "
                                  "share a model between threads, never a cache"
                                  % (type(self).__name__, self.n_layers, self.n_kv_heads, self.head_dim, self.capacity, self.batch,
                                     id(self), self._owner, me))
        self._owner = me
        self._depth += 1
        return 0

    cdef void _release(self) noexcept:
        if self._depth > 0:
            self._depth -= 1

    def _claim(self):
        """Context manager holding this cache for the calling thread: entering it raises
        KVSimdBusyError while another thread holds the cache; the holding thread may nest claims.
        Every method that reads or writes the storage or the bookkeeping (write, commit, attend,
        step_plan, step_attend, shift_range, reset) takes it for its duration; a decoder takes it
        for a whole step.  Views from keys()/values() are the caller's to synchronise."""
        cdef _CacheClaim c = _CacheClaim.__new__(_CacheClaim)
        c.cache = self
        return c

    @property
    def dtype(self):
        """The NumPy dtype of the :meth:`keys` views (uint8 for int4: its bytes), and of the
        :meth:`values` views unless V is stored otherwise (``"int8/int4"``: ``values().dtype`` is
        uint8); :attr:`kv_dtype` names what is stored."""
        return self._np_dtype

    @property
    def kv_dtype(self):
        """What the cache stores: "float16", "float32", "int8", "int4", or "K/V" when keys and values
        differ ("int8/int4": int8 keys, int4 values)."""
        return self._dtype_name

    @property
    def nbytes(self):
        return self.c.nbytes + (self._tail.nbytes if self._tail is not None else 0)

    @property
    def lengths(self):
        """Committed tokens per sequence (a copy)."""
        return self._lengths.copy()

    def length(self, seq=0):
        return int(self._lengths[self._seq(seq)])

    cdef int64_t _seq(self, seq) except -1:
        s = _need_int(seq, "seq")
        if not 0 <= s < self.batch:
            raise KVSimdValueError("seq must be in 0..%d, got %d" % (self.batch - 1, s))
        return s

    cdef int64_t _layer(self, layer) except -1:
        l = _need_int(layer, "layer")
        if not 0 <= l < self.n_layers:
            raise KVSimdValueError("layer must be in 0..%d, got %d" % (self.n_layers - 1, l))
        return l

    cdef int _npy(self, int which) noexcept:
        cdef kv_dtype d = self._v_dtype if which else self._kv_dtype
        return (cnp.NPY_FLOAT16 if d == KV_F16 else cnp.NPY_INT8 if d == KV_I8
                else cnp.NPY_UINT8 if d == KV_I4 else cnp.NPY_FLOAT32)

    cdef object _block(self, int64_t layer, int which, int64_t seq, bint writeable):
        """[Hkv, capacity, D] NumPy view of one block (int4: D's bytes); its base keeps this cache alive."""
        cdef cnp.npy_intp dims[3]
        dims[0], dims[1], dims[2] = self.n_kv_heads, self.capacity, self._v_row_len if which else self._row_len
        arr = cnp.PyArray_SimpleNewFromData(3, dims, self._npy(which), kv_cache_block(&self.c, layer, which, seq))
        cnp.set_array_base(arr, self)
        if not writeable:
            arr.flags.writeable = False
        return arr

    cdef object _scale_block(self, int64_t layer, int which, int64_t seq, bint writeable):
        """[Hkv, capacity, blocks] float32 view of the scales of one block of a quantized cache; its base
        keeps this cache alive."""
        cdef cnp.npy_intp dims[3]
        dims[0], dims[1], dims[2] = self.n_kv_heads, self.capacity, kv_i8_blocks(self.head_dim)
        arr = cnp.PyArray_SimpleNewFromData(3, dims, cnp.NPY_FLOAT32, kv_cache_scales(&self.c, layer, which, seq))
        cnp.set_array_base(arr, self)
        if not writeable:
            arr.flags.writeable = False
        return arr

    cdef int64_t _len_arg(self, int64_t s, length) except -1:
        n = int(self._lengths[s]) if length is None else _need_int(length, "length")
        if not 0 <= n <= self.capacity:
            raise KVSimdValueError("length must be in 0..%d, got %d" % (self.capacity, n))
        return n

    def _layer_view(self, layer, which):
        """Read-only zero-copy view ``[batch, n_kv_heads, capacity, head_dim]`` of the keys
        (``which`` 0) or values (1) of every sequence of one layer: they are one C block (see the
        class docstring).  For integrations that hand the storage to another array library."""
        cdef cnp.npy_intp dims[4]
        l = self._layer(layer)
        w = _need_int(which, "which")
        if w not in (0, 1):
            raise KVSimdValueError("which must be 0 (keys) or 1 (values), got %d" % w)
        dims[0], dims[1], dims[2], dims[3] = self.batch, self.n_kv_heads, self.capacity, \
            self._v_row_len if w else self._row_len
        arr = cnp.PyArray_SimpleNewFromData(4, dims, self._npy(w), kv_cache_block(&self.c, l, w, 0))
        cnp.set_array_base(arr, self)
        arr.flags.writeable = False
        return arr

    def keys(self, layer, seq=0, length=None):
        """Read-only zero-copy view ``[n_kv_heads, length, head_dim]`` of the keys (default: the
        committed ones; a larger ``length`` also shows slots written but not yet committed); an
        int4 cache's bytes, ``[n_kv_heads, length, 16 * ceil(head_dim / 32)]`` uint8."""
        l, s = self._layer(layer), self._seq(seq)
        return self._block(l, 0, s, False)[:, :self._len_arg(s, length)]

    def values(self, layer, seq=0, length=None):
        """Read-only zero-copy view ``[n_kv_heads, length, head_dim]`` of the values (int4: their
        bytes, as :meth:`keys`)."""
        l, s = self._layer(layer), self._seq(seq)
        return self._block(l, 1, s, False)[:, :self._len_arg(s, length)]

    cdef int _need_scaled(self, str what) except -1:
        if not kv_dtype_scaled(self._kv_dtype):
            raise KVSimdTypeError("%s: this cache stores %s, which has no scales (only dtype=\"int8\" and \"int4\" "
                                  "caches do)" % (what, self._dtype_name))
        return 0

    def key_scales(self, layer, seq=0, length=None):
        """Read-only zero-copy view ``[n_kv_heads, length, ceil(head_dim / 32)]`` (float32) of an int8
        or int4 cache's key scales: value d of the key of head h at slot t stands for its integer
        times ``key_scales(layer)[h, t, d // 32]``."""
        self._need_scaled("key_scales")
        l, s = self._layer(layer), self._seq(seq)
        return self._scale_block(l, 0, s, False)[:, :self._len_arg(s, length)]

    def value_scales(self, layer, seq=0, length=None):
        """Read-only zero-copy view ``[n_kv_heads, length, ceil(head_dim / 32)]`` (float32) of an int8
        or int4 cache's value scales."""
        self._need_scaled("value_scales")
        l, s = self._layer(layer), self._seq(seq)
        return self._scale_block(l, 1, s, False)[:, :self._len_arg(s, length)]

    def write(self, layer, k, v, *, seq=0, start=None):
        """Store float32 ``k``, ``v`` ``[n_kv_heads, T, head_dim]`` at slots ``start..start+T-1``
        (default: right after the committed tokens) of ``layer``; not visible until committed.
        An int8 or int4 cache quantizes each row (:func:`kvsimd.ops.quantize_kv`)."""
        with self._claim():
            l, s = self._layer(layer), self._seq(seq)
            _need_array(k, "k", (_F32,), 3, "[n_kv_heads, T, head_dim]")
            _need_array(v, "v", (_F32,), 3, "[n_kv_heads, T, head_dim]")
            if k.shape != v.shape or k.shape[0] != self.n_kv_heads or k.shape[2] != self.head_dim:
                raise KVSimdValueError("k and v must be [%d, T, %d], got %s and %s"
                                       % (self.n_kv_heads, self.head_dim, k.shape, v.shape))
            t0 = int(self._lengths[s]) if start is None else _need_int(start, "start", 0)
            T = k.shape[1]
            if t0 + T > self.capacity:
                raise KVSimdCapacityError("cache full: %d tokens at slot %d exceed capacity %d (sequence %d)"
                                          % (T, t0, self.capacity, s))
            # k or v may be views of this cache's own storage: copied first, so that nothing is
            # written before both are known to be usable
            c0, c1 = <size_t>self.c.data, <size_t>self.c.data + self.c.nbytes
            k, v = (_np.array(a) if _addr(a) < c1 and c0 < _addr(a) + <size_t>a.nbytes else a for a in (k, v))
            over = self._before_write(l, s, t0, t0 + T)
            for which, src in ((0, k), (1, v)):
                self._put_rows(l, which, s, t0, src)
            if self.recent and not over:    # rows over committed tokens: no float rows (_before_write)
                self._recent_write(l, s, t0, k, v)
            self._writer = 0

    cdef int _recent_write(self, int64_t l, int64_t s, int64_t t0, k, v) except -1:
        """write()'s float rows (a cache with ``recent`` = R): rows over tokens that have float
        rows make them stale (the sequence keeps none); the last m = min(T, R) rows go to the
        ring entries after the committed ones, as float16 rows stored the way a plan stores them
        (turned by H with ``hadamard``), for :meth:`append` / :meth:`commit` / end_step to take
        when every layer stored the same rows and they are the newly committed tokens.  A write
        of other rows starts that count again."""
        cdef int64_t T = k.shape[1], R = self._keep, ring = self._ring, i, tag
        cdef int64_t Hkv = self.n_kv_heads, D = self.head_dim, p0, m, e0, j, w
        cdef int64_t *tags = <int64_t *>_ptr(self._ttag) + s * ring
        cdef int64_t *pend = <int64_t *>_ptr(self._pend) + s * 3
        cdef int64_t th = (<int64_t *>_ptr(self._th))[s], tn = (<int64_t *>_ptr(self._tn))[s]
        cdef char *done = <char *>_ptr(self._pend_l) + s * self.n_layers
        for i in range(tn):
            tag = tags[(th + i) % ring]
            if t0 <= tag < t0 + T:
                self._recent_lost(s)
                tn = 0
                break
        p0 = max(t0 + T - R, t0)
        m = t0 + T - p0
        e0 = (th + tn) % ring
        if pend[0] != p0 or pend[1] != m or pend[2] != e0:
            pend[0], pend[1], pend[2] = p0, m, e0
            memset(done, 0, self.n_layers)
        self._save_ring(s, e0, m)
        cdef float *tp = <float *>_ptr(self._rtmp)
        cdef uint16_t *ring_rows
        cdef const float *src
        for w, x in ((0, k), (1, v)):
            ring_rows = <uint16_t *>_ptr(self._tail) + ((l * 2 + w) * self.batch + s) * Hkv * ring * D
            rows = x if T == 1 else _np.ascontiguousarray(x[:, p0 - t0:].transpose(1, 0, 2))   # [m, Hkv, D]
            src = <const float *>_ptr(rows)
            for j in range(m):
                _f16_heads(ring_rows + ((e0 + j) % ring) * D, ring * D, src + j * Hkv * D, tp, Hkv, D, self.hadamard)
        done[l] = 1
        return 0

    def _float_rows(self, layer, seq, k, v, n):
        """For an attention over a pass's rows (the transformers integration): float16 K and V
        ``[n_kv_heads, c + T, head_dim]`` as the ring stores them (turned by H with ``hadamard``),
        the last c = min(n, committed) float rows of sequence ``seq`` followed by k, v (float32
        ``[n_kv_heads, T, head_dim]``, the pass's rows) rounded the same way: what
        ops.attend(recent=..., recent_window=...) reads."""
        cdef int64_t l, s, ring = self._ring, c, j, T, w, first
        cdef int64_t Hkv = self.n_kv_heads, D = self.head_dim
        with self._claim():
            if not self.recent:
                raise KVSimdValueError("_float_rows: this cache keeps no float rows (recent=0)")
            l, s = self._layer(layer), self._seq(seq)
            c = _need_int(n, "n", 0)
            for x, name in ((k, "k"), (v, "v")):
                _need_array(x, name, (_F32,), 3, "[n_kv_heads, T, head_dim]")
                if x.shape[0] != Hkv or x.shape[2] != D or x.shape != k.shape:
                    raise KVSimdValueError("k and v must be [%d, T, %d], got %s and %s" % (Hkv, D, k.shape, v.shape))
            T = k.shape[1]
            c = min(c, int(self._tn[s]))
            first = (self._th[s] + self._tn[s] - c) % ring
            out = _np.empty((2, Hkv, c + T, D), dtype=_np.uint16)
            tmp = _np.empty(Hkv * D, dtype=_np.float32)
            for w, x in ((0, k), (1, v)):
                dst = <uint16_t *>_ptr(out) + w * Hkv * (c + T) * D
                _gather_ring(dst, c + T, <uint16_t *>_ptr(self._tail) + ((l * 2 + w) * self.batch + s) * Hkv * ring * D,
                             ring, first, c, Hkv, D)
                rows = _np.ascontiguousarray(x.transpose(1, 0, 2))
                for j in range(T):
                    _f16_heads(dst + (c + j) * D, (c + T) * D, <const float *>_ptr(rows) + j * Hkv * D,
                               <float *>_ptr(tmp), Hkv, D, self.hadamard)
            out = out.view(_np.float16)
            return out[0], out[1]

    def _copy_recent(self, old):
        """The newest float rows of ``old`` (a KVCache of the same layers, batch, heads and
        head_dim; its slots kept), at most this cache's ``recent`` of them per sequence, e.g. when
        a cache grows into a new one (whose ``recent`` may be larger: it is capped at capacity)."""
        cdef int64_t s, c
        if not isinstance(old, _KVStore) or not (<_KVStore>old).recent or not self.recent:
            raise KVSimdValueError("_copy_recent needs two caches with recent > 0, got %r" % (old,))
        cdef _KVStore o = <_KVStore>old
        if (o.n_layers, o.batch, o.n_kv_heads, o.head_dim) != (self.n_layers, self.batch, self.n_kv_heads,
                                                                 self.head_dim):
            raise KVSimdValueError("_copy_recent: caches of %s and %s (layers, batch, KV heads, head_dim)"
                                   % ((o.n_layers, o.batch, o.n_kv_heads, o.head_dim),
                                      (self.n_layers, self.batch, self.n_kv_heads, self.head_dim)))
        with self._claim():
            for s in range(self.batch):
                c = min(int(o._tn[s]), self._keep)
                idx = (o._th[s] + o._tn[s] - c + _np.arange(c)) % o._ring
                self._tail[:, :, s, :, :c] = o._tail[:, :, s][..., idx, :]
                self._ttag[s, :c] = o._ttag[s, idx]
                self._th[s], self._tn[s] = 0, c
            self._pend[:, 1] = 0

    cdef int _put_rows(self, int64_t l, int which, int64_t s, int64_t t0, src) except -1:
        """float32 rows src [Hkv, T, D] (validated, C-contiguous, not in this storage) into slots
        t0.. of one block, in the cache's dtype (the one conversion of written K/V)."""
        cdef int64_t T = src.shape[1], D = self.head_dim, C = self.capacity, h, nb = kv_i8_blocks(self.head_dim)
        cdef kv_dtype dt = self._v_dtype if which else self._kv_dtype
        cdef int64_t rb = <int64_t>kv_row_bytes(dt, D)
        cdef char *q
        cdef float *sc
        cdef const float *x
        blk = self._block(l, which, s, True)
        if dt == KV_F16:
            for h in range(self.n_kv_heads):
                to_float16(src[h], out=blk[h, t0:t0 + T])
        elif kv_dtype_scaled(dt):
            for h in range(self.n_kv_heads):
                q = <char *>kv_cache_block(&self.c, l, which, s) + (h * C + t0) * rb
                sc = kv_cache_scales(&self.c, l, which, s) + (h * C + t0) * nb
                x = <const float *>_ptr(src) + h * T * D
                with nogil:
                    kv_quantize_rows(dt, self.hadamard, q, rb, sc, x, D, T, D)
        else:
            blk[:, t0:t0 + T] = src
        return 0

    def _saved_rows(self, layer, seq, t0, t1):
        """A copy of slots t0..t1-1 of one layer and sequence as stored: (k, v) or, quantized, (k, v, key
        scales, value scales) -- what _restore_rows puts back bit for bit (a transaction's record)."""
        l, s = self._layer(layer), self._seq(seq)
        out = [_np.array(self._block(l, w, s, False)[:, t0:t1]) for w in (0, 1)]
        if kv_dtype_scaled(self._kv_dtype):
            out += [_np.array(self._scale_block(l, w, s, False)[:, t0:t1]) for w in (0, 1)]
        return tuple(out)

    def _restore_rows(self, layer, seq, t0, rows):
        """Put back at slots t0.. of one layer and sequence the rows _saved_rows copied, bit for
        bit; every array is checked (the dtype and shape of what it goes into) before any is
        stored."""
        with self._claim():
            l, s = self._layer(layer), self._seq(seq)
            t = _need_int(t0, "t0")
            dst = [self._block(l, w, s, True) for w in (0, 1)]
            if kv_dtype_scaled(self._kv_dtype):
                dst += [self._scale_block(l, w, s, True) for w in (0, 1)]
            if not isinstance(rows, tuple) or len(rows) != len(dst):
                raise KVSimdTypeError("rows must be the tuple of %d arrays _saved_rows gives, got %s"
                                      % (len(dst), type(rows).__name__))
            n = rows[0].shape[1] if isinstance(rows[0], _np.ndarray) and rows[0].ndim >= 2 else -1
            for i, (d, r) in enumerate(zip(dst, rows)):
                want = (d.shape[0], n) + d.shape[2:]
                if not isinstance(r, _np.ndarray) or r.dtype != d.dtype or r.shape != want or not 0 <= t <= t + n <= d.shape[1]:
                    raise KVSimdValueError("rows[%d] must be %s %s at slots %d.. of %d, got %s"
                                           % (i, d.dtype, want, t, d.shape[1],
                                              "%s %s" % (getattr(r, "dtype", type(r).__name__), getattr(r, "shape", ""))))
            for d, r in zip(dst, rows):
                d[:, t:t + n] = r

    def commit(self, n, seq=0):
        """Make ``n`` written tokens of sequence ``seq`` part of the cache.  A cache with ``recent``
        float rows takes the float rows write() stored for the last of them when it stored them
        for every layer; else its queries read these tokens, and the ones before, quantized until
        tokens are committed again (KVCache)."""
        cdef int64_t L, k = _need_int(n, "n")
        with self._claim():
            s = self._seq(seq)
            L = self._lengths[s]
            self._commit(s, k)
            self._recent_append(s, L, k)

    cdef int _commit(self, int64_t s, int64_t n) except -1:
        if n < 0 or n > self.capacity - int(self._lengths[s]):
            raise KVSimdCapacityError("cannot commit %d tokens: sequence %d holds %d of %d"
                                      % (n, s, self._lengths[s], self.capacity))
        self._lengths[s] += n
        self._changed()
        return 0

    cdef int _recent_lost(self, int64_t s) except -1:
        """The float rows of sequence s no longer are its last tokens': none are read."""
        if self.recent:
            self._tn[s] = 0
        return self._recent_unpend(s)

    cdef int _recent_append(self, int64_t s, int64_t L, int64_t n) except -1:
        """Tokens L..L+n-1 of sequence s were committed after write(): the float rows the last
        write() stored, of the last of them, join the ring when every layer stored them.  They
        follow the committed ones when that write began at L; when it began later (tokens
        between came from another write) they are the sequence's only float rows, so that the
        ring always holds its newest tokens' rows, none missing.  Else the sequence keeps none."""
        cdef int64_t p0, m, e0, ring = self._ring
        if not self.recent:
            return 0
        p0, m, e0 = (int(x) for x in self._pend[s])
        if not (m > 0 and self._pend_l[s].all() and e0 == (self._th[s] + self._tn[s]) % ring and p0 >= L
                and p0 + m == L + n):
            self._recent_lost(s)
            return 0
        if p0 > L:
            self._th[s], self._tn[s] = e0, 0
        self._recent_join(s, e0, p0, m)
        return self._recent_unpend(s)

    cdef int _recent_unpend(self, int64_t s) except -1:
        """No rows write() stored for sequence s are waiting for a commit."""
        if self.recent:
            self._pend[s, 1] = 0
        return 0

    cdef int _save_ring(self, int64_t s, int64_t e0, int64_t m) except -1:
        """Before ring entries e0..e0+m-1 of sequence s are written: a transaction saves them (KVCache)."""
        return 0

    cdef int _recent_join(self, int64_t s, int64_t e0, int64_t p0, int64_t m) except -1:
        """Ring entries e0.. (after the committed ones) hold the float rows of slots p0..p0+m-1 of
        sequence s, now committed: the oldest beyond ``recent`` leave."""
        cdef int64_t j, tot, drop, ring = self._ring
        for j in range(m):
            self._ttag[s, (e0 + j) % ring] = p0 + j
        tot = self._tn[s] + m
        drop = max(0, tot - self._keep)
        self._th[s] = (self._th[s] + drop) % ring
        self._tn[s] = tot - drop
        return 0

    def _forget(self, seq, n):
        """Drop n tokens from the count of sequence seq (the ring policies free their slots)."""
        with self._claim():
            s = self._seq(seq)
            n = _need_int(n, "n")
            if not 0 <= n <= self._lengths[s]:
                raise KVSimdValueError("cannot forget %d of %d tokens" % (n, self._lengths[s]))
            self._lengths[s] -= n
            self._recent_lost(s)
            self._changed()

    def reset(self, seq=None):
        """Forget the tokens of one sequence (or of all)."""
        with self._claim():
            if seq is None:
                self._lengths[:] = 0
                if self.recent:
                    self._tn[:] = 0
                    self._pend[:, 1] = 0
            else:
                self._lengths[self._seq(seq)] = 0
                self._recent_lost(self._seq(seq))
            self._changed()

    cdef tuple _storage(self):
        """(address, nbytes) of the C block, for overlap checks."""
        return (<size_t>self.c.data, self.c.nbytes)

    cdef object _scratch(self, int64_t H, int nt, int64_t sources=1):
        """The kernel workspace for nt threads (and a call over ``sources`` sources), kept between calls."""
        need = kv_attend_sources_workspace_bytes(H, self.n_kv_heads, self.head_dim, 1, sources, nt)
        if need == 0:
            raise KVSimdValueError("attention with H=%d query heads over %d KV heads: sizes out of range"
                                   % (H, self.n_kv_heads))
        if self._ws is None or self._ws.shape[0] < need + 64:
            self._ws = _workspace(H, self.n_kv_heads, self.head_dim, nt, 1, sources)
        return self._ws

    def attend(self, layer, q, *, seq=0, length=None, scale=None, alibi_slopes=None, query_position=None, out=None,
               softcap=None, float_rows=False):
        """Attention of ``q`` (float32 ``[H, head_dim]``, H a multiple of n_kv_heads) over the first
        ``length`` slots (default: committed length) of ``layer`` for sequence ``seq``, read in place
        as stored (a quantized cache's quantized rows, also where it keeps float rows: ``recent``).
        ALiBi as in ops.attend: ``query_position`` (default ``length - 1``) needs ``alibi_slopes``;
        ``softcap`` as in ops.attend (None or 0: off).

        ``float_rows=True`` (a cache with ``recent`` = R, after a :meth:`write` of this layer's newest
        rows, not yet committed, ending at ``length``): the last keys, up to R of them -- that
        write's rows and the committed float rows just before them -- are read from their float16
        rows and the older ones as stored, under one softmax, as the Decoder's layers read a decode
        step with ``cache_recent=R`` (and ops.attend with ``recent=`` those rows).  Not with ALiBi."""
        cdef kv_attn_params p
        cdef kv_attn_params src[2]
        cdef int64_t H, D = self.head_dim, M = 0, first = 0, ns, w
        cdef int64_t frng[4]
        cdef const float *alibi
        cdef void *wsp
        cdef int nt
        with self._claim():
            l, s = self._layer(layer), self._seq(seq)
            _need_array(q, "q", (_F32,), 2, "[H, head_dim]")
            H = q.shape[0]
            if q.shape[1] != D or H < 1 or H % self.n_kv_heads:
                raise KVSimdValueError("q must be [a multiple of %d, %d], got %s" % (self.n_kv_heads, D, q.shape))
            n = int(self._lengths[s]) if length is None else _need_int(length, "length")
            if not 1 <= n <= self.capacity:
                raise KVSimdValueError("attention needs 1..%d cached tokens, got %d" % (self.capacity, n))
            sc = _need_scale(scale, D)
            cap = _need_softcap(softcap)
            alibi, qpos = NULL, n - 1
            if alibi_slopes is not None:
                alibi_slopes = _need_slopes(alibi_slopes, H)
                alibi = <const float *>_ptr(alibi_slopes)
                if query_position is not None:
                    qpos = _need_pos(query_position, "query_position")
            elif query_position is not None:
                raise KVSimdValueError("query_position only applies with alibi_slopes")
            if out is None:
                out = _np.empty((H, D), dtype=_np.float32)
            else:
                _need_array(out, "out", (_F32,), 2, "[H, head_dim]", writeable=True, shape=(H, D))
                _need_no_overlap(out, "out", (("q", q), ("alibi_slopes", alibi_slopes),
                                              ("the cache storage", self._storage())))
            if not isinstance(float_rows, (bool, _np.bool_)):
                raise KVSimdTypeError("float_rows must be True or False, got %r" % (float_rows,))
            if float_rows:
                if alibi != NULL:
                    raise KVSimdValueError("attend(float_rows=True) does not take alibi_slopes")
                M, first = self._float_tail(l, s, n)
            nt = _threads_now()
            ws = self._scratch(H, nt, 2 if M else 1)
            rng = _np.array([0, 0, n - M, qpos], dtype=_np.int64)
            if self.hadamard:   # the query turned as the rows are (class docstring)
                q = q.copy()
                kv_hadamard_rows(<float *>_ptr(q), D, H, D)
            _attn_init(&p, <const float *>_ptr(q), NULL, kv_cache_block(&self.c, l, 0, s),
                       kv_cache_block(&self.c, l, 1, s), <float *>_ptr(out), alibi, NULL,
                       <const int64_t *>_ptr(rng), 1, H, self.n_kv_heads, D, self.capacity, sc, cap, self._kv_dtype,
                       1, 0, 0, 0, 0, kv_cache_scales(&self.c, l, 0, s), kv_cache_scales(&self.c, l, 1, s),
                       self._v_dtype)
            wsp = _aligned64(ws)
            if M:       # keys n - M..n-1 from the ring's float rows (gathered), the older ones as stored
                fr = self._float_scratch(M)
                for w in range(2):
                    _gather_ring(<uint16_t *>_ptr(fr) + w * self.n_kv_heads * M * D, M,
                                 <uint16_t *>_ptr(self._tail) + ((<int64_t>l * 2 + w) * self.batch + <int64_t>s) * self.n_kv_heads
                                 * self._ring * D, self._ring, first, M, self.n_kv_heads, D)
                ns = 0
                if n > M:
                    src[0] = p
                    ns = 1
                frng[0], frng[1], frng[2], frng[3] = 0, 0, M, qpos
                _attn_init(&src[ns], <const float *>_ptr(q), NULL, _ptr(fr), <uint16_t *>_ptr(fr) + self.n_kv_heads
                           * M * D, <float *>_ptr(out), NULL, NULL, frng, 1, H, self.n_kv_heads, D, M, sc, cap, KV_F16)
                src[ns].key_base = n - M
                with nogil:
                    kv_attend_sources(src, ns + 1, wsp, nt)
            else:
                with nogil:
                    kv_attend(&p, wsp, nt)
            if self.hadamard:
                kv_hadamard_rows(<float *>_ptr(out), D, H, D)
        return out

    cdef tuple _float_tail(self, int64_t l, int64_t s, int64_t n):
        """(M, first): attend(float_rows=True)'s float rows of layer l, sequence s, for keys
        n - M..n-1 -- the rows write() stored beyond the committed ones (ending at n), after the
        committed float rows just before them, at most R in all -- from ring entry ``first`` on."""
        if not self.recent:     # (no ring to read below)
            raise KVSimdValueError("attend(float_rows=True): this cache keeps no float rows (recent=0)")
        cdef int64_t *pend = <int64_t *>_ptr(self._pend) + s * 3
        cdef int64_t ring = self._ring, th = (<int64_t *>_ptr(self._th))[s], tn = (<int64_t *>_ptr(self._tn))[s]
        cdef int64_t *tags = <int64_t *>_ptr(self._ttag) + s * ring
        cdef int64_t p0 = pend[0], m = pend[1], c = 0
        if m == 0 or not (<char *>_ptr(self._pend_l))[s * self.n_layers + l] or p0 + m != n:
            raise KVSimdValueError("attend(float_rows=True) reads the float rows of a write() of layer %d's newest "
                                   "rows, ending at length %d, for sequence %d: there is none" % (l, n, s))
        if m >= self.recent:     # the write's last R rows
            return self.recent, (pend[2] + m - self.recent) % ring
        # then the committed rows before them, while their slots run on to p0 - 1
        while (pend[2] == (th + tn) % ring and c < tn and c + m < self.recent and
               tags[(th + tn - 1 - c) % ring] == p0 - 1 - c):
            c += 1
        return c + m, (th + tn - c) % ring

    cdef set _float_slots(self, int64_t s):
        """The slots of sequence s's committed tokens that have float rows."""
        cdef int64_t ring = self._ring, th = self._th[s], tn = self._tn[s]
        return {int(self._ttag[s, (th + i) % ring]) for i in range(tn)}

    cdef object _float_scratch(self, int64_t M):
        """uint16 [2, n_kv_heads, M, head_dim], kept between calls: attend's gathered float rows."""
        cdef int64_t need = 2 * self.n_kv_heads * M * self.head_dim
        if self._fws is None or self._fws.shape[0] < need:
            self._fws = _np.empty(2 * self.n_kv_heads * self._ring * self.head_dim, dtype=_np.uint16)
        return self._fws



cdef class _CacheClaim:
    """What KVCache._claim() returns: holds the cache for the calling thread while entered."""
    cdef _KVStore cache

    def __enter__(self):
        if self.cache is None:
            raise KVSimdValueError("this claim object was not made by a cache's _claim()")
        self.cache._acquire()
        return self.cache

    def __exit__(self, *exc):
        if self.cache is None:
            raise KVSimdValueError("this claim object was not made by a cache's _claim()")
        self.cache._release()
        return False


def _available_memory():
    """Bytes a new allocation can be given now without the kernel's OOM killer stepping in: Linux's
    MemAvailable plus free swap; elsewhere the machine's RAM (a cache larger than that cannot be used)."""
    try:
        with open("/proc/meminfo") as f:
            kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if ":" in line)}
        return (kib["MemAvailable"] + kib.get("SwapFree", 0)) * 1024
    except (OSError, KeyError, ValueError):
        pass
    try:
        return _cache_os.sysconf("SC_PHYS_PAGES") * _cache_os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 2 ** 62


def _ring_ranges(int64_t start, int64_t count, int64_t base, int64_t width):
    """Slot ranges of ``count`` ring entries starting at slot ``start`` of the ring [base, base+width)."""
    if count <= 0:
        return []
    cdef int64_t first = min(count, width - (start - base))
    out = [(start, start + first)]
    if count > first:
        out.append((base, base + count - first))
    return out


cdef class KVCache(_KVStore):
    """Self-attention K/V cache of a model: storage (see the base) plus, per sequence, the ring
    buffer of StreamingLLM-style infinite generation, owned here.

    Slots ``[0, n_keep)`` hold the attention sinks, ``[n_keep, capacity)`` a ring.  When a
    sequence's window is full, ``policy`` decides (the cache's own methods, run by
    :meth:`begin_step`): "fixed" refuses (KVSimdCapacityError); "reevaluate" drops the
    ``n_discard`` oldest window tokens and tells the caller which tokens to prefill again;
    "shift" drops them and rotates the kept keys back in place (shift-RoPE-K); "sink_query" drops
    the oldest token each step and rewrites nothing (the sinks are read with a query rotated at
    their compressed position instead).  "auto" is resolved by the model that makes the cache.

    A forward pass is ``plan = cache.begin_step(tokens)`` (or ``begin_prefill``), the layers
    (which read and write the cache through the plan), then ``cache.end_step(plan)``, inside
    ``with cache.transaction():`` so that any failure or interrupt puts the cache back as it was.

    ``recent`` = R > 0 (quantized caches only; at most ``capacity``, a larger one taken as that):
    the cache also keeps the float16 K/V rows of each
    sequence's last R tokens (a ring of 4R rows per layer, sequence and KV head: up to 2R committed,
    so that a truncate of up to R tokens -- rejected draft tokens -- leaves R, and 2R for a pass's
    new ones; turned by H as the quantized rows are when ``hadamard``), and every query of
    a step or prefill plan reads its last R keys, itself included, from them and older keys
    quantized, all under one softmax (kvsimd.h kv_attend_sources).  4-bit keys cost most where a
    query looks hardest, at its last tokens: R = 32 takes SmolLM2's int4 perplexity cost from
    about 4% to a fraction of one (README).  The quantized rows of every token are stored as
    well, so where float rows are missing the quantized ones are read: after :meth:`commit` or
    :meth:`append` of rows that write() stored for some layers only or over committed tokens
    (write() of every layer stores the float rows of its last R tokens, which the commit takes;
    else none are read until tokens are committed again), for tokens a :meth:`truncate` leaves
    behind the dropped ones, for the sinks of a ring that wrapped (its float rows cover window
    tokens only), and by explicit plans (:meth:`step_plan`, :meth:`step_attend`) and
    :meth:`attend`, which read the quantized rows only -- but ``attend(..., float_rows=True)``
    after a write() of a step's rows reads them and the committed float rows before them (the
    transformers integration's decode step; ops.attend's ``recent_window`` reads both: its
    prompt passes).  ``shift`` rotates the float rows' keys with the others (in float32, one float16
    rounding); transactions restore them bit for bit.  :meth:`recent_rows` copies them.

    Read-only bookkeeping: ``positions`` [batch, capacity] (the position each slot's key was
    rotated to; ALiBi distances use it), ``head`` (ring slot of each sequence's oldest window
    token), ``seen`` (tokens ever appended), ``rotations`` [batch, capacity] (shifts each slot's
    key went through), ``tokens`` (the ids in the cache, oldest first, per sequence).
    """
    cdef readonly int64_t n_keep, n_discard
    cdef int _policy
    cdef object _pos, _head, _seen, _rot    # int64 [B, C], int64 [B], int64 [B], int32 [B, C]
    cdef list _tokens                        # per sequence: ids in the cache, oldest first
    cdef _Tx _tx                             # the open transaction, or None

    def __cinit__(self, n_layers, n_kv_heads, head_dim, capacity, *, batch=1, dtype="float16", hadamard=None, n_keep=0,
                  policy="fixed", n_discard=None, recent=0, **unexpected):
        if unexpected:
            raise KVSimdTypeError("KVCache got unexpected arguments %s" % ", ".join(sorted(unexpected)))
        n_keep = _need_int(n_keep, "n_keep")
        # more than the capacity keeps every token's: as many as it holds
        cdef int64_t rn = min(_cache_recent(recent, self._dtype_name, "int8" if kv_dtype_scaled(self._kv_dtype) else ""),
                              self.capacity)
        if not isinstance(policy, str) or policy not in POLICIES:
            raise KVSimdValueError("policy must be one of %s, got %r" % (", ".join(POLICIES), policy))
        if not 0 <= n_keep < self.capacity:
            raise KVSimdValueError("n_keep must be in 0..capacity-1=%d, got %d" % (self.capacity - 1, n_keep))
        window = self.capacity - n_keep
        if n_discard is None:
            n_discard = max(1, window // 2)
        n_discard = _need_int(n_discard, "n_discard")
        if not 1 <= n_discard <= window:
            raise KVSimdValueError("n_discard must be in 1..%d (the window), got %d" % (window, n_discard))
        if policy == "reevaluate" and n_keep + window - n_discard < 1:
            raise KVSimdValueError("policy 'reevaluate' re-prefills the tokens a discard keeps, so n_discard must leave "
                                   "at least one: with n_keep=0 and capacity %d, %s, got n_discard=%d"
                                   % (self.capacity, "n_discard must be in 1..%d" % (window - 1) if window > 1
                                      else "the capacity must be at least 2", n_discard))
        self.n_keep, self.n_discard, self._policy = n_keep, n_discard, POLICIES.index(policy)
        try:   # 12 bytes per slot beside the K/V: what the up-front memory check does not count
            self._pos = _np.zeros((self.batch, self.capacity), dtype=_np.int64)
            self._rot = _np.zeros((self.batch, self.capacity), dtype=_np.int32)
        except MemoryError:
            raise KVSimdMemoryError("a KVCache of batch %d and capacity %d: its positions and rotations (%d bytes) "
                                    "cannot be allocated" % (self.batch, self.capacity,
                                                             12 * self.batch * self.capacity)) from None
        self._head = _np.full(self.batch, n_keep, dtype=_np.int64)
        self._seen = _np.zeros(self.batch, dtype=_np.int64)
        self._tokens = [[] for _ in range(self.batch)]
        self._tx = None
        if rn:
            shape = (self.n_layers, 2, self.batch, self.n_kv_heads, 4 * rn, self.head_dim)
            need = 2 * self.n_layers * 2 * self.batch * self.n_kv_heads * 4 * rn * self.head_dim
            if need > _available_memory():
                raise KVSimdMemoryError("recent=%d float16 rows (a ring of %d per layer, sequence and KV head) need %d "
                                        "bytes, more than the memory available now" % (rn, 4 * rn, need))
            try:
                self._tail = _np.zeros(shape, dtype=_np.uint16)
            except MemoryError:
                raise KVSimdMemoryError("recent=%d float16 rows need %d bytes: cannot allocate them" % (rn, need)) from None
            self._th = _np.zeros(self.batch, dtype=_np.int64)
            self._tn = _np.zeros(self.batch, dtype=_np.int64)
            self._ttag = _np.zeros((self.batch, 4 * rn), dtype=_np.int64)
            self._pend = _np.zeros((self.batch, 3), dtype=_np.int64)
            self._pend_l = _np.zeros((self.batch, self.n_layers), dtype=bool)
            self._rtmp = _np.empty(self.n_kv_heads * self.head_dim, dtype=_np.float32)
        self.recent, self._keep, self._ring = rn, 2 * rn, 4 * rn

    # ------------------------------------------------------------------ read-only state
    @property
    def policy(self):
        return POLICIES[self._policy]

    @property
    def positions(self):
        return _readonly(self._pos)

    @property
    def head(self):
        return _readonly(self._head)

    @property
    def seen(self):
        return _readonly(self._seen)

    @property
    def rotations(self):
        return _readonly(self._rot)

    @property
    def tokens(self):
        """The token ids in the cache per sequence, oldest first (copies)."""
        return [list(t) for t in self._tokens]

    def reset(self, seq=None):
        """Forget the tokens of one sequence (or of all), ring bookkeeping included."""
        with self._claim():
            seqs = range(self.batch) if seq is None else [self._seq(seq)]
            for s in seqs:
                if self._tx is not None:
                    self._tx.save_row(s)
                self._lengths[s] = 0
                self._recent_lost(s)
                self._head[s] = self.n_keep
                self._seen[s] = 0
                self._pos[s] = 0
                self._rot[s] = 0
                self._tokens[s] = []
            self._changed()

    def transaction(self):
        """Context manager: everything the cache's bookkeeping and storage go through inside it is
        undone if the block raises (KeyboardInterrupt included).  Nested use joins the outer one."""
        cdef _Tx tx = _Tx.__new__(_Tx)
        tx.cache = self
        return tx

    # ------------------------------------------------------------------ prefill
    def begin_prefill(self, seq, tokens, *, rope=None, alibi_slopes=None, n_heads=None, scale=None, softcap=None,
                      windows=None):
        """Plan a causal pass of ``tokens`` (int64 ids) of sequence ``seq`` after its cached prefix:
        their K/V go to the next slots, row t reads slots 0..start+t.  ``n_heads`` (default
        n_kv_heads) query heads; ``rope`` / ``alibi_slopes`` the model's positions; ``scale`` of
        q.k (default 1/sqrt(head_dim)), ``softcap`` of the scores (None: off); ``windows``: the
        attention windows of the model's layers (a layer with window W reads the last W keys of
        its row's ranges: see begin_step)."""
        cdef int64_t s, start, T, t
        rope = _need_rope(rope)
        with self._claim():
            s = self._seq(seq)
            _need_array(tokens, "tokens", (_I64,), 1, "[T]")
            T = tokens.shape[0]
            start = self._lengths[s]
            if self._head[s] != self.n_keep or self._seen[s] != start:
                raise KVSimdValueError("sequence %d has wrapped its ring buffer: feed further tokens with step()" % s)
            if T < 1 or start + T > self.capacity:
                raise KVSimdCapacityError("prompt of %d tokens after %d cached exceeds capacity %d (sequence %d)"
                                          % (T, start, self.capacity, s))
            H = self.n_kv_heads if n_heads is None else _need_int(n_heads, "n_heads")
            p = _new_plan(self, 1, T, H, self.n_kv_heads, self.head_dim, rope, alibi_slopes, scale, softcap, windows)
            p.seq = s
            p.seqs[:] = s
            p.slots[:] = _np.arange(start, start + T)
            p.kpos[:] = p.slots
            p.spos[:] = p.slots
            p.embed_positions = _readonly(p.kpos)
            p.tokens = _readonly(tokens.copy())
            _plan_prefix(p, p.slots + 1, p.slots)
            _plan_tables(p)
            if self.recent:
                _plan_recent(p, self, None)
            if self._tx is not None:
                self._tx.save_row(s)
                if self.recent:
                    self._tx.save_recent(s, p.tidx)
            self._pos[s, start:start + T] = p.slots     # invisible until committed; ALiBi reads them
            p.key_pos = self._pos
        return p

    def end_prefill(self, plan):
        """Commit the tokens of a prefill plan."""
        cdef _Plan p = _need_plan(plan)
        with self._claim():
            if p.owner is not self or p.kind != 1:
                raise KVSimdValueError("end_prefill needs a plan of begin_prefill on this cache")
            self._need_current(p, "end_prefill")
            self._took(p.seq, p.R, p.tokens.tolist())
            self._recent_took(p)

    cdef int _took(self, int64_t s, int64_t T, list ids) except -1:
        """Commit T prefilled tokens of sequence s (their slots and positions already set)."""
        self._commit(s, T)
        self._seen[s] += T
        self._tokens[s].extend(ids)
        return 0

    def append(self, seq, n, tokens=None):
        """Commit the ``n`` tokens of sequence ``seq`` whose K/V were stored with :meth:`write` right
        after its committed ones, with the bookkeeping a prefill of them gets (positions, ``seen``,
        token ids: ``tokens`` int64 ``[n]``, default -1, unknown): the low-level form of
        begin_prefill / end_prefill for callers that run attention themselves (the transformers
        integration).  Like begin_prefill, only before the sequence's ring has wrapped; under
        "reevaluate" ``tokens`` are required (a discard prefills them again)."""
        with self._claim():
            self._append(self._seq(seq), _need_int(n, "n"), tokens, "append")

    def commit(self, n, seq=0):
        """Commit ``n`` tokens of sequence ``seq`` written with :meth:`write`: on a KVCache what
        ``append(seq, n)`` does (their positions and ``seen``, token ids unknown), so that a later
        step's discard finds the bookkeeping it keeps; ``n`` = 0 changes nothing.  Under
        "reevaluate", which prefills the kept token ids again, append them with their tokens."""
        cdef int64_t k = _need_int(n, "n")
        with self._claim():
            s = self._seq(seq)
            if k != 0:
                self._append(s, k, None, "commit")

    cdef int _append(self, int64_t s, int64_t k, tokens, str verb) except -1:
        cdef int64_t start = self._lengths[s]
        if self._head[s] != self.n_keep or self._seen[s] != start:
            raise KVSimdValueError("sequence %d has wrapped its ring buffer: %s works before that; feed "
                                   "further tokens with begin_step" % (s, verb))
        if k < 1 or k > self.capacity - start:   # not start + k: that can wrap
            raise KVSimdCapacityError("cannot %s %d tokens after %d cached: n must be in 1..%d (capacity %d, "
                                      "sequence %d)" % (verb, k, start, self.capacity - start, self.capacity, s))
        if tokens is None:
            if self._policy == _P_REEVALUATE:
                raise KVSimdValueError("policy 'reevaluate' prefills the kept token ids again after a discard: "
                                       "%s needs them (append(seq, n, tokens))" % verb)
            ids = [-1] * k
        else:
            _need_array(tokens, "tokens", (_I64,), 1, "[n]", shape=(k,))
            ids = tokens.tolist()
        if self._tx is not None:
            self._tx.save_row(s)
        self._pos[s, start:start + k] = _np.arange(start, start + k)
        self._took(s, k, ids)
        self._recent_append(s, start, k)      # the float rows write() stored, if it stored them all
        return 0

    # ------------------------------------------------------------------ decode step
    def begin_step(self, tokens, *, rope=None, alibi_slopes=None, n_heads=None, scale=None, softcap=None,
                   windows=None):
        """Plan one decode step (one token per sequence): make room where a window is full (the
        policy), pick each token's slot and positions and its key ranges.  Under "reevaluate" the
        returned plan may only carry ``refill`` (sequence -> token ids): those sequences were
        emptied, the caller prefills the ids, then calls begin_step again.

        ``scale``, ``softcap`` and ``windows``: as in begin_prefill.  An attention window is a
        per-layer limit on top of the cache's own (the sinks and the ring): a layer with window W
        reads the last W of the keys the cache holds for the row, oldest first -- the sinks only
        while the row holds at most W keys, as in the model without a cache."""
        cdef int64_t B = self.batch, C = self.capacity, nk = self.n_keep, W = C - nk, b, L, slot, Lp, kpos, comp
        rope = _need_rope(rope)
        with self._claim():
            _need_array(tokens, "tokens", (_I64,), 1, "[batch]", shape=(B,))
            H = self.n_kv_heads if n_heads is None else _need_int(n_heads, "n_heads")
            lengths = self._lengths
            if (lengths == 0).any():
                raise KVSimdValueError("sequences %s have no prompt yet: prefill them first"
                                       % _np.nonzero(lengths == 0)[0].tolist())
            if self._policy == _P_FIXED and (lengths + 1 > C).any():
                raise KVSimdCapacityError("cache full: sequences %s hold %d tokens"
                                          % (_np.nonzero(lengths + 1 > C)[0].tolist(), C))
            if self._policy == _P_SHIFT and rope is None and alibi_slopes is None:
                raise KVSimdValueError("policy 'shift' needs the model's rope or alibi_slopes")
            # every argument checked before a full window discards tokens: a bad one leaves the cache as it was
            checked = _plan_args(H, self.n_kv_heads, self.head_dim, rope, alibi_slopes, scale, softcap, windows)
            refill = {}
            for b in range(B):
                if lengths[b] == C:
                    if self._policy == _P_REEVALUATE:
                        refill[b] = tuple(self._discard_reevaluate(b))
                    elif self._policy == _P_SHIFT:
                        self._discard_shift(b, rope)
                    elif self._policy == _P_SINK_QUERY:
                        self._discard_sink_query(b)
                    else:
                        raise KVSimdCapacityError("cache full: sequence %d holds %d tokens" % (b, C))
            p = _new_plan(self, 0, B, H, self.n_kv_heads, self.head_dim, rope, alibi_slopes, None, None, None, checked)
            if refill:
                p.refill = _MappingProxyType(refill)
                return p
            per_row, chrono = [], []
            for b in range(B):
                L = self._lengths[b]
                slot = L if (L < nk or W == 0) else nk + (self._head[b] - nk + (L - nk)) % W
                Lp = L + 1                                   # valid tokens after this step
                comp = Lp - 1
                kpos = self._seen[b] if self._policy == _P_SINK_QUERY else comp
                ranges = [(True, 0, min(nk, Lp), comp)] if nk else []
                ring = [(False, t0, t1, kpos) for t0, t1 in _ring_ranges(self._head[b], Lp - nk, nk, W)] \
                    if Lp > nk else []
                # the window's keys carry their own positions, so slot order does not matter
                # to the softmax: in slot order, ranges that touch become one kernel range
                per_row.append(ranges + sorted(ring))
                chrono.append(ranges + ring)      # oldest key first: attention windows cut it
                p.seqs[b], p.slots[b], p.kpos[b] = b, slot, kpos
                p.spos[b] = comp if nk else kpos
                if self._tx is not None:
                    self._tx.save_cell(b, slot)
                    if self._policy == _P_SINK_QUERY and b in self._tx.rows:
                        self._tx.save_kv(b, slot, slot + 1)  # the oldest window token's K/V, overwritten now
            p.embed_positions = _readonly(p.spos if self._policy == _P_SINK_QUERY else p.kpos)
            p.tokens = _readonly(tokens.copy())
            _plan_ranges(p, per_row, chrono)
            _plan_tables(p)
            if self.recent:
                _plan_recent(p, self, chrono)
                if self._tx is not None:
                    for b in range(B):
                        self._tx.save_recent(b, p.tidx[b:b + 1])
            for b in range(B):
                self._pos[b, p.slots[b]] = p.kpos[b]     # invisible until committed; ALiBi reads it
            p.key_pos = self._pos
        return p

    def end_step(self, plan):
        """Commit the step's tokens."""
        cdef int64_t b
        cdef _Plan p = _need_plan(plan)
        with self._claim():
            if p.owner is not self or p.kind != 0 or p.refill or p.explicit:
                raise KVSimdValueError("end_step needs a plan of begin_step on this cache (without refill)")
            self._need_current(p, "end_step")
            for b in range(self.batch):
                self._rot[b, p.slots[b]] = 0
                self._seen[b] += 1
                self._tokens[b].append(int(p.tokens[b]))
                self._lengths[b] += 1
            self._recent_took(p)
            self._changed()

    # ------------------------------------------------------------------ recent float rows
    cdef int _recent_took(self, _Plan p) except -1:
        """The float rows a committed plan stored (tidx) join its sequences' rings, the oldest
        beyond ``recent`` leaving.  A plan whose K/V write() stored (the low-level prefill:
        begin_prefill, write, end_prefill; a step the same way) takes the float rows write()
        stored when it stored them for every layer (_recent_append); one whose rows a plan wrote
        for some layers and write() for others keeps none."""
        cdef int64_t r, s, tot, drop, ring = self._ring
        if not self.recent:
            return 0
        if p.rn == 0 or self._writer != p.serial:
            if self._writer == 0 and p.kind == 1:       # write() stored the rows: its float rows, if all
                self._recent_append(p.seq, p.slots[0], p.R)
            elif self._writer == 0:
                for r in range(p.R):
                    self._recent_append(p.seqs[r], p.slots[r], 1)
            else:
                for r in range(p.R):
                    self._recent_lost(p.seqs[r])
            return 0
        for r in range(p.R):
            self._recent_unpend(p.seqs[r])
            if p.tidx[r] < 0:
                continue
            self._recent_join(p.seqs[r], p.tidx[r], p.slots[r], 1)
        return 0

    cdef int _save_ring(self, int64_t s, int64_t e0, int64_t m) except -1:
        if self._tx is not None:
            self._tx.save_recent(s, (e0 + _np.arange(m)) % self._ring)
        return 0

    cdef int _recent_keep(self, int64_t s, int64_t n) except -1:
        """At most the newest ``n`` float rows of sequence s stay (a discard left fewer tokens after
        the sinks; a truncate: see there)."""
        self._recent_unpend(s)
        if self.recent and self._tn[s] > n:
            self._th[s] = (self._th[s] + self._tn[s] - max(n, 0)) % self._ring
            self._tn[s] = max(n, 0)
        return 0

    def recent_rows(self, layer, seq=0):
        """A copy of the float rows a cache with ``recent`` > 0 holds for one layer and sequence,
        oldest first: ``(k, v)`` float16 ``[n_kv_heads, n, head_dim]``, the last n <= recent
        committed tokens' K/V as the model computed them (RoPE'd keys), rounded to float16 --
        with ``hadamard``, turned as the quantized rows are (H x / 32 over whole blocks of 32).
        (The ring keeps up to 2R committed rows, so that a truncate of up to R tokens leaves R.)"""
        cdef int64_t n
        with self._claim():
            l, s = self._layer(layer), self._seq(seq)
            if not self.recent:
                raise KVSimdValueError("recent_rows: this cache keeps no float rows (recent=0)")
            n = min(int(self._tn[s]), self.recent)
            idx = (self._th[s] + self._tn[s] - n + _np.arange(n)) % self._ring
            return tuple(self._tail[l, w, s][:, idx].view(_np.float16) for w in (0, 1))

    # ------------------------------------------------------------------ rollback
    def truncate(self, seq, n):
        """Drop the newest ``n`` tokens of sequence ``seq`` (speculative decoding's rollback): its
        length, token list and seen count shrink by ``n``, the dropped tokens' slots become empty
        (position and rotation 0; their K/V are never read again) and the next token goes into the
        first of them.  After a wrap the ring head stays: the kept tokens are those before the
        dropped ones in ring order, at the positions they have (under "shift", rotated back).

        Tokens a window discarded cannot come back, so ``n`` is at most the tokens held
        (``length(seq)``); under "sink_query" once the ring has wrapped, at most the window's
        (``length(seq) - n_keep``): its next tokens take positions from ``seen``, which the sink
        slots cannot.  A sequence truncated to nothing is a fresh one (prefill works again).
        Inside a transaction the truncation is undone with it."""
        cdef int64_t s, k, L, nk = self.n_keep, W = self.capacity - self.n_keep, a, limit
        with self._claim():
            s = self._seq(seq)
            k = _need_int(n, "n")
            L = self._lengths[s]
            wrapped = self._seen[s] != L or self._head[s] != nk      # the window discarded tokens
            limit = max(L - nk, 0) if (wrapped and self._policy == _P_SINK_QUERY) else L
            if not 0 <= k <= limit:
                raise KVSimdValueError("truncate: n must be in 0..%d for sequence %d (it holds %d tokens%s), got %d"
                                       % (limit, s, L, ", %d of them sinks a wrapped 'sink_query' ring keeps" % nk
                                          if limit < L else "", k))
            if k == 0:
                return
            a = L - k                                    # first dropped token (cache order)
            ranges = [(a, min(L, nk))] if a < nk else []
            if L > nk:
                first = max(a, nk) - nk                  # ring index of the first dropped window token
                ranges += _ring_ranges(nk + (self._head[s] - nk + first) % W, L - nk - first, nk, W)
            if self._tx is not None:
                self._tx.save_row(s)
                for t0, t1 in ranges:                    # the next steps overwrite these slots
                    self._tx.save_kv(s, t0, t1)
            for t0, t1 in ranges:
                self._pos[s, t0:t1] = 0
                self._rot[s, t0:t1] = 0
            self._lengths[s] = a
            self._seen[s] -= k
            if self.recent:                              # the newest float rows go with their tokens
                self._tn[s] = max(0, self._tn[s] - k)
                self._recent_unpend(s)
            if a == 0:                                   # emptied: a fresh sequence, prefill works again
                self._head[s], self._seen[s] = nk, 0
            del self._tokens[s][a:]
            self._changed()

    # ------------------------------------------------------------------ explicit plans
    def step_plan(self, HD, slots, kpos, spos, ranges, *, rope=None, alibi_slopes=None, scale=None,
                  key_positions=None):
        """A decode-step plan from explicit slots, positions and key ranges: the low-level form of
        begin_step, for callers that run their own ring (and for tests).  Row b's k/v go to slot
        ``slots[b]`` of sequence b, q and k are rotated at ``kpos[b]`` when ``rope`` (a RopeSpec or
        ``(theta, style, rotary_dim)``); ``ranges[b]`` lists ``(use_sink_query, t0, t1,
        query_position)`` key ranges read under one softmax, a sink-query range with q rotated at
        ``spos[b]``.  ALiBi distances use ``key_positions`` ([batch, capacity] int64; default the
        cache's positions).  The plan is validated once, for every layer, and holds copies of what
        C reads; end_step does not take it (nothing is committed).  A slot of a committed token
        that has a float row (``recent``) costs the sequence its float rows, as write() there does."""
        cdef int64_t B = self.batch, D = self.head_dim, C = self.capacity, H
        with self._claim():
            HD = _need_int(HD, "HD", 1, _MAX_HEADS * D)
            H = HD // D
            if HD % D or H % self.n_kv_heads:
                raise KVSimdValueError("HD (the width of out) must be H * %d with H a multiple of %d, got %d"
                                       % (D, self.n_kv_heads, HD))
            for name, a in (("slots", slots), ("kpos", kpos), ("spos", spos)):
                _need_array(a, name, (_I64,), 1, "[batch]")
                if a.shape[0] != B:
                    raise KVSimdValueError("%s must have %d entries, got %d" % (name, B, a.shape[0]))
            if ((slots < 0) | (slots >= C)).any():
                raise KVSimdCapacityError("slots %s outside 0..%d" % (slots.tolist(), C - 1))
            _need_positions(kpos, "kpos", B, "batch")
            _need_positions(spos, "spos", B, "batch")
            if isinstance(ranges, (str, bytes)) or not hasattr(ranges, "__len__"):
                raise KVSimdTypeError("ranges must be a list of one list of key ranges per sequence, got %r" % (ranges,))
            if len(ranges) != B:
                raise KVSimdValueError("ranges must have one list per sequence (%d), got %d" % (B, len(ranges)))
            if rope is not None and not isinstance(rope, RopeSpec):
                if not isinstance(rope, (tuple, list)) or len(rope) != 3:
                    raise KVSimdValueError("rope must be a RopeSpec or (theta, style, rotary_dim), got %r" % (rope,))
                rope = RopeSpec(rope[0], rope[1], rope[2], D)
            if self.recent:     # a slot whose committed token has a float row: they would no longer match
                for b in range(B):
                    if int(slots[b]) in self._float_slots(b):
                        self._recent_lost(b)
                        self._changed()
            p = _new_plan(self, 0, B, H, self.n_kv_heads, D, rope, alibi_slopes)
            p.explicit = True
            p.seqs[:] = _np.arange(B)
            p.slots[:], p.kpos[:], p.spos[:] = slots, kpos, spos
            _plan_ranges(p, [_key_ranges(ranges[b], C, None, True) for b in range(B)])
            p.scale = _need_scale(scale, D)
            if alibi_slopes is not None:
                kp = self._pos if key_positions is None else key_positions
                _need_array(kp, "key_positions", (_I64,), 2, "[batch, capacity]", shape=(B, C))
                if kp.min() < -_MAX_EXACT_POS or kp.max() > _MAX_EXACT_POS:
                    raise KVSimdPositionError("key_positions must be within +-2**53, got min %d max %d"
                                              % (kp.min(), kp.max()))
                p.key_pos = _np.ascontiguousarray(kp).copy()
            _plan_tables(p)
        return p

    def step_attend(self, layer, qkv, out, slots, kpos, spos, ranges, *, rope=None, alibi_slopes=None, scale=None,
                    key_positions=None):
        """One decode step of self-attention for layer ``layer``, every sequence of the batch, in
        one call: ``step_plan(...)`` then the attention the compiled layers run per layer.
        ``qkv`` float32 ``[batch, (H + 2 n_kv_heads) * head_dim]`` (each row the token's q, k, v,
        heads contiguous; rotated in place with ``rope``, and its q turned in place by H when the
        cache stores turned rows, ``hadamard``: it is the layer's scratch); writes ``out`` float32
        ``[batch, H * head_dim]``.  k/v are stored at ``slots`` (invisible until committed)."""
        cdef _Plan plan
        with self._claim():
            l = self._layer(layer)
            _need_array(out, "out", (_F32,), 2, "[batch, H * head_dim]", writeable=True)
            plan = self.step_plan(out.shape[1], slots, kpos, spos, ranges, rope=rope, alibi_slopes=alibi_slopes,
                                  scale=scale, key_positions=key_positions)
            _need_array(out, "out", (_F32,), 2, "", shape=(self.batch, plan.HD))
            width = plan.HD + 2 * self.n_kv_heads * self.head_dim
            _need_array(qkv, "qkv", (_F32,), 2, "[batch, (H + 2 n_kv_heads) * head_dim]", writeable=True,
                        shape=(self.batch, width))
            _need_no_overlap(out, "out", (("qkv", qkv), ("the cache storage", self._storage())))
            _need_no_overlap(qkv, "qkv", (("the cache storage", self._storage()),))
            _attend_rows(plan, self, l, <float *>_ptr(qkv), width, <float *>_ptr(out))
        return out

    # ------------------------------------------------------------------ the policies
    cdef list _discard_reevaluate(self, int64_t b):
        """Empty sequence b; return the ids to prefill again (the sinks and the window without
        its n_discard oldest tokens)."""
        if self._tx is not None:
            self._tx.save_row(b)
            self._tx.save_kv(b, 0, self.capacity)
        toks = self._tokens[b]
        kept = toks[:self.n_keep] + toks[self.n_keep + self.n_discard:]
        self.reset(b)
        return kept

    cdef int _discard_shift(self, int64_t b, RopeSpec rope) except -1:
        """Drop the n_discard oldest window tokens of sequence b and rotate the kept keys back
        by as many positions (with ALiBi only their positions move).  The rotation is the
        delta's alone (kv_shift_keys): a scaled spec's attention factor is in the keys once."""
        cdef int64_t nk = self.n_keep, nd = self.n_discard, W = self.capacity - nk
        if self._tx is not None:
            self._tx.save_row(b)
            self._tx.save_kv(b, 0, self.capacity)
            if self.recent:
                self._tx.save_recent(b, _np.arange(self._ring))
        keep_start = nk + (self._head[b] - nk + nd) % W
        for t0, t1 in _ring_ranges(keep_start, W - nd, nk, W):
            if rope is not None:
                self._shift(b, t0, t1, -nd, rope)
                self._rot[b, t0:t1] += 1
            self._pos[b, t0:t1] -= nd
        self._head[b] = keep_start
        self._lengths[b] -= nd
        self._recent_keep(b, W - nd)
        if rope is not None:
            self._recent_shift(b, -nd, rope)
        del self._tokens[b][nk:nk + nd]
        self._changed()
        return 0

    cdef int _discard_sink_query(self, int64_t b) except -1:
        """Drop the oldest window token of sequence b (its slot takes the new token)."""
        cdef int64_t nk = self.n_keep, W = self.capacity - nk
        if self._tx is not None:
            self._tx.save_row(b)
        self._head[b] = nk + (self._head[b] - nk + 1) % W
        self._lengths[b] -= 1
        self._recent_keep(b, self._lengths[b] - nk)
        del self._tokens[b][nk]
        self._changed()
        return 0

    cdef int _before_write(self, int64_t l, int64_t s, int64_t t0, int64_t t1) except -1:
        """A write over committed tokens of sequence s (slots t0..t1-1 of layer l): in a
        transaction their K/V are saved first, to be undone with it; their float rows
        (``recent``) no longer hold them, so the sequence keeps none (and plans made before are
        stale: they would read them), nor does the write store any (write() takes the 1 this
        returns then: every layer alike, whatever the order of the layers' writes)."""
        cdef int64_t nk = self.n_keep, L = self._lengths[s], a, b
        if self._tx is None and not self.recent:
            return 0
        held = ([(0, min(nk, L))] if nk else []) + \
            _ring_ranges(self._head[s], L - nk, nk, self.capacity - nk)
        over = False
        for a, b in held:
            a, b = max(a, t0), min(b, t1)
            if a < b:
                over = True
                if self._tx is not None:
                    self._tx.save_kv(s, a, b, l)
        if over and self.recent:
            self._recent_lost(s)
            self._changed()
        return over

    cdef int _recent_shift(self, int64_t s, int64_t delta, RopeSpec rope) except -1:
        """Rotate the keys of sequence s's float rows by ``delta`` positions, as _shift rotates the
        quantized ones: in float32 and rounded to float16 once (turned rows turned back first and
        again after)."""
        cdef int64_t n, D = self.head_dim, Hkv = self.n_kv_heads, l
        cdef kv_status rc
        if not self.recent or self._tn[s] == 0:
            return 0
        n = self._tn[s]
        idx = (self._th[s] + _np.arange(n)) % self._ring
        wb = D // KV_I8_BLOCK * KV_I8_BLOCK
        for l in range(self.n_layers):
            x = _np.ascontiguousarray(self._tail[l, 0, s][:, idx].view(_np.float16).astype(_np.float32))
            if self.hadamard:            # H (H x / 32) = x
                kv_hadamard_rows(<float *>_ptr(x), D, Hkv * n, D)
            rc = kv_shift_keys(_ptr(x), NULL, KV_F32, 0, Hkv, n, D, delta, rope.inv, rope.st, rope.rotary_dim, 0, n)
            _check_status(rc, "shift of the float rows")
            if self.hadamard:
                x[..., :wb] *= _np.float32(1.0 / KV_I8_BLOCK)
                kv_hadamard_rows(<float *>_ptr(x), D, Hkv * n, D)
            self._tail[l, 0, s][:, idx] = x.astype(_np.float16).view(_np.uint16)
        return 0

    cdef int _shift(self, int64_t s, int64_t t0, int64_t t1, int64_t delta, RopeSpec rope) except -1:
        cdef kv_status rc
        cdef void *kp
        cdef float *ksp
        cdef int64_t layer
        for layer in range(self.n_layers):
            kp = kv_cache_block(&self.c, layer, 0, s)
            ksp = kv_cache_scales(&self.c, layer, 0, s)
            with nogil:
                rc = kv_shift_keys(kp, ksp, self._kv_dtype, self.hadamard, self.n_kv_heads, self.capacity, self.head_dim,
                                   delta, rope.inv, rope.st, rope.rotary_dim, t0, t1)
            _check_status(rc, "shift_range")
        return 0

    def shift_range(self, seq, t0, t1, delta, theta, style, rotary_dim, *, inv_freq=None):
        """Rotate the keys of slots t0..t1-1 of every layer by ``delta`` positions (shift-RoPE-K);
        ``rotary_dim`` None means head_dim.  Same RoPE parameter rules as ops.shift_keys (the
        frequencies ``inv_freq``, no attention factor)."""
        with self._claim():
            s = self._seq(seq)
            c0, c1 = _need_int(t0, "t0"), _need_int(t1, "t1")
            if not 0 <= c0 <= c1 <= self.capacity:
                raise KVSimdValueError("slot range t0..t1 = %d..%d outside 0..%d" % (c0, c1, self.capacity))
            spec = RopeSpec(theta, style, rotary_dim, self.head_dim, inv_freq)
            d = _need_pos(delta, "delta")
            if self._tx is not None:   # undone with the transaction, bit for bit
                self._tx.save_kv(s, c0, c1)
            self._shift(s, c0, c1, d, spec)
            self._recent_lost(s)       # its float rows no longer hold the keys of their slots
            self._changed()


cdef class CrossAttentionCache(_KVStore):
    """Per-layer K/V of the encoder output, projected once per request and sequence (see
    EncoderDecoder.cross_for); decode steps read it with no positions and no mask."""

    def __cinit__(self, n_layers, n_kv_heads, head_dim, capacity, *, batch=1, dtype="float16", hadamard=None,
                  **unexpected):
        if unexpected:
            raise KVSimdTypeError("CrossAttentionCache got unexpected arguments %s (it has no ring buffer)"
                                  % ", ".join(sorted(unexpected)))


cdef class _Tx:
    """A cache transaction (KVCache.transaction()): what a prefill or a decode step may change is
    saved before it changes, so that a failure or an interrupt puts the cache back exactly as it was.

    Always saved: each sequence's length, ring head, seen count and token-list length (a few
    integers), and the (position, rotation) of each slot a step writes -- a step writes K/V only
    into slots beyond the committed tokens, which stay invisible until the commit.  A sequence
    whose window is full (the step discards tokens) also has its bookkeeping row saved and the K/V
    the discard rewrites: every slot of every layer under "reevaluate" and "shift" (once per
    discard, i.e. every ``n_discard`` steps), only the overwritten slot under "sink_query".  A
    truncate saves the row and the K/V of the slots it empties (later steps overwrite them); a
    write() over committed tokens, and shift_range, the K/V they rewrite."""
    cdef KVCache cache
    cdef bint outer
    cdef int state                  # 0 not entered yet, 1 open, 2 exited: one use per object
    cdef object lengths, head, seen
    cdef object th, tn, ttag        # recent float rows: ring bookkeeping
    cdef set ring_saved             # (sequence, ring entry) pairs whose rows ``tail`` holds
    cdef list ntok, cells, kv, tail
    cdef readonly dict rows

    def __enter__(self):
        c = self.cache
        if c is None:
            raise KVSimdValueError("this transaction object was not made by cache.transaction()")
        if self.state != 0:
            raise KVSimdValueError("this transaction object is already %s: call cache.transaction() for each "
                                   "with-block (nested ones join the outer)" % ("open" if self.state == 1 else "used"))
        c._acquire()
        self.state = 1
        self.outer = c._tx is None
        if self.outer:
            self.lengths, self.head, self.seen = c._lengths.copy(), c._head.copy(), c._seen.copy()
            self.ntok = [len(t) for t in c._tokens]
            self.rows, self.cells, self.kv, self.tail = {}, [], [], []
            self.ring_saved = set()
            if c.recent:
                self.th, self.tn, self.ttag = c._th.copy(), c._tn.copy(), c._ttag.copy()
            c._tx = self
        return self

    def __exit__(self, exc_type, exc, tb):
        c = self.cache
        if self.state != 1:
            raise KVSimdValueError("this transaction is not open (%s): __exit__ without its __enter__"
                                   % ("never entered" if self.state == 0 else "already exited"))
        try:
            if self.outer:
                if exc_type is not None:
                    self.restore()
                c._tx = None
        finally:
            self.state = 2
            c._release()
        return False

    cdef save_row(self, int64_t b):
        if b not in self.rows:
            k = self.cache
            self.rows[b] = (k._pos[b].copy(), k._rot[b].copy(), list(k._tokens[b]))
            self.cells.append((b, -1, 0, 0))    # in the journal: the row's positions and rotations

    cdef save_cell(self, int64_t b, int64_t slot):
        k = self.cache
        self.cells.append((b, slot, int(k._pos[b, slot]), int(k._rot[b, slot])))

    cdef save_recent(self, int64_t b, idx):
        """The float rows (every layer, K and V) in ring entries ``idx`` of sequence b, which a
        plan stores into or a shift rotates."""
        k = self.cache
        idx = [int(e) for e in _np.asarray(idx) if e >= 0 and (b, int(e)) not in self.ring_saved]
        if idx:
            self.ring_saved.update((b, e) for e in idx)
            idx = _np.asarray(idx)
            self.tail.append((b, idx, k._tail[:, :, b][..., idx, :].copy()))

    cdef save_kv(self, int64_t b, int64_t t0, int64_t t1, int64_t layer=-1):
        """The K/V (and scales) of slots t0..t1-1 of sequence b: of every layer, or of ``layer``."""
        k = self.cache
        for l in (range(k.n_layers) if layer < 0 else (layer,)):
            self.kv.append((l, b, t0, k._saved_rows(l, b, t0, t1)))

    def restore(self):
        """Put everything back.  A Ctrl-C (SIGINT) arriving meanwhile is held until the cache is
        whole again, then delivered as usual (main thread; Python runs signal handlers there).
        Only an open outer transaction can be restored: a closed one's records no longer describe
        the cache (later steps moved its ring and rotated its keys)."""
        if self.state != 1 or not self.outer:
            raise KVSimdValueError("restore() needs an open outer transaction, this one is %s"
                                   % ("not entered yet" if self.state == 0 else "closed" if self.state == 2
                                      else "nested in another (the outer one restores)"))
        held, old = [], None
        if _threading.current_thread() is _threading.main_thread() and _signal.getsignal(_signal.SIGINT) is not None:
            try:     # (None: a handler installed outside Python, left alone)
                old = _signal.signal(_signal.SIGINT, lambda signum, frame: held.append(signum))
            except (ValueError, OSError, TypeError):
                old = None
        try:
            self._restore()
        finally:
            if old is not None:
                _signal.signal(_signal.SIGINT, old)
                if held:
                    _signal.raise_signal(_signal.SIGINT)   # the handler the program had decides

    def _restore(self):
        c = self.cache
        for l, b, t0, rows in reversed(self.kv):      # as stored: bit for bit
            c._restore_rows(l, b, t0, rows)
        for b, idx, rows in reversed(self.tail):
            c._tail[:, :, b][..., idx, :] = rows
        if c.recent:
            c._th[:], c._tn[:], c._ttag[:] = self.th, self.tn, self.ttag
            c._pend[:, 1] = 0
        # newest record first, so the oldest value of each slot is the one left (a row may be
        # saved after a step changed a slot of it: a truncate in the transaction)
        for b, slot, p, r in reversed(self.cells):
            if slot < 0:
                c._pos[b], c._rot[b] = self.rows[b][0], self.rows[b][1]
            else:
                c._pos[b, slot], c._rot[b, slot] = p, r
        for b, (p, r, toks) in self.rows.items():
            c._tokens[b] = toks
        for b in range(c.batch):
            del c._tokens[b][self.ntok[b]:]
        c._head[:], c._seen[:], c._lengths[:] = self.head, self.seen, self.lengths
        c._changed()
