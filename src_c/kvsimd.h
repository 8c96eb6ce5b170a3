/* kvsimd.h - the C contract of kvsimd.
 *
 * Shape letters used in names and comments:
 *   h = query head (H of them), g = KV head (Hkv), t = token (N), d = head_dim (D),
 *   r = rotary pair (R = rotary_dim / 2).
 * A K or V cache is [Hkv, N, D], token-major: row (g, t) holds D contiguous values.
 *
 * Layering:
 *   - kernels (kernels/tu_<isa>.c): never allocate, print, validate or call libc;
 *     they receive everything through a params struct and a caller-provided workspace.
 *   - dispatch.c: the table of ISA rows, selection, KVSIMD_FORCE_ISA.
 *   - ops.c: C entry points that compute cos/sin tables (libm) and call the active row.
 *   - the Python boundary (kvsimd/_kvsimd.pyx) validates shapes, dtypes and alignment.
 */
#ifndef KVSIMD_H
#define KVSIMD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KV_VERSION "0.1.0"

typedef enum kv_status {
    KV_OK = 0,
    KV_ERR_NOMEM = 1,
    KV_ERR_ARG = 2,          /* an argument C can judge (e.g. D out of range) */
    KV_ERR_ISA = 3,          /* unknown ISA name, or a path this CPU cannot run */
    KV_ERR_CAPACITY = 4,
    KV_ERR_POSITION = 5
} kv_status;

/* KV_ISA_SCALAR, KV_ISA_AVX2, ...: the rows of isa_rows.def, in its order. */
typedef enum kv_isa {
#define KV_ISA_ROW(id, name, required, cflags) KV_ISA_##id,
#include "isa_rows.def"
#undef KV_ISA_ROW
    KV_ISA_COUNT
} kv_isa;

/* Element types of a K/V cache.  KV_I8: int8 values q, each row (a token of a KV head, D values)
   in blocks of KV_I8_BLOCK values (the last one shorter when D is not a multiple), one float32
   scale per block: value d of the row stands for q[d] * scale[d / KV_I8_BLOCK] (kv_quantize_rows).
   KV_I4: 4-bit values q in -8..7 with the same blocks and (signed) scales, stored as q + 8; a row is
   kv_i8_blocks(D) blocks of KV_I4_BLOCK_BYTES bytes (the last block padded with zeros to 32
   values), value e of a block in byte e % 16, the low nibble for e < 16 and the high one for
   e >= 16 (so that a vector of up to 16 consecutive values is one run of bytes and one shift). */
typedef enum kv_dtype { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2, KV_I4 = 3 } kv_dtype;
#define KV_I8_BLOCK 32
#define KV_I4_BLOCK_BYTES (KV_I8_BLOCK / 2)
static inline int64_t kv_i8_blocks(int64_t D) { return (D + KV_I8_BLOCK - 1) / KV_I8_BLOCK; }  /* scales per row */
/* Floats of one query vector rounded for int8 or int4 keys in the attention workspace (attn.inc.h
   round_query): per 32-value block of Dp values its step and int32 offset, then Dp int8 values,
   then (from kv_qint_q16 floats on) the same values as int16, each group of 4 as q0 q2 q1 q3. */
static inline int64_t kv_qint_q16(int64_t Dp) { return 2 * kv_i8_blocks(Dp) + (Dp + 3) / 4; }
static inline int64_t kv_qint_floats(int64_t Dp) { return kv_qint_q16(Dp) + (Dp + 3) / 4 * 2; }
static inline int kv_dtype_scaled(kv_dtype d) { return d == KV_I8 || d == KV_I4; }   /* has block scales */
/* Bytes of one row of D values (a token of a KV head) as stored. */
static inline size_t kv_row_bytes(kv_dtype d, int64_t D)
{
    return d == KV_I4 ? (size_t)kv_i8_blocks(D) * KV_I4_BLOCK_BYTES : (size_t)D * (d == KV_F32 ? 4 : d == KV_F16 ? 2 : 1);
}
/* Values per row as the kernels address them: D, or whole blocks for KV_I4 (its padding reads 0). */
static inline int64_t kv_row_values(kv_dtype d, int64_t D) { return d == KV_I4 ? kv_i8_blocks(D) * KV_I8_BLOCK : D; }

typedef enum kv_rope_style { KV_ROPE_GPTJ = 0, KV_ROPE_NEOX = 1 } kv_rope_style;

