# The attention step of one forward pass, planned once and run for every layer.
#
# A forward pass runs R rows (a decode step: one row per sequence; a prefill chunk: the T tokens
# of one sequence; an encoder or an uncached pass: the T tokens in a scratch store).  Its plan
# says, per row, which sequence and slot its K/V go to, the RoPE tables of its positions, and the
# key ranges it reads under one softmax.  The plan is built and checked by its store (KVCache.
# begin_step / begin_prefill, _local_plan) and read by the compiled layers (_layer.pxi) through
# _attend_rows, with no Python object touched per row or head.


from types import MappingProxyType as _MappingProxyType

_NO_REFILL = _MappingProxyType({})


cdef class _Plan:
    """One forward pass's attention rows (see the header of this file).  Read-only to Python."""
    cdef readonly int64_t R, H, HD, nrmax, rd
    cdef readonly object owner          # the store the rows' K/V go to
    cdef readonly object embed_positions
    cdef readonly object refill         # reevaluate: sequence -> token ids to prefill first (read-only)
    cdef readonly object tokens
    cdef readonly int kind              # 0 decode step, 1 prefill chunk, 2 local (encoder / uncached)
    cdef object seqs, slots, kpos, spos, two, rng, nr, cs, alibi, key_pos, ws, qs
    cdef bint do_rope, one_layer
    cdef readonly bint explicit         # made by step_plan from explicit slots and ranges
    cdef kv_rope_style st
    cdef RopeSpec rope                  # its frequencies and attention factor make the tables
    cdef float scale, softcap
    cdef readonly tuple windows         # the attention windows with their own key-range tables
    cdef list wtab                      # per window: (rng, nr, nrmax), the last W keys of each row
    cdef int nt
    cdef int64_t seq                    # prefill: the sequence
    cdef list saved                     # transaction records of begin_* (see _Tx)
    cdef int64_t gen                    # the owner's change count when the plan was made
    cdef int64_t done                   # layers 0..done-1 have the rows' K/V written (end_* need all)
    cdef int64_t serial                 # this plan's number on its store (see _KVStore._writer)
    cdef bint band                      # rows of one sequence in one multi-row kernel call (_plan_prefix):
    cdef int64_t band_rng[4]            #   keys 0..(last row's end) at row 0's query position,
    cdef int64_t band_end               #   row r reads keys < band_end + r (0: all of them)
    # a cache with recent float rows (KVCache(recent=R); made by _plan_recent): row r's float16 K/V
    # go to entry tidx[r] of its sequence's ring (-1: none), and it reads its last R keys (itself
    # included) as float16 rows gathered into tscr -- tcom[r] committed ring entries from tfrom[r],
    # then its own (a prefill band: every row of the chunk) -- and the older keys quantized
    cdef int64_t rn                     # R; 0: quantized rows only
    cdef object tidx, tfrom, tcom, tnf  # int64 [R]; tnf: float keys a row reads (per-row calls)
    cdef list wtnf                      # per attention window: its tnf
    cdef object tscr, tkp, tf, tws      # uint16 [K|V, Hkv, G, D] float16 bits, their positions [rows, G],
                                        #   float32 [Hkv * D] scratch, the two-source workspace


    def row(self, r):
        """Row ``r`` as ``(sequence, slot, key position, sink-query position, ranges)``, ranges the
        ``(use_sink_query, t0, t1, query_position)`` key ranges it reads under one softmax: what the
        compiled layers read, for callers that attend with ops.attend over the cache's storage
        (the transformers integration).  A decode-step plan of a cache with ``recent`` float rows
        lists the ranges it reads quantized: its last :meth:`float_keys` keys it reads from the
        float rows (KVCache).  A prefill plan lists every key of the row (the compiled layers cut
        a prefill chunk's float and quantized keys per row, see ops.attend's ``recent_window``)."""
        cdef int64_t i = _need_int(r, "r")
        if not 0 <= i < self.R:
            raise KVSimdValueError("r must be in 0..%d, got %d" % (self.R - 1, i))
        if self.rng is None:
            raise KVSimdValueError("this plan has no key ranges (a refill plan: prefill its tokens first)")
        ranges = tuple(tuple(int(x) for x in self.rng[i, j]) for j in range(int(self.nr[i])))
        return int(self.seqs[i]), int(self.slots[i]), int(self.kpos[i]), int(self.spos[i]), ranges

    def float_keys(self, r):
        """How many of a decode-step row ``r``'s last keys it reads from a cache's float rows
        (``recent``): the ones :meth:`row`'s ranges leave out, its own and the newest committed
        ones before it (KVCache.recent_rows).  0 for a cache without float rows and for a prefill
        plan (whose rows :meth:`row` lists whole)."""
        cdef int64_t i = _need_int(r, "r")
        if not 0 <= i < self.R:
            raise KVSimdValueError("r must be in 0..%d, got %d" % (self.R - 1, i))
        return int(self.tnf[i]) if self.rn and self.kind == 0 else 0


