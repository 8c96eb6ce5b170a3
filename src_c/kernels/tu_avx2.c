/* tu_avx2.c - the avx2 row: compiled once, with this ISA's flags only. */
#include "vec_avx2.h"
#define KV_ROW_REQUIRED KV_FEAT_AVX2
#define KV_ROW_CFLAGS "-mavx2 -mfma -mf16c"
#include "row.inc.h"