/* KV_WT_F32, KV_WT_Q4_K, ...: the weight types of wtypes.def, in its order. */
typedef enum kv_wtype {
#define KV_WTYPE(id, name, ggml, block, bytes) KV_WT_##id,
#include "wtypes.def"
#undef KV_WTYPE
    KV_WT_COUNT
} kv_wtype;

/* CPU features, as a bitmask (cpu.c). */
#define KV_FEAT_AVX2 (1u << 0)        /* AVX + AVX2 + FMA + F16C, OS saves YMM state */
#define KV_FEAT_AVX512FP16 (1u << 1)  /* KV_FEAT_AVX512 + AVX512_FP16 */
#define KV_FEAT_AVX512 (1u << 2)      /* KV_FEAT_AVX2 + AVX512 F/BW/VL/DQ/VNNI, OS saves ZMM/opmask */
#define KV_FEAT_OSXSAVE (1u << 8)
#define KV_FEAT_OS_YMM (1u << 9)
#define KV_FEAT_OS_ZMM (1u << 10)
#define KV_FEAT_AVX (1u << 11)
#define KV_FEAT_AVX2_ONLY (1u << 12)
#define KV_FEAT_FMA (1u << 13)
#define KV_FEAT_F16C (1u << 14)
#define KV_FEAT_AVX512F (1u << 15)
#define KV_FEAT_AVX512BW (1u << 16)
#define KV_FEAT_AVX512VL (1u << 17)
#define KV_FEAT_AVX512_FP16_ONLY (1u << 18)
#define KV_FEAT_AVX512VNNI (1u << 19)
#define KV_FEAT_AVX512DQ (1u << 20)
/* not an instruction set: the cores execute 512-bit operations as two 256-bit halves (AMD Zen 4,
   family 19h with AVX-512), where 512-bit VCVTPH2PS and cross-lane shuffles convert and reduce no
   faster per element than 256-bit ones (kv_attend_isa) */
#define KV_FEAT_SPLIT512 (1u << 21)

#define KV_MAX_HEAD_DIM 512
#define KV_MAX_TOKENS (1LL << 24)
#define KV_MAX_THREADS 1024 /* kv_set_num_threads clamps to 1..KV_MAX_THREADS */
/* Tokens per attention block and floats per vector, upper bounds over all ISAs
   (used to size workspaces). */
#define KV_MAX_BLOCK 16
#define KV_MAX_WIDTH 16
#define KV_MAX_GROUP 8   /* query heads per pass over a block */
#define KV_MAX_KP 2      /* keys per vector of the scores loop (a query is stored KV_KP times) */
#define KV_MAX_CHUNK 1024 /* tokens per two-pass chunk */
/* Attention over int8 / int4 values on the rows with VPDPWSSD (attn.inc.h kv_accumulate_i16): the
   weights of a span of whole blocks, at most KV_V_SPAN tokens inside one cell of the KV_V_SPAN grid
   of key indices, are rounded to int16 with one step per query head and value block (32 values);
   kvsimd/bounds.py attend_bound states what that costs. */
#define KV_V_SPAN 64
/* How far ahead the attention kernels prefetch K and V rows (attn.inc.h kv_pf_distance), in values:
   KV_PF_VALUES, or on a core that splits 512-bit operations (Zen 4) KV_PF_VALUES_SPLIT512
   (kv_prefetch_values, which kv_attend passes as kv_attn_params.pf_values); the read probe of the
   roofline (membench.c) prefetches as far ahead as fp16 rows are. */
#define KV_PF_VALUES 4096
#define KV_PF_VALUES_SPLIT512 1536
#define KV_PF_MIN_BYTES 2048   /* ... but never nearer than this */
#define KV_QVECS 64       /* query vectors (rows x heads of a group) per tile of a multi-row attention */

/* Query rows per tile of attention with G query heads per KV head: the same on every ISA (row
   tiles are where ops.c splits rows across threads, so results do not depend on the count). */
static inline int64_t kv_attn_row_tile(int64_t G) { return G >= KV_QVECS ? 1 : KV_QVECS / G; }

/* The parameter structs are defined by field lists, F(type, name, code), so that C itself can
 * report their layout (kv_struct_layout, from offsetof/sizeof) to the emulator test harness:
 * no copy of a field list is kept anywhere else.  code is the Python struct letter of the field
 * (pointers are 'Q': the layout is that of x86-64). */
#define KV_FIELD_(type, name, code) type name;

