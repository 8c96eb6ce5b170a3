# The transformer layer of kvsimd, written once: prefill (the T rows of one sequence), decode (one
# row per sequence), the encoder (bidirectional) and the uncached pass all run Layers.run; only
# the attention plan differs (_plan.pxi).  Matrix products go through Linear (weights as stored:
# kvsimd's kernels, _weights.pxi; float32 arrays: BLAS);
# norms, biases, activations, gating and residual adds run here in C, without Python objects per
# row.  Weights are packed once per model (nn/weights.py: pack_layers) into typed Block objects.

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


cdef inline void _add_rows(float *y, const float *bias, int64_t R, int64_t n) noexcept nogil:
    cdef int64_t r, i
    if bias != NULL:
        for r in range(R):
            for i in range(n):
                y[r * n + i] += bias[i]


cdef class _Weight:
    """A float32 array the compiled layers read by pointer, with the pointer and shape it had when
    it was packed: _verify() refuses an array changed in place since (ndarray.resize, a dtype or
    shape assignment), so C never reads a buffer of another size."""
    cdef readonly object a
    cdef readonly str name
    cdef void *data
    cdef int nd
    cdef cnp.npy_intp n0, n1

    def __cinit__(self, a, str name, shape):
        _need_array(a, name, (_F32,), len(shape), str(tuple(shape)), shape=tuple(shape))
        self.a, self.name = a, name
        self.data = cnp.PyArray_DATA(<cnp.ndarray>a)
        self.nd = len(shape)
        self.n0 = shape[0]
        self.n1 = shape[1] if self.nd == 2 else 0

    cdef inline int verify(self) except -1:
        cdef cnp.ndarray arr = <cnp.ndarray>self.a
        if (cnp.PyArray_DATA(arr) != self.data or cnp.PyArray_NDIM(arr) != self.nd
                or cnp.PyArray_TYPE(arr) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(arr)
                or cnp.PyArray_DIMS(arr)[0] != self.n0 or (self.nd == 2 and cnp.PyArray_DIMS(arr)[1] != self.n1)):
            raise KVSimdValueError("%s changed in place after the model packed it (now %s %s): assign a new array "
                                   "instead" % (self.name, self.a.dtype, self.a.shape))
        return 0


cdef inline const float *_wp(_Weight w) noexcept:
    return <const float *>w.data if w is not None else NULL


cdef class _Parameters:
    """A weight and an optional bias, read by pointer, and the row input check of both Linear and Norm."""
    cdef readonly _Weight w, b

    cdef int verify(self) except -1:
        self.w.verify()
        if self.b is not None:
            self.b.verify()
        return 0

    cdef object _rows(self, x, int64_t width):
        """``x`` as float32 C-contiguous rows of ``width``, the weights checked unchanged."""
        x = _np.ascontiguousarray(x, dtype=_np.float32)
        _need_array(x, "x", (_F32,), 2, "[rows, %d]" % width)
        if x.shape[1] != width:
            raise KVSimdValueError("x must be [rows, %d], got %s" % (width, x.shape))
        self.verify()
        return x


# Rows of x up to which stored weights go through the kernel (each weight decoded once, multiplied
# into every row); beyond, dequantized tiles through BLAS (prefill: measured on SmolLM2's shapes,
# the kernel wins at 16 rows, BLAS from 64; Linear._apply_tiles; int8-activation parts: the kernel always).
_KERNEL_ROWS = 32