cdef _Plan _need_plan(plan):
    """``plan`` must be a plan a cache made (begin_step, begin_prefill, step_plan)."""
    if not isinstance(plan, _Plan):
        raise KVSimdTypeError("plan must be a plan of a cache (KVCache.begin_step, begin_prefill, step_plan), got %s"
                              % type(plan).__name__)
    return <_Plan>plan


cdef RopeSpec _need_rope(rope):
    """``rope`` must be None (no RoPE) or a RopeSpec."""
    if rope is not None and not isinstance(rope, RopeSpec):
        raise KVSimdTypeError("rope must be a kvsimd.cache.RopeSpec or None, got %s" % type(rope).__name__)
    return rope


cdef tuple _need_windows(windows):
    """``windows``: None or distinct attention windows (integers >= 1), as a tuple."""
    if windows is None:
        return ()
    if isinstance(windows, (str, bytes)) or not hasattr(windows, "__iter__"):
        raise KVSimdTypeError("windows must be None or a sequence of integers >= 1, got %r" % (windows,))
    out = tuple(_need_int(w, "windows[%d]" % i) for i, w in enumerate(windows))
    if any(w < 1 for w in out) or len(set(out)) != len(out):
        raise KVSimdValueError("windows must be distinct integers >= 1, got %r" % (out,))
    return out


cdef tuple _plan_args(int64_t H, int64_t Hkv, int64_t D, RopeSpec rope, alibi_slopes, scale, softcap, windows):
    """A plan's arguments checked, before anything changes (begin_step checks them before its
    policy discards tokens): (ALiBi slopes copied or None, scale, softcap, windows)."""
    if H < 1 or H % Hkv or H > _MAX_HEADS:
        raise KVSimdValueError("%d query heads is not a positive multiple of %d KV heads" % (H, Hkv))
    if rope is not None and rope.head_dim != D:
        raise KVSimdValueError("rope is for head_dim %d, the cache has %d" % (rope.head_dim, D))
    return (None if alibi_slopes is None else _need_slopes(alibi_slopes, H).copy(),
            1.0 / sqrtf(<float>D) if scale is None else _need_scale(scale, D), _need_softcap(softcap),
            _need_windows(windows))


cdef _Plan _new_plan(object store, int kind, int64_t R, int64_t H, int64_t Hkv, int64_t D, RopeSpec rope,
                     alibi_slopes, scale=None, softcap=None, windows=None, tuple checked=None):
    """A new plan of ``store``; ``checked``: _plan_args of these arguments, when the caller has
    already checked them."""
    cdef _Plan p
    if checked is None:
        checked = _plan_args(H, Hkv, D, rope, alibi_slopes, scale, softcap, windows)
    p = _Plan.__new__(_Plan)
    p.owner, p.kind, p.R, p.H, p.HD = store, kind, R, H, H * D
    p.gen = (<_KVStore>store)._gen
    (<_KVStore>store)._nplans += 1
    if (<_KVStore>store)._writer == 0:       # write()s before this plan are not its K/V
        (<_KVStore>store)._writer = -1
    p.serial = (<_KVStore>store)._nplans
    p.do_rope = rope is not None
    if p.do_rope:
        p.rope, p.st, p.rd = rope, rope.st, rope.rotary_dim
    p.alibi, p.scale, p.softcap, p.windows = checked
    p.wtab = []
    p.nt = _threads_now()
    p.seqs = _np.zeros(R, _np.int64)
    p.slots = _np.zeros(R, _np.int64)
    p.kpos = _np.zeros(R, _np.int64)
    p.spos = _np.zeros(R, _np.int64)
    p.two = _np.zeros(R, _np.int64)
    p.nr = _np.zeros(R, _np.int64)
    p.refill = _NO_REFILL
    p.saved = []
    return p


cdef tuple _range_table(_Plan p, list per_row):
    """per_row[r]: [(use_alt, t0, t1, query_pos)] -> ([R, nrmax, 4] table, [R] counts, nrmax),
    adjacent ranges of the same query merged (one kernel range); rows reading the sink query
    are marked in p.two."""
    cdef int64_t r, i, R = p.R
    nrmax = max([len(x) for x in per_row] + [1])
    rng = _np.zeros((R, nrmax, 4), dtype=_np.int64)
    nr = _np.zeros(R, dtype=_np.int64)
    for r in range(R):
        i = 0
        for use_s, t0, t1, qpos in per_row[r]:
            use_s = 1 if (use_s and p.do_rope and p.spos[r] != p.kpos[r]) else 0
            if use_s:
                p.two[r] = 1
            if i and rng[r, i - 1, 2] == t0 and rng[r, i - 1, 0] == use_s and rng[r, i - 1, 3] == qpos:
                rng[r, i - 1, 2] = t1
            else:
                rng[r, i] = (use_s, t0, t1, qpos)
                i += 1
        nr[r] = i
    return rng, nr, nrmax


