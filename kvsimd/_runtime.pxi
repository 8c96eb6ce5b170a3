# Runtime ISA dispatch: chosen once at import, reported, and switchable for tests.
import os as _os
import platform as _platform

from kvsimd.errors import KVSimdISAError

_FEATURE_BITS = (
    ("osxsave", KV_FEAT_OSXSAVE), ("os_ymm_state", KV_FEAT_OS_YMM), ("os_zmm_state", KV_FEAT_OS_ZMM),
    ("avx", KV_FEAT_AVX), ("avx2", KV_FEAT_AVX2_ONLY), ("fma", KV_FEAT_FMA), ("f16c", KV_FEAT_F16C),
    ("avx512f", KV_FEAT_AVX512F), ("avx512bw", KV_FEAT_AVX512BW), ("avx512vl", KV_FEAT_AVX512VL),
    ("avx512dq", KV_FEAT_AVX512DQ), ("avx512vnni", KV_FEAT_AVX512VNNI), ("avx512fp16", KV_FEAT_AVX512_FP16_ONLY),
    # not an instruction set: 512-bit operations run as two 256-bit halves (Zen 4; see attend_isa)
    ("split512", KV_FEAT_SPLIT512),
)


cdef str _c_text(const char *msg):
    """A C message as text: it may quote bytes that are not UTF-8, or end inside a character
    where snprintf cut it."""
    return (<bytes>msg).decode("utf-8", "backslashreplace")


cdef _init_dispatch():
    cdef char msg[512]
    force = _os.environb.get(b"KVSIMD_FORCE_ISA", b"")     # the bytes the environment holds, any encoding
    if kv_init(force, msg, sizeof(msg)) != KV_OK:
        raise ImportError("kvsimd: KVSIMD_FORCE_ISA=%s: %s" % (force.decode("utf-8", "backslashreplace"), _c_text(msg)))


_init_dispatch()


def _isa_names(which):
    out = []
    for i in range(kv_isa_count()):
        if (which == "compiled" and kv_isa_compiled(i)) or (which == "supported" and kv_isa_supported(i)):
            out.append(kv_isa_name(i).decode())
    return out


def active_isa():
    """Name of the ISA path in use: ``"scalar"``, ``"avx2"``, ``"avx512"`` or ``"avx512fp16"``."""
    return kv_isa_name(kv_active_isa()).decode()


def cpu_features():
    """CPU features detected with CPUID + XGETBV, as a list of names."""
    cdef uint32_t f = kv_features()
    return [name for name, bit in _FEATURE_BITS if f & bit]


def _row_flags():
    """{name: the compiler flags the build gave that row} for every compiled row."""
    cdef const kv_kernels *row
    out = {}
    for i in range(kv_isa_count()):
        row = kv_isa_row(i)
        if row != NULL:
            out[kv_isa_name(i).decode()] = row.cflags.decode()
    return out


def isa_info():
    """Which paths are compiled into this build, which this CPU can run, which is active.

    Returns a dict with keys ``compiled``, ``supported`` (lists, best last), ``active`` (str),
    ``forced`` (the name forced through ``KVSIMD_FORCE_ISA`` or ``testing.use_isa``, else None),
    ``features`` (detected CPU features), ``flags`` (each compiled row's compiler flags, as
    the build passed them) and ``small_group_attention``: the row that runs a decode step over a
    float cache with 2 or 3 query heads per KV head (:func:`attend_isa`), the active one but on
    cores that split 512-bit operations in two, and ``prefetch_values``: how many values ahead of
    its reads the attention kernels prefetch K and V rows on this CPU (4096, or 1536 on cores that
    split 512-bit operations; the read probe of ``python -m kvsimd.bench roofline`` prefetches as
    far ahead as that is of float16)."""
    active = active_isa()
    return {
        "compiled": _isa_names("compiled"),
        "supported": _isa_names("supported"),
        "active": active,
        "forced": active if kv_forced() else None,
        "features": cpu_features(),
        "flags": _row_flags(),
        "small_group_attention": attend_isa(3, 1),
        "prefetch_values": kv_prefetch_values(),
    }