cdef class Linear(_Parameters):
    """``y = x @ W (+ b)`` for rows x: the one interface every weight matrix of a layer goes through.
    ``w`` is either a float32 array ``[in, out]`` (multiplied through BLAS), or weights as a file
    stores them: a :class:`QMatrix` ``[out, in]`` (GGUF / torch order, any weight type), or a
    tuple of QMatrix parts stacked along ``out`` (a fused q|k|v or gate|up projection whose parts
    keep their own types: each writes its column range of the one output)."""
    cdef readonly int64_t n_in, n_out
    cdef readonly str name
    cdef readonly tuple parts          # the QMatrix parts (empty for a float32 array)

    def __cinit__(self, w, b=None, *, str name="w", str bias_name=None):
        self.name = name
        if isinstance(w, QMatrix):
            w = (w,)
        if isinstance(w, (tuple, list)):
            if not w or not all(isinstance(q, QMatrix) for q in w):
                raise KVSimdTypeError("%s must be a float32 array, a QMatrix or a tuple of QMatrix parts, got %r"
                                      % (name, w))
            ni = (<QMatrix>w[0]).cols
            for q in w:
                if (<QMatrix>q).cols != ni:
                    raise KVSimdValueError("%s: the parts of a fused projection must have the same number of "
                                           "columns (inputs), got %s" % (name, ", ".join(repr(x) for x in w)))
            self.parts = tuple(w)
            no = sum((<QMatrix>q).rows for q in w)
            self.w = None
        else:
            if not isinstance(w, _np.ndarray) or w.ndim != 2:
                _need_array(w, name, (_F32,), 2, "[in, out]")
            ni, no = w.shape
            self.w = _Weight(w, name, (ni, no))
            self.parts = ()
        if bias_name is None:       # "layers[0].attn.wqkv" -> "layers[0].attn.bqkv"
            head, _, last = name.rpartition(".")
            bias_name = (head + "." if head else "") + ("b" + last[1:] if last[:1] == "w" else last + "_bias")
        self.b = None if b is None else _Weight(b, bias_name, (no,))
        self.n_in, self.n_out = ni, no

    cdef int verify(self) except -1:
        if self.w is not None:
            self.w.verify()
        if self.b is not None:
            self.b.verify()
        return 0

    cdef list spans(self):
        """(name, start address, end address) of every buffer the product reads."""
        out = []
        if self.w is not None:
            out.append((self.w.name, <size_t>self.w.data, <size_t>self.w.data + <size_t>self.w.a.nbytes))
        for q in self.parts:
            out.append(((<QMatrix>q).name, (<QMatrix>q).address, (<QMatrix>q).address + (<QMatrix>q).nbytes))
        if self.b is not None:
            out.append((self.b.name, <size_t>self.b.data, <size_t>self.b.data + <size_t>self.b.a.nbytes))
        return out

    cdef int apply(self, x, out) except -1:
        """out[R, n_out] = x[R, n_in] @ W + b (x, out: C-contiguous float32, checked by the caller)."""
        cdef int64_t R = out.shape[0], off = 0, ni = self.n_in, no = self.n_out
        cdef const float *xp = <const float *>_ptr(x)
        cdef float *yp = <float *>_ptr(out)
        cdef int threads = kv_get_num_threads()
        cdef QMatrix q
        if self.w is not None:
            _np.matmul(x, self.w.a, out=out)
        else:
            for part in self.parts:
                q = <QMatrix>part
                if R > _KERNEL_ROWS and q._packed == NULL:
                    self._apply_tiles(q, x, out, off)
                else:
                    with nogil:
                        q.apply(xp, R, ni, yp + off, no, threads)
                off += q.rows
        _add_rows(yp, _wp(self.b), R, no)
        return 0

    cdef int _apply_tiles(self, QMatrix q, x, out, int64_t off) except -1:
        """Many rows (a prefill chunk) through a float-activation part: the product is
        compute-bound, so the part is dequantized a tile of rows at a time into float32 scratch
        (~4 MB: it stays in cache) and multiplied through BLAS (measured 2x faster than the
        widening kernel from 64 rows on).  Int8-activation parts keep their kernel at any row
        count (measured faster than these tiles at 64 and 512 rows on SmolLM2's and an 8B
        model's shapes; and it reads the repacked copy only, not the file's pages)."""
        cdef int64_t j, t, T
        cdef float *sp
        cdef const uint8_t *src
        T = max(16, min(256, (1 << 22) // (4 * q.cols)))
        scratch = _np.empty((T, q.cols), _np.float32)
        sp = <float *>_ptr(scratch)
        for j in range(0, q.rows, T):
            t = min(T, q.rows - j)
            src = q._data + j * q.row_bytes
            with nogil:
                kv_dequantize(q.t, sp, src, t * q.cols)
            _np.matmul(x, scratch[:t].T, out=out[:, off + j:off + j + t])
        return 0

    def __call__(self, x):
        x = self._rows(x, self.n_in)
        out = _np.empty((x.shape[0], self.n_out), _np.float32)
        self.apply(x, out)
        return out


cdef int _need_dims(Linear lin, int64_t n_in, int64_t n_out) except -1:
    if lin is None:
        raise KVSimdTypeError("a Block needs every projection of its layer, got None")
    if lin.n_in != n_in or lin.n_out != n_out:
        raise KVSimdValueError("%s must be [%d, %d] for these layers, got [%d, %d]"
                               % (lin.name, n_in, n_out, lin.n_in, lin.n_out))
    return 0


cdef class Norm(_Parameters):
    """RMSNorm (``rms``; no bias) or LayerNorm of rows of width ``d`` with weight ``w`` and bias ``b``."""
    cdef readonly bint rms
    cdef readonly float eps
    cdef readonly int64_t d

    def __cinit__(self, w, b, bint rms, eps, int64_t d, *, str name="norm"):
        self.w = _Weight(w, name + ".w", (d,))
        self.b = None if (b is None or rms) else _Weight(b, name + ".b", (d,))
        self.rms, self.eps, self.d = rms, _need_real(eps, "eps"), d

    cdef void run(self, float *y, const float *x, int64_t R) noexcept nogil:
        cdef int64_t r, i, d = self.d
        cdef double s, mu
        cdef float inv, m
        cdef const float *w = <const float *>self.w.data
        cdef const float *bias = <const float *>self.b.data if self.b is not None else NULL
        for r in range(R):
            mu = 0.0
            if not self.rms:
                for i in range(d):
                    mu += x[r * d + i]
                mu /= d
            m = <float>mu
            s = 0.0
            for i in range(d):
                s += (x[r * d + i] - m) * (x[r * d + i] - m)
            inv = 1.0 / sqrtf(<float>(s / d) + self.eps)
            for i in range(d):
                y[r * d + i] = (x[r * d + i] - m) * inv * w[i] + (bias[i] if bias != NULL else 0.0)

    def __call__(self, x):
        x = self._rows(x, self.d)
        y = _np.empty_like(x)
        cdef float *yp = <float *>_ptr(y)
        cdef const float *xp = <const float *>_ptr(x)
        cdef int64_t R = x.shape[0]
        with nogil:
            self.run(yp, xp, R)
        return y


cdef class Block:
    """One layer's weights, packed: norms, the fused q|k|v projection, the output projection, the
    FFN (``ffn_in`` = [w1 | w3] when gated) and, with cross-attention, its norm, q, o and the
    k|v projection of the encoder output.  Optional: ``q_norm`` / ``k_norm`` (a norm of each q
    and k head before RoPE) and ``post_attn`` / ``post_ffn`` (norms of the attention and FFN
    outputs before their residual adds)."""
    cdef readonly Norm norm1, norm2, norm_cross, q_norm, k_norm, post_attn, post_ffn
    cdef readonly Linear qkv, o, ffn_in, ffn_out, cross_q, cross_o, cross_kv

    def __cinit__(self, Norm norm1, Linear qkv, Linear o, Norm norm2, Linear ffn_in, Linear ffn_out,
                  Norm norm_cross=None, Linear cross_q=None, Linear cross_o=None, Linear cross_kv=None, *,
                  Norm q_norm=None, Norm k_norm=None, Norm post_attn=None, Norm post_ffn=None):
        self.norm1, self.qkv, self.o, self.norm2, self.ffn_in, self.ffn_out = norm1, qkv, o, norm2, ffn_in, ffn_out
        self.norm_cross, self.cross_q, self.cross_o, self.cross_kv = norm_cross, cross_q, cross_o, cross_kv
        if (q_norm is None) != (k_norm is None):
            raise KVSimdValueError("q_norm and k_norm come together (a norm of every q and k head), got one of them")
        self.q_norm, self.k_norm, self.post_attn, self.post_ffn = q_norm, k_norm, post_attn, post_ffn

    cdef tuple norms(self):
        return (self.norm1, self.norm2, self.norm_cross, self.q_norm, self.k_norm, self.post_attn, self.post_ffn)

    cdef int verify(self) except -1:
        for part in self.norms():
            if part is not None:
                (<Norm>part).verify()
        for part in (self.qkv, self.o, self.ffn_in, self.ffn_out, self.cross_q, self.cross_o, self.cross_kv):
            if part is not None:
                (<Linear>part).verify()
        return 0


cdef class Layers:
    """A stack of Blocks under one configuration: what every forward pass of a model runs."""
    cdef readonly tuple blocks
    cdef readonly int64_t d, H, Hkv, D
    cdef readonly bint pre_norm, parallel, gated, cross
    cdef readonly tuple windows      # per block: its attention window (0: every key of the plan's ranges)
    cdef int act
    cdef object _wr                 # int64 [n, 2]: every weight's bytes [start, end), for run's overlap check
    cdef list _wn                   # their names

    def __cinit__(self, blocks, *, int64_t d_model, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                  activation, bint gated, bint pre_norm, bint parallel_residual, windows=None):
        if not isinstance(activation, str) or activation not in _ACTS:
            raise KVSimdValueError("activation must be one of %s, got %r" % (", ".join(_ACTS), activation))
        self.blocks = tuple(blocks)
        for i, b in enumerate(self.blocks):
            if not isinstance(b, Block):
                raise KVSimdTypeError("blocks[%d] must be a Block, got %s" % (i, type(b).__name__))
        self.d, self.H, self.Hkv, self.D = d_model, n_heads, n_kv_heads, head_dim
        self.act, self.gated, self.pre_norm = _ACTS[activation], gated, pre_norm
        self.parallel = parallel_residual and pre_norm
        self.cross = bool(self.blocks) and (<Block>self.blocks[0]).cross_q is not None
        if not (d_model >= 1 and head_dim >= 1 and n_kv_heads >= 1 and n_heads >= 1 and n_heads % n_kv_heads == 0):
            raise KVSimdValueError("d_model=%d, n_heads=%d, n_kv_heads=%d, head_dim=%d do not make attention layers"
                                   % (d_model, n_heads, n_kv_heads, head_dim))
        for b in self.blocks:
            self._check_block(<Block>b)
        if windows is None:
            self.windows = (0,) * len(self.blocks)
        else:
            if isinstance(windows, (str, bytes)) or not hasattr(windows, "__len__") or len(windows) != len(self.blocks):
                raise KVSimdValueError("windows must be one integer >= 0 per block (%d), got %r"
                                       % (len(self.blocks), windows))
            self.windows = tuple(_need_int(w, "windows[%d]" % i) for i, w in enumerate(windows))
            if any(w < 0 for w in self.windows):
                raise KVSimdValueError("windows must be >= 0 (0: every key), got %r" % (self.windows,))
        cdef _Weight w
        spans, self._wn = [], []
        for b in self.blocks:
            for part in (<Block>b).norms():
                if part is None:
                    continue
                for w in ((<_Parameters>part).w, (<_Parameters>part).b):
                    if w is not None:
                        spans.append((<size_t>w.data, <size_t>w.data + <size_t>w.a.nbytes))
                        self._wn.append(w.name)
            for part in ((<Block>b).qkv, (<Block>b).o, (<Block>b).ffn_in, (<Block>b).ffn_out, (<Block>b).cross_q,
                         (<Block>b).cross_o, (<Block>b).cross_kv):
                if part is not None:
                    for nm, a0, a1 in (<Linear>part).spans():
                        spans.append((a0, a1))
                        self._wn.append(nm)
        self._wr = _np.array(spans, dtype=_np.uint64).reshape(-1, 2)

    cdef int _check_block(self, Block b) except -1:
        """Every part's width against the stack's: the compiled pass reads them by pointer with
        these lengths."""
        cdef int64_t d = self.d, HD = self.H * self.D, KV = 2 * self.Hkv * self.D
        for n in (b.norm1, b.norm2) + ((b.norm_cross,) if self.cross else ()):
            if n is None:
                raise KVSimdTypeError("a Block of these layers needs norm1, norm2%s" % (" and norm_cross" if self.cross else ""))
            if (<Norm>n).d != d:
                raise KVSimdValueError("%s must have %d entries for these layers, got %d" % ((<Norm>n).w.name, d, (<Norm>n).d))
        if b.q_norm is not None and (b.q_norm.d != self.D or b.k_norm.d != self.D):
            raise KVSimdValueError("q_norm and k_norm must have head_dim=%d entries, got %d and %d"
                                   % (self.D, b.q_norm.d, b.k_norm.d))
        for n in (b.post_attn, b.post_ffn):
            if n is not None and ((<Norm>n).d != d or not self.pre_norm):
                raise KVSimdValueError("%s: post-sublayer norms need pre-norm layers and %d entries, got %d"
                                       % ((<Norm>n).w.name, d, (<Norm>n).d))
        _need_dims(b.qkv, d, HD + KV)
        _need_dims(b.o, HD, d)
        if b.ffn_in is None or b.ffn_in.n_in != d:
            _need_dims(b.ffn_in, d, b.ffn_out.n_in * (2 if self.gated else 1) if b.ffn_out is not None else 1)
        if self.gated and b.ffn_in.n_out % 2:
            raise KVSimdValueError("%s must be [%d, 2F] ([gate | up] of a gated FFN), got [%d, %d]"
                                   % (b.ffn_in.name, d, b.ffn_in.n_in, b.ffn_in.n_out))
        F = b.ffn_in.n_out // 2 if self.gated else b.ffn_in.n_out
        _need_dims(b.ffn_out, F, d)
        if self.cross != (b.cross_q is not None) or (self.cross and (b.cross_o is None or b.cross_kv is None)):
            raise KVSimdValueError("every Block of a stack has cross-attention (norm_cross, cross_q, cross_o, "
                                   "cross_kv), or none does")
        if self.cross:
            _need_dims(b.cross_q, d, HD)
            _need_dims(b.cross_o, HD, d)
            _need_dims(b.cross_kv, b.cross_kv.n_in, KV)
        return 0

    def run(self, x, plan, cross=None):
        """Run the rows ``x`` (float32 [plan.R, d_model], updated in place) through every block,
        attending through ``plan`` (and over ``cross``, an encoder output cache, when the blocks
        have cross-attention).  Pre-norm: x += attn(norm1 x) [+= cross(norm_c x)] += ffn(norm2 x)
        (parallel residual: attn and ffn both from x); post-norm: x = norm1(x + attn x)
        [= norm_c(x + cross x)] = norm2(x + ffn x)."""
        _need_plan(plan)
        _need_array(x, "x", (_F32,), 2, "[rows, d_model]", writeable=True, shape=((<_Plan>plan).R, self.d))
        if plan.H != self.H:
            raise KVSimdValueError("the plan is for %d query heads, the layers have %d" % (plan.H, self.H))
        cdef _KVStore store = (<_Plan>plan).owner
        if store.n_kv_heads != self.Hkv or store.head_dim != self.D:
            raise KVSimdValueError("the cache has %d KV heads of %d, the layers %d of %d"
                                   % (store.n_kv_heads, store.head_dim, self.Hkv, self.D))
        if not (<_Plan>plan).one_layer and len(self.blocks) > store.n_layers:
            raise KVSimdValueError("%d layers for a cache of %d layers" % (len(self.blocks), store.n_layers))
        if self.cross:
            if not isinstance(cross, CrossAttentionCache):
                raise KVSimdTypeError("cross must be a CrossAttentionCache, got %s" % type(cross).__name__)
            if (<_KVStore>cross).n_kv_heads != self.Hkv or (<_KVStore>cross).head_dim != self.D \
                    or (<_KVStore>cross).n_layers < len(self.blocks):
                raise KVSimdValueError("cross must have at least %d layers of %d KV heads of %d, got %r"
                                       % (len(self.blocks), self.Hkv, self.D, cross))
        elif cross is not None:
            raise KVSimdTypeError("cross must be None for layers without cross-attention, got %s"
                                  % type(cross).__name__)
        for b in self.blocks:
            (<Block>b).verify()      # arrays read by pointer: unchanged since packing (cheap)
        self._need_x_apart(x)
        # the caches are held for the whole pass (not only per layer): no other thread can run or
        # commit a plan between two layers of this one
        store._acquire()
        try:
            if cross is not None:
                (<_KVStore>cross)._acquire()
            try:
                return self._run(x, <_Plan>plan, store, cross)
            finally:
                if cross is not None:
                    (<_KVStore>cross)._release()
        finally:
            store._release()

    cdef int _need_x_apart(self, x) except -1:
        """x is updated in place: refuse one that shares bytes with a weight (the pass would
        rewrite the model).  A C loop over the spans recorded at packing, which verify() keeps valid."""
        cdef const uint64_t *sp = <const uint64_t *>_ptr(self._wr)
        cdef uint64_t x0 = _addr(x), x1 = x0 + <uint64_t>x.nbytes
        cdef Py_ssize_t i, n = self._wr.shape[0]
        for i in range(n):
            if sp[2 * i] < x1 and x0 < sp[2 * i + 1]:
                _need_no_overlap(x, "x", ((self._wn[i], (sp[2 * i], sp[2 * i + 1] - sp[2 * i])),))
        return 0

    cdef int _project(self, Norm norm, Linear lin, cnp.ndarray x, cnp.ndarray h, out) except -1:
        """out = lin(norm(x)) before a pre-norm sublayer, lin(x) before a post-norm one (h: scratch)."""
        cdef int64_t R = x.shape[0]
        cdef float *hp = <float *>_ptr(h)
        cdef const float *xp = <const float *>_ptr(x)
        if self.pre_norm:
            with nogil:
                norm.run(hp, xp, R)
            lin.apply(h, out)
        else:
            lin.apply(x, out)
        return 0

    cdef void _residual(self, float *x, const float *a, const float *b, Norm norm, int64_t R) noexcept nogil:
        """x += a (+ b), then x = norm(x) after a post-norm sublayer."""
        cdef int64_t i, n = R * self.d
        if b != NULL:
            for i in range(n):
                x[i] += a[i] + b[i]
        else:
            for i in range(n):
                x[i] += a[i]
        if not self.pre_norm:
            norm.run(x, x, R)

    cdef int _head_norms(self, Block blk, float *qkv, int64_t R, int64_t width) except -1:
        """q_norm over every q head and k_norm over every k head of each row, in place."""
        cdef int64_t r, H = self.H, Hkv = self.Hkv, D = self.D
        with nogil:
            for r in range(R):
                blk.q_norm.run(qkv + r * width, qkv + r * width, H)
                blk.k_norm.run(qkv + r * width + H * D, qkv + r * width + H * D, Hkv)
        return 0

    cdef object _run(self, cnp.ndarray x, _Plan plan, _KVStore store, _KVStore cross):
        cdef int64_t R = x.shape[0], d = self.d, HD = self.H * self.D, nq, n, l, i, r
        cdef int64_t width = HD + 2 * self.Hkv * self.D
        cdef Block blk
        h = _np.empty((R, d), _np.float32)
        att = _np.empty((R, HD), _np.float32)
        a = _np.empty((R, d), _np.float32)
        f = _np.empty((R, d), _np.float32)
        qkv = _np.empty((R, width), _np.float32)
        cq = _np.empty((R, HD), _np.float32) if cross is not None else None
        cdef float *xp = <float *>_ptr(x)
        cdef float *ap = <float *>_ptr(a)
        cdef float *fp = <float *>_ptr(f)
        cdef float *gp
        cdef float *up
        cdef const int64_t *seqs = <const int64_t *>_ptr(plan.seqs)
        cdef bint par = self.parallel, gated = self.gated
        cdef int kind = self.act
        for l in range(len(self.blocks)):
            blk = self.blocks[l]
            # self-attention
            self._project(blk.norm1, blk.qkv, x, h, qkv)
            if blk.q_norm is not None:
                self._head_norms(blk, <float *>_ptr(qkv), R, width)
            _attend_rows(plan, store, l, <float *>_ptr(qkv), width, <float *>_ptr(att), self.windows[l])
            blk.o.apply(att, a)
            if blk.post_attn is not None:
                with nogil:
                    blk.post_attn.run(ap, ap, R)
            if not par:       # (parallel residual: attention and FFN are both added at the end)
                with nogil:
                    self._residual(xp, ap, NULL, blk.norm1, R)
            # cross-attention
            if cross is not None:
                self._project(blk.norm_cross, blk.cross_q, x, h, cq)
                _attend_cross(cross, l, seqs, R, <float *>_ptr(cq), self.H, <float *>_ptr(att))
                blk.cross_o.apply(att, a)
                with nogil:
                    self._residual(xp, ap, NULL, blk.norm_cross, R)
            # feed-forward
            g = _np.empty((R, blk.ffn_in.n_out), _np.float32)
            self._project(blk.norm2, blk.ffn_in, x, h, g)
            gp = <float *>_ptr(g)
            n = blk.ffn_out.n_in
            u = _np.empty((R, n), _np.float32)
            up = <float *>_ptr(u)
            with nogil:
                if gated:    # rows of g are [gate | up]
                    for r in range(R):
                        _act_rows(up + r * n, gp + r * 2 * n, gp + r * 2 * n + n, n, kind)
                else:
                    _act_rows(up, gp, NULL, R * n, kind)
            blk.ffn_out.apply(u, f)
            with nogil:
                if blk.post_ffn is not None:
                    blk.post_ffn.run(fp, fp, R)
                if par:
                    self._residual(xp, ap, fp, blk.norm2, R)
                else:
                    self._residual(xp, fp, NULL, blk.norm2, R)
        return x
