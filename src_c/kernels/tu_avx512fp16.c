/* tu_avx512fp16.c - the avx512fp16 row: compiled once, with this ISA's flags only. */
#include "vec_avx512fp16.h"
#define KV_ROW_REQUIRED KV_FEAT_AVX512FP16
#define KV_ROW_CFLAGS "-mavx512f -mavx512bw -mavx512vl -mavx512fp16"
#include "row.inc.h"