def attend_isa(n_heads, n_kv_heads, dtype="float16", n_queries=1):
    """The row that attention over a cache of ``dtype`` (as ``KVCache`` takes it: float16,
    float32, int8, int4, "int8/int4", or a NumPy dtype) runs on, for ``n_queries`` query rows of
    ``n_heads`` heads over ``n_kv_heads``.  The active row, except one case: on cores that split
    512-bit operations in two (the "split512" feature: AMD Zen 4), the automatic avx512 choice
    hands a decode step (one query row) over a float16 / float32 cache with 2 or 3 query heads
    per KV head to the avx2 row, which runs it faster there.  A forced row (``KVSIMD_FORCE_ISA``,
    ``testing.use_isa``) always runs its own kernels."""
    cdef kv_attn_params p
    memset(&p, 0, sizeof(kv_attn_params))
    n_heads, n_kv_heads = _need_int(n_heads, "n_heads", 1), _need_int(n_kv_heads, "n_kv_heads", 1)
    n_queries = _need_int(n_queries, "n_queries", 1)
    if n_heads % n_kv_heads:
        raise KVSimdValueError("n_heads must be a multiple of n_kv_heads, got %d and %d" % (n_heads, n_kv_heads))
    kn, vn = _cache_dtypes(dtype)
    p.H, p.Hkv, p.T = n_heads, n_kv_heads, n_queries
    p.dtype, p.v_dtype = _DTYPES[kn][0], _DTYPES[vn][0]
    return kv_isa_name(kv_attend_isa(&p)).decode()


def show_runtime(file=None):
    """Print the version, compiler, per-path flags, detected CPU features and the active path."""
    import sys
    import numpy
    out = sys.stdout if file is None else file
    if not callable(getattr(out, "write", None)) or getattr(out, "closed", False) is True:
        raise KVSimdTypeError("file must be None or an open text stream with write(), got %r" % (file,))
    info = isa_info()
    lines = [
        "kvsimd %s (C core %s)" % (__version__, KV_VERSION.decode()),
        "python %s, numpy %s, %s" % (_platform.python_version(), numpy.__version__, _platform.machine()),
        "compiler: %s" % kv_compiler().decode(),
        "cpu features: %s" % (", ".join(info["features"]) or "(none)"),
        "paths (best last):",
    ]
    for i in range(kv_isa_count()):
        name = kv_isa_name(i).decode()
        state = ("supported" if kv_isa_supported(i) else "cpu lacks it") if kv_isa_compiled(i) else "not compiled"
        flags = info["flags"].get(name)
        flags = "" if flags is None else (flags or "(baseline x86-64)")
        mark = "*" if name == info["active"] else " "
        lines.append("  %s %-11s %-13s %s" % (mark, name, state, flags))
    lines.append("active: %s%s" % (info["active"], " (forced)" if info["forced"] else ""))
    if info["small_group_attention"] != info["active"]:
        lines.append("attention, decode over float caches with 2-3 query heads per KV head: %s (this CPU "
                     "runs 512-bit operations as two 256-bit halves)" % info["small_group_attention"])
    lines.append("attention prefetches K and V rows %d values ahead (%d KiB of float16)"
                 % (info["prefetch_values"], info["prefetch_values"] * 2 // 1024))
    print("\n".join(lines), file=out)


MAX_THREADS = KV_MAX_THREADS
MAX_TOKENS = KV_MAX_TOKENS     # the most tokens a cache holds or one call takes
_V_SPAN = KV_V_SPAN             # kvsimd/bounds.py: the grid of int16 weight spans (kvsimd.h)


def _set_kernel_threads(n):
    """Set the default kernel thread count (1..KV_MAX_THREADS = 1024); each call reads it once."""
    kv_set_num_threads(_need_int(n, "n", 1, KV_MAX_THREADS))


def _get_kernel_threads():
    return kv_get_num_threads()


def _threads_started():
    """Whether a kernel has run on more than one thread in this process (kvsimd.h kv_threads_started)."""
    return kv_threads_started() != 0
