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


def _decode_stack(list layers, cnp.ndarray x, KVCache cache, _StepPlan plan, bint rms, float eps, act,
                  bint gated, bint parallel, bint pre_norm=True, KVCache cross=None):
    """Run ``x`` (float32 [B, d_model], updated in place) through ``layers``: tuples
    (norm1 w, b, wqkv, bqkv, wo, bo, norm2 w, b, w_in, b_in, w2, b2, norm_cross w, b, cross wq, bq,
    cross wo, bo), w_in = [w1 | w3] when gated; the cross entries are None without ``cross``.
    Pre-norm: x += attn(norm1 x) [+= cross(norm_c x)] += ffn(norm2 x) (parallel: both from x);
    post-norm: x = norm1(x + attn x) [= norm_c(x + cross x)] = norm2(x + ffn x)."""
    cdef int64_t B = x.shape[0], d = x.shape[1], HD = plan.HD, l, i, n, nq, b
    cdef int kind = _ACTS[act]
    _need_array(x, "x", (_F32,), 2, "[batch, d_model]", writeable=True)
    if B != cache.batch or (cross is not None and cross.batch != B):
        raise KVSimdValueError("x must have one row per sequence of the caches (%d), got %d" % (cache.batch, B))
    # The layer tuples come from Decoder._fast_layers, built only from weights validated against the
    # model's config (kvsimd.layers.check_layer); what is checked here, once per step, is that the
    # caches have what the layers index: a layer per tuple, the plan's heads and head_dim.
    if len(layers) > cache.n_layers or (cross is not None and len(layers) > cross.n_layers):
        raise KVSimdValueError("%d layers for a cache of %d layers" % (len(layers), cache.n_layers))
    if cross is not None and (cross.head_dim != cache.head_dim or (HD // cross.head_dim) % cross.n_kv_heads):
        raise KVSimdValueError("cross cache heads (%d x %d) do not fit %d query features"
                               % (cross.n_kv_heads, cross.head_dim, HD))
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