/* Attention of T query rows (T = 1: a single query) over a list of key ranges, under one softmax:
 *   out[h, :] = softmax_t(score(h, t)) @ v[g, t, :] over the tokens t of every range, where
 *   score(h, t) = cap(scale * q'[h] . k[g, t])  (- alibi[h] * (range.query_pos - key_pos[t]) when
 *   alibi != NULL; key_pos == NULL means key_pos[t] = t), and q' is q, or q_alt for a range
 *   with query = 1 (the attention-sink query of a ring cache, rotated at another position).
 *   cap(s) = softcap * tanh(s / softcap) when softcap > 0 (Gemma 2's attention logit soft-capping),
 *   else s: the scaled dot product is capped first, then the ALiBi bias is subtracted.
 *   q, q_alt, out [H, D] float32; k [Hkv, n_total, D] (dtype), v the same (v_dtype), rows of kv_row_bytes;
 *   KV_I8, KV_I4: block scales k_scale, v_scale [Hkv, n_total, kv_i8_blocks(D)], see kv_dtype; int8 keys
 *   may go with int4 values and the other way round; over KV_I8 and KV_I4 keys q' is each query
 *   vector rounded by the int8 keys' rule, kv_quantize_rows, before the scale); ranges: n_ranges >= 1
 *   non-empty ranges t0..t1-1 inside 0..n_total.  Query heads h in [g*G, (g+1)*G) use KV
 *   head g, G = H / Hkv; each K/V row is read once per group, every KV head reads its ranges
 *   in order.  The kernel computes KV heads g0..g1-1 and query rows r0..r1-1 (its arguments:
 *   ops.c splits heads, and rows at multiples of kv_attn_row_tile, across threads); its softmax
 *   state lives in the workspace.
 *   Several rows (a prefill chunk of one sequence): row t has q + t * q_stride (q_alt the same),
 *   out + t * out_stride, and reads the keys of the ranges that lie below causal_end + t (when
 *   causal_end > 0) and, with window > 0, at or above causal_end + t - window; its ALiBi query
 *   position is range.query_pos + t.  Rows are taken kv_attn_row_tile(G) at a time: each K/V
 *   row is read once per group and per tile, each row keeps its own online softmax.  Every row
 *   must see at least one key (the caller checks).
 *   A piece of a split-K call (kv_attend sets these; callers leave them 0): with part_hi > 0 the
 *   kernel reads only keys part_lo..part_hi-1 of the ranges counted end to end (range 0's
 *   first key is 0); with part_ml != NULL it writes each vector's unnormalized weighted sum to
 *   out and its softmax (max, sum) to part_ml[(t * H + h) * 2 + 0, 1] (a piece with no key:
 *   -inf, 0 and zeros), for the caller to merge.
 *   key_base: the keys of this call stand at key_base + t in the causal order, so that a row
 *   reads key t when key_base + t < causal_end + row (and the window's cut the same); 0 but for
 *   a source that follows another (kv_attend_sources).  A row that sees no key of a piece or a
 *   source gets -inf, 0 and zeros.
 *
 * Four int64s per range: the layout a KVCache step plan keeps per range. */
#define KV_ATTN_RANGE_FIELDS(F) \
    F(int64_t, query, 'q')          /* 0: q, 1: q_alt */ \
    F(int64_t, t0, 'q') \
    F(int64_t, t1, 'q') \
    F(int64_t, query_pos, 'q')      /* ALiBi distances of this range */
typedef struct kv_attn_range { KV_ATTN_RANGE_FIELDS(KV_FIELD_) } kv_attn_range;