cdef int _plan_ranges(_Plan p, list per_row, list chrono=None) except -1:
    """The plan's key ranges from per_row (see _range_table), and one table per attention window
    of the plan: the last W keys of ``chrono`` (per row, the same ranges oldest key first)."""
    p.rng, p.nr, p.nrmax = _range_table(p, per_row)
    for W in p.windows:
        p.wtab.append(_range_table(p, [_last_keys(x, W) for x in (chrono if chrono is not None else per_row)]))
    return 0


cdef list _last_keys(list ranges, int64_t W):
    """The ranges (oldest key first) cut to their last W keys."""
    cdef int64_t left = W, t0, t1
    out = []
    for use_s, t0, t1, qpos in reversed(ranges):
        if left <= 0:
            break
        if t1 - t0 > left:
            t0 = t1 - left
        out.append((use_s, t0, t1, qpos))
        left -= t1 - t0
    out.reverse()
    return out


cdef tuple _drop_last(list ranges, int64_t m, bint alt):
    """(``ranges`` (oldest key first) without their last ``m`` keys, how many were dropped): stops
    at a range read with the sink query when the row has one (``alt``), whose keys the float rows
    never hold (a ring that wrapped keeps no float rows of its sinks)."""
    cdef int64_t left = m, t0, t1
    out = list(ranges)
    while left > 0 and out:
        use_s, t0, t1, qpos = out[len(out) - 1]
        if use_s and alt:
            break
        if t1 - t0 > left:
            out[len(out) - 1] = (use_s, t0, t1 - left, qpos)
            left = 0
        else:
            out.pop()
            left -= t1 - t0
    return out, m - left


cdef int _plan_recent(_Plan p, KVCache c, list chrono) except -1:
    """The float rows of a plan of a cache with ``recent`` = R > 0 (KVCache): where each row's
    float16 K/V go and which keys it reads as float16 (the _Plan fields above).  A decode plan
    (``chrono``: per row its key ranges, oldest key first): each row reads its last min(R, keys)
    keys from the float rows and the older ones through range tables built here without them.  A
    prefill band (``chrono`` None): one kernel call over three sources (_attend_rows), the
    quantized keys before the committed float rows, the others' quantized rows below
    causal_end - R + r and the float rows (committed ones, then the chunk) at or above it."""
    cdef int64_t R = p.R, rn = c.recent, ring = c._ring, r, s, tn, th, com, k, first, G
    cdef int64_t Hkv = c.n_kv_heads, D = c.head_dim
    p.rn = rn
    p.tidx = _np.full(R, -1, dtype=_np.int64)
    p.tfrom = _np.zeros(R, dtype=_np.int64)
    p.tcom = _np.zeros(R, dtype=_np.int64)
    p.tnf = _np.zeros(R, dtype=_np.int64)
    p.wtnf = []
    tag, pos = c._ttag, c._pos
    if chrono is None:                   # a prefill chunk of sequence p.seq
        s = p.seq
        tn, th = c._tn[s], c._th[s]
        com = min(tn, rn - 1)
        p.tcom[:], p.tfrom[:] = com, (th + tn - com) % ring
        first = max(0, R - c._keep)      # the chunk's last 2R rows are kept (a truncate of R leaves R)
        p.tidx[first:] = (th + tn + _np.arange(R - first)) % ring
        G = com + R
        p.tkp = _np.empty((1, G), dtype=_np.int64)
        for k in range(com):
            p.tkp[0, k] = pos[s, tag[s, (p.tfrom[0] + k) % ring]]
        p.tkp[0, com:] = p.kpos
    else:
        G = rn
        p.tkp = _np.zeros((R, G), dtype=_np.int64)
        alt = [bool(p.do_rope and p.spos[r] != p.kpos[r]) for r in range(R)]
        rows = []
        for r in range(R):
            s = p.seqs[r]
            tn, th = c._tn[s], c._th[s]
            com = min(tn, rn - 1)
            p.tcom[r], p.tfrom[r], p.tidx[r] = com, (th + tn - com) % ring, (th + tn) % ring
            for k in range(com):
                p.tkp[r, k] = pos[s, tag[s, (p.tfrom[r] + k) % ring]]
            p.tkp[r, com] = p.kpos[r]
            kept, p.tnf[r] = _drop_last(chrono[r], com + 1, alt[r])
            rows.append(kept)
        p.rng, p.nr, p.nrmax = _range_table(p, [_slot_order(x) for x in rows])
        p.wtab = []
        for W in p.windows:
            nfs = _np.zeros(R, dtype=_np.int64)
            rows = []
            for r in range(R):
                kept, nfs[r] = _drop_last(_last_keys(chrono[r], W), p.tcom[r] + 1, alt[r])
                rows.append(_slot_order(kept))
            p.wtab.append(_range_table(p, rows))
            p.wtnf.append(nfs)
    try:
        p.tscr = _np.zeros((2, Hkv, G, D), dtype=_np.uint16)
        p.tf = _np.empty(Hkv * D, dtype=_np.float32)
    except MemoryError:
        raise KVSimdMemoryError("a pass of %d rows over a cache with recent=%d float rows: %d bytes of float16 rows "
                                "cannot be allocated" % (R, rn, 4 * Hkv * G * D)) from None
    p.tws = _workspace(p.H, Hkv, D, p.nt, R if chrono is None else 1, 3 if chrono is None else 2)
    return 0


