# Weights as a file stores them: QMatrix, a matrix in one of the weight types of
# src_c/wtypes.def (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), read in place from any
# buffer (a memory-mapped GGUF file: nothing is copied or dequantized at load), and its product
# with rows of activations through the active row's kernel (kv_matmul).
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_C_CONTIGUOUS, PyBUF_SIMPLE
from libc.stdlib cimport malloc, free

# the weight types, as C lists them: name -> (index, ggml type id, values per block, bytes per block)
_WT_NAMES = []
_WTYPES = {}


cdef _init_wtypes():
    cdef int ggml
    cdef int64_t block, nbytes
    for t in range(KV_WT_COUNT):
        name = kv_wtype_info(t, &ggml, &block, &nbytes).decode()
        _WT_NAMES.append(name)
        _WTYPES[name] = (t, ggml, block, nbytes)


_init_wtypes()
_WT_BY_GGML = {v[1]: k for k, v in _WTYPES.items()}


def weight_types():
    """The weight types kvsimd multiplies in place: {name: {"ggml_type", "block", "block_bytes"}}."""
    return {k: {"ggml_type": v[1], "block": v[2], "block_bytes": v[3]} for k, v in _WTYPES.items()}


cdef int64_t _MAX_DIM = (1 << 31) - 1


cdef class QMatrix:
    """A weight matrix kept as stored: ``rows`` rows of ``cols`` values in weight type ``wtype``
    ("q4_k", "q8_0", "f16", ...; :func:`weight_types`), each row a whole number of the type's
    blocks -- a GGUF tensor of shape ``[rows, cols]`` (NumPy order), or a torch ``nn.Linear``
    weight ``[out, in]``.  As a projection it computes ``x @ W.T`` (``matmul``); as an embedding
    table it gives rows (``take``).

    ``data`` is any C-contiguous buffer of exactly ``rows * row_bytes`` bytes (a ``numpy.uint8``
    view of a memory-mapped file is used in place); the QMatrix holds it exported for its
    lifetime, so the owner cannot resize or close it meanwhile.  A memory-mapped file must not be
    truncated while a QMatrix reads it (as with any memory map, the process would get SIGBUS).

    ``activations`` chooses how a product multiplies:

    - ``"int8"`` (types Q8_0, Q4_0, Q4_1, Q4_K, Q5_K with ``rows`` a multiple of 8; the default
      for them): x is rounded per block of 32 values to int8 steps of ``max |x| / 127`` (as
      llama.cpp does) and multiplied by integer dot products -- about twice the speed of widening
      the weights (Q6_K's integer form measured no faster: it widens), with
      the extra error of rounding x (``kvsimd.bounds.matmul_bound``: at most half a step times
      the block's sum of ``|w|``).  The matrix is then held a second time, repacked for the
      kernel (8 rows side by side; the same size as stored, 3% more for Q4_K/Q5_K, made once
      here): products read only
      the repacked copy; ``dequantize``, ``take`` and ``raw`` the stored bytes.
    - ``"float32"`` (every type; the default for the others): each weight widened exactly to
      float32 and multiplied into x in float32 (nothing is rounded but the sums)."""
    cdef Py_buffer _view
    cdef bint _held
    cdef const uint8_t *_data
    cdef uint8_t *_packed               # the repacked copy (int8 activations), or NULL
    cdef int64_t _packed_bytes
    cdef readonly object base
    cdef readonly str wtype, name, activations
    cdef readonly int64_t rows, cols, row_bytes
    cdef readonly int ggml_type
    cdef int t

    def __cinit__(self, data, wtype, shape, *, name="w", activations=None):
        self._held = False
        self._packed = NULL
        if not isinstance(name, str):
            raise KVSimdTypeError("QMatrix: name must be a str, got %r" % (name,))
        if not isinstance(wtype, str) or wtype.lower() not in _WTYPES:
            raise KVSimdValueError("%s: wtype must be one of %s, got %r" % (name, ", ".join(_WTYPES), wtype))
        wt = wtype.lower()
        self.t, self.ggml_type, block, bsize = _WTYPES[wt]
        try:
            rows, cols = shape
        except (TypeError, ValueError):
            raise KVSimdTypeError("%s: shape must be (rows, cols), got %r" % (name, shape)) from None
        rows = _need_int(rows, name + " rows", 1, _MAX_DIM)
        cols = _need_int(cols, name + " cols", 1, _MAX_DIM)
        if cols % block:
            raise KVSimdValueError("%s: rows of %s hold whole blocks of %d values, got %d columns"
                                   % (name, wt.upper(), block, cols))
        self.rows, self.cols, self.wtype, self.name, self.base = rows, cols, wt, name, data
        self.row_bytes = cols // block * bsize          # < 2^31 * 4: no overflow
        want = <object>self.rows * self.row_bytes       # Python integers: exact
        if isinstance(data, _np.ndarray) and data.dtype != _np.uint8:
            raise KVSimdTypeError("%s: data must be bytes (a numpy.uint8 array or another buffer), got dtype %s"
                                  % (name, data.dtype))
        try:
            PyObject_GetBuffer(data, &self._view, PyBUF_C_CONTIGUOUS)
        except (TypeError, BufferError, ValueError) as e:
            raise KVSimdTypeError("%s: data must be a C-contiguous buffer, got %s (%s)"
                                  % (name, type(data).__name__, e)) from None
        self._held = True
        if self._view.len != want:
            raise KVSimdValueError("%s: [%d, %d] %s needs %d bytes, data has %d"
                                   % (name, rows, cols, wt.upper(), want, self._view.len))
        self._data = <const uint8_t *>self._view.buf
        align = 4 if wt == "f32" else 2 if wt in ("f16", "bf16") else 1
        if (<size_t>self._data) % align:
            raise KVSimdValueError("%s: %s data must be aligned to %d bytes (address %#x)"
                                   % (name, wt.upper(), align, <size_t>self._data))
        can = kv_has_x8(self.t) and rows % 8 == 0
        if activations is None:
            activations = "int8" if can else "float32"
        if not isinstance(activations, str) or activations not in ("int8", "float32"):
            raise KVSimdValueError("%s: activations must be 'int8' or 'float32', got %r" % (name, activations))
        if activations == "int8" and not can:
            raise KVSimdValueError("%s: int8 activations need a Q8_0, Q4_0, Q4_1, Q4_K or Q5_K matrix of a "
                                   "multiple of 8 rows, "
                                   "got %s [%d, %d]" % (name, wt.upper(), rows, cols))
        self.activations = activations
        if activations == "int8":
            self._packed_bytes = kv_x8_bytes(self.t, rows, cols)
            self._packed = <uint8_t *>malloc(<size_t>self._packed_bytes)
            if self._packed == NULL:
                raise KVSimdMemoryError("%s: no memory for the repacked copy (%d bytes)" % (name, self._packed_bytes))
            with nogil:
                kv_repack_x8(self.t, self._packed, self._data, self.rows, self.row_bytes)

    def __dealloc__(self):
        free(self._packed)
        if self._held:
            PyBuffer_Release(&self._view)

    @property
    def shape(self):
        return (self.rows, self.cols)

    @property
    def nbytes(self):
        return self.rows * self.row_bytes

    @property
    def address(self):
        """The address of the first byte (for overlap checks)."""
        return <size_t>self._data

    def __repr__(self):
        return "QMatrix(%s, %s, [%d, %d], %s activations)" % (self.name, self.wtype.upper(), self.rows, self.cols,
                                                            self.activations)

    def _repacked(self):
        """A copy of the repacked bytes (int8 activations; None otherwise): for the emulator tests."""
        if self._packed == NULL:
            return None
        return _np.frombuffer((<char *>self._packed)[:self._packed_bytes], dtype=_np.uint8).copy()

    def raw(self):
        """The stored bytes as a read-only numpy.uint8 array [rows, row_bytes] (no copy)."""
        a = _np.frombuffer(self.base, dtype=_np.uint8, count=self.nbytes,
                           offset=<size_t>self._data - <size_t>self._view.buf).reshape(self.rows, self.row_bytes)
        a.flags.writeable = False
        return a

    def dequantize(self):
        """All rows as float32 [rows, cols] (a new array)."""
        out = _new_array((self.rows, self.cols), _np.float32, "%s: dequantize's output" % self.name)
        cdef float *op = <float *>_ptr(out)
        cdef int64_t n = self.rows * self.cols
        with nogil:
            kv_dequantize(self.t, op, self._data, n)
        return out

    def take(self, ids):
        """Rows ``ids`` (integers in [0, rows)) as float32 [len(ids), cols]: an embedding lookup."""
        try:
            idx = _np.asarray(ids)
        except (TypeError, ValueError):   # ragged nested sequences, objects numpy cannot read
            raise KVSimdTypeError("%s: ids must be a 1-D sequence of integers, got %r" % (self.name, ids)) from None
        if idx.ndim != 1 or not (idx.dtype.kind in "iu" or idx.size == 0):
            raise KVSimdTypeError("%s: ids must be a 1-D sequence of integers, got %r" % (self.name, ids))
        idx = idx.astype(_np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.rows):
            bad = idx[(idx < 0) | (idx >= self.rows)][0]
            raise KVSimdValueError("%s: row id %d out of range [0, %d)" % (self.name, bad, self.rows))
        out = _new_array((idx.size, self.cols), _np.float32, "%s: take's output" % self.name)
        cdef float *op = <float *>_ptr(out)
        cdef const int64_t *ip = <const int64_t *>_ptr(idx)
        cdef int64_t i, n = idx.size, c = self.cols, rb = self.row_bytes
        with nogil:
            for i in range(n):
                kv_dequantize(self.t, op + i * c, self._data + ip[i] * rb, c)
        return out

    def matmul(self, x, out=None):
        """``x @ W.T``: x float32 [B, cols] -> [B, rows] (into ``out`` when given)."""
        x = _need_array(x, "x", (_F32,), 2, "[rows of x, %d]" % self.cols)
        if x.shape[1] != self.cols:
            raise KVSimdValueError("x must be [B, %d] for %r, got %s" % (self.cols, self, x.shape))
        if out is None:
            out = _new_array((x.shape[0], self.rows), _np.float32, "%s: the product's output" % self.name)
        else:
            _need_array(out, "out", (_F32,), 2, "[B, %d]" % self.rows, writeable=True,
                        shape=(x.shape[0], self.rows))
            _need_no_overlap(out, "out", (("x", x), (self.name, (self.address, self.nbytes))))
        self.apply(<const float *>_ptr(x), x.shape[0], self.cols, <float *>_ptr(out), self.rows, kv_get_num_threads())
        return out

    cdef void apply(self, const float *x, int64_t B, int64_t xs, float *y, int64_t ys, int threads) noexcept nogil:
        """y[b, j] = sum_i x[b, i] W[j, i] for b < B (strides in floats); arguments checked by the caller."""
        cdef kv_gemv_params p
        cdef void *ws = NULL
        if B <= 0:
            return
        if self._packed != NULL:   # (no memory for x's int8 copy: the float path, from the stored bytes)
            ws = malloc(<size_t>(B * KV_XQ_ROW_BYTES(self.cols)))
        p.xq = ws
        p.w = <const void *>self._packed if ws != NULL else <const void *>self._data
        p.x = x
        p.y = y
        p.row_bytes = self.row_bytes
        p.k = self.cols
        p.n = self.rows
        p.B = B
        p.x_stride = xs
        p.y_stride = ys
        p.wtype = self.t
        kv_matmul(&p, threads)
        free(ws)