#define KV_ATTN_PARAMS_FIELDS(F) \
    F(const float *, q, 'Q') \
    F(const void *, k, 'Q') \
    F(const void *, v, 'Q') \
    F(float *, out, 'Q') \
    F(const float *, alibi, 'Q')    /* [H] slopes, or NULL */ \
    F(const int64_t *, key_pos, 'Q') /* [n_total], or NULL */ \
    F(const float *, q_alt, 'Q')    /* [H, D], or NULL (no range uses it) */ \
    F(const kv_attn_range *, ranges, 'Q') \
    F(int64_t, n_ranges, 'q')       /* >= 1 */ \
    F(int64_t, H, 'q') \
    F(int64_t, Hkv, 'q') \
    F(int64_t, D, 'q') \
    F(int64_t, n_total, 'q')        /* row stride of a head in k/v, in tokens */ \
    F(int64_t, T, 'q')              /* query rows, >= 1 */ \
    F(int64_t, q_stride, 'q')       /* floats from a row of q (and q_alt) to the next */ \
    F(int64_t, out_stride, 'q')     /* floats from a row of out to the next */ \
    F(int64_t, causal_end, 'q')     /* > 0: row t reads keys < causal_end + t; 0: no cut */ \
    F(int64_t, window, 'q')         /* > 0: row t reads keys >= causal_end + t - window; 0: no cut */ \
    F(float, scale, 'f') \
    F(float, softcap, 'f')          /* > 0: scores capped to +-softcap; 0: off */ \
    F(int32_t, dtype, 'i')          /* kv_dtype of k */ \
    F(int32_t, v_dtype, 'i')        /* kv_dtype of v: both scaled (KV_I8, KV_I4) or neither */ \
    F(int64_t, part_lo, 'q')        /* split-K piece (ops.c): see above */ \
    F(int64_t, part_hi, 'q') \
    F(float *, part_ml, 'Q') \
    F(const float *, k_scale, 'Q')  /* KV_I8, KV_I4: [Hkv, n_total, kv_i8_blocks(D)] block scales of k; else unused */ \
    F(const float *, v_scale, 'Q') \
    F(int64_t, key_base, 'q')       /* key t stands at key_base + t in the causal order (kv_attend_sources) */ \
    F(int64_t, pf_values, 'q')      /* values ahead to prefetch (kv_attend sets it: kv_prefetch_values; 0: KV_PF_VALUES) */
typedef struct kv_attn_params { KV_ATTN_PARAMS_FIELDS(KV_FIELD_) } kv_attn_params;

/* Rotation of row pairs by per-token (or shared) angles.
 *   x [H, n_total, D] (dtype); rows (h, t) for t in t0..t1-1 are rotated in place.
 *   cs: for token t, the R (cos, sin) float pairs at cs + (t - t0) * cs_stride;
 *   cs_stride == 0 means every token uses the same R pairs (a K-cache shift).
 *   Pair r is (x[2r], x[2r+1]) for KV_ROPE_GPTJ and (x[r], x[r+R]) for KV_ROPE_NEOX;
 *   dims 2R..D-1 are not touched. */
#define KV_ROT_PARAMS_FIELDS(F) \
    F(void *, x, 'Q') \
    F(const float *, cs, 'Q') \
    F(int64_t, H, 'q') \
    F(int64_t, D, 'q') \
    F(int64_t, R, 'q') \
    F(int64_t, n_total, 'q') \
    F(int64_t, t0, 'q') \
    F(int64_t, t1, 'q') \
    F(int64_t, cs_stride, 'q')      /* in floats */ \
    F(int32_t, dtype, 'i') \
    F(int32_t, style, 'i')
typedef struct kv_rot_params { KV_ROT_PARAMS_FIELDS(KV_FIELD_) } kv_rot_params;

/* Matrix product with weights as stored: y[b, j] = sum_i x[b, i] * W[i, j] for rows b < B of x and
 * output columns j in [n0, n1) (the kernel's arguments: ops.c splits columns across threads).
 * W [k, n] is stored column by column ("ggml order": column j is one row of the file's tensor),
 * each column `row_bytes` bytes of k / block blocks of type `wtype` (wtypes.def), column j at
 * w + j * row_bytes.  x [B, k] float32 (row stride x_stride floats), y [B, n] (row stride
 * y_stride floats; a fused projection writes its parts into column ranges of one output).
 * Kernels take 1 <= B <= KV_GEMV_MAX_B and k a multiple of the block; ops.c feeds longer inputs
 * in slices of KV_GEMV_MAX_B rows.
 *
 * Int8 activations (gemv_x8, types Q8_0, Q4_0, Q4_1, Q4_K, Q5_K; kv_has_x8): w is then the
 * repacked layout of
 * kv_repack_x8 (8 columns side by side), n0 and n1 are multiples of 8, and xq holds x quantized
 * per block of 32 values (kv_quantize_x): row b at xq + b * KV_XQ_ROW_BYTES(k) is k int8 values
 * q, then k / 32 floats d (the blocks' steps), then k / 32 floats s = d * sum(q); x is not read.
 * The product is then sum over blocks of d_w d_x sum(q_w q_x) (+ the type's minimum or offset
 * times s): integer dot products, exact, one float rounding per block and column. */
