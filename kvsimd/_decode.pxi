# One decode step through the layers of a pre-norm decoder, with the per-layer glue in C.
#
# The matrix products stay in BLAS (np.matmul into preallocated outputs); norms, biases,
# activations, residual adds and the attention step (KVCache._attend_plan) run here without
# creating Python objects per layer.  Between two weight matrices a decode step is otherwise
# a few dozen small NumPy calls, and on a model whose weights stream from DRAM that glue was
# ~10% of the step.  Post-norm and encoder-decoder models keep the Python path (layers.py).


_ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


cdef inline float _act1(float v, int kind) noexcept nogil:
    if kind == 0:
        return v / (1.0 + expf(-v))
    if kind == 1:
        return 0.5 * v * (1.0 + erff(v * 0.7071067811865476))
    if kind == 2:
        return 0.5 * v * (1.0 + tanhf(0.7978845608028654 * (v + 0.044715 * v * v * v)))
    return v if v > 0 else 0


cdef void _act_rows(float *y, const float *x, const float *mul, int64_t n, int kind) noexcept nogil:
    """y = act(x) (* mul), one activation per loop so that each loop is a single simple body."""
    cdef int64_t i
    if kind == 0:
        for i in range(n):
            y[i] = x[i] / (1.0 + expf(-x[i]))
    else:
        for i in range(n):
            y[i] = _act1(x[i], kind)
    if mul != NULL:
        for i in range(n):
            y[i] *= mul[i]


cdef void _norm_rows(float *y, const float *x, int64_t B, int64_t d, const float *w, const float *bias, float eps,
                     bint rms) noexcept nogil:
    cdef int64_t b, i
    cdef double s, mu
    cdef float r, m
    for b in range(B):
        mu = 0.0
        if not rms:
            for i in range(d):
                mu += x[b * d + i]
            mu /= d
        m = <float>mu
        s = 0.0
        for i in range(d):
            s += (x[b * d + i] - m) * (x[b * d + i] - m)
        r = 1.0 / sqrtf(<float>(s / d) + eps)
        for i in range(d):
            y[b * d + i] = (x[b * d + i] - m) * r * w[i] + (bias[i] if bias != NULL else 0.0)


cdef inline void _add_bias(float *y, const float *bias, int64_t B, int64_t n) noexcept nogil:
    cdef int64_t b, i
    if bias != NULL:
        for b in range(B):
            for i in range(n):
                y[b * n + i] += bias[i]


cdef inline const float *_fptr(a):
    return <const float *>_ptr(a) if a is not None else NULL


# The entries of a layer tuple, in order (names as in kvsimd.layers.LayerWeights).
_ENTRIES = ("norm1.w", "norm1.b", "attn.wqkv", "attn.bqkv", "attn.wo", "attn.bo", "norm2.w", "norm2.b",
            "ffn.w_in", "ffn.b_in", "ffn.w2", "ffn.b2", "norm_cross.w", "norm_cross.b", "cross.wq", "cross.bq",
            "cross.wo", "cross.bo")


cdef inline bint _is_f32(object a, int nd, int64_t n0, int64_t n1) noexcept:
    """Fast path of _need_weight: an exact numpy.ndarray, float32, C-contiguous, aligned, of shape
    (n0,) or (n0, n1).  C-level compares only; anything else goes to the full check."""
    if not cnp.PyArray_CheckExact(a):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>a
    if cnp.PyArray_TYPE(arr) != cnp.NPY_FLOAT32 or cnp.PyArray_NDIM(arr) != nd:
        return False
    if not (cnp.PyArray_IS_C_CONTIGUOUS(arr) and cnp.PyArray_ISALIGNED(arr)):
        return False
    cdef cnp.npy_intp *dims = cnp.PyArray_DIMS(arr)
    return dims[0] == n0 and (nd == 1 or dims[1] == n1)


cdef int _need_weight(object a, int64_t l, int e, int64_t n0, int64_t n1, bint optional) except -1:
    """Entry ``e`` of layer ``l`` must be a float32, C-contiguous, aligned array of shape (n0,)
    (n1 < 0) or (n0, n1): _decode_stack reads it by pointer with these lengths.  The message
    comes from _need_array, the one array check of the boundary."""
    cdef int nd = 1 if n1 < 0 else 2
    cdef tuple shape
    if a is None:
        if optional:
            return 0
        shape = (<object>n0,) if nd == 1 else (<object>n0, <object>n1)
        raise KVSimdTypeError("layers[%d].%s must be a float32 array of shape %s, got None" % (l, _ENTRIES[e], shape))
    if _is_f32(a, nd, n0, n1):
        return 0
    shape = (<object>n0,) if nd == 1 else (<object>n0, <object>n1)
    _need_array(a, "layers[%d].%s" % (l, _ENTRIES[e]), (_F32,), nd, "[%s]" % _ENTRIES[e], shape=shape)
    return 0


