/* tu_avx512fp16.c - the avx512fp16 row: compiled once, with the flags isa_rows.def gives it (the build
   also passes them as KV_ROW_CFLAGS). */
#include "vec_avx512fp16.h"
#include "row.inc.h"