#define KV_GEMV_MAX_B 8
#define KV_XQ_ROW_BYTES(k) ((k) + 2 * (int64_t)sizeof(float) * ((k) / 32))
#define KV_GEMV_PARAMS_FIELDS(F) \
    F(const void *, w, 'Q') \
    F(const float *, x, 'Q') \
    F(float *, y, 'Q') \
    F(int64_t, row_bytes, 'q') \
    F(int64_t, k, 'q') \
    F(int64_t, n, 'q') \
    F(int64_t, B, 'q') \
    F(int64_t, x_stride, 'q') \
    F(int64_t, y_stride, 'q') \
    F(const void *, xq, 'Q') \
    F(int32_t, wtype, 'i')
typedef struct kv_gemv_params { KV_GEMV_PARAMS_FIELDS(KV_FIELD_) } kv_gemv_params;

/* Layout of a parameter struct, one entry per field, in declaration order (layout.c). */
typedef struct kv_field {
    const char *name;
    size_t offset, size;
    char code;              /* Python struct letter: 'Q' pointer, 'q' int64, 'i' int32, 'f' float */
} kv_field;
enum { KV_STRUCT_ATTN_PARAMS = 0, KV_STRUCT_ATTN_RANGE = 1, KV_STRUCT_ROT_PARAMS = 2, KV_STRUCT_GEMV_PARAMS = 3,
       KV_STRUCT_COUNT = 4 };
/* Fields of struct `which` (NULL if unknown); *n_fields and *struct_size are set. */
const kv_field *kv_struct_layout(int which, size_t *n_fields, size_t *struct_size);
const char *kv_struct_name(int which);

/* KV heads g0..g1-1, query rows r0..r1-1 of the attention p (workspace: kv_attn_workspace_bytes,
   64-byte aligned) */
typedef void (*kv_attn_fn)(const kv_attn_params *p, int64_t g0, int64_t g1, int64_t r0, int64_t r1,
                           void *workspace);
typedef void (*kv_rot_fn)(const kv_rot_params *p);
typedef void (*kv_f32_to_f16_fn)(uint16_t *dst, const float *src, size_t n);
typedef void (*kv_f16_to_f32_fn)(float *dst, const uint16_t *src, size_t n);
/* columns n0..n1-1 of the product p (see kv_gemv_params) */
typedef void (*kv_gemv_fn)(const kv_gemv_params *p, int64_t n0, int64_t n1);
/* dst[0..n) = the n values (a multiple of the type's block) stored at src, as float32 */
typedef void (*kv_dequant_fn)(float *dst, const void *src, int64_t n);

/* fp32 multiply-add throughput probe: runs `iters` rounds of independent FMA chains, stores a
   result in *sink (so nothing is optimized away) and returns the floating-point ops done. */
typedef uint64_t (*kv_peak_fn)(int64_t iters, float *sink);

/* One row of the dispatch table: the kernels of one ISA (its name and required features are
   in isa_rows.def, read through kv_isa_name / kv_isa_required). */
typedef struct kv_kernels {
    const char *cflags;     /* the flags the build compiled this row with (KV_ROW_CFLAGS) */
    kv_attn_fn attn;
    kv_rot_fn rotate;
    kv_f32_to_f16_fn f32_to_f16;
    kv_f16_to_f32_fn f16_to_f32;
    kv_peak_fn fma_peak;
    kv_gemv_fn gemv[KV_WT_COUNT];        /* indexed by kv_wtype */
    kv_dequant_fn dequant[KV_WT_COUNT];
    kv_gemv_fn gemv_x8[KV_WT_COUNT];     /* int8 activations, repacked weights (NULL: none) */
} kv_kernels;

/* cpu.c: CPUID + XGETBV.  Freestanding (no libc), so it also runs in the emulator. */
uint32_t kv_cpu_features(void);

/* dispatch.c */
kv_status kv_init(const char *force, char *msg, size_t msg_len);  /* once, at import */
/* Make row `name` active; `forced` is what kv_forced() reports from now on (1 for a test's
   or KVSIMD_FORCE_ISA's choice, 0 to restore the automatic choice it replaced). */
