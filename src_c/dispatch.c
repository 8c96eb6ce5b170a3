/* dispatch.c - the one table of ISA rows, and the choice of the active row.
 *
 * Compiled at the baseline ISA: nothing here may use AVX, since it runs before we know
 * whether the CPU has it.  Rows are listed in priority order, best first.
 */
#if defined(__AVX__) || defined(__AVX2__)
#error "dispatch.c must be compiled for the baseline ISA"
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvsimd.h"

extern const kv_kernels kv_kernels_scalar;
extern const kv_kernels kv_kernels_avx2;
#ifdef KV_HAVE_AVX512FP16
extern const kv_kernels kv_kernels_avx512fp16;
#define KV_ROW_AVX512FP16 &kv_kernels_avx512fp16
#else
#define KV_ROW_AVX512FP16 NULL
#endif

static const char *const kv_names[KV_ISA_COUNT] = {"scalar", "avx2", "avx512fp16"};

/* Indexed by kv_isa; NULL = not compiled into this build. */
static const kv_kernels *const kv_table[KV_ISA_COUNT] = {
    [KV_ISA_SCALAR] = &kv_kernels_scalar,
    [KV_ISA_AVX2] = &kv_kernels_avx2,
    [KV_ISA_AVX512FP16] = KV_ROW_AVX512FP16,
};

static const kv_kernels *kv_current = &kv_kernels_scalar;
static int kv_current_isa = KV_ISA_SCALAR;
static int kv_was_forced = 0;
static uint32_t kv_feature_mask = 0;

int kv_select_isa(uint32_t features)
{
    for (int i = KV_ISA_COUNT - 1; i > 0; i--)
        if (kv_table[i] && (kv_table[i]->required & ~features) == 0)
            return i;
    return KV_ISA_SCALAR;
}

int kv_isa_count(void) { return KV_ISA_COUNT; }
const kv_kernels *kv_isa_row(int i) { return (i >= 0 && i < KV_ISA_COUNT) ? kv_table[i] : NULL; }
const char *kv_isa_name(int i) { return (i >= 0 && i < KV_ISA_COUNT) ? kv_names[i] : "?"; }
int kv_isa_compiled(int i) { return kv_isa_row(i) != NULL; }
int kv_isa_supported(int i)
{
    const kv_kernels *row = kv_isa_row(i);
    return row && (row->required & ~kv_feature_mask) == 0;
}
const kv_kernels *kv_active(void) { return kv_current; }
int kv_active_isa(void) { return kv_current_isa; }
int kv_forced(void) { return kv_was_forced; }
uint32_t kv_features(void) { return kv_feature_mask; }
const char *kv_compiler(void)
{
#if defined(__clang__)
    return "clang " __clang_version__;
#elif defined(__GNUC__)
    return "gcc " __VERSION__;
#else
    return "unknown";
#endif
}

static void list_names(char *buf, size_t len, int (*pred)(int))
{
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < KV_ISA_COUNT; i++) {
        if (!pred(i))
            continue;
        int w = snprintf(buf + used, len - used, "%s%s", used ? ", " : "", kv_names[i]);
        if (w < 0 || (size_t)w >= len - used)
            break;
        used += (size_t)w;
    }
}

kv_status kv_set_isa(const char *name, char *msg, size_t msg_len)
{
    int found = -1;
    for (int i = 0; i < KV_ISA_COUNT; i++)
        if (name && strcmp(name, kv_names[i]) == 0)
            found = i;
    if (found < 0 || !kv_isa_supported(found)) {
        char compiled[64], supported[64];
        list_names(compiled, sizeof compiled, kv_isa_compiled);
        list_names(supported, sizeof supported, kv_isa_supported);
        const char *why = found < 0 ? "unknown ISA"
                          : !kv_isa_compiled(found) ? "ISA not compiled into this build"
                                                    : "this CPU cannot run ISA";
        if (msg && msg_len)
            snprintf(msg, msg_len, "%s '%.32s' (compiled: %s; supported on this CPU: %s)", why,
                     name ? name : "", compiled, supported);
        return KV_ERR_ISA;
    }
    kv_current = kv_table[found];
    kv_current_isa = found;
    return KV_OK;
}

kv_status kv_init(const char *force, char *msg, size_t msg_len)
{
    kv_feature_mask = kv_cpu_features();
    if (force && force[0]) {
        kv_status s = kv_set_isa(force, msg, msg_len);
        if (s == KV_OK)
            kv_was_forced = 1;
        return s;
    }
    int best = kv_select_isa(kv_feature_mask);
    kv_current = kv_table[best];
    kv_current_isa = best;
    kv_was_forced = 0;
    return KV_OK;
}