cdef int _check_layers(list layers, int64_t d, int64_t HD, int64_t nq, bint gated, bint cross) except -1:
    """Every array each layer tuple holds, against the widths _decode_stack reads: once per step,
    before any layer runs (an array resized in place after the model checked it must not be read
    out of bounds)."""
    cdef int64_t l, F, n
    cdef tuple t
    for l in range(len(layers)):
        t = layers[l] if type(layers[l]) is tuple else None
        if t is None or len(t) != 18:
            raise KVSimdTypeError("layers[%d] must be a tuple of the 18 arrays (or None) %s, got %r"
                                  % (l, ", ".join(_ENTRIES), type(layers[l]).__name__ if t is None else len(t)))
        _need_weight(t[0], l, 0, d, -1, False)
        _need_weight(t[1], l, 1, d, -1, True)
        _need_weight(t[2], l, 2, d, nq, False)
        _need_weight(t[3], l, 3, nq, -1, True)
        _need_weight(t[4], l, 4, HD, d, False)
        _need_weight(t[5], l, 5, d, -1, True)
        _need_weight(t[6], l, 6, d, -1, False)
        _need_weight(t[7], l, 7, d, -1, True)
        w_in = t[8]      # [d, F]: F read from it, then checked like the others
        if not (cnp.PyArray_Check(w_in) and cnp.PyArray_NDIM(<cnp.ndarray>w_in) == 2):
            _need_weight(w_in, l, 8, d, 1, False)     # raises: None, not an array, or not 2-D
        F = w_in.shape[1]
        if F < 1 or (gated and F % 2):
            raise KVSimdValueError("layers[%d].ffn.w_in must be [%d, F] with F >= 1%s, got shape %s"
                                   % (l, d, " and even ([w1 | w3] of a gated FFN)" if gated else "", w_in.shape))
        _need_weight(w_in, l, 8, d, F, False)
        _need_weight(t[9], l, 9, F, -1, True)
        n = F // 2 if gated else F
        _need_weight(t[10], l, 10, n, d, False)
        _need_weight(t[11], l, 11, d, -1, True)
        if cross:
            _need_weight(t[12], l, 12, d, -1, False)
            _need_weight(t[13], l, 13, d, -1, True)
            _need_weight(t[14], l, 14, d, HD, False)
            _need_weight(t[15], l, 15, HD, -1, True)
            _need_weight(t[16], l, 16, HD, d, False)
            _need_weight(t[17], l, 17, d, -1, True)
    return 0


def _decode_stack(layers, x, cache, plan, rms, eps, act, gated, parallel, pre_norm=True, cross=None):
    """Run ``x`` (float32 [B, d_model], updated in place) through ``layers``: tuples
    (norm1 w, b, wqkv, bqkv, wo, bo, norm2 w, b, w_in, b_in, w2, b2, norm_cross w, b, cross wq, bq,
    cross wo, bo), w_in = [w1 | w3] when gated; the cross entries are None without ``cross``.
    Pre-norm: x += attn(norm1 x) [+= cross(norm_c x)] += ffn(norm2 x) (parallel: both from x);
    post-norm: x = norm1(x + attn x) [= norm_c(x + cross x)] = norm2(x + ffn x)."""
    for name, v, cls in (("layers", layers, list), ("cache", cache, KVCache), ("plan", plan, _StepPlan)):
        if not isinstance(v, cls):
            raise KVSimdTypeError("%s must be a %s, got %s" % (name, cls.__name__, type(v).__name__))
    if cross is not None and not isinstance(cross, KVCache):
        raise KVSimdTypeError("cross must be a KVCache or None, got %s" % type(cross).__name__)
    _need_array(x, "x", (_F32,), 2, "[batch, d_model]", writeable=True)
    return _run_stack(list(layers), x, cache, plan, _need_flag(rms, "rms"), _need_real(eps, "eps"), act,
                      _need_flag(gated, "gated"), _need_flag(parallel, "parallel"), _need_flag(pre_norm, "pre_norm"),
                      cross)