kv_status kv_set_isa(const char *name, int forced, char *msg, size_t msg_len);
const kv_kernels *kv_active(void);
int kv_active_isa(void);
int kv_isa_count(void);                            /* rows in the table */
const kv_kernels *kv_isa_row(int i);               /* NULL if not compiled */
const char *kv_isa_name(int i);                    /* "?" out of range */
uint32_t kv_isa_required(int i);                   /* KV_FEAT_* bits row i needs */
int kv_isa_compiled(int i);
int kv_isa_supported(int i);                       /* compiled and runnable here */
int kv_select_isa(uint32_t features);              /* best compiled row for a feature mask */
int kv_forced(void);                               /* active row chosen by name, not detection */
uint32_t kv_features(void);                        /* cached kv_cpu_features() */
int64_t kv_prefetch_values(void);                 /* the attention kernels' prefetch distance on this CPU (KV_PF_VALUES) */
const char *kv_compiler(void);                     /* compiler that built dispatch.c */
int kv_sanitized(void);                            /* built with AddressSanitizer (KVSIMD_SANITIZE) */

/* ops.c: entry points over the active row.  Arguments are validated by the caller.
   Workspace sizes are 0 when the arguments are out of range or the size does not fit a size_t. */
size_t kv_attn_workspace_bytes(int64_t H, int64_t Hkv, int64_t D);   /* one kernel call */
/* The process-wide default thread count (clamped to 1..KV_MAX_THREADS).  It is only a default:
   a caller reads it once per call and passes that same value to kv_attend_workspace_bytes and
   kv_attend, so a concurrent kv_set_num_threads never changes a call under way. */
void kv_set_num_threads(int n);
int kv_get_num_threads(void);
/* Nonzero once a kernel has run a parallel region of more than one thread in this process: GNU
   OpenMP cannot start threads again in a child forked after that (the Python layer then keeps
   the child at one thread), so each parallel region with nt > 1 calls kv_mark_threads_started. */
int kv_threads_started(void);
void kv_mark_threads_started(void);
size_t kv_attend_workspace_bytes(int64_t H, int64_t Hkv, int64_t D, int threads); /* what kv_attend needs */
void kv_attend(const kv_attn_params *p, void *workspace, int threads);
/* The row kv_attend runs p on (a kv_isa): the active one, except that on KV_FEAT_SPLIT512 cores the
   automatic avx512 choice hands a decode step (T == 1) over float K and V with 2 or 3 query heads
   per KV head to the avx2 row, whose 256-bit add trees and conversions are faster there (SmolLM2
   decode at 8,192 tokens on Zen 4, 1 thread: step time 0.94x).  A forced row (KVSIMD_FORCE_ISA,
   testing.use_isa) always runs its own kernels. */
int kv_attend_isa(const kv_attn_params *p);
int64_t kv_attend_pieces(const kv_attn_params *p, int threads); /* split-K pieces per KV head (ops.c) */
/* Attention of the same query rows over n K/V sources under one softmax (a quantized cache and
   the float rows of its most recent tokens): src[s] is a whole kv_attn_params over source s (its
   own k, v, dtypes, scales, ranges, n_total, key_pos, q_alt, key_base, causal_end and window: a
   source's cut is its own, so that one row reads a key of one source and not of another, e.g.
   its last R keys from float rows and the older ones quantized; q, out, H, Hkv, D, T, the
   strides, scale, softcap and alibi the same in every one; part_* 0).  Each
   source is computed as a split-K piece would be (its (max, sum) and unnormalized weighted sum;
   one query row: each source split across threads as kv_attend splits one), then one merge
   writes out.  1 <= n <= KV_MAX_SOURCES; every row must see a key of some source.  Results are
   identical for a given thread count. */
#define KV_MAX_SOURCES 4
size_t kv_attend_sources_workspace_bytes(int64_t H, int64_t Hkv, int64_t D, int64_t T, int64_t n, int threads);
void kv_attend_sources(const kv_attn_params *src, int64_t n, void *workspace, int threads);
/* RoPE of x [H, N, D] at positions[t]: pair r turns by positions[t] * inv[r] (inv: rotary_dim / 2
   inverse frequencies, from kv_rope_inv_freq or a scaled spec), and is multiplied by `scale`
   (the attention factor of YaRN-style scaling; 1 otherwise). */
kv_status kv_apply_rope(void *x, kv_dtype dtype, int64_t H, int64_t N, int64_t D, const int64_t *positions,
                        const double *inv, double scale, kv_rope_style style, int64_t rotary_dim);
