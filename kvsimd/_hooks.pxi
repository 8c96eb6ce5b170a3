# Testing hooks: switching the ISA row in-process (kvsimd.testing.use_isa) and what the
# emulator harness (tests/emulator.py) needs to run this module's machine code.


def _set_isa(name, forced=True):
    """Switch the active path in-process (tests only; see kvsimd.testing.use_isa); ``forced`` is
    what ``isa_info()["forced"]`` reports from now on (C keeps it: kv_forced)."""
    cdef char msg[512]
    if not isinstance(name, str):
        raise KVSimdISAError("ISA name must be a str, got %r" % (name,))
    nb = name.encode("utf-8", "surrogatepass")    # a name with lone surrogates is just an unknown name
    if b"\0" in nb:                                # C would read it only up to the NUL
        raise KVSimdISAError("ISA name must not contain NUL, got %r" % (name,))
    if kv_set_isa(nb, 1 if forced else 0, msg, sizeof(msg)) != KV_OK:
        raise KVSimdISAError(_c_text(msg))


def _restore_isa(name, forced):
    _set_isa(name, forced is not None)


def _sanitized():
    """Was this build made with KVSIMD_SANITIZE=1?  Its kernel objects then call the sanitizer
    runtime, so the emulator (where nothing else is mapped) cannot run them."""
    return bool(kv_sanitized())


def _struct_layouts():
    """The C layout of the parameter structs, as C reports it (offsetof/sizeof in layout.c):
    {struct name: {"size": bytes, "fields": {field: (offset, size, struct letter)}}}."""
    cdef const kv_field *f
    cdef size_t n, size
    out = {}
    for which in range(KV_STRUCT_COUNT):
        f = kv_struct_layout(which, &n, &size)
        out[kv_struct_name(which).decode()] = {
            "size": size,
            "fields": {f[i].name.decode(): (f[i].offset, f[i].size, chr(f[i].code)) for i in range(n)},
        }
    return out


def _kernel_addresses():
    """Addresses, in this process, of every compiled row's kernels and of the detection code,
    plus the C layout of the parameter structs.  Used by the emulator test harness to run the
    very machine code of this extension module inside an emulated CPU."""
    cdef const kv_kernels *row
    rows = {}
    for i in range(kv_isa_count()):
        row = kv_isa_row(i)
        if row == NULL:
            continue
        rows[kv_isa_name(i).decode()] = {
            "attn": <size_t>row.attn, "rotate": <size_t>row.rotate,
            "f32_to_f16": <size_t>row.f32_to_f16, "f16_to_f32": <size_t>row.f16_to_f32,
            "gemv": {_WT_NAMES[t]: <size_t>row.gemv[t] for t in range(KV_WT_COUNT)},
            "dequant": {_WT_NAMES[t]: <size_t>row.dequant[t] for t in range(KV_WT_COUNT)},
            "gemv_x8": {_WT_NAMES[t]: <size_t>row.gemv_x8[t] for t in range(KV_WT_COUNT) if row.gemv_x8[t] != NULL},
            "required": kv_isa_required(i),
        }
    return {
        "rows": rows,
        "kv_cpu_features": <size_t>kv_cpu_features,
        "kv_select_isa": <size_t>kv_select_isa,
        "structs": _struct_layouts(),
        "feature_bits": {"avx2": KV_FEAT_AVX2, "avx512": KV_FEAT_AVX512, "avx512fp16": KV_FEAT_AVX512FP16},
        "isa_index": {kv_isa_name(i).decode(): i for i in range(kv_isa_count())},
    }


def _quantize_x(x):
    """kv_quantize_x of float32 x [B, k] (k a multiple of 32) as uint8 [B, KV_XQ_ROW_BYTES(k)]: the
    activations an int8 product reads (for the emulator tests, which call the kernels directly)."""
    x = _np.ascontiguousarray(x, _np.float32)
    if x.ndim != 2 or x.shape[1] % 32:
        raise KVSimdValueError("x must be [B, k] with k a multiple of 32, got %s" % (x.shape,))
    out = _np.empty((x.shape[0], KV_XQ_ROW_BYTES(x.shape[1])), _np.uint8)
    kv_quantize_x(<void *>_ptr(out), <const float *>_ptr(x), x.shape[0], x.shape[1], x.shape[1])
    return out
