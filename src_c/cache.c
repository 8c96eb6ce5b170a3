/* cache.c - KV-cache storage: one 64-byte-aligned block per cache, laid out so that
 * attention reads each (layer, sequence, KV head) as one contiguous [capacity, D] run:
 *     [layer][K | V][sequence][kv head][slot][d]
 * Lengths and positions live with the Python object; C owns only the memory. */
#define _DEFAULT_SOURCE   /* posix_memalign, madvise */
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kvsimd.h"

kv_status kv_cache_create(kv_cache *c, int64_t n_layers, int64_t batch, int64_t n_kv_heads, int64_t capacity,
                          int64_t head_dim, kv_dtype dtype, kv_dtype v_dtype)
{
    memset(c, 0, sizeof *c);
    if (n_layers < 1 || batch < 1 || n_kv_heads < 1 || capacity < 1 || head_dim < 1 || head_dim > KV_MAX_HEAD_DIM)
        return KV_ERR_ARG;
    for (int w = 0; w < 2; w++) {
        const kv_dtype d = w ? v_dtype : dtype;
        if (d != KV_F16 && d != KV_F32 && d != KV_I8 && d != KV_I4)
            return KV_ERR_ARG;
    }
    if (kv_dtype_scaled(dtype) != kv_dtype_scaled(v_dtype))   /* scales for both or neither */
        return KV_ERR_ARG;
    /* every product checked before it is used: rows = n_layers * batch * n_kv_heads * capacity of K
       and as many of V, values rows * (kv_row_bytes of K + of V); KV_I8, KV_I4 add 2 rows *
       kv_i8_blocks(head_dim) * 4 bytes of scales, 64-byte aligned */
    size_t rows = 1, values = 0, total = 0;
    const int64_t dims[4] = {n_layers, batch, n_kv_heads, capacity};
    for (int i = 0; i < 4; i++)
        if (__builtin_mul_overflow(rows, (uint64_t)dims[i], &rows))
            return KV_ERR_CAPACITY;
    if (__builtin_mul_overflow(rows, (uint64_t)(kv_row_bytes(dtype, head_dim) + kv_row_bytes(v_dtype, head_dim)),
                               &values))
        return KV_ERR_CAPACITY;
    total = values;
    if (kv_dtype_scaled(dtype)) {
        size_t sbytes = 0;
        if (__builtin_mul_overflow(rows, 2 * sizeof(float) * (size_t)kv_i8_blocks(head_dim), &sbytes) ||
            values > SIZE_MAX - 64 ||
            __builtin_add_overflow((values + 63) / 64 * 64, sbytes, &total))
            return KV_ERR_CAPACITY;
    }
    if (total > SIZE_MAX - ((size_t)2 << 20))
        return KV_ERR_CAPACITY;
    void *p = NULL;
    /* Large caches on 2 MiB boundaries, and asking Linux for transparent huge pages: attention
       streams the whole cache every step, and 4 KiB pages cost a TLB miss every 4 KiB. */
    const size_t huge = (size_t)2 << 20;
    const size_t align = total >= 4 * huge ? huge : 64;
    if (posix_memalign(&p, align, total ? total : 64) != 0)
        return KV_ERR_NOMEM;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align == huge)
        madvise(p, total / huge * huge, MADV_HUGEPAGE);   /* advice only: failure is harmless */
#endif
    memset(p, 0, total);
    c->data = p;
    c->scales = kv_dtype_scaled(dtype) ? (float *)((char *)p + (values + 63) / 64 * 64) : NULL;
    c->nbytes = total;
    c->n_layers = n_layers;
    c->batch = batch;
    c->n_kv_heads = n_kv_heads;
    c->capacity = capacity;
    c->head_dim = head_dim;
    c->dtype = dtype;
    c->v_dtype = v_dtype;
    return KV_OK;
}

void kv_cache_destroy(kv_cache *c)
{
    if (c && c->data) {
        free(c->data);
        c->data = NULL;
        c->scales = NULL;
    }
}

/* Start of the [Hkv, capacity, D] block of K (which = 0) or V (which = 1). */
void *kv_cache_block(const kv_cache *c, int64_t layer, int which, int64_t seq)
{   /* callers check 0 <= layer < n_layers, which in {0, 1}, 0 <= seq < batch: no product can then
       exceed nbytes, which kv_cache_create checked */
    const size_t slots = (size_t)c->n_kv_heads * (size_t)c->capacity;
    const size_t kb = slots * kv_row_bytes(c->dtype, c->head_dim), vb = slots * kv_row_bytes(c->v_dtype, c->head_dim);
    const size_t at = (size_t)layer * (size_t)c->batch * (kb + vb);
    return (char *)c->data + (which ? at + (size_t)c->batch * kb + (size_t)seq * vb : at + (size_t)seq * kb);
}

/* Start of the [Hkv, capacity, blocks] scales of K (which = 0) or V (which = 1); NULL unless KV_I8 or KV_I4. */
float *kv_cache_scales(const kv_cache *c, int64_t layer, int which, int64_t seq)
{
    if (!c->scales)
        return NULL;
    const size_t block = (size_t)c->n_kv_heads * (size_t)c->capacity * (size_t)kv_i8_blocks(c->head_dim);
    return c->scales + (((size_t)layer * 2 + (size_t)which) * (size_t)c->batch + (size_t)seq) * block;
}