/* Rows start..stop-1 of an already rotated k turned by delta * inv[r], with no scale: the
   attention factor is in the key once, from kv_apply_rope or the step that stored it.
   KV_I8, KV_I4 (k_scale [Hkv, N, kv_i8_blocks(D)] its block scales): each row is widened (q * scale),
   rotated in fp32 and quantized again (kv_quantize_rows; hadamard: rows stored as kv_hadamard_rows
   describes, read back and stored again that way), in one pass over rows held on the stack. */
kv_status kv_shift_keys(void *k, float *k_scale, kv_dtype dtype, int hadamard, int64_t Hkv, int64_t N, int64_t D,
                        int64_t delta, const double *inv, kv_rope_style style, int64_t rotary_dim, int64_t start,
                        int64_t stop);
/* Rows t0..t1-1 of x [H, N, D] rotated in place by one shared table cs (from kv_rope_table):
   what a decode step uses to rotate q and k with angles computed once for every layer. */
void kv_rotate_rows(void *x, kv_dtype dtype, int64_t H, int64_t N, int64_t D, const float *cs, kv_rope_style style,
                    int64_t rotary_dim, int64_t t0, int64_t t1);
void kv_f32_to_f16(uint16_t *dst, const float *src, size_t n);
/* Weight type t: its name, ggml type id, values and bytes per block (0 and NULL if unknown). */
const char *kv_wtype_info(int t, int *ggml_id, int64_t *block, int64_t *block_bytes);
/* The product p for any B >= 1 (slices of KV_GEMV_MAX_B rows), columns split across `threads`
   OpenMP threads in contiguous ranges: every column is computed by the same code whatever the
   thread count, so results are identical for any thread count.  With p->xq set (int8
   activations: p->w repacked, p->xq the caller's workspace of B * KV_XQ_ROW_BYTES(k) bytes),
   x is first quantized into it; column ranges are then multiples of 8.  No allocation. */
void kv_matmul(const kv_gemv_params *p, int threads);
/* 1 if type t has the int8-activation product (every row has the same set). */
int kv_has_x8(kv_wtype t);
/* Bytes of the repacked layout of a [rows, k] matrix of type t (0 if t has none). */
int64_t kv_x8_bytes(kv_wtype t, int64_t rows, int64_t k);
/* The repacked layout of a [rows, k] matrix of type t (kv_has_x8, rows a multiple of 8; the same
 * size as stored; Q4_K's and Q5_K's layout is in kernels/wt_kquant.inc.h, 3% larger): columns
 * 8g..8g+7 (the file's rows) take row_bytes * 8 contiguous bytes, block
 * after block; a block of the 8 columns is their 8 half scales d (lane c = column c), for Q4_1
 * their 8 half minimums m, then the quant bytes 4 at a time: 32 bytes i hold bytes 4i..4i+3 of
 * each column's quants, column c at 4c (for Q4_x the low nibbles of those bytes are values
 * 4i..4i+3 and the high nibbles values 16+4i..; for Q8_0 the bytes are values 4i..4i+3).
 * kv_repack_x8 returns KV_ERR_ARG for another type or rows not a multiple of 8. */
kv_status kv_repack_x8(kv_wtype t, void *dst, const void *src, int64_t rows, int64_t row_bytes);
/* x [B, k] (row stride xs floats, k a multiple of 32) into xq (B * KV_XQ_ROW_BYTES(k) bytes,
 * 4-byte aligned), as kv_gemv_params describes: per block of 32, d = max |x| / 127 and
 * q = x / d rounded to nearest (ties to even) -- |x - d q| <= d / 2; a block holding NaN or
 * infinity gets d = s = NaN (its products are NaN, as with float activations). */
void kv_quantize_x(void *xq, const float *x, int64_t B, int64_t k, int64_t xs);
/* rows x [n, D] (row stride xs floats) into q (dtype KV_I8 or KV_I4, rows qs bytes apart, each
 * kv_row_bytes(dtype, D)) and scale [n, kv_i8_blocks(D)] (contiguous), each block of KV_I8_BLOCK
 * values of a row on its own: KV_I8 by the rule of kv_quantize_x -- scale = max |x| / 127, q = x /
 * scale rounded to nearest (ties to even), |x - scale q| <= scale / 2; KV_I4 q in -8..7 with the
 * smallest |scale| for which |x - scale q| <= |scale| / 2 still holds: levels -8..7 reach from -8.5
 * to 7.5 steps, so |scale| = max(neg / 8.5, pos / 7.5) (neg, pos: the largest magnitudes of the
 * block's negative and positive values; up an ulp or two until the rounding's quotients are below
 * 8.5 and 7.5), and scale < 0 (the levels mirrored) where that side gives the smaller step.  A
 * block holding NaN or infinity gets scale NaN and q = 0 (it reads as NaN, as a float row would).
 * Returns KV_ERR_ARG for another dtype. */