cdef list _slot_order(list ranges):
    """Key ranges oldest first -> as a step reads them: the sink ranges, then the others in slot
    order (their keys carry their own positions, so ranges that touch become one kernel range)."""
    return [x for x in ranges if x[0]] + sorted(x for x in ranges if not x[0])


cdef int _plan_prefix(_Plan p, object t1, object qpos) except -1:
    """Row r reads keys 0..t1[r]-1 as one range at query position qpos[r] (a prefill chunk, a
    local pass): the table _plan_ranges would build, without a Python object per row."""
    p.nrmax = 1
    p.rng = _np.zeros((p.R, 1, 4), dtype=_np.int64)
    p.rng[:, 0, 2] = t1
    p.rng[:, 0, 3] = qpos
    p.nr = _np.ones(p.R, dtype=_np.int64)
    # the same rows as one band for the multi-row kernel: ends t1[0] + r (causal) or all equal
    # (t1 an int: every row reads every key), query positions qpos[0] + r
    ends, qp = p.rng[:, 0, 2], p.rng[:, 0, 3]
    steps = _np.arange(p.R, dtype=_np.int64)
    causal = not isinstance(t1, int)
    p.band = bool((qp == qp[0] + steps).all()) and (not causal or bool((ends == ends[0] + steps).all()))
    if p.band:
        p.band_rng[0], p.band_rng[1], p.band_rng[2], p.band_rng[3] = 0, 0, ends[p.R - 1], qp[0]
        p.band_end = ends[0] if causal else 0
    for W in p.windows:      # the last W keys: slots max(0, t1 - W)..t1-1
        rng = p.rng.copy()
        rng[:, 0, 1] = _np.maximum(rng[:, 0, 2] - W, 0)
        p.wtab.append((rng, p.nr, 1))
    return 0


cdef int _plan_tables(_Plan p) except -1:
    """RoPE tables of every row's positions ([r][key position | sink position]) and the scratch;
    both with the spec's attention factor (each rotates a fresh q or k once)."""
    cdef int64_t r
    if p.do_rope:
        p.cs = _np.zeros((p.R, 2, p.rd), dtype=_np.float32)
        for r in range(p.R):
            kv_rope_table(<float *>_ptr(p.cs) + 2 * r * p.rd, <double>p.kpos[r], p.rope.inv, p.rd // 2,
                          p.rope.attn_factor)
            if p.two[r]:
                kv_rope_table(<float *>_ptr(p.cs) + (2 * r + 1) * p.rd, <double>p.spos[r], p.rope.inv, p.rd // 2,
                              p.rope.attn_factor)
    p.qs = _np.empty((<object>p.R, <object>p.HD) if p.two.any() else (1, 1), dtype=_np.float32)
    p.ws = (<_KVStore>p.owner)._scratch(p.H, p.nt)     # the store's workspace, reused step after step
    return 0


cdef void _f16_heads(uint16_t *dst, int64_t dstride, const float *x, float *tmp, int64_t n, int64_t D,
                     bint turned) noexcept nogil:
    """n rows of D floats (contiguous) as float16 bits at dst + i * dstride; ``turned``: as a
    quantized row of the cache is stored, H x / 32 over every whole block of 32 (kv_hadamard_rows)."""
    cdef int64_t i, d, wb = D // KV_I8_BLOCK * KV_I8_BLOCK
    if turned:
        memcpy(tmp, x, n * D * sizeof(float))
        for i in range(n):
            for d in range(wb):
                tmp[i * D + d] *= 0.03125
        kv_hadamard_rows(tmp, D, n, D)
        x = tmp
    for i in range(n):
        kv_f32_to_f16(dst + i * dstride, x + i * D, D)


