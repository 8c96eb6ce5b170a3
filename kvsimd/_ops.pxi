# kvsimd.ops: the kernels over NumPy arrays (checked by _validate.pxi).


def attend(q, k, v, *, scale=None, alibi_slopes=None, key_positions=None, query_position=None, out=None,
           ranges=None, q_alt=None, softcap=None, causal_offset=None, causal=True, window=None, k_scale=None,
           v_scale=None, hadamard=False, recent=None, recent_window=None):
    """Attention over a KV cache: ``out[h] = softmax(scale * k[g] @ q[h] + bias) @ v[g]``.

    q: float32 ``[H, D]`` (one query) or ``[T, H, D]`` (T query rows of one sequence, see below);
    k, v: float16, float32 or int8 ``[Hkv, N, D]``, or uint8 ``[Hkv, N, 16 * ceil(D / 32)]`` holding
    int4 values two per byte (same dtype, or int8 keys with int4 values and the other way round, as
    a ``KVCache(dtype="int8/int4")`` stores them; int8 and int4 with their float32 block scales ``k_scale``,
    ``v_scale`` ``[Hkv, N, ceil(D / 32)]``: value d of row t stands for its integer times
    ``k_scale[g, t, d // 32]``, see :func:`quantize_kv`); H a multiple of
    Hkv (GQA/MQA: query head h uses KV head ``h // (H // Hkv)``).  ``scale`` defaults to
    ``1/sqrt(D)``.  Over int8 and int4 keys each query vector (and ``q_alt``) is read rounded by the
    int8 keys' rule, 32 values per step (:func:`quantize_kv`; turned first with ``hadamard``), and
    the scale applies after: full blocks of keys are then scored with exact integer dot products
    (VPDPBUSD on the AVX-512 rows, VPMADDWD on avx2; 4-bit keys read as int8 ones), and every path
    reads that same query (``kvsimd.reference.query_as_read``).  ALiBi: with ``alibi_slopes`` (float32 ``[H]``) the score of head h and key j
    gets ``- alibi_slopes[h] * (query_position - key_positions[j])``; ``key_positions`` (int64
    ``[N]``) defaults to ``0..N-1`` and ``query_position`` to ``N-1``.  One pass over K/V, online
    softmax, fp32 accumulation.  Returns float32 ``[H, D]`` (``out`` if given).  The weighted values
    are summed before the division by the sum of the weights (each at most 1, the largest exactly
    1): an output is finite when ``sum_j w_j |v_jd|`` is, which can reach N times the largest
    ``|v|`` when many keys share the top score -- values near float32's maximum / N (1e37 over 64
    equal keys) give inf where the exact average is finite.

    Several key ranges under one softmax (a ring cache with attention sinks): ``ranges`` lists
    ``(t0, t1)``, ``(t0, t1, use_q_alt)`` or ``(t0, t1, use_q_alt, query_position)`` tuples,
    non-empty and non-overlapping; only those keys are read, a range with ``use_q_alt`` is
    scored with ``q_alt`` (float32, q's shape, e.g. the query rotated at another position) and
    its ALiBi distances use its own ``query_position``.  One kernel call for all ranges.

    ``softcap`` (Gemma 2's attention logit soft-capping; None or 0: off): each scaled dot
    product s becomes ``softcap * tanh(s / softcap)`` before the ALiBi bias and the softmax.

    Several query rows (q ``[T, H, D]``, a prefill chunk; returns ``[T, H, D]``): row t reads the
    keys of the ranges (default all N) up to ``causal_offset + t`` (default offset ``N - T``: the
    last row sees key N-1), or every key with ``causal=False``; with ``window`` W (causal only) only
    the last W of those, keys ``> causal_offset + t - W``.  Its ALiBi query position is
    ``query_position + t`` (default ``query_position``: the offset), a range's own one + t.  Each
    K/V row is read once per KV-head group and tile of rows; every row must see a key.

    ``hadamard=True`` (int8 and int4 K/V only): the rows of k and v were stored turned by the
    32 x 32 Hadamard matrix H (``quantize_kv(..., hadamard=True)``, a :class:`KVCache` with
    ``hadamard``), so that H of the values a row stands for is the row (a shorter last block as it
    is).  The kernel then reads a turned copy of q (and of ``q_alt``; the caller's arrays are not
    changed) and ``out`` is turned back in place after it: scores and output are those of the
    unturned rows, up to the float32 rounding of the two turns.

    ``recent=(k_recent, v_recent)``: float16 or float32 ``[Hkv, M, D]`` (one dtype), the K/V rows of
    M tokens that follow k/v's N in the sequence, read as they are (a quantized cache's most
    recent tokens, kept unquantized: SmolLM2's int4 perplexity, ``bench/int4_recent_ppl.py``), under
    the same softmax as k/v.  The keys are then N + M: k/v's (their ``ranges``, if given), then every
    recent one, scored with q; ``key_positions`` has N + M entries and ``query_position``
    defaults to N + M - 1; rows cut causally over all N + M (``causal_offset`` default
    N + M - T, and in 0..N + M - T).  With ``hadamard`` the recent rows are given as a cache that
    turns its rows stores them, turned like k and v (H x / 32 over every whole block of 32,
    :func:`quantize_kv`'s turn; ``KVCache.recent_rows``).  Each part is computed on its own and
    merged (kvsimd.h kv_attend_sources): within the attention bound of one softmax over all N + M
    rows.

    ``recent_window=W`` (with ``recent``; a causal pass, no ALiBi, no ``q_alt``): the M recent rows
    are instead float rows of keys k/v hold quantized too, the M keys up to the last row's own
    (``causal_offset`` + T - M..``causal_offset`` + T - 1; one query q ``[H, D]`` is the row at key
    N - 1), and each query row reads its last W keys (itself included) from them where they hold
    the key, every older key from k/v -- how a quantized cache with float rows of its newest
    tokens is read (``KVCache(recent=W)``, the transformers integration's
    ``KVSimdCache(recent=W)``).  The keys are then k/v's N; with ``window`` w a row reads its last
    min(w, W) keys from the float rows (turned like k/v with ``hadamard``, as above).  Three parts
    merged as above: the
    keys before the float rows', the later ones read from k/v below each row's cut, the float
    rows at or above it."""
    cdef kv_attn_params p
    _need_array(q, "q", (_F32,), -1, "")
    if q.ndim not in (2, 3):
        raise KVSimdValueError("q must be 2-D [H, D] or 3-D [T, H, D], got shape %s" % (q.shape,))
    _need_array(k, "k", _KV_STORED, 3, "[Hkv, N, D]")
    _need_array(v, "v", _KV_STORED, 3, "[Hkv, N, D]")
    if k.dtype != v.dtype and not (k.dtype in (_I8, _U8) and v.dtype in (_I8, _U8)):
        raise KVSimdTypeError("k and v must have the same dtype (or be int8 and int4 rows), got %s and %s"
                              % (k.dtype, v.dtype))
    if k.shape[:2] != v.shape[:2] or (k.dtype == v.dtype and k.shape != v.shape):
        raise KVSimdValueError("k and v must have the same shape, got %s and %s" % (k.shape, v.shape))
    cdef bint rows = q.ndim == 3
    cdef int64_t T = q.shape[0] if rows else 1
    cdef int64_t H = q.shape[q.ndim - 2], D = q.shape[q.ndim - 1], Hkv = k.shape[0], N = k.shape[1]
    _need_head_dim(D)
    for x, name in ((k, "k"), (v, "v")):
        if x.dtype == _U8:
            _need_row_length(x, D, name)
        elif x.shape[2] != D:
            raise KVSimdValueError("head_dim mismatch: q is %s but k/v are %s" % (q.shape, x.shape))
    k_scale = _need_block_scales(k, k_scale, "k", "k_scale", D)
    v_scale = _need_block_scales(v, v_scale, "v", "v_scale", D)
    cdef bint hd = _need_flag(hadamard, "hadamard")
    kr, vr = _need_recent(recent, k, D)
    cdef int64_t M = 0 if kr is None else kr.shape[1], Mo = 0, W = 0
    if recent_window is not None:         # float rows over k/v's last M keys, not after them
        W = _need_int(recent_window, "recent_window", 1)
        if kr is None:
            raise KVSimdValueError("recent_window=%d needs the float rows it reads: recent=(k_recent, v_recent)" % W)
        if M > N:
            raise KVSimdValueError("recent_window: recent holds %d rows, more than k/v's %d keys it stands for"
                                   % (M, N))
        if alibi_slopes is not None or q_alt is not None or not _need_flag(causal, "causal"):
            raise KVSimdValueError("recent_window reads a causal pass without ALiBi or q_alt, got %s"
                                   % ("alibi_slopes" if alibi_slopes is not None else
                                      "q_alt" if q_alt is not None else "causal=False"))
        Mo, M = M, 0
    cdef int64_t NM = N + M
    if hd and k_scale is None:
        raise KVSimdValueError("hadamard=True applies to quantized K/V (int8, or int4 as uint8 rows), got k and v of "
                               "dtype %s" % (k.dtype,))
    if Hkv < 1 or H < 1 or H % Hkv:
        raise KVSimdValueError("query heads H=%d must be a positive multiple of KV heads Hkv=%d" % (H, Hkv))
    if N < 1:
        raise KVSimdValueError("the cache is empty (N=0): attention needs at least one key")
    if NM > KV_MAX_TOKENS:
        raise KVSimdValueError("N%s=%d tokens exceeds the supported maximum %d" % ("+M" if M else "", NM, KV_MAX_TOKENS))
    cdef int64_t off = 0, cend = 0, win = 0
    causal = _need_flag(causal, "causal")
    if not rows:
        if causal_offset is not None or window is not None:
            raise KVSimdValueError("causal_offset and window apply to several query rows (q [T, H, D]), got q %s"
                                   % (q.shape,))
    else:
        if T < 1:
            raise KVSimdValueError("q has no rows (shape %s)" % (q.shape,))
        if causal_offset is not None and not causal:
            raise KVSimdValueError("causal_offset applies to a causal pass, got causal=False")
        if causal and causal_offset is None and T > NM:
            raise KVSimdValueError("q has %d query rows, more than the N%s=%d keys (a causal pass needs a key "
                                   "per row)" % (T, "+M" if M else "", NM))
        off = NM - T if causal_offset is None else _need_int(causal_offset, "causal_offset")
        if causal and not 0 <= off <= NM - T:
            raise KVSimdValueError("causal_offset must be in 0..N%s-T=%d (row t sees keys up to causal_offset + t), "
                                   "got %d" % ("+M" if M else "", NM - T, off))
        if window is not None:
            if not causal:
                raise KVSimdValueError("window needs a causal pass, got causal=False")
            win = _need_int(window, "window", 1)
        cend = off + 1 if causal else 0
        if Mo > off + T:
            raise KVSimdValueError("recent_window: recent holds %d rows, more than the %d keys up to the last row's "
                                   "(causal_offset + T)" % (Mo, off + T))
    cdef float sc = _need_scale(scale, D)
    cdef float cap = _need_softcap(softcap)
    cdef const float *alibi = NULL
    cdef const int64_t *kpos = NULL
    cdef int64_t qpos = off if rows else NM - 1
    if alibi_slopes is None:
        if key_positions is not None or query_position is not None:
            raise KVSimdValueError("key_positions and query_position only apply with alibi_slopes")
    else:
        alibi = <const float *>_ptr(_need_slopes(alibi_slopes, H))
        if key_positions is not None:
            kpos = <const int64_t *>_ptr(_need_positions(key_positions, "key_positions", NM, "N+M" if M else "N"))
        if query_position is not None:
            qpos = _need_pos(query_position, "query_position")
            if rows and abs(qpos + T) > _MAX_EXACT_POS:
                raise KVSimdPositionError("query_position + T must stay within +-2**53, got %d + %d" % (qpos, T))
    if q_alt is not None:
        _need_array(q_alt, "q_alt", (_F32,), q.ndim, "(q's shape)", shape=q.shape)
    if out is None:
        out = _new_array(q.shape, _np.float32, "out")
    else:
        _need_array(out, "out", (_F32,), q.ndim, "(q's shape)", writeable=True, shape=q.shape)
        _need_no_overlap(out, "out", (("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes),
                                      ("key_positions", key_positions), ("q_alt", q_alt), ("k_scale", k_scale),
                                      ("v_scale", v_scale), ("recent[0]", kr), ("recent[1]", vr)))
    if ranges is not None:
        rng = _np.array(_key_ranges(ranges, N, qpos, False), dtype=_np.int64).reshape(-1, 4)
        if q_alt is None and rng[:, 0].any():
            raise KVSimdValueError("range %d uses q_alt, but q_alt was not given" % int(_np.argmax(rng[:, 0])))
        if rows and _np.abs(rng[:, 3]).max() + T > _MAX_EXACT_POS:
            raise KVSimdPositionError("a range's query_position + T must stay within +-2**53")
    elif q_alt is not None:
        raise KVSimdValueError("q_alt is only used by ranges that ask for it (ranges=...)")
    if rows and cend:           # every row must see a key of the ranges
        hi = off + 1 + _np.arange(T, dtype=_np.int64)
        lo = hi - win if win else _np.zeros(T, dtype=_np.int64)
        bounds = [(0, N)] if ranges is None else [tuple(b) for b in rng[:, 1:3]]
        if M:
            bounds.append((N, NM))
        seen = _np.zeros(T, dtype=bool)
        for t0, t1 in bounds:
            seen |= (_np.maximum(lo, t0) < _np.minimum(hi, t1))
        if not seen.all():
            t = int(_np.argmin(seen))
            raise KVSimdValueError("query row %d sees no key: its keys %d..%d hold none of the ranges"
                                   % (t, max(int(lo[t]), 0), int(hi[t])))
    cdef int64_t whole[4]                # every key, one range (no array for the common call)
    whole[0], whole[1], whole[2], whole[3] = 0, 0, N, qpos
    cdef const int64_t *rp = whole
    cdef int64_t nr = 1
    if ranges is not None:
        rp, nr = <const int64_t *>_ptr(rng), rng.shape[0]
    if hd:      # the rows are stored turned by H: so are the queries the kernel reads (copies)
        q = q.copy()
        kv_hadamard_rows(<float *>_ptr(q), D, T * H, D)
        if q_alt is not None:
            q_alt = q_alt.copy()
            kv_hadamard_rows(<float *>_ptr(q_alt), D, T * H, D)
    cdef int nt = _threads_now()
    ws = _workspace(H, Hkv, D, nt, T, 3 if Mo else 2 if M else 1)
    cdef void *wsp = _aligned64(ws)
    cdef kv_attn_params src[2]
    cdef int64_t tail[4]                 # the recent rows: one range, scored with q
    tail[0], tail[1], tail[2], tail[3] = 0, 0, M, qpos
    if M and alibi != NULL and kpos == NULL:   # their positions N..N+M-1 (k/v's default to 0..N-1)
        key_positions = _np.arange(N, NM, dtype=_np.int64)
    elif M and kpos != NULL:
        key_positions = key_positions[N:]
    _attn_init(&p, <const float *>_ptr(q), <const float *>_ptr(q_alt) if q_alt is not None else NULL, _ptr(k), _ptr(v),
               <float *>_ptr(out), alibi, kpos, rp, nr, H, Hkv, D, N, sc, cap, _kv_code(k), T, H * D, H * D, cend, win,
               <const float *>_ptr(k_scale) if k_scale is not None else NULL,
               <const float *>_ptr(v_scale) if v_scale is not None else NULL, _kv_code(v))
    cdef float *op = <float *>_ptr(out)
    if Mo:
        return _attend_over_float_rows(&p, rp, nr, kr, vr, Mo, W, off + T if rows else N, T if rows else 1,
                                       off + 1 if rows else N, win, hd, out, ws, nt)
    if M:
        src[0] = p
        _attn_init(&src[1], <const float *>_ptr(q), NULL, _ptr(kr), _ptr(vr), op, alibi,
                   <const int64_t *>_ptr(key_positions) if alibi != NULL else NULL, tail, 1, H, Hkv, D, M, sc, cap,
                   _kv_code(kr), T, H * D, H * D, cend, win)
        src[1].key_base = N
        with nogil:
            kv_attend_sources(src, 2, wsp, nt)
            if hd:
                kv_hadamard_rows(op, D, T * H, D)
        return out
    with nogil:
        kv_attend(&p, wsp, nt)
        if hd:  # and the output turned back
            kv_hadamard_rows(op, D, T * H, D)
    return out


cdef object _attend_over_float_rows(kv_attn_params *p, const int64_t *rp, int64_t nr, kr, vr, int64_t M, int64_t W,
                                    int64_t N, int64_t T, int64_t cend, int64_t win, bint hd, out, ws, int nt):
    """ops.attend with ``recent_window`` W: ``p`` filled for k/v over ranges ``rp`` (causal_end
    ``cend``, window ``win``); kr/vr the float rows of keys N - M..N-1, N the last row's key + 1
    (turned like k/v with ``hd``).  Three sources of kv_attend_sources, each range cut at
    lo = N - M: k/v below lo; k/v from lo with key_base W (row t reads key j there when
    j < cend + t - W); the float rows with key_base lo and window W (the row's last W keys)."""
    cdef int64_t lo = N - M, i, t0, t1, n = 0, na = 0, nb = 0
    cdef kv_attn_params src[3]
    tabs = _np.empty((2, nr, 4), dtype=_np.int64)      # the ranges below lo; those from lo (k/v's keys)
    cdef int64_t[:, :, :] tb = tabs
    for i in range(nr):
        t0, t1 = rp[4 * i + 1], rp[4 * i + 2]
        if t0 < lo:
            tb[0, na, 0], tb[0, na, 1], tb[0, na, 2], tb[0, na, 3] = rp[4 * i], t0, min(t1, lo), rp[4 * i + 3]
            na += 1
        if t1 > lo:
            tb[1, nb, 0], tb[1, nb, 1], tb[1, nb, 2], tb[1, nb, 3] = rp[4 * i], max(t0, lo), t1, rp[4 * i + 3]
            nb += 1
    flt = tabs[1, :nb].copy()                             # the same, over the float rows' own keys
    flt[:, 1:3] -= lo
    if na:
        src[n] = p[0]
        src[n].ranges, src[n].n_ranges, src[n].causal_end = <const kv_attn_range *>&tb[0, 0, 0], na, cend
        n += 1
    if nb and (win == 0 or win > W):
        src[n] = p[0]
        src[n].ranges, src[n].n_ranges = <const kv_attn_range *>&tb[1, 0, 0], nb
        src[n].key_base, src[n].window, src[n].causal_end = W, (win - W if win else 0), cend
        n += 1
    if nb:
        _attn_init(&src[n], p.q, NULL, _ptr(kr), _ptr(vr), p.out, NULL, NULL, <const int64_t *>_ptr(flt),
                   nb, p.H, p.Hkv, p.D, M, p.scale, p.softcap, _kv_code(kr), T, p.q_stride, p.out_stride,
                   cend, min(win, W) if win else W)
        src[n].key_base = lo
        n += 1
    cdef void *wsp = _aligned64(ws)
    cdef float *op = p.out
    cdef int64_t D = p.D, H = p.H
    with nogil:
        kv_attend_sources(src, n, wsp, nt)
        if hd:
            kv_hadamard_rows(op, D, T * H, D)
    return out


def apply_rope(x, positions, *, theta=10000.0, style="gptj", rotary_dim=None, inv_freq=None, attn_factor=1.0):
    """Rotate ``x`` (float32 or float16 ``[H, N, D]``) in place by RoPE at ``positions`` (int64 ``[N]``).

    ``style="gptj"`` pairs ``(x[2i], x[2i+1])``; ``style="neox"`` pairs ``(x[i], x[i + rotary_dim/2])``.
    Only the first ``rotary_dim`` dims (even, default D) rotate; pair i turns by
    ``position * inv_freq[i]``, the angle computed in double precision from the integer position;
    ``inv_freq`` (rotary_dim/2 positive reals, e.g. from kvsimd.nn.config.rope_frequencies)
    defaults to ``theta ** (-2i / rotary_dim)``.  The rotated pairs are multiplied by
    ``attn_factor`` (YaRN's attention factor; default 1).  fp16 results are rounded as
    :func:`kvsimd.bounds.rope_bound` states (once on the scalar, avx2 and avx512 rows, each component
    twice on avx512fp16)."""
    _need_array(x, "x", _KV_DTYPES, 3, "[H, N, D]", writeable=True)
    cdef int64_t H = x.shape[0], N = x.shape[1], D = x.shape[2]
    if N == 0 or H == 0 or D == 0:
        raise KVSimdValueError("x is empty (shape %s)" % (x.shape,))
    _need_positions(positions, "positions", N)
    _need_no_overlap(x, "x", (("positions", positions),))
    cdef RopeSpec spec = RopeSpec(theta, style, rotary_dim, D, inv_freq, attn_factor)
    cdef const double *inv = spec.inv
    cdef double sc = spec.attn_factor
    cdef kv_rope_style cst = spec.st
    cdef int64_t crd = spec.rotary_dim
    cdef kv_dtype dt = KV_F16 if x.dtype == _F16 else KV_F32
    cdef void *xp = _ptr(x)
    cdef const int64_t *pp = <const int64_t *>_ptr(positions)
    cdef kv_status s
    with nogil:
        s = kv_apply_rope(xp, dt, H, N, D, pp, inv, sc, cst, crd)
    _check_status(s, "apply_rope")


def shift_keys(k, delta, *, theta=10000.0, style="gptj", rotary_dim=None, inv_freq=None, start=0, stop=None,
               k_scale=None, head_dim=None, hadamard=False):
    """Rotate an already-RoPE'd cache ``k`` (float16 or float32 ``[Hkv, N, D]``) in place, as if
    tokens ``start..stop-1`` had moved by the integer ``delta`` positions (negative after a discard).
    An int8 ``k``, or a uint8 one holding int4 (``[Hkv, N, 16 * ceil(D / 32)]``; ``head_dim`` D,
    default twice its last axis), comes with its float32 block scales ``k_scale``
    ``[Hkv, N, ceil(D / 32)]`` (rewritten too): each row is widened, rotated in fp32 and quantized
    again (:func:`quantize_kv`), which adds at most half a step of the new scale per component
    (:func:`kvsimd.bounds.quantized_shift_bound`).  ``hadamard``: the rows were stored turned by the
    Hadamard matrix (``quantize_kv(..., hadamard=True)``); they are turned back, rotated, and stored
    turned again.

    Same pairing and frequencies (``inv_freq``) as :func:`apply_rope`, and no attention factor:
    a key rotated with one already carries it, and the shift only turns it.  The angle comes from
    the integer delta in double precision and each call adds at most one
    :func:`kvsimd.bounds.rope_bound` of rounding, so ``apply_rope`` at p then ``shift_keys(delta)``
    equals ``apply_rope`` at ``p + delta`` up to rounding."""
    _need_array(k, "k", _KV_STORED, 3, "[Hkv, N, D]", writeable=True)
    cdef int64_t H = k.shape[0], N = k.shape[1], D = k.shape[2]
    if N == 0 or H == 0 or D == 0:
        raise KVSimdValueError("k is empty (shape %s)" % (k.shape,))
    if head_dim is not None or k.dtype == _U8:
        if k.dtype != _U8:
            raise KVSimdValueError("head_dim applies to int4 (uint8) keys only; k is %s [Hkv, N, D]" % (k.dtype,))
        D = 2 * D if head_dim is None else _need_int(head_dim, "head_dim", 1)
        _need_head_dim(D)
        _need_row_length(k, D, "k")
    k_scale = _need_block_scales(k, k_scale, "k", "k_scale", D)
    cdef bint hd = _need_flag(hadamard, "hadamard")
    if hd and k_scale is None:
        raise KVSimdValueError("hadamard=True applies to quantized keys (int8 or int4), got k of dtype %s" % (k.dtype,))
    if k_scale is not None:
        _need_array(k_scale, "k_scale", (_F32,), 3, "[Hkv, N, blocks]", writeable=True)
        _need_no_overlap(k_scale, "k_scale", (("k", k),))
    cdef RopeSpec spec = RopeSpec(theta, style, rotary_dim, D, inv_freq)
    d = _need_pos(delta, "delta")
    t0 = _need_int(start, "start")
    t1 = N if stop is None else _need_int(stop, "stop")
    if not (0 <= t0 <= t1 <= N):
        raise KVSimdPositionError("need 0 <= start <= stop <= N=%d, got start=%d stop=%d" % (N, t0, t1))
    cdef const double *inv = spec.inv
    cdef kv_rope_style cst = spec.st
    cdef int64_t crd = spec.rotary_dim, cd = d, c0 = t0, c1 = t1
    cdef kv_dtype dt = _kv_code(k)
    cdef void *kp = _ptr(k)
    cdef float *ksp = <float *>_ptr(k_scale) if k_scale is not None else NULL
    cdef kv_status s
    with nogil:
        s = kv_shift_keys(kp, ksp, dt, hd, H, N, D, cd, inv, cst, crd, c0, c1)
    _check_status(s, "shift_keys")


def quantize_kv(x, dtype="int8", *, hadamard=False):
    """Quantize float32 ``x`` (any shape ``[..., D]``) as a quantized KV cache stores K and V: each
    row of the last axis in blocks of 32 values (the last one shorter when D is not a multiple),
    one float32 scale per block.  Returns ``(q, scale)``, scale float32 ``x.shape[:-1] +
    (ceil(D / 32),)``.  ``dtype="int8"``: q int8 ``x.shape``, ``scale = max |block| / 127`` and
    ``q = block / scale`` rounded to nearest (ties to even): ``|x - q * scale| <= scale / 2``.
    ``dtype="int4"``: q in -8..7 and the smallest ``|scale|`` that keeps ``|x - q * scale| <= |scale| / 2``
    (:func:`kvsimd.reference.int4_scale`: ``max(neg / 8.5, pos / 7.5)``, negative where the
    positive side is the larger, so that it gets the 8.5 steps of room), stored two per byte as uint8
    ``x.shape[:-1] + (16 * ceil(D / 32),)``: byte i of block b holds value 32 b + i in its low nibble
    and 32 b + 16 + i in its high one, each as q + 8 (the padding of a short last block reads 0);
    :func:`kvsimd.reference.unpack_int4` unpacks.  A block holding NaN or infinity gets scale NaN
    (and q 0), so it reads as NaN.  ``hadamard=True``: every whole block of 32 values is turned by
    the 32 x 32 Hadamard matrix H (entries +-1) before it is quantized and its scale divided by 32,
    so that the values the row stands for are H x / 32 and H of them is x
    (:func:`kvsimd.reference.hadamard_rows`; a shorter last block as without)."""
    _need_array(x, "x", (_F32,), -1, "[..., D]")
    if x.ndim < 1 or x.shape[x.ndim - 1] < 1:
        raise KVSimdValueError("x must have a non-empty last axis, got shape %s" % (x.shape,))
    cdef kv_dtype dt
    if not isinstance(dtype, str):
        raise KVSimdTypeError("dtype must be 'int8' or 'int4', got %r" % (dtype,))
    if dtype == "int8":
        dt = KV_I8
    elif dtype == "int4":
        dt = KV_I4
    else:
        raise KVSimdValueError("dtype must be 'int8' or 'int4', got %r" % (dtype,))
    cdef bint hd = _need_flag(hadamard, "hadamard")
    cdef int64_t D = x.shape[x.ndim - 1], n = x.size // D, rb = <int64_t>kv_row_bytes(dt, D)
    lead = x.shape[:x.ndim - 1]
    q = _new_array(lead + (rb,), _I8 if dt == KV_I8 else _U8, "quantize_kv's values")
    scale = _new_array(lead + (kv_i8_blocks(D),), _F32, "quantize_kv's scales")
    cdef void *qp = _ptr(q)
    cdef float *sp = <float *>_ptr(scale)
    cdef const float *xp = <const float *>_ptr(x)
    with nogil:
        kv_quantize_rows(dt, hd, qp, rb, sp, xp, D, n, D)
    return q, scale


def _convert_out(x, out, dtype):
    if out is None:
        return _new_array(x.shape, dtype, "out")
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
