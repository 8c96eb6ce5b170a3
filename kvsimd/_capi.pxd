# The C contract (src_c/kvsimd.h), and nothing else.
from libc.stdint cimport int8_t, int32_t, int64_t, uint16_t, uint32_t, uint64_t


cdef extern from "kvsimd.h" nogil:
    ctypedef enum kv_status:
        KV_OK
        KV_ERR_NOMEM
        KV_ERR_ARG
        KV_ERR_ISA
        KV_ERR_CAPACITY
        KV_ERR_POSITION

    ctypedef enum kv_dtype:
        KV_F32
        KV_F16
        KV_I8
        KV_I4

    ctypedef enum kv_rope_style:
        KV_ROPE_GPTJ
        KV_ROPE_NEOX

    int KV_MAX_HEAD_DIM
    long long KV_MAX_TOKENS
    int KV_V_SPAN
    int KV_MAX_THREADS
    const char *KV_VERSION
    uint32_t KV_FEAT_AVX2, KV_FEAT_AVX512, KV_FEAT_AVX512FP16, KV_FEAT_OSXSAVE, KV_FEAT_OS_YMM, KV_FEAT_OS_ZMM
    uint32_t KV_FEAT_AVX, KV_FEAT_AVX2_ONLY, KV_FEAT_FMA, KV_FEAT_F16C, KV_FEAT_AVX512F
    uint32_t KV_FEAT_AVX512BW, KV_FEAT_AVX512VL, KV_FEAT_AVX512_FP16_ONLY, KV_FEAT_AVX512VNNI
    uint32_t KV_FEAT_AVX512DQ, KV_FEAT_SPLIT512

    ctypedef struct kv_attn_range:
        int64_t query
        int64_t t0, t1
        int64_t query_pos

    ctypedef struct kv_attn_params:
        const float *q
        const void *k
        const void *v
        float *out
        const float *alibi
        const int64_t *key_pos
        const float *q_alt
        const kv_attn_range *ranges
        int64_t n_ranges
        int64_t H, Hkv, D
        int64_t n_total
        int64_t T, q_stride, out_stride, causal_end, window
        float scale
        float softcap
        int32_t dtype
        int32_t v_dtype
        int64_t part_lo, part_hi
        float *part_ml
        const float *k_scale
        const float *v_scale
        int64_t key_base
        int64_t pf_values

    ctypedef struct kv_rot_params:
        void *x
        const float *cs
        int64_t H, D, R
        int64_t n_total
        int64_t t0, t1
        int64_t cs_stride
        int32_t dtype
        int32_t style

    ctypedef struct kv_gemv_params:
        const void *w
        const float *x
        float *y
        int64_t row_bytes, k, n, B, x_stride, y_stride
        const void *xq
        int32_t wtype
    int KV_WT_COUNT
    int KV_GEMV_MAX_B
    ctypedef void (*kv_gemv_fn)(const kv_gemv_params *p, int64_t n0, int64_t n1) noexcept nogil
    ctypedef void (*kv_dequant_fn)(float *dst, const void *src, int64_t n) noexcept nogil
    const char *kv_wtype_info(int t, int *ggml_id, int64_t *block, int64_t *block_bytes) noexcept
    void kv_matmul(const kv_gemv_params *p, int threads) noexcept
    void kv_dequantize(int t, float *dst, const void *src, int64_t n) noexcept
    int kv_has_x8(int t) noexcept
    int64_t kv_x8_bytes(int t, int64_t rows, int64_t k) noexcept
    kv_status kv_repack_x8(int t, void *dst, const void *src, int64_t rows, int64_t row_bytes) noexcept nogil
    void kv_quantize_x(void *xq, const float *x, int64_t B, int64_t k, int64_t xs) noexcept nogil
    kv_status kv_quantize_rows(kv_dtype dtype, int hadamard, void *q, int64_t qs, float *scale, const float *x,
                               int64_t xs, int64_t n, int64_t D) noexcept nogil
    void kv_hadamard_rows(float *x, int64_t xs, int64_t n, int64_t D) noexcept nogil
    int64_t kv_i8_blocks(int64_t D) noexcept nogil
    size_t kv_row_bytes(kv_dtype d, int64_t D) noexcept nogil
    bint kv_dtype_scaled(kv_dtype d) noexcept nogil
    int KV_I8_BLOCK
    int64_t KV_XQ_ROW_BYTES(int64_t k) noexcept nogil

    ctypedef struct kv_field:
        const char *name
        size_t offset, size
        char code
    enum:
        KV_STRUCT_ATTN_PARAMS
        KV_STRUCT_ATTN_RANGE
        KV_STRUCT_ROT_PARAMS
        KV_STRUCT_GEMV_PARAMS
        KV_STRUCT_COUNT
    const kv_field *kv_struct_layout(int which, size_t *n_fields, size_t *struct_size) noexcept
    const char *kv_struct_name(int which) noexcept

    ctypedef void (*kv_attn_fn)(const kv_attn_params *p, int64_t g0, int64_t g1, int64_t r0, int64_t r1,
                               void *workspace) noexcept nogil
    ctypedef void (*kv_rot_fn)(const kv_rot_params *p) noexcept nogil
    ctypedef void (*kv_f32_to_f16_fn)(uint16_t *dst, const float *src, size_t n) noexcept nogil
    ctypedef void (*kv_f16_to_f32_fn)(float *dst, const uint16_t *src, size_t n) noexcept nogil
    ctypedef uint64_t (*kv_peak_fn)(int64_t iters, float *sink) noexcept nogil

    ctypedef struct kv_kernels:
        const char *cflags
        kv_attn_fn attn
        kv_rot_fn rotate
        kv_f32_to_f16_fn f32_to_f16
        kv_f16_to_f32_fn f16_to_f32
        kv_peak_fn fma_peak
        kv_gemv_fn gemv[9]
        kv_dequant_fn dequant[9]
        kv_gemv_fn gemv_x8[9]

    uint32_t kv_cpu_features() noexcept
    kv_status kv_init(const char *force, char *msg, size_t msg_len) noexcept
    kv_status kv_set_isa(const char *name, int forced, char *msg, size_t msg_len) noexcept
    const kv_kernels *kv_active() noexcept
    int kv_active_isa() noexcept
    int kv_isa_count() noexcept
    const kv_kernels *kv_isa_row(int i) noexcept
    const char *kv_isa_name(int i) noexcept
    uint32_t kv_isa_required(int i) noexcept
    int kv_isa_compiled(int i) noexcept
    int kv_isa_supported(int i) noexcept
    int kv_select_isa(uint32_t features) noexcept
    int kv_forced() noexcept
    uint32_t kv_features() noexcept
    int64_t kv_prefetch_values() noexcept
    const char *kv_compiler() noexcept
    int kv_sanitized() noexcept

    size_t kv_attn_workspace_bytes(int64_t H, int64_t Hkv, int64_t D) noexcept
    size_t kv_attend_workspace_bytes(int64_t H, int64_t Hkv, int64_t D, int threads) noexcept
    void kv_set_num_threads(int n) noexcept
    int kv_get_num_threads() noexcept
    int kv_threads_started() noexcept
    void kv_attend(const kv_attn_params *p, void *workspace, int threads) noexcept
    size_t kv_attend_sources_workspace_bytes(int64_t H, int64_t Hkv, int64_t D, int64_t T, int64_t n,
                                             int threads) noexcept
    void kv_attend_sources(const kv_attn_params *src, int64_t n, void *workspace, int threads) noexcept
    int kv_attend_isa(const kv_attn_params *p) noexcept
    int64_t kv_attend_pieces(const kv_attn_params *p, int threads) noexcept
    kv_status kv_apply_rope(void *x, kv_dtype dtype, int64_t H, int64_t N, int64_t D,
                            const int64_t *positions, const double *inv, double scale, kv_rope_style style,
                            int64_t rotary_dim) noexcept
    kv_status kv_shift_keys(void *k, float *k_scale, kv_dtype dtype, int hadamard, int64_t Hkv, int64_t N, int64_t D,
                            int64_t delta, const double *inv, kv_rope_style style, int64_t rotary_dim, int64_t start,
                            int64_t stop) noexcept
    void kv_rotate_rows(void *x, kv_dtype dtype, int64_t H, int64_t N, int64_t D, const float *cs,
                        kv_rope_style style, int64_t rotary_dim, int64_t t0, int64_t t1) noexcept
    void kv_f32_to_f16(uint16_t *dst, const float *src, size_t n) noexcept
    void kv_f16_to_f32(float *dst, const uint16_t *src, size_t n) noexcept
    void kv_rope_inv_freq(double *inv, double theta, int64_t R, int64_t rotary_dim) noexcept
    void kv_rope_table(float *cs, double units, const double *inv, int64_t R, double scale) noexcept
    uint64_t kv_bench_read(const void *buf, size_t bytes) noexcept
    void kv_bench_copy(void *dst, const void *src, size_t bytes) noexcept
    void kv_bench_write(void *dst, size_t bytes) noexcept
    uint64_t kv_bench_run(int op, void *dst, const void *src, size_t bytes, int threads) noexcept
    enum:
        KV_BENCH_READ
        KV_BENCH_WRITE
        KV_BENCH_COPY

    ctypedef struct kv_cache:
        void *data
        float *scales
        size_t nbytes
        int64_t n_layers, batch, n_kv_heads, capacity, head_dim
        kv_dtype dtype, v_dtype

    kv_status kv_cache_create(kv_cache *c, int64_t n_layers, int64_t batch, int64_t n_kv_heads,
                              int64_t capacity, int64_t head_dim, kv_dtype dtype, kv_dtype v_dtype) noexcept
    void kv_cache_destroy(kv_cache *c) noexcept
    void *kv_cache_block(const kv_cache *c, int64_t layer, int which, int64_t seq) noexcept
    float *kv_cache_scales(const kv_cache *c, int64_t layer, int which, int64_t seq) noexcept