cdef void _gather_ring(uint16_t *dst, int64_t G, const uint16_t *ring_rows, int64_t ring, int64_t first, int64_t n,
                       int64_t Hkv, int64_t D) noexcept nogil:
    """n entries of a ring [Hkv, ring, D] from entry ``first`` (wrapping) into rows 0..n-1 of
    dst [Hkv, G, D] (float16 bits)."""
    cdef int64_t h, a = n if n < ring - first else ring - first
    for h in range(Hkv):
        memcpy(dst + h * G * D, ring_rows + (h * ring + first) * D, a * D * sizeof(uint16_t))
        if n > a:
            memcpy(dst + (h * G + a) * D, ring_rows + h * ring * D, (n - a) * D * sizeof(uint16_t))


cdef int _attend_rows(_Plan plan, _KVStore store, int64_t l, float *qkv, int64_t width, float *out,
                      int64_t window=0) except -1:
    """Self-attention of every row of ``plan`` for layer ``l``: rotate q/k (RoPE), store k/v at the
    row's slot, then attend over the row's key ranges (with ``window`` > 0: the last ``window``
    keys of them, a table the plan made for that window).  ``qkv``: R rows of ``width`` floats
    ([q | k | v], heads contiguous), rotated in place; ``out``: R rows of plan.HD floats."""
    cdef kv_attn_params p
    cdef int64_t R = plan.R, Hkv = store.n_kv_heads, D = store.head_dim, C = store.capacity
    cdef int64_t H = plan.H, HD = plan.HD, r, h, slot, sq
    if plan.owner is not store:
        raise KVSimdValueError("this plan was made by another cache")
    if width != HD + 2 * Hkv * D:
        raise KVSimdValueError("qkv rows must hold %d floats, got %d" % (HD + 2 * Hkv * D, width))
    cdef int64_t lb = 0 if plan.one_layer else l
    if not 0 <= lb < store.n_layers:
        raise KVSimdValueError("layer must be in 0..%d, got %d" % (store.n_layers - 1, l))
    cdef float *qrow
    cdef float *krow
    cdef float *vrow
    cdef float *qsp = <float *>_ptr(plan.qs)
    cdef const int64_t *sqp = <const int64_t *>_ptr(plan.seqs)
    cdef const int64_t *slp = <const int64_t *>_ptr(plan.slots)
    rng, nr, nrmax = plan.rng, plan.nr, plan.nrmax
    if window:
        if window not in plan.windows:
            raise KVSimdValueError("layer %d attends over a window of %d keys: the plan was made for windows %r"
                                   % (l, window, plan.windows))
        rng, nr, nrmax = plan.wtab[plan.windows.index(window)]
    cdef const int64_t *rg = <const int64_t *>_ptr(rng)
    cdef const int64_t *nrp = <const int64_t *>_ptr(nr)
    cdef int64_t nrm = nrmax
    cdef const int64_t *twp = <const int64_t *>_ptr(plan.two)
    cdef const float *csp = <const float *>_ptr(plan.cs) if plan.do_rope else NULL
    cdef const float *alibi = <const float *>_ptr(plan.alibi) if plan.alibi is not None else NULL
    cdef const int64_t *kpos_all = <const int64_t *>_ptr(plan.key_pos) if plan.key_pos is not None else NULL
    cdef void *wsp = _aligned64(plan.ws)
    cdef char *kc
    cdef char *vc
    cdef float *ksc
    cdef float *vsc
    cdef kv_dtype dt = store._kv_dtype, vdt = store._v_dtype
    cdef int64_t nsb = kv_i8_blocks(D)    # int8, int4: scales per row
    cdef size_t es = 2 if dt == KV_F16 else 4, rb = kv_row_bytes(dt, D), vrb = kv_row_bytes(vdt, D)
    cdef bint quantized = kv_dtype_scaled(dt), hd = store.hadamard
    cdef int nt = plan.nt, rd = plan.rd
    cdef kv_rope_style st = plan.st
    # the float rows of the most recent keys (plan.rn > 0: _plan_recent)
    cdef kv_attn_params src[3]
    cdef int64_t rn = plan.rn, ring = store._ring, G = 0, ti, com, m, nf, ns, B = store.batch, start
    cdef int64_t srng[4]
    cdef int64_t qa[4]
    cdef int64_t qb[4]
    cdef uint16_t *tail = NULL
    cdef uint16_t *scr = NULL
    cdef uint16_t *sv = NULL
    cdef float *tfp = NULL
    cdef const int64_t *tip = NULL
    cdef const int64_t *tcp = NULL
    cdef const int64_t *tfr = NULL
    cdef const int64_t *tnfp = NULL
    cdef const int64_t *tkpp = NULL
    cdef const int64_t *kpp = <const int64_t *>_ptr(plan.kpos)
    cdef void *twsp = NULL
    cdef bint band = plan.band and (R > 1 or rn > 0)
    if rn:
        tail, scr, tfp = <uint16_t *>_ptr(store._tail), <uint16_t *>_ptr(plan.tscr), <float *>_ptr(plan.tf)
        G = plan.tscr.shape[2]
        sv = scr + Hkv * G * D
        tip, tcp, tfr = <const int64_t *>_ptr(plan.tidx), <const int64_t *>_ptr(plan.tcom), \
            <const int64_t *>_ptr(plan.tfrom)
        tnfp = <const int64_t *>_ptr(plan.wtnf[plan.windows.index(window)] if window and not band else plan.tnf)
        tkpp = <const int64_t *>_ptr(plan.tkp)
        twsp = _aligned64(plan.tws)
    store._acquire()
    try:
        store._need_current(plan)     # checked under the claim: no thread can change the cache now
        if store._writer != plan.serial:  # another plan wrote since: this one's earlier layers are gone
            store._writer, plan.done = plan.serial, 0
        with nogil:
            # 1. every row's q/k rotated and k/v stored (an encoder row reads keys after its own)
            for r in range(R):
                qrow = qkv + r * width
                krow = qrow + HD
                vrow = krow + Hkv * D
                if twp[r]:
                    memcpy(qsp + r * HD, qrow, HD * sizeof(float))
                    kv_rotate_rows(qsp + r * HD, KV_F32, H, 1, D, csp + (2 * r + 1) * rd, st, rd, 0, 1)
                if csp != NULL:
                    kv_rotate_rows(qrow, KV_F32, H, 1, D, csp + 2 * r * rd, st, rd, 0, 1)
                    kv_rotate_rows(krow, KV_F32, Hkv, 1, D, csp + 2 * r * rd, st, rd, 0, 1)
                kc = <char *>kv_cache_block(&store.c, lb, 0, sqp[r])
                vc = <char *>kv_cache_block(&store.c, lb, 1, sqp[r])
                ksc = kv_cache_scales(&store.c, lb, 0, sqp[r])
                vsc = kv_cache_scales(&store.c, lb, 1, sqp[r])
                slot = slp[r]
                for h in range(Hkv):
                    if quantized:
                        kv_quantize_rows(dt, hd, kc + (h * C + slot) * rb, rb, ksc + (h * C + slot) * nsb,
                                         krow + h * D, D, 1, D)
                        kv_quantize_rows(vdt, hd, vc + (h * C + slot) * vrb, vrb, vsc + (h * C + slot) * nsb,
                                         vrow + h * D, D, 1, D)
                    elif es == 2:
                        kv_f32_to_f16(<uint16_t *>(kc + ((h * C + slot) * D) * es), krow + h * D, D)
                        kv_f32_to_f16(<uint16_t *>(vc + ((h * C + slot) * D) * es), vrow + h * D, D)
                    else:
                        memcpy(kc + ((h * C + slot) * D) * es, krow + h * D, D * es)
                        memcpy(vc + ((h * C + slot) * D) * es, vrow + h * D, D * es)
                if rn:    # the float16 rows: the ring keeps them, a prefill band reads them
                    ti = tip[r]
                    if ti >= 0:
                        _f16_heads(tail + (((lb * 2) * B + sqp[r]) * Hkv * ring + ti) * D, ring * D, krow, tfp, Hkv,
                                   D, hd)
                        _f16_heads(tail + (((lb * 2 + 1) * B + sqp[r]) * Hkv * ring + ti) * D, ring * D, vrow, tfp,
                                   Hkv, D, hd)
                    if band:
                        _f16_heads(scr + (tcp[0] + r) * D, G * D, krow, tfp, Hkv, D, hd)
                        _f16_heads(sv + (tcp[0] + r) * D, G * D, vrow, tfp, Hkv, D, hd)
                if hd:   # rows stored turned by H: the queries turned too (_KVStore's docstring)
                    kv_hadamard_rows(qrow, D, H, D)
                    if twp[r]:
                        kv_hadamard_rows(qsp + r * HD, D, H, D)
            # 2. every row's key ranges under one softmax: the rows of one sequence (a prefill
            #    chunk, a local pass) in one multi-row call that reads each K/V row once per tile
            #    of rows; decode steps one call per row
            if band and rn:
                # three sources (each with its own cut, kvsimd.h kv_attend_sources): the tokens
                # before the committed float rows, all quantized (slots 0..start-com-1); the
                # committed and the chunk's tokens, read quantized below causal_end + r - R
                # (key_base R); their float rows, the last R keys of each row (the window R)
                sq = sqp[0]
                start = slp[0]
                com = tcp[0]
                _gather_ring(scr, G, tail + ((lb * 2) * B + sq) * Hkv * ring * D, ring, tfr[0], com, Hkv, D)
                _gather_ring(sv, G, tail + ((lb * 2 + 1) * B + sq) * Hkv * ring * D, ring, tfr[0], com, Hkv, D)
                ns = 0
                if start - com > 0:
                    qa[0], qa[1], qa[2], qa[3] = 0, 0, start - com, plan.band_rng[3]
                    _attn_init(&src[0], qkv, NULL, kv_cache_block(&store.c, lb, 0, sq), kv_cache_block(&store.c, lb, 1, sq),
                               out, alibi, kpos_all + sq * C if kpos_all != NULL else NULL, qa, 1,
                               H, Hkv, D, C, plan.scale, plan.softcap, dt, R, width, HD, plan.band_end,
                               window, kv_cache_scales(&store.c, lb, 0, sq), kv_cache_scales(&store.c, lb, 1, sq), vdt)
                    ns = 1
                if window == 0 or window > rn:
                    qb[0], qb[1], qb[2], qb[3] = 0, start - com, plan.band_rng[2], plan.band_rng[3]
                    _attn_init(&src[ns], qkv, NULL, kv_cache_block(&store.c, lb, 0, sq),
                               kv_cache_block(&store.c, lb, 1, sq),
                               out, alibi, kpos_all + sq * C if kpos_all != NULL else NULL, qb, 1,
                               H, Hkv, D, C, plan.scale, plan.softcap, dt, R, width, HD, plan.band_end,
                               window - rn if window else 0, kv_cache_scales(&store.c, lb, 0, sq),
                               kv_cache_scales(&store.c, lb, 1, sq), vdt)
                    src[ns].key_base = rn
                    ns += 1
                srng[0], srng[1], srng[2], srng[3] = 0, 0, G, plan.band_rng[3]
                _attn_init(&src[ns], qkv, NULL, scr, sv, out, alibi, tkpp if alibi != NULL else NULL, srng, 1,
                           H, Hkv, D, G, plan.scale, plan.softcap, KV_F16, R, width, HD, plan.band_end,
                           window if 0 < window < rn else rn)
                src[ns].key_base = start - tcp[0]
                kv_attend_sources(src, ns + 1, twsp, nt)
            elif band:
                sq = sqp[0]
                _attn_init(&p, qkv, NULL, kv_cache_block(&store.c, lb, 0, sq), kv_cache_block(&store.c, lb, 1, sq),
                           out, alibi, kpos_all + sq * C if kpos_all != NULL else NULL, plan.band_rng, 1,
                           H, Hkv, D, C, plan.scale, plan.softcap, dt, R, width, HD, plan.band_end,
                           window, kv_cache_scales(&store.c, lb, 0, sq), kv_cache_scales(&store.c, lb, 1, sq), vdt)
                kv_attend(&p, wsp, nt)
            for r in range(R if not band else 0):
                sq = sqp[r]
                _attn_init(&p, qkv + r * width, qsp + r * HD if twp[r] else NULL,
                           kv_cache_block(&store.c, lb, 0, sq), kv_cache_block(&store.c, lb, 1, sq), out + r * HD,
                           alibi, kpos_all + sq * C if kpos_all != NULL else NULL,
                           rg + r * nrm * 4, nrp[r], H, Hkv, D, C, plan.scale, plan.softcap, dt,
                           1, 0, 0, 0, 0, kv_cache_scales(&store.c, lb, 0, sq), kv_cache_scales(&store.c, lb, 1, sq),
                           vdt)
                if not rn:
                    kv_attend(&p, wsp, nt)
                    continue
                # the row's last keys as float16 rows: its committed ring entries, then its own
                com, nf = tcp[r], tnfp[r]
                m = com + 1
                _gather_ring(scr, G, tail + ((lb * 2) * B + sq) * Hkv * ring * D, ring, tfr[r], com, Hkv, D)
                _gather_ring(sv, G, tail + ((lb * 2 + 1) * B + sq) * Hkv * ring * D, ring, tfr[r], com, Hkv, D)
                _gather_ring(scr + com * D, G, tail + ((lb * 2) * B + sq) * Hkv * ring * D, ring, tip[r], 1, Hkv, D)
                _gather_ring(sv + com * D, G, tail + ((lb * 2 + 1) * B + sq) * Hkv * ring * D, ring, tip[r], 1, Hkv, D)
                ns = 0
                if nrp[r] > 0:
                    src[0] = p
                    ns = 1
                if nf > 0:
                    srng[0], srng[1], srng[2], srng[3] = 0, m - nf, m, kpp[r]
                    _attn_init(&src[ns], qkv + r * width, NULL, scr, sv, out + r * HD, alibi,
                               tkpp + r * G if alibi != NULL else NULL, srng, 1, H, Hkv, D, G, plan.scale,
                               plan.softcap, KV_F16)
                    ns += 1
                kv_attend_sources(src, ns, twsp, nt)
            if hd:       # and the outputs turned back
                kv_hadamard_rows(out, D, R * H, D)
        if lb == plan.done:
            plan.done += 1
    finally:
        store._release()
    return 0