cdef object _run_stack(list layers, cnp.ndarray x, KVCache cache, _StepPlan plan, bint rms, float eps, act,
                       bint gated, bint parallel, bint pre_norm, KVCache cross):
    cdef int64_t B = x.shape[0], d = x.shape[1], HD = plan.HD, l, i, n, nq, b
    if not isinstance(act, str) or act not in _ACTS:
        raise KVSimdValueError("act must be one of %s, got %r" % (", ".join(_ACTS), act))
    cdef int kind = _ACTS[act]
    if plan.owner is not cache:
        raise KVSimdValueError("this step plan was made by another KVCache")
    if B != cache.batch or (cross is not None and cross.batch != B):
        raise KVSimdValueError("x must have one row per sequence of the caches (%d), got %d" % (cache.batch, B))
    # What the caches index: a layer per tuple, the plan's heads and head_dim.
    if len(layers) > cache.n_layers or (cross is not None and len(layers) > cross.n_layers):
        raise KVSimdValueError("%d layers for a cache of %d layers" % (len(layers), cache.n_layers))
    if cross is not None and (cross.head_dim != cache.head_dim or (HD // cross.head_dim) % cross.n_kv_heads):
        raise KVSimdValueError("cross cache heads (%d x %d) do not fit %d query features"
                               % (cross.n_kv_heads, cross.head_dim, HD))
    # What the layers hold: the tuples come from Decoder._fast_layers, built from weights checked
    # against the model's config, but an array can change after that (ndarray.resize), so every
    # array read by pointer is checked here, once per step, before the first layer runs.
    _check_layers(layers, d, HD, HD + 2 * cache.n_kv_heads * cache.head_dim, gated, cross is not None)
    h = _np.empty((B, d), _np.float32)
    att = _np.empty((B, HD), _np.float32)
    a = _np.empty((B, d), _np.float32)
    f = _np.empty((B, d), _np.float32)
    cq = _np.empty((B, HD), _np.float32)
    cdef float *xp = <float *>_ptr(x)
    cdef float *hp = <float *>_ptr(h)
    cdef float *ap = <float *>_ptr(a)
    cdef float *fp = <float *>_ptr(f)
    cdef float *attp = <float *>_ptr(att)
    cdef float *cqp = <float *>_ptr(cq)
    cdef float *gp
    cdef float *up
    cdef float *inp
    cdef const float *w1p
    cdef const float *b1p
    cdef const float *w2p
    cdef const float *b2p
    cdef const float *wcp
    cdef const float *bcp
    for l in range(len(layers)):
        n1w, n1b, wqkv, bqkv, wo, bo, n2w, n2b, w_in, b_in, w2, b2, ncw, ncb, cwq, cbq, cwo, cbo = layers[l]
        w1p, b1p, w2p, b2p = _fptr(n1w), _fptr(n1b), _fptr(n2w), _fptr(n2b)
        nq = wqkv.shape[1]
        qkv = _np.empty((B, nq), _np.float32)
        # self-attention
        if pre_norm:
            with nogil:
                _norm_rows(hp, xp, B, d, w1p, b1p, eps, rms)
            _np.matmul(h, wqkv, out=qkv)
        else:
            _np.matmul(x, wqkv, out=qkv)
        _add_bias(<float *>_ptr(qkv), _fptr(bqkv), B, nq)
        cache._attend_plan(l, <float *>_ptr(qkv), nq, attp, plan)
        _np.matmul(att, wo, out=a)
        _add_bias(ap, _fptr(bo), B, d)
        if not parallel:
            with nogil:
                for i in range(B * d):
                    xp[i] += ap[i]
                if not pre_norm:
                    _norm_rows(xp, xp, B, d, w1p, b1p, eps, rms)
        # cross-attention
        if cross is not None:
            wcp, bcp = _fptr(ncw), _fptr(ncb)
            if pre_norm:
                with nogil:
                    _norm_rows(hp, xp, B, d, wcp, bcp, eps, rms)
                _np.matmul(h, cwq, out=cq)
            else:
                _np.matmul(x, cwq, out=cq)
            _add_bias(cqp, _fptr(cbq), B, HD)
            cross._attend_all(l, cqp, HD // cross.head_dim, attp)
            _np.matmul(att, cwo, out=a)
            _add_bias(ap, _fptr(cbo), B, d)
            with nogil:
                for i in range(B * d):
                    xp[i] += ap[i]
                if not pre_norm:
                    _norm_rows(xp, xp, B, d, wcp, bcp, eps, rms)
        # feed-forward
        if pre_norm:
            with nogil:
                _norm_rows(hp, xp, B, d, w2p, b2p, eps, rms)
            g = _np.matmul(h, w_in)
        else:
            g = _np.matmul(x, w_in)
        gp = <float *>_ptr(g)
        _add_bias(gp, _fptr(b_in), B, g.shape[1])
        n = g.shape[1] // 2 if gated else g.shape[1]
        u = _np.empty((B, n), _np.float32)
        up = <float *>_ptr(u)
        with nogil:
            if gated:    # rows of g are [gate | up]
                for b in range(B):
                    _act_rows(up + b * n, gp + b * 2 * n, gp + b * 2 * n + n, n, kind)
            else:
                _act_rows(up, gp, NULL, B * n, kind)
        _np.matmul(u, w2, out=f)
        _add_bias(fp, _fptr(b2), B, d)
        with nogil:
            if parallel:
                for i in range(B * d):
                    xp[i] += ap[i] + fp[i]
            else:
                for i in range(B * d):
                    xp[i] += fp[i]
                if not pre_norm:
                    _norm_rows(xp, xp, B, d, w2p, b2p, eps, rms)
    return x
