# Benchmark probes (kvsimd.bench): memory streams, the FMA peak, workspace sizes, RoPE tables.
# Checked like every entry point; never used by the library itself.


def _bench_read(buf):
    """Stream-read ``buf`` once (benchmark roofline); returns a checksum."""
    _need_array(buf, "buf", None, -1, "")
    cdef const void *p = _ptr(buf)
    cdef size_t n = buf.nbytes
    cdef uint64_t r
    with nogil:
        r = kv_bench_read(p, n)
    return r


def _bench_copy(dst, src):
    """Copy ``src`` into ``dst`` with plain loads and stores (benchmark roofline)."""
    _need_array(src, "src", None, -1, "")
    _need_array(dst, "dst", None, -1, "", writeable=True)
    _need_no_overlap(dst, "dst", (("src", src),))
    cdef void *d = _ptr(dst)
    cdef const void *s = _ptr(src)
    cdef size_t n = min(dst.nbytes, src.nbytes)
    with nogil:
        kv_bench_copy(d, s, n)


_BENCH_OPS = {"read": KV_BENCH_READ, "write": KV_BENCH_WRITE, "copy": KV_BENCH_COPY}


def _bench_mem(op, dst, src, threads=1):
    """Stream ``op`` ("read" src, "write" dst, "copy" src to dst) over the whole buffer, split
    across ``threads`` OpenMP threads (benchmark roofline)."""
    if not isinstance(op, str) or op not in _BENCH_OPS:
        raise KVSimdValueError("op must be one of %s, got %r" % (", ".join(_BENCH_OPS), op))
    cdef int o = _BENCH_OPS[op]
    _need_array(src, "src", None, -1, "")
    _need_array(dst, "dst", None, -1, "", writeable=op != "read")
    if op == "copy":
        _need_no_overlap(dst, "dst", (("src", src),))
    cdef int nt = _need_int(threads, "threads", 1, KV_MAX_THREADS)
    cdef void *d = _ptr(dst)
    cdef const void *s = _ptr(src)
    cdef size_t n = min(dst.nbytes, src.nbytes)
    cdef uint64_t r
    with nogil:
        r = kv_bench_run(o, d, s, n, nt)
    return r


def _fma_peak(isa, iters):
    """(flops, seconds) of ``iters`` rounds of the fp32 multiply-add probe on ISA row ``isa``."""
    cdef const kv_kernels *row = NULL
    for i in range(kv_isa_count()):
        if isinstance(isa, str) and kv_isa_name(i).decode() == isa and kv_isa_supported(i):
            row = kv_isa_row(i)
    if row == NULL:
        raise KVSimdValueError("ISA %r is not supported here" % (isa,))
    cdef int64_t n = _need_int(iters, "iters", 0, 2 ** 40)
    cdef float sink
    cdef uint64_t flops
    t0 = _time.perf_counter()
    with nogil:
        flops = row.fma_peak(n, &sink)
    return flops, _time.perf_counter() - t0


def _attn_workspace_bytes(H, Hkv, D):
    """Bytes of scratch the attention kernel needs (for tests driving kernels directly)."""
    cdef int64_t h = _need_int(H, "H", 1), g = _need_int(Hkv, "Hkv", 1), d = _need_int(D, "D", 1, KV_MAX_HEAD_DIM)
    if h % g:
        raise KVSimdValueError("H=%d must be a multiple of Hkv=%d" % (h, g))
    cdef size_t n = kv_attn_workspace_bytes(h, g, d)
    if n == 0:
        raise KVSimdValueError("H=%d query heads: the workspace size does not fit a size_t" % h)
    return n


def _attend_pieces(H, Hkv, D, T, keys, threads):
    """Split-K pieces per KV head kv_attend uses for T query rows over ``keys`` keys with
    ``threads`` threads (1: no split; tests check which calls split)."""
    cdef kv_attn_params p
    cdef int64_t rng[4]
    cdef int64_t h = _need_int(H, "H", 1), g = _need_int(Hkv, "Hkv", 1), d = _need_int(D, "D", 1, KV_MAX_HEAD_DIM)
    cdef int64_t t = _need_int(T, "T", 1), n = _need_int(keys, "keys", 1, KV_MAX_TOKENS)
    cdef int nt = _need_int(threads, "threads", 1, KV_MAX_THREADS)
    if h % g:
        raise KVSimdValueError("H=%d must be a multiple of Hkv=%d" % (h, g))
    rng[0], rng[1], rng[2], rng[3] = 0, 0, n, 0
    _attn_init(&p, NULL, NULL, NULL, NULL, NULL, NULL, NULL, rng, 1, h, g, d, n, 1.0, 0.0, KV_F16, t)
    return kv_attend_pieces(&p, nt)


def _rope_table(units, theta, R, rotary_dim, inv_freq=None, attn_factor=1.0):
    """The (cos, sin) float32 pairs ops.c hands the rotation kernel for ``units`` positions."""
    u = _need_real(units, "units")
    if not _math.isfinite(u):
        raise KVSimdValueError("units must be finite, got %r" % (u,))
    cdef int64_t rd = _need_int(rotary_dim, "rotary_dim", 2, KV_MAX_HEAD_DIM)
    cdef RopeSpec spec = RopeSpec(theta, "gptj", rd, rd, inv_freq, attn_factor)
    cdef int64_t r = _need_int(R, "R", 0, rd // 2)
    cs = _np.empty(2 * r, dtype=_np.float32)
    kv_rope_table(<float *>_ptr(cs), u, spec.inv, r, spec.attn_factor)
    return cs