cdef int _attend_cross(_KVStore cross, int64_t l, const int64_t *seqs, int64_t R, float *q, int64_t H,
                       float *out) except -1:
    """Row r: out[r] = attention of q[r] ([H, head_dim]) over every committed token of sequence
    seqs[r] of the cross-attention store (no positions, no mask)."""
    cdef kv_attn_params p
    cdef int64_t Hkv = cross.n_kv_heads, D = cross.head_dim, r, s
    cdef int64_t rng[4]
    if not 0 <= l < cross.n_layers:
        raise KVSimdValueError("layer must be in 0..%d, got %d" % (cross.n_layers - 1, l))
    if H < 1 or H % Hkv:
        raise KVSimdValueError("%d query heads is not a positive multiple of %d KV heads" % (H, Hkv))
    cdef const int64_t *lens = <const int64_t *>_ptr(cross._lengths)
    for r in range(R):
        if not 0 <= seqs[r] < cross.batch or lens[seqs[r]] == 0:
            raise KVSimdValueError("cross-attention cache has no tokens for sequence %d" % seqs[r])
    cdef int nt = _threads_now()
    cdef void *wsp = _aligned64(cross._scratch(H, nt))
    cdef float scale = 1.0 / sqrtf(<float>D)
    rng[0], rng[1], rng[3] = 0, 0, 0
    cross._acquire()
    try:
        with nogil:
            for r in range(R):
                s = seqs[r]
                rng[2] = lens[s]
                _attn_init(&p, q + r * H * D, NULL, kv_cache_block(&cross.c, l, 0, s),
                           kv_cache_block(&cross.c, l, 1, s), out + r * H * D, NULL, NULL, rng, 1,
                           H, Hkv, D, cross.capacity, scale, 0.0, cross._kv_dtype,
                           1, 0, 0, 0, 0, kv_cache_scales(&cross.c, l, 0, s), kv_cache_scales(&cross.c, l, 1, s),
                           cross._v_dtype)
                if cross.hadamard:   # q and out turned as the rows are (_KVStore's docstring)
                    kv_hadamard_rows(q + r * H * D, D, H, D)
                kv_attend(&p, wsp, nt)
                if cross.hadamard:
                    kv_hadamard_rows(out + r * H * D, D, H, D)
    finally:
        cross._release()
    return 0


