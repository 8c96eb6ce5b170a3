/* layout.c - the layout of the parameter structs, as the compiler lays them out: what the
 * emulator test harness packs structs from (no field list is kept outside kvsimd.h). */
#include <stddef.h>

#include "kvsimd.h"

#define KV_FIELD_ENTRY(st, type, name, code) {#name, offsetof(st, name), sizeof(((st *)0)->name), code},
#define KV_ATTN_F(type, name, code) KV_FIELD_ENTRY(kv_attn_params, type, name, code)
#define KV_RANGE_F(type, name, code) KV_FIELD_ENTRY(kv_attn_range, type, name, code)
#define KV_ROT_F(type, name, code) KV_FIELD_ENTRY(kv_rot_params, type, name, code)
#define KV_GEMV_F(type, name, code) KV_FIELD_ENTRY(kv_gemv_params, type, name, code)

static const kv_field attn_fields[] = {KV_ATTN_PARAMS_FIELDS(KV_ATTN_F)};
static const kv_field range_fields[] = {KV_ATTN_RANGE_FIELDS(KV_RANGE_F)};
static const kv_field rot_fields[] = {KV_ROT_PARAMS_FIELDS(KV_ROT_F)};
static const kv_field gemv_fields[] = {KV_GEMV_PARAMS_FIELDS(KV_GEMV_F)};

static const struct {
    const char *name;
    const kv_field *fields;
    size_t n, size;
} kv_structs[KV_STRUCT_COUNT] = {
    [KV_STRUCT_ATTN_PARAMS] = {"kv_attn_params", attn_fields, sizeof attn_fields / sizeof attn_fields[0],
                               sizeof(kv_attn_params)},
    [KV_STRUCT_ATTN_RANGE] = {"kv_attn_range", range_fields, sizeof range_fields / sizeof range_fields[0],
                              sizeof(kv_attn_range)},
    [KV_STRUCT_ROT_PARAMS] = {"kv_rot_params", rot_fields, sizeof rot_fields / sizeof rot_fields[0],
                              sizeof(kv_rot_params)},
    [KV_STRUCT_GEMV_PARAMS] = {"kv_gemv_params", gemv_fields, sizeof gemv_fields / sizeof gemv_fields[0],
                               sizeof(kv_gemv_params)},
};

const kv_field *kv_struct_layout(int which, size_t *n_fields, size_t *struct_size)
{
    if (which < 0 || which >= KV_STRUCT_COUNT) {
        *n_fields = *struct_size = 0;
        return NULL;
    }
    *n_fields = kv_structs[which].n;
    *struct_size = kv_structs[which].size;
    return kv_structs[which].fields;
}

const char *kv_struct_name(int which) { return which >= 0 && which < KV_STRUCT_COUNT ? kv_structs[which].name : "?"; }