kv_status kv_quantize_rows(kv_dtype dtype, int hadamard, void *q, int64_t qs, float *scale, const float *x, int64_t xs,
                           int64_t n, int64_t D);
/* The float32 values rows q (as kv_quantize_rows stores them) stand for, q[d] * scale[d / 32], into
 * x [n, D] (row stride xs floats); with hadamard, then kv_hadamard_rows of them (the rows x had). */
void kv_dequantize_rows(kv_dtype dtype, int hadamard, float *x, int64_t xs, const void *q, int64_t qs,
                        const float *scale, int64_t n, int64_t D);
/* Every whole block of 32 values of rows x [n, D] (row stride xs floats) in place times H, the 32 x 32
 * Sylvester-Hadamard matrix of +-1 (H H = 32 I): the block times 1/32, five butterfly stages (a, b) ->
 * (a + b, a - b) at distances 1, 2, 4, 8, 16, then times 32, in float32 (the powers of 2 keep every
 * partial sum in range where the result is); a shorter last block is left as it is.  With hadamard,
 * kv_quantize_rows quantizes H x / 32 (the same steps without the last) instead of x, so that the
 * values q * scale a row stands for are H x / 32 and H of them is x again: attention over such rows
 * with the query H q gives the scores of q (q . x = Hq . Hx / 32), and H of its output is the output
 * over x.  The rotation spreads an outlier channel over its block (what keeps 4-bit keys usable). */
void kv_hadamard_rows(float *x, int64_t xs, int64_t n, int64_t D);
void kv_dequantize(kv_wtype t, float *dst, const void *src, int64_t n);
void kv_f16_to_f32(float *dst, const uint16_t *src, size_t n);
/* inv[r] = theta^(-2r / rotary_dim) for r < R (in double). */
void kv_rope_inv_freq(double *inv, double theta, int64_t R, int64_t rotary_dim);
/* The one RoPE table: (cos, sin) * scale of units * inv[r] for r < R, computed in double, stored
   as float pairs (what the rotate kernel reads). */
void kv_rope_table(float *cs, double units, const double *inv, int64_t R, double scale);

/* cache.c: storage of a KV cache, [layer][K|V][seq][kv head][slot][row] (K rows of kv_row_bytes(dtype), V rows
   of kv_row_bytes(v_dtype)), 64-byte aligned; for KV_I8, KV_I4
   also the block scales, [layer][K|V][seq][kv head][slot][kv_i8_blocks(d)] float32, after the
   values in the same allocation. */
typedef struct kv_cache {
    void *data;
    float *scales;          /* KV_I8, KV_I4: the block scales; NULL otherwise */
    size_t nbytes;
    int64_t n_layers, batch, n_kv_heads, capacity, head_dim;
    kv_dtype dtype, v_dtype;    /* of K and of V: both scaled (KV_I8, KV_I4) or neither */
} kv_cache;
kv_status kv_cache_create(kv_cache *c, int64_t n_layers, int64_t batch, int64_t n_kv_heads, int64_t capacity,
                          int64_t head_dim, kv_dtype dtype, kv_dtype v_dtype);
void kv_cache_destroy(kv_cache *c);                 /* accepts a destroyed or zeroed cache */
void *kv_cache_block(const kv_cache *c, int64_t layer, int which, int64_t seq);
/* [Hkv, capacity, kv_i8_blocks(head_dim)] block scales of K (which = 0) or V; NULL unless scaled */
float *kv_cache_scales(const kv_cache *c, int64_t layer, int which, int64_t seq);

/* membench.c: what the benchmark compares kernels against (baseline ISA, no tricks). */
uint64_t kv_bench_read(const void *buf, size_t bytes);
void kv_bench_copy(void *dst, const void *src, size_t bytes);
void kv_bench_write(void *dst, size_t bytes);
enum { KV_BENCH_READ = 0, KV_BENCH_WRITE = 1, KV_BENCH_COPY = 2 };
/* op over `bytes` split into `threads` equal 64-byte-multiple parts, one per OpenMP thread */
uint64_t kv_bench_run(int op, void *dst, const void *src, size_t bytes, int threads);

#ifdef __cplusplus
}
#endif
#endif /* KVSIMD_H */