def _local_plan(int64_t T, int64_t H, int64_t Hkv, int64_t D, RopeSpec rope, alibi_slopes, bint causal, scale=None,
                softcap=None, windows=None):
    """The plan of a pass without a cache (an encoder, or the uncached decoder forward): the T
    rows' K/V go to a scratch float32 store reused by every layer; row t reads keys 0..t
    (causal) or all T."""
    if not 1 <= T <= KV_MAX_TOKENS:
        raise KVSimdValueError("T (rows of the pass) must be in 1..%d, got %d" % (KV_MAX_TOKENS, T))
    cdef _KVStore scratch = _KVStore(1, Hkv, D, T, dtype="float32")
    if windows and not causal:
        raise KVSimdValueError("attention windows need a causal pass, got windows=%r" % (windows,))
    cdef _Plan p = _new_plan(scratch, 2, T, H, Hkv, D, rope, alibi_slopes, scale, softcap, windows)
    cdef int64_t t
    p.one_layer = True
    p.slots[:] = _np.arange(T)
    p.kpos[:] = p.slots
    p.spos[:] = p.slots
    p.embed_positions = _readonly(p.kpos)
    _plan_prefix(p, p.slots + 1 if causal else T, p.slots)
    p.key_pos = None          # ALiBi: a key's position is its slot
    _plan_tables(p)
    return p


def _attend_plan(plan, layer, qkv, out, window=0):
    """Testing hook: the self-attention of every row of ``plan`` for ``layer``, as the compiled
    layers run it (_attend_rows): ``qkv`` float32 [rows, (H + 2 Hkv) * head_dim] (rotated and
    turned in place), ``out`` float32 [rows, H * head_dim]; ``window`` the layer's attention window."""
    cdef _Plan p = _need_plan(plan)
    cdef _KVStore store = p.owner
    _need_array(qkv, "qkv", (_F32,), 2, "", writeable=True,
                shape=(p.R, p.HD + 2 * store.n_kv_heads * store.head_dim))
    _need_array(out, "out", (_F32,), 2, "", writeable=True, shape=(p.R, p.HD))
    _need_no_overlap(out, "out", (("qkv", qkv), ("the cache storage", store._storage())))
    _attend_rows(p, store, _need_int(layer, "layer"), <float *>_ptr(qkv), qkv.shape[1], <float *>_ptr(out),
                 _need_int(window, "window", 0))
    return out
