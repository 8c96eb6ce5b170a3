# KVCache: the self-attention cache of a whole model, owning its C memory.
import os as _cache_os

from kvsimd.errors import KVSimdBusyError, KVSimdCapacityError

_DTYPES = {"float16": (KV_F16, _F16), "float32": (KV_F32, _F32)}
POLICIES = ("fixed", "reevaluate", "shift", "sink_query", "auto")


def _init_streaming(cache, n_keep, policy, n_discard):
    """Attention-sink bookkeeping: slots [0, n_keep) hold the sinks, [n_keep, capacity) a ring."""
    n_keep = _need_int(n_keep, "n_keep")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise KVSimdValueError("policy must be one of %s, got %r" % (", ".join(POLICIES), policy))
    if not 0 <= n_keep < cache.capacity:
        raise KVSimdValueError("n_keep must be in 0..capacity-1=%d, got %d" % (cache.capacity - 1, n_keep))
    window = cache.capacity - n_keep
    if n_discard is None:
        n_discard = max(1, window // 2)
    n_discard = _need_int(n_discard, "n_discard")
    if not 1 <= n_discard <= window:
        raise KVSimdValueError("n_discard must be in 1..%d (the window), got %d" % (window, n_discard))
    if policy == "reevaluate" and n_keep + window - n_discard < 1:
        raise KVSimdValueError("policy 'reevaluate' re-prefills the tokens a discard keeps, so n_discard must leave "
                               "at least one: with n_keep=0 and capacity %d, %s, got n_discard=%d"
                               % (cache.capacity, "n_discard must be in 1..%d" % (window - 1) if window > 1
                                  else "the capacity must be at least 2", n_discard))
    cache.n_keep, cache.policy, cache.n_discard = n_keep, policy, n_discard
    # position of the token in each slot (as its key was rotated; ALiBi distances use it)
    cache.positions = _np.zeros((cache.batch, cache.capacity), dtype=_np.int64)
    cache.head = _np.full(cache.batch, n_keep, dtype=_np.int64)   # ring slot of the oldest window token
    cache.seen = _np.zeros(cache.batch, dtype=_np.int64)          # tokens ever appended (absolute position)
    cache.rotations = _np.zeros((cache.batch, cache.capacity), dtype=_np.int32)
    cache.tokens = [[] for _ in range(cache.batch)]               # ids in the cache, oldest first


def _reset_streaming(cache, seq):
    seqs = range(cache.batch) if seq is None else [seq]
    for s in seqs:
        cache.head[s] = cache.n_keep
        cache.seen[s] = 0
        cache.positions[s] = 0
        cache.rotations[s] = 0
        cache.tokens[s] = []


cdef class _StepPlan:
    """One decode step's validated slots, positions, key ranges and scratch (see KVCache.step_plan)."""
    cdef object slots, kpos, spos, alibi, rng, nr, two, cs, ws, qs, key_pos, owner
    cdef int64_t B, H, HD, nrmax, rd
    cdef int nt
    cdef double theta
    cdef kv_rope_style st
    cdef bint do_rope
    cdef float scale


cdef class KVCache:
    """Self-attention K/V cache for every layer of a model and every sequence of a batch.

    Storage is one 64-byte-aligned C block, ``[layer][K|V][sequence][kv head][slot][head_dim]``,
    so attention reads each (layer, sequence, head) as one contiguous run.  A forward pass
    writes the new tokens' K/V of each layer with :meth:`write` at slots beyond the committed
    length, then :meth:`commit` makes them part of the cache: a pass that fails half-way
    leaves the cache as it was.  Writing past ``capacity`` raises
    :class:`kvsimd.KVSimdCapacityError` and changes nothing.

    One thread at a time: write, commit, attend, step_plan, step_attend, shift_range and reset
    hold the cache for their duration (see ``_claim``, which a decoder holds for a whole step), and
    a call from another thread meanwhile raises :class:`kvsimd.KVSimdBusyError`.  The views that
    keys() and values() return are the caller's to synchronise.
    """
    cdef kv_cache c
    cdef dict __dict__
    cdef readonly int64_t n_layers, n_kv_heads, head_dim, capacity, batch
    cdef object _np_dtype
    cdef kv_dtype _kv_dtype
    cdef object _lengths
    cdef unsigned long _owner     # thread holding the claim (see _claim), valid while _depth > 0
    cdef int _depth

    def __cinit__(self, n_layers, n_kv_heads, head_dim, capacity, *, batch=1, dtype="float16", n_keep=0,
                  policy="fixed", n_discard=None):
        self._depth = 0
        self._owner = 0
        cdef int64_t nl = _need_int(n_layers, "n_layers", 1), hkv = _need_int(n_kv_heads, "n_kv_heads", 1)
        cdef int64_t hd = _need_int(head_dim, "head_dim", 1, KV_MAX_HEAD_DIM)
        cdef int64_t cap = _need_int(capacity, "capacity", 1, KV_MAX_TOKENS), bt = _need_int(batch, "batch", 1)
        try:
            key = _np.dtype(dtype).name
        except (TypeError, ValueError):
            key = None
        if key not in _DTYPES:
            raise KVSimdTypeError("dtype must be float16 or float32, got %r" % (dtype,))
        self._kv_dtype, self._np_dtype = _DTYPES[key]
        nbytes = int(nl) * 2 * int(bt) * int(hkv) * int(cap) * int(hd) * self._np_dtype.itemsize  # exact: Python ints
        what = ("KVCache(n_layers=%d, n_kv_heads=%d, head_dim=%d, capacity=%d, batch=%d, dtype=%s) needs %d bytes"
                % (nl, hkv, hd, cap, bt, key, nbytes))
        # the storage is zero-filled at once, and the bookkeeping (positions, rotations, token
        # lists) grows with batch x capacity: both must fit what the machine can give now
        need = nbytes + int(bt) * (12 * int(cap) + 128)
        avail = _available_memory()
        if need > avail:
            raise KVSimdMemoryError("%s (%d with its bookkeeping), more than the %d bytes of memory available now"
                                    % (what, need, avail))
        cdef kv_status s = kv_cache_create(&self.c, nl, bt, hkv, cap, hd, self._kv_dtype)
        if s == KV_ERR_NOMEM or s == KV_ERR_CAPACITY:
            raise KVSimdMemoryError("%s: cannot allocate them" % what)
        if s != KV_OK:
            raise KVSimdValueError("%s: bad dimensions (status %d)" % (what, s))
        self.n_layers, self.n_kv_heads, self.head_dim = nl, hkv, hd
        self.capacity, self.batch = cap, bt
        self._lengths = _np.zeros(bt, dtype=_np.int64)
        _init_streaming(self, n_keep, policy, n_discard)

    def __dealloc__(self):
        kv_cache_destroy(&self.c)

    def __reduce__(self):
        raise KVSimdTypeError("a KVCache cannot be pickled or copied (it owns C memory); make a new cache and "
                              "prefill it, or copy its keys()/values() views")

    def __repr__(self):
        return ("KVCache(n_layers=%d, n_kv_heads=%d, head_dim=%d, capacity=%d, batch=%d, dtype=%s, lengths=%s)"
                % (self.n_layers, self.n_kv_heads, self.head_dim, self.capacity, self.batch, self._np_dtype,
                   self._lengths.tolist()))

    cdef int _acquire(self) except -1:
        """Take the one-user claim for the calling thread (re-entrant).  With the GIL held and no
        Python call between the check and the set, so two threads cannot both take it."""
        cdef unsigned long me = PyThread_get_thread_ident()
        if self._depth > 0 and self._owner != me:
            raise KVSimdBusyError("KVCache(n_layers=%d, n_kv_heads=%d, head_dim=%d, capacity=%d, batch=%d) at %#x is "
                                  "in use by thread %d (this is thread %d): one cache serves one thread at a time; "
                                  "share a model between threads, never a cache"
                                  % (self.n_layers, self.n_kv_heads, self.head_dim, self.capacity, self.batch,
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
        return self._np_dtype

    @property
    def nbytes(self):
        return self.c.nbytes

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

    cdef object _block(self, int64_t layer, int which, int64_t seq, bint writeable):
        """[Hkv, capacity, D] NumPy view of one block; its base keeps this cache alive."""
        cdef cnp.npy_intp dims[3]
        dims[0], dims[1], dims[2] = self.n_kv_heads, self.capacity, self.head_dim
        arr = cnp.PyArray_SimpleNewFromData(3, dims, cnp.NPY_FLOAT16 if self._kv_dtype == KV_F16 else cnp.NPY_FLOAT32,
                                            kv_cache_block(&self.c, layer, which, seq))
        cnp.set_array_base(arr, self)
        if not writeable:
            arr.flags.writeable = False
        return arr

    cdef int64_t _len_arg(self, int64_t s, length) except -1:
        n = int(self._lengths[s]) if length is None else _need_int(length, "length")
        if not 0 <= n <= self.capacity:
            raise KVSimdValueError("length must be in 0..%d, got %d" % (self.capacity, n))
        return n

    def keys(self, layer, seq=0, length=None):
        """Read-only zero-copy view ``[n_kv_heads, length, head_dim]`` of the keys (default: the
        committed ones; a larger ``length`` also shows slots written but not yet committed)."""
        l, s = self._layer(layer), self._seq(seq)
        return self._block(l, 0, s, False)[:, :self._len_arg(s, length)]

    def values(self, layer, seq=0, length=None):
        """Read-only zero-copy view ``[n_kv_heads, length, head_dim]`` of the values."""
        l, s = self._layer(layer), self._seq(seq)
        return self._block(l, 1, s, False)[:, :self._len_arg(s, length)]

    def write(self, layer, k, v, *, seq=0, start=None):
        """Store float32 ``k``, ``v`` ``[n_kv_heads, T, head_dim]`` at slots ``start..start+T-1``
        (default: right after the committed tokens) of ``layer``; not visible until committed."""
        with self._claim():
            l, s = self._layer(layer), self._seq(seq)
            _need_array(k, "k", (_F32,), 3, "[n_kv_heads, T, head_dim]")
            _need_array(v, "v", (_F32,), 3, "[n_kv_heads, T, head_dim]")
            if k.shape != v.shape or k.shape[0] != self.n_kv_heads or k.shape[2] != self.head_dim:
                raise KVSimdValueError("k and v must be [%d, T, %d], got %s and %s"
                                       % (self.n_kv_heads, self.head_dim, k.shape, v.shape))
            t0 = int(self._lengths[s]) if start is None else _need_int(start, "start")
            T = k.shape[1]
            if t0 < 0 or t0 + T > self.capacity:
                raise KVSimdCapacityError("cache full: %d tokens at slot %d exceed capacity %d (sequence %d)"
                                          % (T, t0, self.capacity, s))
            # k or v may be views of this cache's own storage: copied first, so that nothing is
            # written before both are known to be usable
            c0, c1 = <size_t>self.c.data, <size_t>self.c.data + self.c.nbytes
            k, v = (_np.array(a) if _addr(a) < c1 and c0 < _addr(a) + <size_t>a.nbytes else a for a in (k, v))
            for which, src in ((0, k), (1, v)):
                blk = self._block(l, which, s, True)
                if self._kv_dtype == KV_F16:
                    for h in range(self.n_kv_heads):
                        to_float16(src[h], out=blk[h, t0:t0 + T])
                else:
                    blk[:, t0:t0 + T] = src

    def commit(self, n, seq=0):
        """Make ``n`` written tokens of sequence ``seq`` part of the cache."""
        with self._claim():
            s = self._seq(seq)
            n = _need_int(n, "n")
            if n < 0 or n > self.capacity - int(self._lengths[s]):
                raise KVSimdCapacityError("cannot commit %d tokens: sequence %d holds %d of %d"
                                          % (n, s, self._lengths[s], self.capacity))
            self._lengths[s] += n

    def _forget(self, seq, n):
        """Drop n tokens from the count of sequence seq (the ring policies free their slots)."""
        with self._claim():
            s = self._seq(seq)
            n = _need_int(n, "n")
            if not 0 <= n <= self._lengths[s]:
                raise KVSimdValueError("cannot forget %d of %d tokens" % (n, self._lengths[s]))
            self._lengths[s] -= n

    def reset(self, seq=None):
        """Forget the tokens of one sequence (or of all)."""
        with self._claim():
            if seq is None:
                self._lengths[:] = 0
                _reset_streaming(self, None)
            else:
                s = self._seq(seq)
                self._lengths[s] = 0
                _reset_streaming(self, s)

    cdef tuple _storage(self):
        """(address, nbytes) of the C block, for overlap checks."""
        return (<size_t>self.c.data, self.c.nbytes)

    def step_attend(self, layer, qkv, out, slots, kpos, spos, ranges, *, rope=None, alibi_slopes=None, scale=None):
        """One decode step of self-attention for layer ``layer``, every sequence of the batch, in
        one call (what a decoder does per layer and token, without per-head Python work).

        ``qkv`` float32 ``[batch, (H + 2 n_kv_heads) * head_dim]``: each row the token's q, k, v
        projections, heads contiguous; rotated in place when ``rope = (theta, style, rotary_dim)``
        (q and k at ``kpos[b]``).  k and v are stored at slot ``slots[b]`` (visible once
        committed).  ``ranges[b]`` lists ``(use_sink_query, t0, t1, query_position)`` key ranges
        read under one softmax; a range with ``use_sink_query`` uses q rotated at ``spos[b]``
        instead.  ALiBi distances use ``self.positions``.  Writes ``out`` float32 ``[batch, H * head_dim]``."""
        cdef _StepPlan plan
        with self._claim():
            l = self._layer(layer)
            _need_array(out, "out", (_F32,), 2, "[batch, H * head_dim]", writeable=True)
            plan = self.step_plan(out.shape[1], slots, kpos, spos, ranges, rope=rope,
                                  alibi_slopes=alibi_slopes, scale=scale)
            _need_array(out, "out", (_F32,), 2, "", shape=(self.batch, plan.HD))
            width = plan.HD + 2 * self.n_kv_heads * self.head_dim
            _need_array(qkv, "qkv", (_F32,), 2, "[batch, (H + 2 n_kv_heads) * head_dim]", writeable=True,
                        shape=(self.batch, width))
            _need_no_overlap(out, "out", (("qkv", qkv), ("the cache storage", self._storage())))
            _need_no_overlap(qkv, "qkv", (("the cache storage", self._storage()),))
            self._attend_plan(l, <float *>_ptr(qkv), width, <float *>_ptr(out), plan)
        return out

    def step_plan(self, HD, slots, kpos, spos, ranges, *, rope=None, alibi_slopes=None, scale=None):
        """Validate one decode step's slots, positions, key ranges, RoPE/ALiBi parameters and scale
        once, for every layer; the plan holds its own copies of what C will read."""
        cdef _StepPlan p = _StepPlan.__new__(_StepPlan)
        cdef int64_t B = self.batch, Hkv = self.n_kv_heads, D = self.head_dim, C = self.capacity
        cdef int64_t H, b, i
        with self._claim():
            HD = _need_int(HD, "HD", 1, _MAX_HEADS * D)
            H = HD // D
            if HD % D or H % Hkv:
                raise KVSimdValueError("HD (the width of out) must be H * %d with H a multiple of %d, got %d"
                                       % (D, Hkv, HD))
            for name, a in (("slots", slots), ("kpos", kpos), ("spos", spos)):
                _need_array(a, name, (_I64,), 1, "[batch]")
                if a.shape[0] != B:
                    raise KVSimdValueError("%s must have %d entries, got %d" % (name, B, a.shape[0]))
            slots, kpos, spos = slots.copy(), kpos.copy(), spos.copy()   # what C reads cannot change under it
            if ((slots < 0) | (slots >= C)).any():
                raise KVSimdCapacityError("slots %s outside 0..%d" % (slots.tolist(), C - 1))
            _need_positions(kpos, "kpos", B, "batch")
            _need_positions(spos, "spos", B, "batch")
            if isinstance(ranges, (str, bytes)) or not hasattr(ranges, "__len__"):
                raise KVSimdTypeError("ranges must be a list of one list of key ranges per sequence, got %r" % (ranges,))
            if len(ranges) != B:
                raise KVSimdValueError("ranges must have one list per sequence (%d), got %d" % (B, len(ranges)))
            p.do_rope = rope is not None
            if p.do_rope:
                if not isinstance(rope, (tuple, list)) or len(rope) != 3:
                    raise KVSimdValueError("rope must be (theta, style, rotary_dim), got %r" % (rope,))
                p.theta, p.st, p.rd = _rope_params(rope[0], rope[1], rope[2], D)
            if alibi_slopes is not None:
                alibi_slopes = _need_slopes(alibi_slopes, H).copy()
                pos = self.positions
                if not isinstance(pos, _np.ndarray) or pos.shape != (B, C):
                    raise KVSimdValueError("KVCache.positions must be int64 [%d, %d], got %r" % (B, C, pos))
                p.key_pos = _np.ascontiguousarray(pos, dtype=_np.int64).copy()
                if p.key_pos.min() < -_MAX_EXACT_POS or p.key_pos.max() > _MAX_EXACT_POS:
                    raise KVSimdPositionError("KVCache.positions must be within +-2**53, got min %d max %d"
                                              % (p.key_pos.min(), p.key_pos.max()))
            per_seq = [_key_ranges(ranges[b], C, None, True) for b in range(B)]
            nr = max([len(r) for r in per_seq] + [1])
            p.rng = _np.zeros((B, nr, 4), dtype=_np.int64)    # (use sink query, t0, t1, query position)
            p.nr = _np.zeros(B, dtype=_np.int64)
            p.two = _np.zeros(B, dtype=_np.int64)
            for b in range(B):
                i = 0
                for use_s, t0, t1, qpos in per_seq[b]:
                    use_s = 1 if (use_s and p.do_rope and spos[b] != kpos[b]) else 0
                    if use_s:
                        p.two[b] = 1
                    if i and p.rng[b, i - 1, 2] == t0 and p.rng[b, i - 1, 0] == use_s and p.rng[b, i - 1, 3] == qpos:
                        p.rng[b, i - 1, 2] = t1      # adjacent, same query: one range for the kernel
                    else:
                        p.rng[b, i] = (use_s, t0, t1, qpos)
                        i += 1
                p.nr[b] = i
            if p.do_rope:
                # rotation tables of this step's positions, once for every layer: [b][k position | sink position]
                p.cs = _np.zeros((B, 2, p.rd), dtype=_np.float32)
                for b in range(B):
                    kv_rope_table(<float *>_ptr(p.cs) + 2 * b * p.rd, <double>kpos[b], p.theta, p.rd // 2, p.rd)
                    if p.two[b]:
                        kv_rope_table(<float *>_ptr(p.cs) + (2 * b + 1) * p.rd, <double>spos[b], p.theta, p.rd // 2,
                                      p.rd)
            p.slots, p.kpos, p.spos, p.alibi = slots, kpos, spos, alibi_slopes
            p.B, p.H, p.HD, p.nrmax = B, H, HD, nr
            p.scale = _need_scale(scale, D)
            p.nt = _threads_now()
            p.ws, p.qs = self._scratch(H, p.nt)
            p.owner = self
        return p

    cdef tuple _scratch(self, int64_t H, int nt):
        """Buffers kept between calls: kernel workspace (for nt threads), an [H, head_dim] query."""
        ws = getattr(self, "_ws", None)
        need = kv_attend_workspace_bytes(H, self.n_kv_heads, self.head_dim, nt)
        if need == 0:
            raise KVSimdValueError("attention with H=%d query heads over %d KV heads: sizes out of range"
                                   % (H, self.n_kv_heads))
        if ws is None or ws.shape[0] < need + 64:
            ws = self._ws = _workspace(H, self.n_kv_heads, self.head_dim, nt)
        qs = getattr(self, "_qs", None)
        if qs is None or qs.shape[0] < H * self.head_dim:
            qs = self._qs = _np.empty(H * self.head_dim, dtype=_np.float32)
        return ws, qs

    cdef int _attend_plan(self, int64_t l, float *qkv, int64_t row, float *out, _StepPlan plan) except -1:
        """The work of step_attend for a validated plan (no Python objects touched per head).
        ``qkv`` holds ``batch`` rows of ``row`` floats, ``out`` ``batch`` rows of plan.HD."""
        cdef kv_attn_params p
        cdef int64_t B = self.batch, Hkv = self.n_kv_heads, D = self.head_dim, C = self.capacity
        cdef int64_t H = plan.H, HD = plan.HD, b, h, slot
        if plan.owner is not self:
            raise KVSimdValueError("this step plan was made by another KVCache")
        if not 0 <= l < self.n_layers:
            raise KVSimdValueError("layer must be in 0..%d, got %d" % (self.n_layers - 1, l))
        if row != HD + 2 * Hkv * D:
            raise KVSimdValueError("qkv rows must hold %d floats, got %d" % (HD + 2 * Hkv * D, row))
        cdef float *qrow
        cdef float *krow
        cdef float *vrow
        cdef float *qsp = <float *>_ptr(plan.qs)
        cdef const int64_t *slp = <const int64_t *>_ptr(plan.slots)
        cdef const int64_t *rg = <const int64_t *>_ptr(plan.rng)
        cdef const int64_t *nrp = <const int64_t *>_ptr(plan.nr)
        cdef const int64_t *twp = <const int64_t *>_ptr(plan.two)
        cdef const float *csp = <const float *>_ptr(plan.cs) if plan.do_rope else NULL
        cdef const float *alibi = <const float *>_ptr(plan.alibi) if plan.alibi is not None else NULL
        cdef const int64_t *kpos_all = <const int64_t *>_ptr(plan.key_pos) if plan.alibi is not None else NULL
        cdef void *wsp = _aligned64(plan.ws)
        cdef char *kc
        cdef char *vc
        cdef size_t es = 2 if self._kv_dtype == KV_F16 else 4
        cdef int nt = plan.nt
        memset(&p, 0, sizeof(p))
        self._acquire()
        try:
            with nogil:
                for b in range(B):
                    qrow = qkv + b * row
                    krow = qrow + HD
                    vrow = krow + Hkv * D
                    slot = slp[b]
                    if twp[b]:
                        memcpy(qsp, qrow, HD * sizeof(float))
                        kv_rotate_rows(qsp, KV_F32, H, 1, D, csp + (2 * b + 1) * plan.rd, plan.st, plan.rd, 0, 1)
                    if plan.do_rope:
                        kv_rotate_rows(qrow, KV_F32, H, 1, D, csp + 2 * b * plan.rd, plan.st, plan.rd, 0, 1)
                        kv_rotate_rows(krow, KV_F32, Hkv, 1, D, csp + 2 * b * plan.rd, plan.st, plan.rd, 0, 1)
                    kc = <char *>kv_cache_block(&self.c, l, 0, b)
                    vc = <char *>kv_cache_block(&self.c, l, 1, b)
                    for h in range(Hkv):
                        if es == 2:
                            kv_f32_to_f16(<uint16_t *>(kc + ((h * C + slot) * D) * es), krow + h * D, D)
                            kv_f32_to_f16(<uint16_t *>(vc + ((h * C + slot) * D) * es), vrow + h * D, D)
                        else:
                            memcpy(kc + ((h * C + slot) * D) * es, krow + h * D, D * es)
                            memcpy(vc + ((h * C + slot) * D) * es, vrow + h * D, D * es)
                    # every key range of the sequence in one kernel call: one softmax, and each KV
                    # head reads its ranges back to back
                    p.q = qrow
                    p.q_alt = qsp if twp[b] else NULL
                    p.ranges = <const kv_attn_range *>(rg + b * plan.nrmax * 4)
                    p.n_ranges = nrp[b]
                    p.k = kc
                    p.v = vc
                    p.out = out + b * HD
                    p.alibi = alibi
                    p.key_pos = kpos_all + b * C if alibi != NULL else NULL
                    p.H, p.Hkv, p.D = H, Hkv, D
                    p.n_total = C
                    p.scale = plan.scale
                    p.dtype = self._kv_dtype
                    kv_attend(&p, wsp, nt)
        finally:
            self._release()
        return 0

    cdef int _attend_all(self, int64_t l, float *q, int64_t H, float *out) except -1:
        """Every sequence b: out[b] = attention of q[b] ([H, head_dim]) over its committed
        tokens of layer l (a cross-attention step: no positions, no mask)."""
        cdef kv_attn_params p
        cdef kv_attn_range whole
        memset(&p, 0, sizeof(p))
        memset(&whole, 0, sizeof(whole))
        cdef int64_t B = self.batch, Hkv = self.n_kv_heads, D = self.head_dim, b
        if not 0 <= l < self.n_layers:
            raise KVSimdValueError("layer must be in 0..%d, got %d" % (self.n_layers - 1, l))
        if H < 1 or H % Hkv:
            raise KVSimdValueError("%d query heads is not a positive multiple of %d KV heads" % (H, Hkv))
        if (self._lengths == 0).any():
            raise KVSimdValueError("cross-attention cache has empty sequences %s" % _np.nonzero(self._lengths == 0)[0].tolist())
        cdef int nt = _threads_now()
        ws, _ = self._scratch(H, nt)
        cdef void *wsp = _aligned64(ws)
        cdef const int64_t *lens = <const int64_t *>_ptr(self._lengths)
        self._acquire()
        try:
            with nogil:
                for b in range(B):
                    p.q = q + b * H * D
                    p.k = kv_cache_block(&self.c, l, 0, b)
                    p.v = kv_cache_block(&self.c, l, 1, b)
                    p.out = out + b * H * D
                    p.alibi = NULL
                    p.key_pos = NULL
                    whole.t1 = lens[b]
                    p.ranges = &whole
                    p.n_ranges = 1
                    p.H, p.Hkv, p.D = H, Hkv, D
                    p.n_total = self.capacity
                    p.scale = 1.0 / sqrtf(<float>D)
                    p.dtype = self._kv_dtype
                    kv_attend(&p, wsp, nt)
        finally:
            self._release()
        return 0

    def shift_range(self, seq, t0, t1, delta, theta, style, rotary_dim):
        """Rotate the keys of slots t0..t1-1 of every layer by ``delta`` positions (shift-RoPE-K);
        ``rotary_dim`` None means head_dim.  Same RoPE parameter rules as ops.shift_keys."""
        cdef int64_t s, c0, c1, cd, crd, layer
        cdef double th
        cdef kv_rope_style st
        cdef kv_status rc
        cdef void *kp
        with self._claim():
            s = self._seq(seq)
            c0, c1 = _need_int(t0, "t0"), _need_int(t1, "t1")
            if not 0 <= c0 <= c1 <= self.capacity:
                raise KVSimdValueError("slot range t0..t1 = %d..%d outside 0..%d" % (c0, c1, self.capacity))
            cd = _need_pos(delta, "delta")
            th, st, crd = _rope_params(theta, style, rotary_dim, self.head_dim)
            for layer in range(self.n_layers):
                kp = kv_cache_block(&self.c, layer, 0, s)
                with nogil:
                    rc = kv_shift_keys(kp, self._kv_dtype, self.n_kv_heads, self.capacity, self.head_dim, cd, th,
                                       st, crd, c0, c1)
                if rc != KV_OK:
                    raise KVSimdValueError("shift_range: bad arguments (status %d)" % rc)

    def attend(self, layer, q, *, seq=0, length=None, scale=None, alibi_slopes=None, query_position=None, out=None):
        """Attention of ``q`` (float32 ``[H, head_dim]``, H a multiple of n_kv_heads) over the first
        ``length`` slots (default: committed length) of ``layer`` for sequence ``seq``, read in place.
        ALiBi as in ops.attend: ``query_position`` (default ``length - 1``) needs ``alibi_slopes``."""
        cdef kv_attn_params p
        cdef kv_attn_range whole
        memset(&p, 0, sizeof(p))
        memset(&whole, 0, sizeof(whole))
        cdef int64_t H, D = self.head_dim
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
            p.alibi = NULL
            p.key_pos = NULL
            whole.query_pos = n - 1
            if alibi_slopes is not None:
                p.alibi = <const float *>_ptr(_need_slopes(alibi_slopes, H))
                if query_position is not None:
                    whole.query_pos = _need_pos(query_position, "query_position")
            elif query_position is not None:
                raise KVSimdValueError("query_position only applies with alibi_slopes")
            if out is None:
                out = _np.empty((H, D), dtype=_np.float32)
            else:
                _need_array(out, "out", (_F32,), 2, "[H, head_dim]", writeable=True, shape=(H, D))
                _need_no_overlap(out, "out", (("q", q), ("alibi_slopes", alibi_slopes),
                                              ("the cache storage", self._storage())))
            nt = _threads_now()
            ws = _workspace(H, self.n_kv_heads, D, nt)
            p.q = <const float *>_ptr(q)
            p.k = kv_cache_block(&self.c, l, 0, s)
            p.v = kv_cache_block(&self.c, l, 1, s)
            p.out = <float *>_ptr(out)
            whole.t1 = n
            p.ranges = &whole
            p.n_ranges = 1
            p.H, p.Hkv, p.D = H, self.n_kv_heads, D
            p.n_total = self.capacity
            p.scale = sc
            p.dtype = self._kv_dtype
            wsp = _aligned64(ws)
            with nogil:
                kv_attend(&p, wsp, nt)
        return out


cdef class _CacheClaim:
    """What KVCache._claim() returns: holds the cache for the calling thread while entered."""
    cdef KVCache cache

    def __enter__(self):
        self.cache._acquire()
        return self.cache

    def __exit__(self, *exc):
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
